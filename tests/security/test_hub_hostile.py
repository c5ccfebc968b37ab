"""A hostile Hub: a repo owner who swaps in remote code, another tokenizer or pickle weights after
`speculative=True` chose their draft, a repo that vanishes, file names that climb out of the cache,
configs that are not what a config should be, and selection cache files that lie.

Each case runs against a real local Hub server (tests/hub_server.py) and the real huggingface_hub
client, inside the sandbox of conftest.py: afterwards no code from a repo has run (its sentinel file
is absent), nothing read stdin (transformers' "[y/N]" prompt) and no file appeared outside the two
caches. One control opts in to remote code and sees the sentinel written, so the guard can fail.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.selection.method import DRAFT_FREE_AUTO
from hf_specdec.selection.select import load_draft, select_draft

from ..hub_server import tiny_tokenizer
from .conftest import DRAFT, TARGET, Sandbox, pickle_weights, remote_code_config

PROMPT = torch.tensor([[1, 5, 6, 7, 8, 5, 6]])
PACKAGE = Path(hf_specdec.__file__).resolve().parent


@pytest.fixture
def target(hub_target):
    """The Hub-named target (conftest's `hub_target`); the other security tests keep the plain one."""
    return hub_target


def generate(target, speculative=True, **kwargs):
    """`speculative` generation's stats, after checking its tokens are plain greedy `generate`'s."""
    plain = target.generate(PROMPT, max_new_tokens=10, do_sample=False)
    out = target.generate(
        PROMPT,
        max_new_tokens=10,
        do_sample=False,
        speculative=speculative,
        return_dict_in_generate=True,
        **kwargs,
    )
    assert torch.equal(out.sequences, plain)
    return out.speculative_stats


def _config(sandbox: Sandbox) -> bytes:
    return sandbox.hub.repos[DRAFT].files["config.json"]


def _drop_downloaded(sandbox: Sandbox, repo_id: str) -> None:
    """Forget every file of `repo_id` in the Hub cache (as if it had never been downloaded)."""
    shutil.rmtree(sandbox.hub_cache / f"models--{repo_id.replace('/', '--')}", ignore_errors=True)


# --- remote code ----------------------------------------------------------------------------------


@pytest.mark.parametrize("loaded_before", [True, False], ids=["draft-loaded", "only-selected"])
def test_remote_code_pushed_after_the_choice_was_cached_never_runs(sandbox, target, loaded_before):
    """The issue's scenario: the search picks the draft honestly and caches it, then the owner pushes
    a config.json whose auto_map points at code in a third repo. The draft stays the commit that was
    checked: its files come from that commit, whatever `main` is now."""
    checked = select_draft(TARGET)
    assert (checked.draft, checked.revision) == (DRAFT, sandbox.hub.repos[DRAFT].sha)
    if loaded_before:
        assert generate(target).method == "draft_model"
    sandbox.hub.push(DRAFT, {"config.json": remote_code_config(_config(sandbox))})
    hf_specdec.clear_cache()  # load it again from the files

    stats = generate(target)
    assert stats.method == "draft_model" and stats.drafted > 0
    assert load_draft(select_draft(TARGET), target).config.model_type == "llama"
    assert {rev for rev, _ in sandbox.hub.resolved(DRAFT)} == {checked.revision}  # never `main`
    sandbox.assert_contained()


def test_remote_code_the_api_does_not_show_is_refused_within_one_call(sandbox, target):
    """The repo's info reports a plain config, its config.json needs remote code: the search reads
    the config.json it downloaded, at the commit it checks, and skips the draft."""
    honest = json.loads(_config(sandbox))
    sandbox.hub.push(DRAFT, {"config.json": remote_code_config(_config(sandbox))}, api={"config": honest})

    assert generate(target).method == DRAFT_FREE_AUTO
    choice = select_draft(TARGET)
    assert choice.draft is None
    assert any(r.startswith(f"{DRAFT}: needs custom code (auto_map") for r in choice.rejected)
    sandbox.assert_contained()


def test_a_rewritten_history_drops_the_cached_choice(sandbox, target):
    """The checked commit is gone (force push) and its weights were never downloaded: the choice no
    longer loads, so it is dropped with a warning naming the cache, and the call speculates with
    n-grams. The next search sees the remote code and skips the draft."""
    select_draft(TARGET)
    sandbox.hub.push(DRAFT, {"config.json": remote_code_config(_config(sandbox))})
    sandbox.hub.rewrite_history(DRAFT)
    with pytest.warns(UserWarning, match=rf"{DRAFT}.*no revision.*'suffix'.*selections") as caught:
        assert generate(target).method == DRAFT_FREE_AUTO
    assert len([w for w in caught if "suffix" in str(w.message)]) == 1
    assert sandbox.selections() == []
    choice = select_draft(TARGET)
    assert choice.draft is None and any("needs custom code" in r for r in choice.rejected)
    sandbox.assert_contained()


def test_opting_in_runs_the_remote_code(sandbox, target):
    """Control: with the user's opt-in the same draft's code is downloaded and run, and the sentinel
    says so, so the guard of the other cases can fail."""
    sandbox.hub.push(DRAFT, {"config.json": remote_code_config(_config(sandbox))})
    stats = generate(target, SpeculativeConfig(trust_remote_code=True))
    assert stats.method == "draft_model" and stats.drafted > 0
    assert sandbox.sentinel.read_text().startswith("ran: transformers_modules")
    assert sandbox.stdin.reads == 0  # an opt-in is an argument, never a question


# --- tokenizer and repo swapped after caching -----------------------------------------------------


def test_tokenizer_pushed_after_the_choice_was_cached_is_not_used(sandbox, target, tiny_repos):
    """A new commit with another tokenizer (same words, other ids): the draft and its tokenizer stay
    those of the commit whose tokenizer was compared with the target's."""
    checked = select_draft(TARGET)
    decoy = (tiny_repos["decoy"] / "tokenizer.json").read_bytes()
    sandbox.hub.push(DRAFT, {"tokenizer.json": decoy})
    assert generate(target).method == "draft_model"
    assert {rev for rev, _ in sandbox.hub.resolved(DRAFT)} == {checked.revision}
    sandbox.assert_contained()


def test_tokenizer_changed_under_the_checked_commit_drops_the_choice(sandbox, target, tiny_repos):
    """The files served for the checked commit are not those checked (a mirror that lies, or a
    tampered download): the draft's tokenizer is not the one compared with the target's, so the
    choice is dropped with a warning and the call speculates with n-grams."""
    checked = select_draft(TARGET)
    served = sandbox.hub.commits[DRAFT, checked.revision]
    served.files["tokenizer.json"] = (tiny_repos["decoy"] / "tokenizer.json").read_bytes()
    _drop_downloaded(sandbox, DRAFT)
    with pytest.warns(UserWarning, match=rf"{DRAFT}.*tokenizer is not the one.*'suffix'.*selections"):
        assert generate(target).method == DRAFT_FREE_AUTO
    assert sandbox.selections() == []
    sandbox.assert_contained()


def test_a_deleted_repo_drops_the_cached_choice(sandbox, target):
    select_draft(TARGET)  # cached; only the tokenizer files were downloaded
    sandbox.hub.delete(DRAFT)
    with pytest.warns(UserWarning, match=rf"{DRAFT}.*not found on the Hub.*'suffix'.*selections"):
        assert generate(target).method == DRAFT_FREE_AUTO
    assert sandbox.selections() == []
    assert generate(target).method == DRAFT_FREE_AUTO  # searched again: no draft left, no warning
    assert select_draft(TARGET).source == "cache"
    sandbox.assert_contained()


def test_offline_the_pinned_commit_is_loaded_from_the_cache(sandbox, target, monkeypatch):
    assert generate(target).method == "draft_model"  # downloads the checked commit
    hf_specdec.clear_cache()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = len(sandbox.hub.requests)
    assert generate(target).method == "draft_model"
    assert len(sandbox.hub.requests) == seen
    sandbox.assert_contained()


def test_offline_without_the_weights_falls_back_and_keeps_the_choice(sandbox, target, monkeypatch):
    """Not having the files offline is not a reason to forget the choice: it loads once online."""
    select_draft(TARGET)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.warns(UserWarning, match=rf"{DRAFT}.*not in the local Hub cache.*'suffix'"):
        assert generate(target).method == DRAFT_FREE_AUTO
    assert len(sandbox.selections()) == 1
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert generate(target).method == "draft_model"
    sandbox.assert_contained()


# --- file names, pickles, configs -----------------------------------------------------------------

HOSTILE_NAMES = [
    "../../escaped.json",
    "model/../../escaped.safetensors",
    "model-00001-of-00001.safetensors/../../../escaped.json",
    "/tmp/escaped-absolute.safetensors",
    "model\\..\\..\\escaped.safetensors",
    "C:/escaped.safetensors",
    "./config.json",
]


def test_hostile_file_names_are_skipped_before_any_download(sandbox, target):
    sandbox.hub.push(DRAFT, dict.fromkeys(HOSTILE_NAMES, b"{}"))
    assert generate(target).method == "draft_model"  # its own files are fine
    named = SpeculativeConfig(method="draft_model", draft=DRAFT)
    assert generate(target, named, tokenizer=tiny_tokenizer("A")).method == "draft_model"
    requested = {name for _, name in sandbox.hub.resolved(DRAFT)}
    assert requested and not requested & set(HOSTILE_NAMES)
    sandbox.assert_contained()


def test_pickle_weights_are_never_downloaded(sandbox, target):
    """A draft with `pytorch_model.bin` only (its unpickling runs code): the search skips it, and a
    draft named by the user is refused, before the file is fetched."""
    stated = sandbox.hub.repos[DRAFT].info()["safetensors"]  # so that its size still fits
    changes = {"model.safetensors": None, "pytorch_model.bin": pickle_weights(sandbox.sentinel)}
    sandbox.hub.push(DRAFT, changes, api={"safetensors": stated})

    assert generate(target).method == DRAFT_FREE_AUTO
    rejected = select_draft(TARGET).rejected
    assert any(r.startswith(f"{DRAFT}: no safetensors weights") for r in rejected), rejected
    with pytest.raises(
        ValueError, match=rf"{DRAFT} cannot be used: no safetensors weights.*pickle.*loaded model"
    ):
        generate(target, SpeculativeConfig(method="draft_model", draft=DRAFT))
    assert "pytorch_model.bin" not in {name for _, name in sandbox.hub.resolved(DRAFT)}
    sandbox.assert_contained()


BAD_CONFIGS = {
    "not-json": (b'{"model_type": "llama",', "not valid JSON"),
    "a-list": (b'["model_type", "llama"]', "not a JSON object"),
    "null": (b"null", "not a JSON object"),
    "huge": (None, "larger than 1 MiB"),  # a valid config with 2 MiB of padding
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_malformed_configs_are_refused(sandbox, target, case):
    blob, why = BAD_CONFIGS[case]
    if blob is None:
        blob = json.dumps({**json.loads(_config(sandbox)), "padding": "x" * (2 << 20)}).encode()
    sandbox.hub.push(DRAFT, {"config.json": blob})

    assert generate(target).method == DRAFT_FREE_AUTO
    rejected = [r for r in select_draft(TARGET).rejected if r.startswith(f"{DRAFT}:")]
    assert rejected, "the draft was not even considered"
    with pytest.raises(ValueError, match=rf"{DRAFT}.*config\.json is {why}"):
        generate(target, SpeculativeConfig(method="draft_model", draft=DRAFT))
    sandbox.assert_contained()


# --- the selection cache --------------------------------------------------------------------------


def _outside_folder(sandbox: Sandbox) -> str:
    """A local model folder outside every cache, whose config needs remote code."""
    folder = sandbox.root / "elsewhere"
    folder.mkdir()
    for name, blob in sandbox.hub.repos[DRAFT].files.items():
        (folder / name).write_bytes(remote_code_config(blob) if name == "config.json" else blob)
    return str(folder)


CACHE_LIES = {
    "not-json": lambda choice, sandbox: "{oops",
    "a-list": lambda choice, sandbox: [choice],
    "wrong-types": lambda choice, sandbox: {**choice, "draft": 5, "rejected": "none"},
    "draft-is-a-folder": lambda choice, sandbox: {**choice, "draft": _outside_folder(sandbox)},
    "draft-climbs-out": lambda choice, sandbox: {**choice, "draft": "evil/.."},
    "no-revision": lambda choice, sandbox: {k: v for k, v in choice.items() if k != "revision"},
    "revision-is-a-branch": lambda choice, sandbox: {**choice, "revision": "main"},
    "no-tokenizer-fingerprint": lambda choice, sandbox: {**choice, "tokenizer_fingerprint": None},
    "another-target": lambda choice, sandbox: {**choice, "target": "evil/Other-160M"},
    "draft-free-method-unknown": lambda choice, sandbox: {**choice, "method": "eagle", "draft": None},
    "huge": lambda choice, sandbox: {**choice, "reason": "x" * (2 << 20)},
}


@pytest.mark.parametrize("case", sorted(CACHE_LIES))
def test_malformed_selection_cache_files_are_dropped(sandbox, target, case):
    """A cache file that does not hold a choice this version wrote is never trusted: dropped with a
    warning naming it, and the Hub searched again."""
    select_draft(TARGET)
    (path,) = sandbox.selections()
    lie = CACHE_LIES[case](json.loads(path.read_text()), sandbox)
    path.write_text(lie if isinstance(lie, str) else json.dumps(lie))
    sandbox.before = sandbox.files()

    with pytest.warns(UserWarning, match=r"Ignoring the cached draft choice .*selections"):
        stats = generate(target)
    assert stats.method == "draft_model"
    again = select_draft(TARGET)
    assert (again.draft, again.revision, again.source) == (DRAFT, sandbox.hub.repos[DRAFT].sha, "cache")
    sandbox.assert_contained()


def test_malformed_selection_cache_offline_falls_back_to_ngram(sandbox, target, monkeypatch):
    select_draft(TARGET)
    (path,) = sandbox.selections()
    path.write_text('{"method": "draft_model", "draft": "/"}')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.warns(UserWarning, match=r"Ignoring the cached draft choice"):
        assert generate(target).method == DRAFT_FREE_AUTO
    assert select_draft(TARGET).source == "offline"
    sandbox.assert_contained()


def test_a_cached_commit_that_needs_remote_code_is_dropped(sandbox, target):
    """A cache entry naming a commit of the draft whose config needs remote code (written by hand: a
    search never picks one) fails the checks made before loading."""
    select_draft(TARGET)
    (path,) = sandbox.selections()
    evil = sandbox.hub.push(DRAFT, {"config.json": remote_code_config(_config(sandbox))})
    sandbox.hub.push(
        DRAFT,
        {
            "config.json": sandbox.hub.commits[DRAFT, json.loads(path.read_text())["revision"]].files[
                "config.json"
            ]
        },
    )
    path.write_text(json.dumps({**json.loads(path.read_text()), "revision": evil.sha}))
    with pytest.warns(UserWarning, match=rf"{DRAFT}.*needs custom code.*'suffix'"):
        assert generate(target).method == DRAFT_FREE_AUTO
    assert sandbox.selections() == []
    sandbox.assert_contained()


# --- the package's own calls ----------------------------------------------------------------------

LOADERS = {"from_pretrained"}
DOWNLOADERS = {"hf_hub_download", "snapshot_download"}


def _calls(name_set: set[str]) -> list[tuple[Path, ast.Call]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in name_set:
                    found.append((path, node))
    return found


def test_every_from_pretrained_says_whether_remote_code_may_run():
    """transformers asks on stdin when `trust_remote_code` is left out and a config needs remote
    code: every load in the package passes it."""
    loads = _calls(LOADERS)
    assert len(loads) >= 10
    silent = [
        f"{path.relative_to(PACKAGE.parent)}:{call.lineno}"
        for path, call in loads
        if not any(k.arg == "trust_remote_code" for k in call.keywords)
    ]
    assert silent == [], f"from_pretrained without trust_remote_code=: {silent}"


def test_every_download_goes_through_the_hub_module():
    """File names are checked in one place (`hub.download.is_safe_filename`) before anything is fetched."""
    places = {path.relative_to(PACKAGE).as_posix() for path, _ in _calls(DOWNLOADERS)}
    assert places == {"hub/download.py"}
