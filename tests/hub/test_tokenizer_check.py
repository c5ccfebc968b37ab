"""Tokens two different tokenizers share: what each token spells, which ids pair up, and how much of
a text each tokenizer writes with shared tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_specdec.hub.tokenizer_check import (
    PROBE_TEXT,
    compare_tokenizers,
    shared_token_pairs,
    token_spellings,
    vocabulary_overlap,
)

from ..helpers.tokenizers import CORPUS, byte_level_bpe, metaspace_bpe

TEXT = "the fox walked to the river.\n    return a + b"


@pytest.fixture(scope="module")
def pair():
    corpus = CORPUS + PROBE_TEXT
    return byte_level_bpe(400, corpus), metaspace_bpe(200, corpus)


def test_each_token_spells_the_bytes_it_decodes_to(pair):
    """Byte-level tokens through their byte alphabet (`Ġ`, `Ċ`), SentencePiece-style ones with `▁` as
    a space: a text's tokens spell the text, whichever way the tokenizer writes them."""
    for tokenizer in pair:
        spellings = token_spellings(tokenizer)
        ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        assert b"".join(spellings[i] for i in ids) == TEXT.encode()
    byte_level, metaspace = pair
    assert token_spellings(byte_level)[byte_level.convert_tokens_to_ids("Ġthe")] == b" the"
    assert token_spellings(metaspace)[metaspace.convert_tokens_to_ids("▁the")] == b" the"
    assert token_spellings(metaspace)[metaspace.bos_token_id] is None  # special tokens spell nothing


def test_byte_fallback_tokens_spell_their_byte_and_yield_to_the_tokenizers_own_token():
    """A SentencePiece vocabulary with both `\\n` and its byte-fallback twin `<0x0A>` (as Gemma's):
    both spell b"\\n", and the pairing keeps the one the tokenizer writes."""
    vocab = {"<unk>": 0, "<0x0A>": 1, "a": 2, "\n": 3, "▁a": 4}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    twins = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")
    assert token_spellings(twins)[1:] == [b"\n", b"a", b"\n", b" a"]
    byte_level = byte_level_bpe(300)
    pairs = shared_token_pairs(byte_level, twins)
    assert pairs[3] == byte_level.convert_tokens_to_ids("Ċ") and 1 not in pairs


def test_shared_tokens_pair_one_to_one_and_spell_alike(pair):
    byte_level, metaspace = pair
    pairs = shared_token_pairs(byte_level, metaspace)  # draft id -> target id
    assert len(set(pairs.values())) == len(pairs) > 150
    target_spellings, draft_spellings = token_spellings(byte_level), token_spellings(metaspace)
    assert all(draft_spellings[d] == target_spellings[t] for d, t in pairs.items())
    assert not compare_tokenizers(byte_level, metaspace).compatible  # the ids differ all the same


def test_coverage_is_the_share_of_a_texts_tokens_the_other_vocabulary_has(pair):
    byte_level, metaspace = pair
    overlap = vocabulary_overlap(byte_level, metaspace)
    ids = byte_level(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    shared = set(shared_token_pairs(byte_level, metaspace).values())
    assert overlap.target_coverage == sum(i in shared for i in ids) / len(ids) > 0.9
    assert overlap.draft_coverage > 0.9
    characters = metaspace_bpe(90, CORPUS + PROBE_TEXT)  # hardly more than the alphabet
    assert vocabulary_overlap(byte_level, characters).target_coverage < 0.7
