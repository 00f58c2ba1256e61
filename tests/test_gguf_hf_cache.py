"""The cache of a GGUF file's converted transformers config and tokenizer (dynaquant.sources.gguf_hf_cache): the
cached ones are the ones transformers derives from the file, and the cache is only ever a shortcut."""

from __future__ import annotations

import os

from transformers import AutoConfig

from dynaquant.sources.checkpoint import gguf_cached, load_tokenizer
from dynaquant.sources.gguf_hf_cache import entry

TEXT = "def f(x):\n    return x ** 2  # héllo <|im_start|>user\n\tTabs,   spaces and 12345 digits."


def _direct_config(source):
    return AutoConfig.from_pretrained(source.folder, gguf_file=source.path.name)


def test_cached_config_and_tokenizer_equal_the_files_own(default_source, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAQUANT_CACHE", str(tmp_path / "cache"))
    folder = entry(default_source.path)
    assert folder is not None and not folder.exists()
    first = load_tokenizer(default_source)  # converted from the file, and kept
    assert (folder / "tokenizer" / "tokenizer.json").is_file()
    second = load_tokenizer(default_source)  # from the cache
    monkeypatch.setenv("DYNAQUANT_CACHE", "off")
    direct = load_tokenizer(default_source)
    assert first(TEXT)["input_ids"] == second(TEXT)["input_ids"] == direct(TEXT)["input_ids"]
    assert second.eos_token_id == direct.eos_token_id and second.bos_token_id == direct.bos_token_id
    assert len(second) == len(direct)
    assert gguf_cached(default_source, "config", AutoConfig) is None  # off: none, transformers reads the file
    monkeypatch.setenv("DYNAQUANT_CACHE", str(tmp_path / "cache"))
    cfg = gguf_cached(default_source, "config", AutoConfig)
    assert (folder / "config" / "config.json").is_file()
    skip = {"transformers_version", "_name_or_path"}
    want = {k: v for k, v in _direct_config(default_source).to_dict().items() if k not in skip}
    assert {k: v for k, v in cfg.to_dict().items() if k not in skip} == want
    assert gguf_cached(default_source, "config", AutoConfig, cache=False) is None


def test_a_file_changed_in_place_gets_a_new_entry_and_an_unwritable_cache_is_skipped(default_source, tmp_path,
                                                                                      monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("DYNAQUANT_CACHE", str(tmp_path / "cache"))
    a = entry(f)
    os.utime(f, ns=(1, 1))
    assert entry(f) != a
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("DYNAQUANT_CACHE", str(blocked))
    tok = load_tokenizer(default_source)  # read from the file, no error
    assert tok(TEXT)["input_ids"] and blocked.is_file()


def test_a_gguf_model_built_from_the_file_is_transformers_own(default_source):
    """load_model of a single GGUF file builds the model from the cached config and fills it tensor by tensor from
    dynaquant's reader (not transformers' GGUF loader, which parses the file again): every parameter, buffer and
    flag as transformers' loader gives them, the head tied, the same logits."""
    import torch
    from model_equality import assert_same_model

    from dynaquant.sources.model import _gguf_model, load_model

    ours = _gguf_model(default_source, torch.float32, "cpu")
    assert ours is not None  # (None: the fallback to transformers' loader)
    theirs = load_model(default_source, cache=False)  # transformers' GGUF loader
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.config.to_diff_dict() == theirs.config.to_diff_dict()
    assert_same_model(ours, theirs, torch.arange(3, 3 + 7 * 40, 7)[None])
