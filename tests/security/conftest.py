"""The red-team suite's sandbox: a local Hub (tests/hub_server.py) for hostile repos, every cache in a
temporary folder, and guards for what must never happen.

- **Code from a repo runs**: hostile repos carry code (`remote_code_files`, a pickle) that writes
  `Sandbox.sentinel` when run; it must not exist afterwards.
- **Something asks on stdin**: `sys.stdin` is replaced by `NoStdin`, which counts reads (and refuses
  them, as a closed terminal would); transformers' "Do you wish to run the custom code? [y/N]" reads it.
- **A file lands outside the caches**: `Sandbox.assert_contained` compares every path under the
  sandbox, the working directory included, with what was there before; only the Hub cache
  (HF_HUB_CACHE) and ours (HF_SPECDEC_CACHE) may change.

huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE once, at import: the fixture also points its
constants at the sandbox, so that even a download our code did not ask for (transformers fetching
remote code) reaches the local server and the temporary cache, never huggingface.co.
"""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import transformers.dynamic_module_utils
from transformers import LlamaForCausalLM

from hf_specdec.drafters import draft_model

try:  # `python -m pytest` from the repo root, or --import-mode=importlib
    from tests.hub_server import HubServer, build_tiny_repo
except ImportError:  # plain `pytest`: the tests folder itself is on sys.path
    from hub_server import HubServer, build_tiny_repo

TARGET = "evil/Tiny-160M-Instruct"
DRAFT = "evil/Tiny-7M-Instruct"  # the only candidate of TARGET's family and size: the search picks it
CODE_REPO = "evil/code"  # where a swapped config's auto_map points


class NoStdin:
    """A stdin that counts reads and refuses each one."""

    def __init__(self) -> None:
        self.reads = 0

    def _read(self, *args: Any) -> str:
        self.reads += 1
        raise OSError("the red-team suite closed stdin: nothing may ask the user a question")

    read = readline = readlines = _read

    def fileno(self) -> int:
        raise OSError("no file descriptor")

    def isatty(self) -> bool:
        return False


@dataclass
class Sandbox:
    root: Path
    hub: HubServer
    hub_cache: Path
    specdec_cache: Path
    sentinel: Path
    stdin: NoStdin
    before: set[Path]

    def files(self) -> set[Path]:
        """Every path under the sandbox outside the two caches."""
        caches = (self.hub_cache, self.specdec_cache)
        return {p for p in self.root.rglob("*") if not any(p == c or c in p.parents for c in caches)}

    def assert_contained(self) -> None:
        """No code ran, nothing read stdin, no file appeared outside the caches."""
        assert not self.sentinel.exists(), f"code from a hostile repo ran: {self.sentinel.read_text()!r}"
        assert self.stdin.reads == 0, "something asked a question on stdin"
        assert self.files() == self.before, f"files outside the caches: {sorted(self.files() - self.before)}"

    def selections(self) -> list[Path]:
        """The cached draft choices."""
        return sorted((self.specdec_cache / "selections").glob("*.json"))


def remote_code_files(sentinel: Path) -> dict[str, bytes]:
    """A repo of custom code (a config and a model class) that writes `sentinel` when imported."""
    mark = f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('ran: ' + __name__)\n"
    configuration = mark + (
        "from transformers import LlamaConfig\n\n\n"
        "class EvilConfig(LlamaConfig):\n"
        "    model_type = 'evilarch'\n"
    )
    modeling = mark + (
        "from transformers import LlamaForCausalLM\n\n"
        "from .configuration_evil import EvilConfig\n\n\n"
        "class EvilForCausalLM(LlamaForCausalLM):\n"
        "    config_class = EvilConfig\n"
    )
    return {"configuration_evil.py": configuration.encode(), "modeling_evil.py": modeling.encode()}


def remote_code_config(config: bytes) -> bytes:
    """`config` turned into one that needs the code of CODE_REPO (an architecture transformers lacks)."""
    data = json.loads(config)
    data["model_type"] = "evilarch"
    data["architectures"] = ["EvilForCausalLM"]
    data["auto_map"] = {
        "AutoConfig": f"{CODE_REPO}--configuration_evil.EvilConfig",
        "AutoModelForCausalLM": f"{CODE_REPO}--modeling_evil.EvilForCausalLM",
    }
    return json.dumps(data).encode()


class _Unpickled:
    """Unpickling this runs code: it writes the sentinel."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({str(self.sentinel)!r}, 'w').write('ran: unpickled')",)


def pickle_weights(sentinel: Path) -> bytes:
    """A `pytorch_model.bin` whose unpickling writes `sentinel`."""
    return pickle.dumps({"model.embed_tokens.weight": _Unpickled(sentinel)})


@pytest.fixture(scope="session")
def tiny_repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real small repos, built once: the target, a compatible draft (padded vocab_size 160 vs 128,
    same tokenizer) and a decoy draft (same words, other ids)."""
    root = tmp_path_factory.mktemp("tiny-repos")
    return {
        "target": build_tiny_repo(root / "target", 64, 4, 128, "A"),
        "draft": build_tiny_repo(root / "draft", 16, 1, 160, "A"),
        "decoy": build_tiny_repo(root / "decoy", 16, 1, 160, "B"),
    }


@pytest.fixture
def sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_repos: dict[str, Path]
) -> Iterator[Sandbox]:
    """A local Hub serving TARGET and DRAFT (and CODE_REPO), every cache under `tmp_path`, the
    working directory there too, stdin closed."""
    root = tmp_path / "sandbox"
    hub_cache, specdec_cache, modules, work = (
        root / name for name in ("hf-cache", "specdec", "modules", "work")
    )
    for folder in (hub_cache, specdec_cache, modules, work):
        folder.mkdir(parents=True)
    sentinel = root / "code-ran"
    server = HubServer()
    server.add(TARGET, tiny_repos["target"])
    server.add(DRAFT, tiny_repos["draft"])
    code = server.add(CODE_REPO)
    code.files.update(remote_code_files(sentinel))
    server.start()

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(specdec_cache))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    constants = huggingface_hub.constants  # read once at import: what transformers' own downloads use
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(root / "no-token"))  # ignore a login
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(modules))
    monkeypatch.setattr(sys, "path", list(sys.path))  # remote code would add the modules folder
    monkeypatch.delitem(sys.modules, "transformers_modules", raising=False)
    monkeypatch.chdir(work)
    stdin = NoStdin()
    monkeypatch.setattr(sys, "stdin", stdin)
    box = Sandbox(root, server, hub_cache, specdec_cache, sentinel, stdin, set())
    box.before = box.files()
    yield box
    draft_model.clear_loaded()  # drafts are loaded from this test's own folders: nothing to reuse
    server.stop()


@pytest.fixture(scope="session")
def hub_target(tiny_repos: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    """TARGET's weights loaded from a local folder whose config.json names the Hub repo (generate
    leaves the model as it was, so one serves every test)."""
    folder = tmp_path_factory.mktemp("target")
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((tiny_repos["target"] / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": TARGET}))
    return LlamaForCausalLM.from_pretrained(folder).eval()
