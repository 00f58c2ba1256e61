"""``dynaquant push`` / ``push_folder`` against a local stand-in for the hub (tests/hub_server.py), Xet off.

The folder is built by hand (a card written by huggingface_hub's ModelCard, GGUFs written by gguf-py's writer,
a 2-shard split set among them): no quantization runs here.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from hub_server import HubServer
from huggingface_hub import ModelCard, ModelCardData, constants

from dynaquant.cli import main
from dynaquant.pipeline.push import check_folder, push_folder

TOKEN = "hf_" + secrets.token_hex(16)  # a fresh fake token: it must never show up outside the Authorization header
REPO = "dq-org/SmolLM2-135M-dynamic-GGUF"
LFS_FILES = {"model-00001-of-00002.gguf", "model-00002-of-00002.gguf", "imatrix.gguf", "layers.png"}
REGULAR_FILES = {"README.md", "report.json", "plan.json", "report.html"}
# the endpoints huggingface_hub 2.4 calls for create_repo + upload_folder (Xet off), as HubServer.routes names them
ROUTES = {"POST /api/repos/create", "POST /api/validate-yaml", "POST /api/models/{repo}/preupload/{rev}",
          "POST /{repo}.git/info/lfs/objects/batch", "PUT /lfs/{oid}", "POST /lfs/{oid}/verify",
          "POST /api/models/{repo}/commit/{rev}"}


def _gguf(path: Path, rng: np.random.Generator, n_tensors: int, **kw) -> None:
    w = gguf.GGUFWriter(path, "llama", **kw)
    if path.name == "imatrix.gguf":
        w.add_type(gguf.GGUFType.IMATRIX)
    for i in range(n_tensors):
        w.add_tensor(f"blk.{i}.ffn_down.weight", rng.standard_normal((3, 32 + 32 * i)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_folder(folder: Path, seed: int = 0) -> Path:
    """A publishable folder: card, a 2-shard split GGUF, imatrix.gguf, report/plan JSON, report.html, a PNG."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    data = ModelCardData(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", base_model_relation="quantized",
                         library_name="gguf", tags=["gguf", "quantized", "dynaquant", "llama"], license="apache-2.0",
                         pipeline_tag="text-generation")
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n# SmolLM2-135M dynamic GGUF\n\n`llama-cli -m model-00001-of-00002.gguf`\n"
              ).save(folder / "README.md")
    _gguf(folder / "model.gguf", rng, 2, split_max_tensors=1)  # gguf-py names the shards model-0000i-of-00002.gguf
    _gguf(folder / "imatrix.gguf", rng, 1)
    (folder / "report.json").write_text('{"schema_version": 1, "kld_mean": 0.0123}\n')
    (folder / "plan.json").write_text('{"tensors": {"blk.0.ffn_down.weight": "Q4_K"}}\n')
    (folder / "report.html").write_text("<!doctype html><title>report</title>\n")
    (folder / "layers.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + rng.bytes(300))
    return folder


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder`` (hidden ones too): sha256 and mtime."""
    return {p.relative_to(folder).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def uploadable(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.relative_to(folder).as_posix().startswith((".cache/", ".git/"))}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in hub, huggingface_hub pointed at it (Xet off, online), the token in HF_TOKEN only."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # read at import: patch the constant, not the env
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with HubServer() as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)  # what HfApi() uses for the command line
        yield server


def api_requests(hub: HubServer) -> list:
    """The requests to the hub's API (huggingface_hub's user-agent registry fetch aside: HubServer.routes)."""
    return [r for r in hub.requests if r.path.startswith("/api/") and r.path != "/api/agent-harnesses"]


def assert_no_token(*texts: str, folders: tuple[Path, ...] = (), hub: HubServer | None = None) -> None:
    for t in texts:
        assert TOKEN not in t
    for folder in folders:
        for p in folder.rglob("*"):
            assert not p.is_file() or TOKEN.encode() not in p.read_bytes(), p
    if hub is not None:
        for repo in hub.repos.values():
            for files in repo.branches.values():
                assert all(TOKEN.encode() not in b for b in files.values())
        assert all(TOKEN.encode() not in b for b in hub.lfs.values())
        for r in hub.requests:  # only ever in the Authorization header, never in a URL or body
            assert TOKEN not in r.path and TOKEN.encode() not in r.body
            assert {k.lower(): v for k, v in r.headers.items()}.get("authorization") in (f"Bearer {TOKEN}", None)


def test_push_uploads_every_file_byte_identical(hub, tmp_path, caplog):
    folder = make_folder(tmp_path / "out")
    # upload_large_folder's (huggingface_hub < 2) resume bookkeeping and a .git folder: checked past, never uploaded
    (folder / ".cache" / "huggingface" / "upload").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "upload" / "README.md.metadata").write_text("0123\n")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    before = snapshot(folder)
    checked = check_folder(folder)
    assert checked.model_files == ("model-00001-of-00002.gguf",)  # imatrix.gguf is a side file, not a model
    assert checked.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    caplog.set_level("DEBUG")

    url = push_folder(folder, REPO, endpoint=hub.url)

    assert url == f"{hub.url}/{REPO}"
    repo = hub.repos[REPO]
    assert repo.private is None  # the owner's default visibility, not forced public
    stored = {k: v for k, v in repo.branches["main"].items() if k != ".gitattributes"}
    assert stored == uploadable(folder)  # byte-identical, .cache/huggingface and .git left out
    assert set(stored) == LFS_FILES | REGULAR_FILES
    assert sorted(hub.lfs.values()) == sorted(stored[f] for f in LFS_FILES)  # binaries through LFS, text inline
    routes = hub.routes()
    assert set(routes) == ROUTES
    assert Counter(routes)["PUT /lfs/{oid}"] == len(LFS_FILES)
    assert routes[0] == "POST /api/repos/create" and routes[-1] == "POST /api/models/{repo}/commit/{rev}"
    assert len(repo.commits) == 1
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in api_requests(hub))
    assert snapshot(folder) == before
    assert_no_token(caplog.text, folders=(folder,), hub=hub)


def test_push_cli_private_branch_stored_login(hub, tmp_path, monkeypatch, capsys, caplog):
    """``dynaquant push DIR ORG/NAME --private --revision dev`` with the token of a stored login (no HF_TOKEN)."""
    folder = make_folder(tmp_path / "out", seed=1)
    token_file = tmp_path / "hf_home" / "token"
    token_file.parent.mkdir()
    token_file.write_text(TOKEN)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(token_file))
    monkeypatch.delenv("HF_TOKEN")
    caplog.set_level("DEBUG")

    assert main(["-v", "push", str(folder), REPO, "--private", "--revision", "dev"]) == 0

    out, err = capsys.readouterr()
    assert f"published {folder} to {hub.url}/{REPO} (branch dev)" in out
    repo = hub.repos[REPO]
    assert repo.private is True
    assert {k: v for k, v in repo.branches["dev"].items() if k != ".gitattributes"} == uploadable(folder)
    assert set(repo.branches["main"]) == {".gitattributes"}  # the default branch untouched
    assert [c["branch"] for c in repo.commits] == ["dev"]
    assert "POST /api/models/{repo}/branch/{rev}" in hub.routes()
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in api_requests(hub))
    assert_no_token(out, err, caplog.text, folders=(folder,), hub=hub)

    # the same push again: repository and branch exist (409 taken as exist_ok), files unchanged
    assert main(["push", str(folder), REPO, "--private", "--revision", "dev"]) == 0
    assert {k: v for k, v in repo.branches["dev"].items() if k != ".gitattributes"} == uploadable(folder)


def _no_card(f: Path) -> str:
    (f / "README.md").unlink()
    return "README.md: missing"


def _card_without_base_model(f: Path) -> str:
    ModelCard("---\nlicense: apache-2.0\n---\n# x\n").save(f / "README.md")
    return "README.md: the model card's metadata has no base_model"


def _bad_card_yaml(f: Path) -> str:
    (f / "README.md").write_text("---\nbase_model: [unclosed\n---\n# x\n")
    return "README.md: not a valid model card"


def _missing_shard(f: Path) -> str:
    (f / "model-00002-of-00002.gguf").unlink()
    return "model-00002-of-00002.gguf: missing: split GGUF set model has 1 of its 2 shards"


def _renamed_shard_count(f: Path) -> str:
    os.replace(f / "model-00002-of-00002.gguf", f / "model-00002-of-00003.gguf")
    return "model-00002-of-00003.gguf: its split keys (split.no 1, split.count 2) do not match its name"


def _truncated_shard(f: Path) -> str:
    p = f / "model-00002-of-00002.gguf"
    p.write_bytes(p.read_bytes()[:-40])
    return "model-00002-of-00002.gguf: damaged or truncated GGUF file"


def _work_folder(f: Path) -> str:
    (f / ".model.gguf.4242.0badf00d.dynaquant-work").mkdir()
    return ".model.gguf.4242.0badf00d.dynaquant-work: a temporary or partial file"


def _partial_download(f: Path) -> str:
    (f / "tokenizer.json.incomplete").write_text("{")
    return "tokenizer.json.incomplete: a temporary or partial file"


def _no_model(f: Path) -> str:
    for p in f.glob("model-*.gguf"):
        p.unlink()
    return "no model file"


def _safetensors_without_config(f: Path) -> str:
    from safetensors.numpy import save_file

    save_file({"w": np.ones((2, 3), np.float32)}, str(f / "model.safetensors"))
    return "config.json: missing: a safetensors checkpoint needs its config.json"


@pytest.mark.parametrize("damage", [_no_card, _card_without_base_model, _bad_card_yaml, _missing_shard, _renamed_shard_count,
                                    _truncated_shard, _work_folder, _partial_download, _no_model, _safetensors_without_config],
                         ids=lambda f: f.__name__.strip("_"))
def test_incomplete_folder_uploads_nothing(hub, tmp_path, capsys, damage):
    folder = make_folder(tmp_path / "out")
    expected = damage(folder)
    before = snapshot(folder)

    assert main(["push", str(folder), REPO]) == 2

    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dynaquant push: error: ")
    assert expected in err
    assert hub.requests == []  # checked before a single request
    assert snapshot(folder) == before


def test_server_error_leaves_folder_and_says_how_to_retry(hub, tmp_path, capsys, caplog):
    folder = make_folder(tmp_path / "out")
    before = snapshot(folder)
    hub.fail = lambda method, path: 500 if path.startswith("/api/models/") and "/commit/" in path else None
    caplog.set_level("DEBUG")

    assert main(["push", str(folder), REPO]) == 2

    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.startswith("dynaquant")]  # the others: the upload's progress bars
    assert len(lines) == 1 and err.rstrip().endswith(lines[0])
    assert lines[0].startswith(f"dynaquant push: error: {REPO}: upload of {folder} failed (HfHubHTTPError: ")
    retry = f"dynaquant push {shlex.quote(str(folder))} {REPO}"
    assert lines[0].endswith(f"the folder is unchanged: retry with `{retry}`")
    assert snapshot(folder) == before
    assert set(hub.repos[REPO].branches["main"]) == {".gitattributes"}  # nothing committed
    assert len(hub.lfs) == len(LFS_FILES)  # the LFS objects went up before the commit failed
    assert_no_token(out, err, caplog.text, folders=(folder,), hub=hub)

    # the retry command, as printed: the LFS objects already held are not sent again
    hub.fail = lambda method, path: None
    n_before = len(hub.requests)
    assert main(shlex.split(retry)[1:]) == 0
    assert "PUT /lfs/{oid}" not in hub.routes()[n_before:]
    assert {k: v for k, v in hub.repos[REPO].branches["main"].items() if k != ".gitattributes"} == uploadable(folder)
    assert snapshot(folder) == before


def test_unreachable_hub_says_how_to_retry(hub, tmp_path, capsys, monkeypatch):
    folder = make_folder(tmp_path / "out")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert main(["push", str(folder), REPO, "--revision", "v1"]) == 2
    err = capsys.readouterr().err
    assert f"retry with `dynaquant push {shlex.quote(str(folder))} {REPO} --revision v1`" in err
    assert TOKEN not in err


@pytest.mark.parametrize("argv, expected", [
    (["quantize", "--push-to-hub", "no-org"], "no-org: not a hub repository id (ORG/NAME"),
    (["quantize", "--push-to-hub", "org/name", "--private", "--hub-branch", "dev"], "org/name: no hub token to upload with"),
    (["push", "DIR", "org/name"], "org/name: no hub token to upload with"),
])
def test_push_target_checked_before_any_work(hub, monkeypatch, capsys, argv, expected):
    """A bad repository id, or no token anywhere, fails at once: before a quantization runs or a request is made."""
    monkeypatch.delenv("HF_TOKEN")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err
    assert hub.requests == []


def test_quantize_push_to_hub_uploads_the_run_folder(hub, tmp_path, monkeypatch, capsys):
    """``quantize --push-to-hub ORG/NAME --private --hub-branch B``: the options reach QuantizeConfig and the run's
    output folder (``QuantizeResult.folder``) is pushed after the run; the run itself is stood in for here."""
    import types

    import dynaquant.pipeline.quantize as pq

    folder = make_folder(tmp_path / "out")
    seen = {}

    def run_quantize(model, cfg):
        seen["cfg"] = cfg
        assert hub.requests == []  # nothing is uploaded before the run ends
        return types.SimpleNamespace(folder=folder, output=folder / "model-00001-of-00002.gguf",
                                     to_dict=lambda: {"output": str(folder / "model-00001-of-00002.gguf")})

    monkeypatch.setattr(pq, "run_quantize", run_quantize)
    assert main(["quantize", "--preset", "Q8_0", "--no-imatrix", "--push-to-hub", REPO, "--private", "--hub-branch", "b1",
                 "--json"]) == 0
    cfg = seen["cfg"]
    assert (cfg.push_to_hub, cfg.push_private, cfg.push_branch) == (REPO, True, "b1")
    assert json.loads(capsys.readouterr().out)["hub_url"] == f"{hub.url}/{REPO}"
    repo = hub.repos[REPO]
    assert repo.private is True
    assert {k: v for k, v in repo.branches["b1"].items() if k != ".gitattributes"} == uploadable(folder)

    # a run that made no folder (a plain -o FILE.gguf before the card helper's output folder): one clear line
    monkeypatch.setattr(pq, "run_quantize", lambda model, cfg: types.SimpleNamespace(folder=None, output=tmp_path / "m.gguf"))
    assert main(["quantize", "--preset", "Q8_0", "--push-to-hub", REPO]) == 2
    assert f"--push-to-hub {REPO}: this run made no output folder to publish" in capsys.readouterr().err


def test_is_temporary_names():
    from dynaquant.workdir import is_temporary

    assert is_temporary(f".m.v2.gguf.{os.getpid()}.0badf00d.dynaquant-work")  # a live run's: still not publishable
    assert is_temporary(".report.json.99999.ab12.tmp")
    assert not any(map(is_temporary, ["model.gguf", ".gitattributes", ".cache", ".m.gguf.12.xyz.tmp", ".m.gguf.dynaquant-work",
                                      "m.gguf.12.ab.tmp"]))
