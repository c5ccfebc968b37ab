"""Which translation a draft of another tokenizer drafts through, and token-level intersection's
mapping of sequences, tokens and logits."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from hf_specdec.drafters import vocabulary
from hf_specdec.drafters.vocabulary import MIN_SHARED_COVERAGE, TokenIntersection, choose_translation
from hf_specdec.hub import tokenizer_check
from hf_specdec.hub.tokenizer_check import (
    PROBE_TEXT,
    compare_tokenizers_once,
    shared_token_pairs,
    token_spellings,
)

from ..helpers.tokenizers import CORPUS, byte_level_bpe, metaspace_bpe, word_level

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizers():
    corpus = CORPUS + PROBE_TEXT
    return {
        "byte": byte_level_bpe(400, corpus),
        "meta": metaspace_bpe(200, corpus),
        "chars": metaspace_bpe(90, corpus),  # shares too little of the byte-level one's tokens
    }


def _choose(target, draft, requested="auto"):
    return choose_translation(target, draft, requested, len(target), len(draft), CPU)


def test_the_rule_picks_the_intersection_where_it_covers_enough_and_text_elsewhere(tokenizers):
    tli = _choose(tokenizers["byte"], tokenizers["meta"])
    assert tli.kind == "intersection" and tli.statement.startswith("token-level intersection (TLI)")
    assert f"at least {MIN_SHARED_COVERAGE:.0%} each" in tli.statement
    uad = _choose(tokenizers["byte"], tokenizers["chars"])
    assert (uad.kind, uad.vocabulary) == ("text", None)
    assert uad.statement.startswith("text re-tokenization (UAD), greedy only")
    assert "options={'translation': 'intersection'}" in uad.statement  # the way out, for sampling
    forced = _choose(tokenizers["byte"], tokenizers["chars"], "intersection")
    assert forced.kind == "intersection" and "(as asked)" in forced.statement
    assert _choose(tokenizers["byte"], tokenizers["meta"], "text").kind == "text"
    remembered = _choose(tokenizers["byte"], tokenizers["meta"])  # per pair: nothing built again
    assert remembered.vocabulary.draft_index is tli.vocabulary.draft_index


def test_no_shared_token_leaves_only_text():
    letters, digits = word_level(["<unk>", "a", "b", "c"]), word_level(["<unk>", "1", "2", "3"])
    assert _choose(letters, digits).kind == "text"
    with pytest.raises(ValueError, match="shares no token.*translation': 'text'"):
        _choose(letters, digits, "intersection")


def test_a_target_sequence_is_read_token_for_token(tokenizers):
    """Shared tokens map one to one, the others are spelled in the draft's tokens, the draft's BOS
    comes first and the target's specials are left out; a longer sequence extends a shorter one's
    translation, so the draft's cache holds."""
    target, draft = tokenizers["byte"], tokenizers["meta"]
    tli = TokenIntersection(target, draft, len(target), len(draft), CPU)
    text = "the fox walked to the river, said the rabbit: 12345"
    ids = torch.tensor(target(text)["input_ids"] + [target.eos_token_id])
    sequence = tli.draft_sequence(ids).sequence.tolist()
    assert sequence[0] == draft.bos_token_id and sequence[-1] == draft.eos_token_id
    spellings = token_spellings(draft)
    assert b"".join(spellings[i] or b"" for i in sequence).decode() == text
    pairs = shared_token_pairs(target, draft)
    assert sum(t in pairs.values() for t in ids.tolist()) >= 0.8 * len(ids)
    shorter = tli.draft_sequence(ids[:-3]).sequence.tolist()
    assert shorter == sequence[: len(shorter)]


def _drafts_of(ids: torch.Tensor) -> list[torch.Tensor]:
    """A row's tokens at successive drafts: growing a few at a time, cut back and continued
    otherwise (rejected tokens), grown again, and started over with other tokens."""
    n = len(ids)
    cut = n // 3
    other = torch.cat([ids[: cut - 2], ids.flip(0)[: n // 4]])
    return [
        ids[:1],
        ids[:4],
        ids[:cut],
        ids[: cut + 3],
        other,  # what followed `cut - 2` was rejected
        torch.cat([other, ids[cut : cut + 5]]),
        ids[: cut - 5],  # shorter than before
        ids[: 2 * cut],
        ids,
        ids,  # nothing added
        ids.flip(0),  # nothing kept
        ids[:0],
        ids[:7],
    ]


def _check_incremental_translation(tli: TokenIntersection, ids: torch.Tensor) -> None:
    """Each draft's translation, kept from the previous one's, is the one made from scratch."""
    before = None
    for row in _drafts_of(ids):
        whole = tli.draft_sequence(row)
        before = tli.draft_sequence(row, before)
        assert torch.equal(before.sequence, whole.sequence), f"after {len(row)} tokens"
        assert torch.equal(before.ends, whole.ends)


def test_a_translation_kept_from_the_last_draft_is_the_whole_ones(tokenizers):
    target, draft = tokenizers["byte"], tokenizers["meta"]
    tli = TokenIntersection(target, draft, len(target), len(draft), CPU)
    text = "the fox walked to the river, said the rabbit: 12345 and zebras quizzed 東京 🦜"
    ids = torch.tensor(target(text)["input_ids"] + [target.eos_token_id])
    assert (tli.to_draft[ids] < 0).sum() >= 5  # spelled tokens among them
    _check_incremental_translation(tli, ids)


def _real_tokenizer(name: str):
    from transformers import AutoTokenizer

    from hf_specdec.store.paths import cache_dir

    folder = cache_dir() / "models" / name
    if not (folder / "tokenizer_config.json").exists():
        pytest.skip(f"{name} not built in {folder.parent}")
    return AutoTokenizer.from_pretrained(folder)


REAL_TEXT = (
    "東京は日本の首都です。人口は約1400万人。🍣🗼🦜 👩🏽‍💻 "  # CJK, emoji, a ZWJ sequence
    "𠀋𪚲 ꙮ ᚠᛇᚻ 𓀀 \x07\x1b "  # byte-fallback tokens in Gemma's vocabulary
    "The quick brown fox jumps over the lazy dog; naïve café, Ελληνικά, русский.\n"
    "def add(a, b):\n    return a + b  # <eos> written out\n"
)


@pytest.mark.parametrize("pair", ["gemma<-smollm2", "smollm2<-gemma"])
def test_a_kept_translation_is_the_whole_ones_on_a_real_pair(pair):
    """Gemma-3's tokenizer (SentencePiece with byte fallback) and SmolLM2's (byte-level BPE), each
    way round, on CJK, emoji, byte-fallback tokens and special tokens."""
    from hf_specdec.demo_model import DEMO_MODEL_NAME, GEMMA_MODEL_NAME

    gemma, smollm2 = _real_tokenizer(GEMMA_MODEL_NAME), _real_tokenizer(DEMO_MODEL_NAME)
    target, draft = (gemma, smollm2) if pair == "gemma<-smollm2" else (smollm2, gemma)
    tli = TokenIntersection(target, draft, len(target), len(draft), CPU)
    ids = torch.tensor(target(REAL_TEXT * 3)["input_ids"] + [target.eos_token_id])
    assert (tli.to_draft[ids] < 0).sum() >= 20
    if target is gemma:
        assert any(t.startswith("<0x") for t in target.convert_ids_to_tokens(ids.tolist()))
    _check_incremental_translation(tli, ids)


def test_draft_logits_land_on_the_shared_tokens_target_ids(tokenizers):
    target, draft = tokenizers["byte"], tokenizers["meta"]
    tli = TokenIntersection(target, draft, len(target) + 8, len(draft), CPU)  # a padded target head
    logits = torch.randn(2, 3, len(draft))
    mapped = tli.target_logits(logits)
    assert mapped.shape == (2, 3, len(target) + 8)
    pairs = shared_token_pairs(target, draft)
    for d, t in list(pairs.items())[:20]:
        assert torch.equal(mapped[..., t], logits[..., d])
    off = torch.ones(len(target) + 8, dtype=torch.bool)
    off[list(pairs.values()) + [target.eos_token_id]] = False
    assert torch.isneginf(mapped[..., off]).all()
    # Renormalised on the shared tokens: the draft's distribution restricted to them.
    restricted = logits[..., tli.draft_index].softmax(-1)
    torch.testing.assert_close(mapped.softmax(-1)[..., tli.target_index], restricted)
    drafted = tli.target_index[:5]
    assert torch.equal(tli.draft_ids(drafted), tli.draft_index[:5])


def test_the_intersection_holds_every_pair_transformers_own_translator_finds(tokenizers):
    """transformers' `AssistantToTargetTranslator` (its TLI) pairs tokens by their strings, the
    draft's leading space sign swapped for the target's; ours pairs the bytes tokens spell, which
    finds each of its pairs and more (`Ċ` is `\\n`, whatever the space sign)."""
    from transformers.generation.candidate_generator import AssistantToTargetTranslator

    target, draft = tokenizers["byte"], tokenizers["meta"]
    theirs = AssistantToTargetTranslator(target, draft, len(target))._assistant_to_target_input_ids.tolist()
    theirs = {d: t for d, t in enumerate(theirs) if t >= 0}
    ours = shared_token_pairs(target, draft)
    assert len(theirs) > 100 and all(ours.get(d) == t for d, t in theirs.items())
    assert len(ours) > len(theirs)


@pytest.mark.parametrize("kept", [None, "target", "draft"])
def test_a_remembered_translation_keeps_no_tokenizer_alive(kept):
    """Tokenizers made for each call (a server loading them per request) go with their last
    reference, and what was remembered of them with them: their spellings, the pair's translation.
    A remembered translation spells with the draft tokenizer passed again."""
    corpus = CORPUS + PROBE_TEXT
    target, draft = byte_level_bpe(400, corpus), metaspace_bpe(200, corpus)
    tli = _choose(target, draft)
    assert _choose(target, draft).vocabulary.draft_tokenizer is draft
    assert compare_tokenizers_once(target, draft).compatible is False
    refs = {"target": weakref.ref(target), "draft": weakref.ref(draft)}
    alive = {"target": target, "draft": draft}.get(kept)
    del target, draft, tli
    gc.collect()
    assert [name for name, ref in refs.items() if ref() is not None] == ([kept] if kept else [])
    for memo in (vocabulary._CHOSEN, tokenizer_check._CHECKED, tokenizer_check._SPELLINGS):
        stale = [key for key, entry in memo.items() if any(held() is None for held in entry[:-1])]
        assert not stale, "entries of tokenizers gone"
    del alive


def test_a_thread_tokenizing_while_another_re_tokenizes_reads_its_special_tokens():
    """A server's threads share the target's tokenizer: one tokenizes a chat prompt (its markers
    special tokens) while another's generate re-tokenizes text through it (`encode`, each step of
    a draft of another tokenizer). Encoding with the caller's tokenizer set its backend's flag to
    read special tokens' names as text, which a call on the other thread between its own setting
    and its encoding read: 2-11 of ~2,000 prompts came out spelled out in each of 10 runs of this
    test on a 2-core machine."""
    tokenizer = byte_level_bpe(400, CORPUS + PROBE_TEXT)
    prompt = f"{tokenizer.eos_token}the fox walked to the river{tokenizer.eos_token}" * 50
    expected = tokenizer(prompt)["input_ids"]
    done = threading.Event()

    def re_tokenize() -> None:
        try:
            for _ in range(1500):
                vocabulary.encode(tokenizer, prompt)
        finally:
            done.set()

    drafting = threading.Thread(target=re_tokenize)
    drafting.start()
    read = []
    while not done.is_set():
        read.append(tokenizer(prompt)["input_ids"])
    drafting.join()
    wrong = sum(ids != expected for ids in read)
    assert read and not wrong, f"{wrong} of {len(read)} prompts read the special tokens as text"
