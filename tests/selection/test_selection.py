"""`select_draft`: the registry, the Hub search against a real local Hub server, caching, the CLI."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_specdec.hub.tokenizer_check import PROBE_TEXT
from hf_specdec.selection import select as select_module
from hf_specdec.selection.choice import auto_method
from hf_specdec.selection.select import DraftSelectionError, load_draft, registry_lookup, select_draft

from ..helpers.hub import finished_within, silent_hub
from ..helpers.tokenizers import CORPUS, byte_level_bpe, metaspace_bpe

try:  # `python -m pytest` from the repo root, or --import-mode=importlib
    from tests.hub_server import TOKEN, HubServer, build_tiny_repo
except ImportError:  # plain `pytest`: the tests folder itself is on sys.path
    from hub_server import TOKEN, HubServer, build_tiny_repo

TARGET = "acme/Tiny-160M-Instruct"
GOOD_DRAFT = "acme/Tiny-7M-Instruct"
ALONE = "solo/Alone-160M-Instruct"
CROSS_DRAFT = "general/Mini-6M-Instruct"

# repo id -> (hidden size, layers, config vocab_size, tokenizer, extra config, server options).
# Target ~170k parameters; the ratio window 1/100..1/4 keeps the ~6-7k drafts and drops the rest.
REPOS = {
    TARGET: (64, 4, 128, "A", {}, {}),
    "acme/Tiny-160M": (64, 4, 128, "A", {}, {}),
    "acme/Tiny-1M-Instruct": (4, 1, 128, "A", {}, {}),  # too small: < 1/100 of the target
    "acme/Tiny-5M-Instruct": (16, 1, 128, "B", {}, {}),  # decoy: same words, other ids
    "acme/Tiny-5M": (16, 1, 130, "A", {}, {}),  # compatible but a base model
    "acme/Tiny-5.5M-Instruct": (16, 1, 136, "A", {}, {"vanished": True}),  # listed, then 404
    "acme/Tiny-6M-Instruct-Custom": (16, 1, 140, "A", {"auto_map": {"AutoModelForCausalLM": "x.Y"}}, {}),
    "acme/Tiny-6.5M-Instruct": (16, 1, 144, "A", {}, {"gated": True}),
    GOOD_DRAFT: (16, 1, 160, "A", {}, {}),  # padded vocab_size (160 vs 128), same tokenizer
    "acme/Tiny-80M-Instruct": (48, 3, 128, "A", {}, {}),  # too large: > 1/4 of the target
    "someone/Tiny-160M-Instruct-Pirate": (64, 4, 128, "A", {}, {"card_data": {"base_model": TARGET}}),
    "lonely/Solo-160M": (64, 4, 128, "A", {}, {}),
    "acme/Secret-160M-Instruct": (64, 4, 128, "A", {}, {"gated": True}),
    # A target no draft shares a tokenizer with, and small drafts of other tokenizers (`CROSS`).
    ALONE: (64, 4, 400, "byte-level", {}, {}),
    "general/Chars-5M-Instruct": (16, 1, 90, "characters", {}, {}),  # shares too little of ALONE's
    CROSS_DRAFT: (16, 1, 200, "metaspace", {}, {}),
}
CROSS = ("general/Chars-5M-Instruct", CROSS_DRAFT, "general/Gone-5M-Instruct")  # the last is not served


def _trained_tokenizer(name: str):
    """The tokenizers of the cross-tokenizer repos, trained on the tests' text and the probe text."""
    corpus = CORPUS + PROBE_TEXT
    return {
        "byte-level": lambda: byte_level_bpe(400, corpus),
        "metaspace": lambda: metaspace_bpe(200, corpus, bos=False),
        "characters": lambda: metaspace_bpe(90, corpus),
    }[name]()


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory):
    """A local Hub serving REPOS; HF_ENDPOINT and the caches point at it for the whole session."""
    root = tmp_path_factory.mktemp("hub")
    server = HubServer()
    for repo_id, (hidden, layers, vocab, tok, extra, options) in REPOS.items():
        tok = tok if tok in ("A", "B") else _trained_tokenizer(tok)
        folder = build_tiny_repo(root / repo_id.replace("/", "--"), hidden, layers, vocab, tok, extra)
        server.add(repo_id, folder, **options)
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", server.url)
        mp.setenv("HF_HUB_CACHE", str(root / "hf-cache"))
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.delenv("HF_TOKEN", raising=False)
        mp.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        mp.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(root / "no-token"))  # ignore a login
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        yield server
    server.stop()


@pytest.fixture(autouse=True)
def selections_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh hf-specdec cache per test, so decisions never leak between tests."""
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "specdec"))
    return tmp_path / "specdec"


# --- registry (offline) ---------------------------------------------------------------------------

REGISTRY_CASES = [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    ("google/gemma-2-9b-it", "google/gemma-2-2b-it"),
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", None),
    ("mistralai/Mistral-7B-Instruct-v0.3", None),
]


@pytest.mark.parametrize(("target", "draft"), REGISTRY_CASES)
def test_registry_answers_offline(target: str, draft: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    choice = select_draft(target)
    assert (choice.draft, choice.source) == (draft, "registry")
    assert choice.method == ("draft_model" if draft else "ngram")
    assert choice.reason


def test_registry_pairs_are_instruct_to_instruct() -> None:
    from hf_specdec.selection.select import _registry

    for target, entry in _registry().items():
        if "draft" in entry:
            assert ("instruct" in target or "-it" in target) == (
                "instruct" in entry["draft"].lower() or "-it" in entry["draft"].lower()
            ), target
            assert entry["source"], target
            assert registry_lookup(target).size_ratio is None or registry_lookup(target).size_ratio <= 0.25


def test_local_smollm2_folder_is_draft_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "config.json").write_text(
        json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    )
    choice = select_draft(tmp_path)
    assert choice.method == "ngram" and choice.draft is None
    assert "smallest" in choice.reason and "config.json" in choice.reason


def test_demo_model_folder_is_draft_free(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_specdec.demo_model import DEMO_MODEL_NAME
    from hf_specdec.store.paths import cache_dir

    folder = Path.home() / ".cache" / "hf-specdec" / "models" / DEMO_MODEL_NAME  # the default cache
    folder = folder if folder.exists() else cache_dir() / "models" / DEMO_MODEL_NAME
    if not (folder / "config.json").exists():
        pytest.skip(f"the demo model has not been built in {folder} (set HF_SPECDEC_CACHE to its cache)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    choice = select_draft(folder)
    assert (choice.method, choice.draft) == ("ngram", None) and "smallest" in choice.reason


def test_model_without_name_is_draft_free() -> None:
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
        )
    )
    choice = select_draft(model)
    assert (choice.method, choice.source) == ("ngram", "local") and "name_or_path" in choice.reason


def test_folder_without_origin_is_draft_free(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path)}))
    choice = select_draft(str(tmp_path))
    assert (choice.method, choice.source) == ("ngram", "local")
    assert "does not say which Hub model" in choice.reason


@pytest.mark.parametrize("config", [b'{"_name_or_path": ', b"\xff\xfe"], ids=["truncated", "not-utf8"])
def test_folder_with_an_unreadable_config_is_draft_free_saying_why(tmp_path: Path, config: bytes) -> None:
    """Was json's bare error ("Expecting value: line 1 column 19"), from `select` and from generate
    under speculative=True alike, naming no file."""
    (tmp_path / "config.json").write_bytes(config)
    choice = select_draft(str(tmp_path))
    assert (choice.method, choice.source) == ("ngram", "local")
    assert f"{tmp_path}'s config.json is not valid JSON" in choice.reason


def test_unknown_target_offline_is_draft_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    choice = select_draft("nobody/Unknown-7B")
    assert (choice.method, choice.source) == ("ngram", "offline")
    assert "HF_HUB_OFFLINE" in choice.reason


@pytest.mark.parametrize(
    "env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}], ids=["offline", "unreachable"]
)
def test_a_draft_free_reason_names_the_method_that_runs(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The reason (`speculative_stats.selection`, `hf-specdec select`) said "speculating from n-grams
    of the text" where speculative=True runs suffix decoding (prompt lookup, plus earlier calls'
    outputs): it names the method that runs."""
    for name, value in {**env, "HF_SPECDEC_CACHE": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    model.name_or_path = "nobody/Unknown-7B"
    out = model.generate(
        torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, speculative=True, return_dict_in_generate=True
    )
    stats = out.speculative_stats
    assert stats.method == auto_method(select_draft("nobody/Unknown-7B").method) == "suffix"
    assert f"speculating draft-free with {stats.method!r} (prompt lookup" in stats.selection
    assert "n-gram" not in stats.selection


def test_an_unreachable_hub_is_draft_free_and_not_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without HF_HUB_OFFLINE, a Hub that cannot be reached raised the HTTP client's ConnectError
    out of `select_draft`, so `speculative=True` and `hf-specdec select` crashed on such machines."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    choice = select_draft("nobody/Unknown-7B")
    assert (choice.method, choice.source) == ("ngram", "offline")
    assert "could not be searched" in choice.reason
    assert not list(tmp_path.rglob("*.json"))  # the next call searches again


def test_a_hub_that_never_answers_is_draft_free_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The target's info was asked with no timeout: behind a Hub (or proxy) that takes the connection
    and never answers, `generate(speculative=True)` hung for ever, where plain `generate` asks nothing."""
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    model.name_or_path = "nobody/Unknown-7B-Instruct"
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    server = silent_hub(monkeypatch)
    try:
        out = finished_within(
            30, lambda: model.generate(ids, max_new_tokens=6, do_sample=False, speculative=True)
        )
        choice = finished_within(30, lambda: select_draft("nobody/Unknown-7B-Instruct"))
    finally:
        server.close()
    assert torch.equal(out, plain)
    assert (choice.method, choice.source) == ("ngram", "offline") and "could not be searched" in choice.reason


def test_a_hub_that_never_answers_the_search_is_draft_free_after_the_timeout(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's info was bounded by the Hub's timeout, but the search for candidates
    (`list_models`, which takes none) was not: a Hub that answered the one and took the other's
    connection without answering hung `generate(speculative=True)` for ever."""
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    config = LlamaConfig(
        vocab_size=128, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    model.name_or_path = TARGET
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    hub.stalled = {"/api/models"}
    try:
        out = finished_within(
            30,
            lambda: model.generate(
                ids, max_new_tokens=6, do_sample=False, speculative=True, return_dict_in_generate=True
            ),
        )
    finally:
        hub.stalled = set()
    assert torch.equal(out.sequences, plain)
    assert "could not be searched (ReadTimeout" in out.speculative_stats.selection
    monkeypatch.setattr(select_module, "SEARCH_RETRY_SECONDS", 0.0)
    assert select_draft(TARGET).draft == GOOD_DRAFT  # not cached: searched again once the Hub answers


def test_a_hub_that_cannot_be_searched_is_said_once_and_not_asked_again_for_a_while(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a Hub that does not answer, every `speculative=True` call waited for the Hub's timeout
    (10 s by default) before drafting without a draft model, and said so only in the statistics of
    a call that returned them (a 6-token call took 10 s). A warning, once, says so and how to avoid
    it, and the process asks the Hub again only after `SEARCH_RETRY_SECONDS`."""
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    config = LlamaConfig(
        vocab_size=128, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    model.name_or_path = TARGET
    ids = torch.tensor([[5, 6, 7, 8]])
    hub.stalled, asked = {"/api/models"}, len(hub.requests)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for _ in range(2):
                model.generate(ids, max_new_tokens=2, do_sample=False, speculative=True)
    finally:
        hub.stalled = set()
    said = [str(w.message) for w in caught if "could not be searched" in str(w.message)]
    assert len(said) == 1, said
    assert "asks the Hub again 60 s from now" in said[0] and "HF_HUB_OFFLINE=1" in said[0]
    searches = [path for _, path in hub.requests[asked:] if path == "/api/models"]
    assert len(searches) == 1, searches  # the second call waited for no Hub


@pytest.mark.parametrize("status", [500, 429])
def test_a_hub_failing_for_now_is_draft_free_and_not_cached(
    hub: HubServer, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server error or a rate limit on the target's info raised out of `select_draft` (so out of
    `generate(speculative=True)`); a failing candidate was cached as rejected for good."""
    hub.failing = {f"/api/models/{TARGET}": status}
    try:
        choice = select_draft(TARGET)
    finally:
        hub.failing = {}
    assert (choice.method, choice.source) == ("ngram", "offline")
    assert "could not be searched (HfHubHTTPError: " in choice.reason and str(status) in choice.reason
    assert "\n" not in choice.reason  # one sentence: the error's first line
    again = select_draft(TARGET)  # within SEARCH_RETRY_SECONDS: the Hub is not asked
    assert (again.method, again.source) == ("ngram", "offline") and "asked again 60 s after" in again.reason
    monkeypatch.setattr(select_module, "SEARCH_RETRY_SECONDS", 0.0)
    assert select_draft(TARGET).draft == GOOD_DRAFT  # not cached: searched again once the Hub answers


def test_a_cross_tokenizer_candidate_failing_for_now_leaves_no_choice_cached(
    hub: HubServer, cross_drafts, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.failing = {f"/api/models/{CROSS_DRAFT}": 503}
    try:
        choice = select_draft(ALONE)
    finally:
        hub.failing = {}
    assert (choice.method, choice.source) == ("ngram", "offline")
    monkeypatch.setattr(select_module, "SEARCH_RETRY_SECONDS", 0.0)  # asked again once it has passed
    assert select_draft(ALONE).draft == CROSS_DRAFT


def test_generate_on_a_target_the_hub_will_not_show_speculates_without_a_draft(hub: HubServer) -> None:
    """A model loaded with a token (or since deleted) whose repo the Hub will not show now: the
    search's refusal ended `generate(speculative=True)`; it now warns and drafts without a model."""
    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    model.name_or_path = "acme/Gone-160M-Instruct"  # not served
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    with pytest.warns(UserWarning, match="was not found on the Hub .* Speculating without a draft model"):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, speculative=True)
    assert torch.equal(out, plain)


# --- Hub search -----------------------------------------------------------------------------------


def test_search_ranks_and_checks_tokenizers(hub: HubServer) -> None:
    choice = select_draft(TARGET)
    assert (choice.method, choice.draft, choice.source) == ("draft_model", GOOD_DRAFT, "hub")
    assert 1 / 100 <= choice.size_ratio <= 1 / 4
    assert "agree" in choice.tokenizer_check  # padded vocab_size 160 vs 128 is accepted
    rejected = "\n".join(choice.rejected)
    assert "acme/Tiny-5M-Instruct: tokenizers differ" in rejected  # the decoy
    assert "acme/Tiny-5.5M-Instruct: no longer available" in rejected
    assert "acme/Tiny-6M-Instruct-Custom: needs custom code" in rejected
    assert "acme/Tiny-6.5M-Instruct: gated" in rejected
    assert "acme/Tiny-1M-Instruct: 1/" in rejected and "acme/Tiny-80M-Instruct: 1/" in rejected
    assert "acme/Tiny-5M:" not in rejected  # a base draft is ranked after instruct ones, never reached


def test_search_pins_the_commit_it_checked(hub: HubServer, capsys: pytest.CaptureFixture[str]) -> None:
    choice = select_draft(TARGET)
    sha = hub.repos[GOOD_DRAFT].sha
    assert choice.revision == sha and len(choice.tokenizer_fingerprint) == 64
    assert {revision for revision, _ in hub.resolved(GOOD_DRAFT)} == {sha}  # never `main`
    assert _select_cli(["select", TARGET]) == 0
    assert f"revision:  {sha}" in capsys.readouterr().out


def test_trust_remote_code_must_be_a_bool() -> None:
    from hf_specdec import SpeculativeConfig

    with pytest.raises(TypeError, match="trust_remote_code.*True or False"):
        SpeculativeConfig(trust_remote_code="yes")


def test_base_target_prefers_base_draft(hub: HubServer) -> None:
    assert select_draft("acme/Tiny-160M").draft == "acme/Tiny-5M"


def test_token_opens_gated_candidate(hub: HubServer) -> None:
    assert select_draft(TARGET, token=TOKEN).draft == "acme/Tiny-6.5M-Instruct"


def test_trust_remote_code_admits_custom_candidate(hub: HubServer) -> None:
    assert select_draft(TARGET, trust_remote_code=True).draft == "acme/Tiny-6M-Instruct-Custom"


def test_fine_tune_searches_its_base_family(hub: HubServer) -> None:
    choice = select_draft("someone/Tiny-160M-Instruct-Pirate")
    assert choice.draft == GOOD_DRAFT and TARGET in choice.reason


def test_no_candidate_falls_back_to_ngram(hub: HubServer) -> None:
    choice = select_draft("lonely/Solo-160M")
    assert (choice.method, choice.draft, choice.source) == ("ngram", None, "hub")
    assert "no model of the lonely/Solo-160M family" in choice.reason


def test_gated_target_says_token_needed(hub: HubServer) -> None:
    with pytest.raises(DraftSelectionError, match="gated.*token"):
        select_draft("acme/Secret-160M-Instruct")


def test_missing_target_and_revision(hub: HubServer) -> None:
    with pytest.raises(DraftSelectionError, match="not found.*private"):
        select_draft("acme/Nothing-1B")
    with pytest.raises(DraftSelectionError, match="no revision"):
        select_draft(TARGET, revision="v9")


def test_decision_is_cached_and_reused_offline(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    first = select_draft(TARGET)
    seen = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = select_draft(TARGET)
    assert len(hub.requests) == seen  # no request reached the Hub
    assert (again.draft, again.source) == (first.draft, "cache")
    assert again.rejected == first.rejected


def _local_copy_of_target(hub: HubServer, tmp_path: Path) -> Path:
    """TARGET's weights in a local folder whose config.json names the Hub repo it came from."""
    folder = tmp_path / "target"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes(hub.repos[TARGET].files[name])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": TARGET}))
    return folder


def test_loaded_model_target_and_load_draft(hub: HubServer, tmp_path: Path) -> None:
    target = LlamaForCausalLM.from_pretrained(_local_copy_of_target(hub, tmp_path), dtype=torch.bfloat16)
    choice = select_draft(target)
    assert choice.draft == GOOD_DRAFT
    draft = load_draft(choice, target)
    assert draft.dtype == torch.bfloat16 and draft.device == target.device
    assert draft.config.vocab_size == 160 and not draft.training


# --- CLI ------------------------------------------------------------------------------------------


def _select_cli(argv: list[str]) -> int:
    """`hf-specdec select ...` through the select command's own parser."""
    from hf_specdec_cli import select

    parser = argparse.ArgumentParser()
    select.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_json(hub: HubServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert _select_cli(["select", TARGET, "--json", "--token", TOKEN]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["draft"] == "acme/Tiny-6.5M-Instruct" and data["method"] == "draft_model"


def test_cli_text_and_error(hub: HubServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert _select_cli(["select", "Qwen/Qwen2.5-7B-Instruct"]) == 0
    assert "Qwen/Qwen2.5-0.5B-Instruct" in capsys.readouterr().out
    assert _select_cli(["select", "acme/Secret-160M-Instruct"]) == 1
    assert "gated" in capsys.readouterr().err


def test_cli_text_lists_published_heads_offline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert _select_cli(["select", "meta-llama/Llama-3.1-8B-Instruct"]) == 0
    out = capsys.readouterr().out
    assert "draft:     meta-llama/Llama-3.2-1B-Instruct" in out
    heads = [line for line in out.splitlines() if line.startswith("head:")]
    assert heads == [
        "head:      eagle yuhuili/EAGLE3-LLaMA3.1-Instruct-8B "
        "(EAGLE-3 layout; source: eagle-readme (EAGLE-3 weights); vllm-tests)"
    ]
    assert "speculative=dict(method=METHOD, draft=REPO)" in out
    assert _select_cli(["select", "Qwen/Qwen2.5-7B-Instruct"]) == 0  # the registry lists no head for it
    out = capsys.readouterr().out
    assert "head:" not in out and "speculative=dict" not in out


def test_a_local_target_that_is_not_a_causal_lm_is_refused(
    t5_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hf-specdec select ./t5` answered "method: suffix", a choice for a model that generate with
    speculative= cannot run (load_model refuses it)."""
    with pytest.raises(ValueError, match=r"is a t5 model \(T5ForConditionalGeneration\), not a causal LM"):
        select_draft(str(t5_folder))
    assert _select_cli(["select", str(t5_folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "not a causal LM" in captured.err


def test_a_local_target_that_reads_images_beside_text_is_selected_for(tmp_path: Path) -> None:
    """generate(speculative=True) speculates for a loaded LLaVA; `select` refused its folder as "not a
    causal LM" (AutoModelForCausalLM loads no image-text model)."""
    from transformers import CLIPVisionConfig, LlavaConfig

    text = LlamaConfig(
        vocab_size=64, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    vision = CLIPVisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    LlavaConfig(text_config=text, vision_config=vision, image_token_id=4).save_pretrained(tmp_path)
    assert select_draft(str(tmp_path)).method == "ngram"


def test_cli_main(capsys: pytest.CaptureFixture[str]) -> None:
    from hf_specdec.cli import main

    assert main(["select", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["draft"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_registry_is_shipped_with_the_checkout() -> None:
    from hf_specdec.selection.select import registry_path

    assert registry_path() == Path(__file__).resolve().parents[2] / "configs" / "draft_pairs.toml"


def test_speculative_true_uses_the_selected_draft(hub: HubServer, tmp_path: Path) -> None:
    target = LlamaForCausalLM.from_pretrained(_local_copy_of_target(hub, tmp_path)).eval()
    prompt = torch.tensor([[1, 5, 6, 7, 8, 5, 6]])
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    out = target.generate(
        prompt, max_new_tokens=12, do_sample=False, speculative=True, return_dict_in_generate=True
    )
    assert out.speculative_stats.method == "draft_model"
    assert out.speculative_stats.drafted > 0
    assert torch.equal(out.sequences, plain)


# --- drafts of another tokenizer -------------------------------------------------------------------


@pytest.fixture
def cross_drafts(monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """The registry's `[[cross_tokenizer_draft]]` list, as the tests' repos."""
    monkeypatch.setattr(select_module, "registry_cross_tokenizer_drafts", lambda: CROSS)
    return CROSS


def test_a_draft_of_another_tokenizer_only_where_none_shares_the_targets(
    hub: HubServer, cross_drafts
) -> None:
    choice = select_draft(ALONE)
    assert (choice.method, choice.draft, choice.translation) == ("draft_model", CROSS_DRAFT, "intersection")
    assert f"No model of the {ALONE} family" in choice.reason and "has another tokenizer" in choice.reason
    assert "token-level intersection" in choice.reason and "tokenizers differ" in choice.tokenizer_check
    rejected = "\n".join(choice.rejected)
    assert "general/Chars-5M-Instruct: " in rejected and "under the 90% each" in rejected
    assert "general/Gone-5M-Instruct: not available on the Hub" in rejected
    # A target with a draft of its own tokenizer keeps it: drafts of others are not proposed then.
    assert (select_draft(TARGET).draft, select_draft(TARGET).translation) == (GOOD_DRAFT, None)


def test_speculative_true_drafts_across_tokenizers_where_that_was_chosen(
    hub: HubServer, cross_drafts, tmp_path: Path
) -> None:
    """The choice is cached with its translation, and `speculative=True` drafts through it: greedy
    identical to plain, the translation stated in the statistics."""
    folder = tmp_path / "alone"
    folder.mkdir()
    for name, blob in hub.repos[ALONE].files.items():
        (folder / name).write_bytes(blob)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": ALONE}))
    target = LlamaForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    plain = target.generate(prompt, max_new_tokens=8, do_sample=False)
    out = target.generate(
        prompt, max_new_tokens=8, do_sample=False, speculative=True, return_dict_in_generate=True
    )
    assert out.speculative_stats.translation.startswith("token-level intersection (TLI)")
    assert out.speculative_stats.drafted > 0 and torch.equal(out.sequences, plain)
    cached = [json.loads(p.read_text()) for p in (tmp_path / "specdec" / "selections").glob("*.json")]
    assert [c["translation"] for c in cached] == ["intersection"]


def test_select_draft_is_public_api() -> None:
    import hf_specdec

    assert hf_specdec.select_draft is select_draft
    assert "select_draft" in hf_specdec.__all__ and "DraftChoice" in hf_specdec.__all__


def test_cli_names_what_speculative_true_runs_for_a_draft_free_choice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A draft-free choice is cached and exported as `ngram`; `speculative=True` runs `suffix` for it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert _select_cli(["select", "acme/Unknown-1B-Instruct"]) == 0
    assert "method:    suffix (draft-free: ngram plus" in capsys.readouterr().out
    assert _select_cli(["select", "acme/Unknown-1B-Instruct", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "ngram" and data["auto_method"] == "suffix"
