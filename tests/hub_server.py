"""A small Hub-compatible HTTP server for tests: real repos, served the way huggingface_hub expects.

It answers the endpoints `HfApi.list_models`, `HfApi.model_info`, `HfApi.list_repo_tree` (what
`snapshot_download` lists files with) and `hf_hub_download` call (huggingface_hub 2.x):
`GET /api/models`, `GET /api/models/{repo}[/revision/{rev}]`, `GET /api/models/{repo}/tree/{rev}`
and `HEAD|GET /{repo}/resolve/{rev}/{file}`, with the headers the client reads (`X-Repo-Commit`,
`ETag`, `Content-Length`, `X-Error-Code`). Repos can be gated (401 `GatedRepo` on files without
the test token), private (401 `RepoNotFound` everywhere without it) or vanished (listed by
`/api/models`, 404 everywhere else, as a repo deleted between listing and download).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "hf_test_token"
_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class Repo:
    """One model repo at one commit."""

    repo_id: str
    files: dict[str, bytes]
    gated: bool = False
    private: bool = False
    vanished: bool = False
    card_data: dict[str, Any] | None = None
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1(self.repo_id.encode())
        for name in sorted(self.files):
            digest.update(name.encode() + self.files[name])
        self.sha = digest.hexdigest()

    def info(self) -> dict[str, Any]:
        """The JSON the Hub returns for a model (list entry and `model_info`)."""
        data: dict[str, Any] = {
            "id": self.repo_id,
            "modelId": self.repo_id,
            "author": self.repo_id.split("/")[0],
            "sha": self.sha,
            "private": self.private,
            "gated": "manual" if self.gated else False,
            "disabled": False,
            "library_name": "transformers",
            "tags": ["transformers", "safetensors", "text-generation"],
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "siblings": [{"rfilename": name, "size": len(blob)} for name, blob in sorted(self.files.items())],
        }
        if "config.json" in self.files:
            data["config"] = json.loads(self.files["config.json"])
        if self.card_data:
            data["cardData"] = self.card_data
            base = self.card_data.get("base_model")
            if base:
                data["tags"].append(f"base_model:{base}")
        if "model.safetensors" in self.files:
            data["safetensors"] = _safetensors_summary(self.files["model.safetensors"])
        return data


def _safetensors_summary(blob: bytes) -> dict[str, Any]:
    """Parameter counts per dtype, read from a safetensors header as the Hub does."""
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    counts: dict[str, int] = {}
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for dim in tensor["shape"]:
            n *= dim
        counts[tensor["dtype"]] = counts.get(tensor["dtype"], 0) + n
    return {"parameters": counts, "total": sum(counts.values())}


def _git_blob_id(blob: bytes) -> str:
    """A file's git blob id: the Hub's `oid` in tree listings and its `ETag` for non-LFS files."""
    return hashlib.sha1(b"blob %d\0" % len(blob) + blob).hexdigest()


class HubServer:
    """A threaded HTTP server on 127.0.0.1 (random port) serving `repos`; records every request."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo_id: str, folder: Path | None = None, **options: Any) -> Repo:
        """Serve the files of `folder` (all of them, flat) as `repo_id`."""
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()} if folder else {}
        repo = Repo(repo_id, files, **options)
        self.repos[repo_id] = repo
        return repo

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _make_handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default log
            pass

        def do_GET(self) -> None:
            self._route(body=True)

        def do_HEAD(self) -> None:
            self._route(body=False)

        def _route(self, *, body: bool) -> None:
            parts = urlsplit(self.path)
            path = unquote(parts.path)
            hub.requests.append((self.command, path))
            if path == "/api/models":
                return self._list(parse_qs(parts.query), body)
            if match := _TREE.match(path):
                return self._tree(match.group(1), match.group(2), match.group(3), body)
            if match := _INFO.match(path):
                return self._info(match.group(1), match.group(2), body)
            if match := _RESOLVE.match(path):
                return self._resolve(match.group(1), match.group(2), match.group(3), body)
            self._error(404, "NotFound", "Unknown endpoint", body)

        def _authorized(self) -> bool:
            return self.headers.get("Authorization") == f"Bearer {TOKEN}"

        def _repo(self, repo_id: str, revision: str | None, body: bool) -> Repo | None:
            """The repo, or None after answering with the error the Hub would give."""
            repo = hub.repos.get(repo_id)
            if repo is None or repo.vanished:
                self._error(404, "RepoNotFound", "Repository not found", body)
            elif repo.private and not self._authorized():
                self._error(401, "RepoNotFound", "Repository not found", body)
            elif revision not in (None, "main", repo.sha):
                self._error(404, "RevisionNotFound", "Invalid rev id", body, commit=None)
            else:
                return repo
            return None

        def _list(self, query: dict[str, list[str]], body: bool) -> None:
            author = query.get("author", [""])[0]
            search = query.get("search", [""])[0].lower()
            found = [
                repo.info()
                for repo in hub.repos.values()
                if (not author or repo.repo_id.split("/")[0] == author)
                and search in repo.repo_id.lower()
                and (not repo.private or self._authorized())
            ]
            self._json(found, body)

        def _info(self, repo_id: str, revision: str | None, body: bool) -> None:
            repo = self._repo(repo_id, revision, body)
            if repo is not None:
                self._json(repo.info(), body)

        def _tree(self, repo_id: str, revision: str, folder: str | None, body: bool) -> None:
            """The repo's files (all of them: files are flat, so `recursive` changes nothing)."""
            repo = self._repo(repo_id, revision, body)
            if repo is None:
                return
            if folder:
                self._error(404, "EntryNotFound", f"{folder} does not exist", body, commit=repo.sha)
                return
            entries = [
                {"type": "file", "oid": _git_blob_id(blob), "size": len(blob), "path": name}
                for name, blob in sorted(repo.files.items())
            ]
            self._json(entries, body)

        def _resolve(self, repo_id: str, revision: str, filename: str, body: bool) -> None:
            repo = self._repo(repo_id, revision, body)
            if repo is None:
                return
            if repo.gated and not self._authorized():
                self._error(401, "GatedRepo", "Access to model is restricted", body)
                return
            blob = repo.files.get(filename)
            if blob is None:
                self._error(404, "EntryNotFound", "Entry not found", body, commit=repo.sha)
                return
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{_git_blob_id(blob)}"'}
            self._send(200, blob, "application/octet-stream", body, headers)

        def _json(self, data: Any, body: bool) -> None:
            self._send(200, json.dumps(data).encode(), "application/json", body, {})

        def _error(self, status: int, code: str, message: str, body: bool, commit: str | None = None) -> None:
            headers = {"X-Error-Code": code, "X-Error-Message": message}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": message}).encode(), "application/json", body, headers)

        def _send(self, status: int, payload: bytes, ctype: str, body: bool, headers: dict[str, str]) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(payload)

    return Handler
