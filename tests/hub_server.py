"""A small Hub-compatible HTTP server for tests: real repos, served the way huggingface_hub expects.

It answers the endpoints `HfApi.list_models`, `HfApi.model_info`, `HfApi.list_repo_tree` (what
`snapshot_download` lists files with) and `hf_hub_download` call (huggingface_hub 2.x):
`GET /api/models`, `GET /api/models/{repo}[/revision/{rev}]`, `GET /api/models/{repo}/tree/{rev}`
and `HEAD|GET /{repo}/resolve/{rev}/{file}`, with the headers the client reads (`X-Repo-Commit`,
`ETag`, `Content-Length`, `X-Error-Code`). Requests can fail (`failing`) or go unanswered (`stalled`,
a stuck proxy). Repos can be gated (401 `GatedRepo` on files without the test token), private (401
`RepoNotFound` everywhere without it) or vanished (listed by `/api/models`, 404 everywhere else, as
a repo deleted between listing and download).

Like the Hub, it keeps every commit: `push` makes a new one the repo's `main` while the earlier
ones stay reachable by their sha (`rewrite_history` forgets them, as a force push does), `delete`
removes a repo, and `expand=` asks for some fields of a model's info only (`sha` among them, which
the Hub leaves out unless asked for). A repo can also report other info than its files say (`api`:
fields such as `config` or `safetensors` the API answers instead of the true ones), hold file names
a client must never write (`../x`, absolute paths, backslashes) and a config.json that is not JSON
at all: a hostile repo.

`build_tiny_repo` writes the small real models (a tiny Llama with a word-level tokenizer) served.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    api: dict[str, Any] = field(default_factory=dict)  # info fields reported instead of the true ones
    parent: str = ""  # the previous commit's sha: two commits of the same files still differ
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1((self.repo_id + self.parent).encode())
        for name in sorted(self.files):
            digest.update(name.encode() + self.files[name])
        self.sha = digest.hexdigest()

    def info(self, expand: list[str] | None = None) -> dict[str, Any]:
        """The JSON the Hub returns for a model (list entry and `model_info`); with `expand`, only
        those fields (and the id), as the Hub answers."""
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
        config = self._config()
        if config is not None:
            data["config"] = config
        if self.card_data:
            data["cardData"] = self.card_data
            base = self.card_data.get("base_model")
            if base:
                data["tags"].append(f"base_model:{base}")
        if "model.safetensors" in self.files:
            data["safetensors"] = _safetensors_summary(self.files["model.safetensors"])
        data.update(self.api)
        if expand:
            data = {key: value for key, value in data.items() if key in {"id", *expand}}
        return data

    def _config(self) -> Any:
        """config.json as the Hub reports it: nothing when there is none or it is not JSON."""
        try:
            return json.loads(self.files["config.json"])
        except (KeyError, ValueError):
            return None


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
        self.repos: dict[str, Repo] = {}  # each repo's latest commit (its `main`)
        self.commits: dict[tuple[str, str], Repo] = {}  # (repo id, sha) -> that commit, kept by `push`
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.failing: dict[str, int] = {}  # path prefix -> the status every request under it gets
        self.stalled: set[str] = set()  # paths whose requests are never answered
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        # Polled every 50 ms for `stop` (the default 0.5 s would be most of a small test's time).
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo_id: str, folder: Path | None = None, **options: Any) -> Repo:
        """Serve the files of `folder` (all of them, flat) as `repo_id`."""
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()} if folder else {}
        return self._commit(Repo(repo_id, files, **options))

    def push(self, repo_id: str, changes: dict[str, bytes | None], **options: Any) -> Repo:
        """A new commit of `repo_id`: its files with `changes` applied (None deletes a file), its
        options with `options`. Earlier commits stay reachable by their sha."""
        old = self.repos[repo_id]
        files = {**old.files, **changes}
        files = {name: blob for name, blob in files.items() if blob is not None}
        kept = {f: getattr(old, f) for f in ("gated", "private", "vanished", "card_data", "api")}
        return self._commit(Repo(repo_id, files, **{**kept, **options, "parent": old.sha}))

    def rewrite_history(self, repo_id: str) -> None:
        """Forget every commit of `repo_id` but its latest (a force push)."""
        latest = self.repos[repo_id].sha
        self.commits = {
            key: repo for key, repo in self.commits.items() if key[0] != repo_id or key[1] == latest
        }

    def delete(self, repo_id: str) -> None:
        """Remove `repo_id` and its history: 404 everywhere, gone from listings."""
        del self.repos[repo_id]
        self.commits = {key: repo for key, repo in self.commits.items() if key[0] != repo_id}

    def resolved(self, repo_id: str) -> list[tuple[str, str]]:
        """(revision, file name) of each file of `repo_id` requested (HEAD or GET), in order."""
        prefix = f"/{repo_id}/resolve/"
        found = [path[len(prefix) :].split("/", 1) for _, path in self.requests if path.startswith(prefix)]
        return [(revision, name) for revision, name in found]

    def _commit(self, repo: Repo) -> Repo:
        self.repos[repo.repo_id] = repo
        self.commits[repo.repo_id, repo.sha] = repo
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
            if path in hub.stalled:  # a stuck proxy: taken, never answered, closed once no longer stalled
                while path in hub.stalled:
                    time.sleep(0.05)
                return
            if status := next(
                (code for prefix, code in hub.failing.items() if path.startswith(prefix)), None
            ):
                return self._error(status, "Failing", "The Hub fails for now", body)
            if path == "/api/models":
                return self._list(parse_qs(parts.query), body)
            if match := _TREE.match(path):
                return self._tree(match.group(1), match.group(2), match.group(3), body)
            if match := _INFO.match(path):
                return self._info(match.group(1), match.group(2), body, parse_qs(parts.query).get("expand"))
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
            elif revision not in (None, "main") and (repo_id, revision) not in hub.commits:
                self._error(404, "RevisionNotFound", "Invalid rev id", body, commit=None)
            else:
                return repo if revision in (None, "main") else hub.commits[repo_id, revision]
            return None

        def _list(self, query: dict[str, list[str]], body: bool) -> None:
            author = query.get("author", [""])[0]
            search = query.get("search", [""])[0].lower()
            found = [
                repo.info(query.get("expand"))
                for repo in hub.repos.values()
                if (not author or repo.repo_id.split("/")[0] == author)
                and search in repo.repo_id.lower()
                and (not repo.private or self._authorized())
            ]
            self._json(found, body)

        def _info(self, repo_id: str, revision: str | None, body: bool, expand: list[str] | None) -> None:
            repo = self._repo(repo_id, revision, body)
            if repo is not None:
                self._json(repo.info(expand), body)

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


# --- the small real repos served -----------------------------------------------------------------

WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "one", "small"),
    *("cat", "sat", "on", "warm", "mat", "and", "two", "birds", "sang", "in", "green", "trees"),
]


def tiny_tokenizer(order: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS: order "A" gives them ids 3, 4, ...; "B" the same words
    reversed (the same strings, other ids: a decoy)."""
    words = list(dict.fromkeys(WORDS))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in words if order == "A" else reversed(words):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_tiny_repo(
    folder: Path, hidden: int, layers: int, vocab: int, tok: Any, extra: dict[str, Any] | None = None
) -> Path:
    """A random tiny Llama (seed 0) with `tiny_tokenizer(tok)` (or `tok` itself, a tokenizer), saved
    in `folder`; `extra` is merged into its config.json."""
    torch.manual_seed(0)
    heads = max(1, hidden // 16)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=hidden // heads,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    (tiny_tokenizer(tok) if isinstance(tok, str) else tok).save_pretrained(folder)
    if extra:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return folder
