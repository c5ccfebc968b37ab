"""Which translation a draft of another tokenizer drafts through, and token-level intersection's
mapping of sequences, tokens and logits."""

from __future__ import annotations

import gc
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
    sequence = tli.draft_sequence(ids).tolist()
    assert sequence[0] == draft.bos_token_id and sequence[-1] == draft.eos_token_id
    spellings = token_spellings(draft)
    assert b"".join(spellings[i] or b"" for i in sequence).decode() == text
    pairs = shared_token_pairs(target, draft)
    assert sum(t in pairs.values() for t in ids.tolist()) >= 0.8 * len(ids)
    assert tli.draft_sequence(ids[:-3]).tolist() == sequence[: len(tli.draft_sequence(ids[:-3]))]


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
