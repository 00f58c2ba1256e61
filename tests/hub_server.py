"""A local stand-in for the few Hugging Face hub endpoints that ``huggingface_hub`` (2.4) calls to create a model
repository, a branch, and commit a folder through git LFS (Xet turned off: ``HF_HUB_DISABLE_XET``), so that an
upload is plain HTTP to this process:

- ``POST /api/repos/create`` (``create_repo``): 200 and the repo's URL; 409 when it exists (``exist_ok``).
- ``POST /api/models/{repo}/branch/{branch}`` (``create_branch``): 200; 409 when it exists.
- ``POST /api/validate-yaml`` (``upload_folder``, for a ``README.md``): 200 when the card's front matter is a YAML
  mapping, else 400 with the hub's ``errors`` list.
- ``POST /api/models/{repo}/preupload/{rev}`` (``_fetch_upload_modes``): ``lfs`` for binary samples (a NUL byte)
  or 10 MB and more, as the hub decides, else ``regular``.
- ``POST /{repo}.git/info/lfs/objects/batch`` (``post_lfs_batch_info``): the ``basic`` transfer, an upload
  ``href`` and a ``verify`` ``href`` on this server; no actions for an object it already holds (resume).
- ``PUT /lfs/{oid}`` (``lfs_upload``, basic transfer): stores the bytes after checking their sha256.
- ``POST /lfs/{oid}/verify``: 200 when held.
- ``POST /api/models/{repo}/commit/{rev}`` (``create_commit``, NDJSON: ``header``, ``file`` base64 ``content``,
  ``lfsFile`` ``oid``): applies the files to the branch; 400 for an LFS object never uploaded.

Anything else answers 404 and is recorded in :attr:`HubServer.requests` like every request, so a test sees the
whole conversation. :attr:`HubServer.fail` makes chosen requests fail (a server error mid-upload).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

LFS_MIN_BYTES = 10 * 1024 * 1024


@dataclass
class Repo:
    private: bool | None
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {".gitattributes": b"*.gguf filter=lfs\n"}})
    commits: list[dict] = field(default_factory=list)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class HubServer:
    """The hub, on ``127.0.0.1``: use as a context manager; :attr:`url` is its endpoint.

    Attributes:
        repos: repo id -> :class:`Repo` (branches map path -> bytes).
        lfs: sha256 hex -> bytes uploaded.
        requests: every request, in order.
        fail: ``(method, path) -> status or None``: answer that status (with a JSON error) instead.
    """

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[Request] = []
        self.fail: Callable[[str, str], int | None] = lambda method, path: None
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def routes(self) -> list[str]:
        """``METHOD path`` of each request, ids and hashes replaced by placeholders (the endpoints used), without
        ``GET /api/agent-harnesses``: huggingface_hub 2.x's best-effort registry fetch for its user agent (once a
        day, cached in ``HF_HOME``; a 404 here is swallowed), not part of an upload."""
        out = []
        for r in self.requests:
            path = urlsplit(r.path).path
            if path == "/api/agent-harnesses":
                continue
            path = re.sub(r"/lfs/[0-9a-f]{64}", "/lfs/{oid}", path)
            path = re.sub(r"/api/models/[^/]+/[^/]+/", "/api/models/{repo}/", path)
            path = re.sub(r"^/[^/]+/[^/]+\.git/", "/{repo}.git/", path)
            path = re.sub(r"/(preupload|commit|branch|revision)/.+$", r"/\1/{rev}", path)
            out.append(f"{r.method} {path}")
        return out

    # --- the endpoints -------------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict | None]:
        path = urlsplit(path).path
        if method == "POST" and path == "/api/repos/create":
            req = json.loads(body)
            repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
            private = req["visibility"] == "private" if "visibility" in req else req.get("private")
            self.repos[repo_id] = Repo(private=private)
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}
        if method == "POST" and path == "/api/validate-yaml":
            m = re.match(r"^---\n(.*?)\n---\n", json.loads(body)["content"], re.S)
            meta = yaml.safe_load(m.group(1)) if m else None
            if not isinstance(meta, dict):
                return 400, {"errors": [{"message": "no YAML metadata mapping at the start of README.md"}]}
            return 200, {"warnings": []}
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(branch|preupload|commit)/(.+)", path)
        if m is not None:
            repo = self.repos.get(m.group(1))
            if repo is None:
                return 404, {"error": "Repository not found"}
            rev = unquote(m.group(3))
            if m.group(2) == "branch":
                if rev in repo.branches:
                    return 409, {"error": "Reference already exists"}
                repo.branches[rev] = dict(repo.branches["main"])
                return 200, {}
            if rev not in repo.branches:
                return 404, {"error": f"Invalid rev id: {rev}"}
            if m.group(2) == "preupload":
                files = json.loads(body)["files"]
                return 200, {"files": [{"path": f["path"], "shouldIgnore": False, "oid": None,
                                        "uploadMode": "lfs" if f["size"] >= LFS_MIN_BYTES or b"\0" in base64.b64decode(f["sample"])
                                        else "regular"} for f in files]}
            return self._commit(m.group(1), repo, rev, body)
        m = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
        if m is not None and method == "POST":
            req = json.loads(body)
            objects = []
            for o in req["objects"]:
                actions = {} if o["oid"] in self.lfs else {
                    "upload": {"href": f"{self.url}/lfs/{o['oid']}"},
                    "verify": {"href": f"{self.url}/lfs/{o['oid']}/verify"}}
                objects.append({"oid": o["oid"], "size": o["size"], **({"actions": actions} if actions else {})})
            return 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}
        m = re.fullmatch(r"/lfs/([0-9a-f]{64})(/verify)?", path)
        if m is not None:
            if m.group(2):
                return (200, {}) if m.group(1) in self.lfs else (404, {"error": "object not found"})
            if method == "PUT":
                if hashlib.sha256(body).hexdigest() != m.group(1):
                    return 400, {"error": "sha256 mismatch"}
                self.lfs[m.group(1)] = body
                return 200, None
        return 404, {"error": f"no such endpoint on the test hub: {method} {path}"}

    def _commit(self, repo_id: str, repo: Repo, rev: str, body: bytes) -> tuple[int, dict]:
        files, header = {}, None
        for line in body.decode().splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "header":
                header = value
            elif item["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return 400, {"error": f"LFS object {value['oid']} was never uploaded"}
                files[value["path"]] = self.lfs[value["oid"]]
            else:
                return 400, {"error": f"unsupported commit operation {item['key']}"}
        repo.branches[rev].update(files)
        oid = hashlib.sha1(body).hexdigest()
        repo.commits.append({"branch": rev, "header": header, "files": sorted(files), "oid": oid})
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid, "success": True}


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            with hub.lock:
                hub.requests.append(Request(self.command, self.path, dict(self.headers), body))
                status = hub.fail(self.command, urlsplit(self.path).path)
                if status is not None:
                    answer = {"error": "the test hub failed this request on purpose"}
                else:
                    status, answer = hub.handle(self.command, self.path, body)
            data = json.dumps(answer).encode() if answer is not None else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _serve

        def log_message(self, *args) -> None:  # quiet
            pass

    return Handler
