"""Universal assisted decoding's two re-tokenizations, aligned on a lookbehind: the row's text into
the draft's tokens, and the draft's text into the target's."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.drafters.decoder import TorchDecoder
from hf_specdec.drafters.text_aligned import LOOKBEHIND, TextAlignedDrafter
from hf_specdec.drafters.vocabulary import encode
from hf_specdec.hub.tokenizer_check import PROBE_TEXT, token_spellings

from ..conftest import tiny_llama
from ..helpers.tokenizers import CORPUS, byte_level_bpe, metaspace_bpe

TEXT = "The fox and the rabbit walked along the river together, talking about the forest and the trees."


@pytest.fixture(scope="module")
def drafter():
    target_tok, draft_tok = byte_level_bpe(400, CORPUS + PROBE_TEXT), metaspace_bpe(200, CORPUS + PROBE_TEXT)
    decoder = TorchDecoder(tiny_llama(0, len(draft_tok)))
    return TextAlignedDrafter(decoder, 0.0, torch.device("cpu"), target_tok, draft_tok, "text")


def _spelled(spellings, ids) -> bytes:
    return b"".join(spellings[i] or b"" for i in ids)


def test_the_draft_reads_its_own_tokenization_of_the_rows_text_step_by_step(drafter):
    """Fed a few target tokens at a time, cut inside words, the draft's tokens spell the text and,
    LOOKBEHIND tokens back, are its own tokenizer's; each step re-tokenizes a bounded tail."""
    target_ids = torch.tensor(encode(drafter.target_tokenizer, TEXT))
    draft_spellings = token_spellings(drafter.draft_tokenizer)
    for n in range(1, len(target_ids) + 1, 3):
        sequence = drafter._draft_sequence(0, target_ids[:n]).tolist()
        assert sequence[0] == drafter.draft_tokenizer.bos_token_id  # its own start, first
        text = _spelled(drafter.target_spellings, target_ids[:n].tolist())
        assert _spelled(draft_spellings, sequence[1:]) == text
        row = drafter.texts[0]
        assert n - row.syncs[0][0] <= 2 * LOOKBEHIND + 3  # the re-tokenized tail stays short
    own = encode(drafter.draft_tokenizer, TEXT)
    settled = row.syncs[0][1]
    assert sequence[1 : 1 + settled] == own[:settled] and settled > len(own) // 2


def test_a_step_converts_the_re_tokenized_tail_not_the_whole_row(drafter, monkeypatch):
    """The row's draft sequence is kept as a tensor: a step converts from Python only the draft's
    tokens of the re-tokenized tail (bounded by `LOOKBEHIND`), not the whole row's, which cost a
    step 0.5-0.7 ms at 8,000 tokens. The sequence is the same: the text, in the draft's tokens."""
    target_ids = torch.tensor(encode(drafter.target_tokenizer, TEXT * 40))
    draft_spellings = token_spellings(drafter.draft_tokenizer)
    row, n = 99, len(target_ids) - 8
    drafter._draft_sequence(row, target_ids[:n])  # the prompt: translated whole, once
    converted: list[int] = []  # elements of the Python lists made tensors, per step
    tensor = torch.tensor

    def counted(data, *args, **kwargs):
        converted[-1] += len(data) if isinstance(data, list) else 0
        return tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counted)
    try:
        for m in range(n + 1, len(target_ids) + 1):  # a token a step
            converted.append(0)
            sequence = drafter._draft_sequence(row, target_ids[:m])
            assert _spelled(draft_spellings, sequence[1:].tolist()) == _spelled(
                drafter.target_spellings, target_ids[:m].tolist()
            )
    finally:
        del drafter.texts[row]
    assert len(sequence) > 20 * LOOKBEHIND
    assert max(converted) <= 3 * LOOKBEHIND, converted


def test_the_drafts_text_becomes_the_targets_tokens_after_the_rows(drafter):
    target, draft = drafter.target_tokenizer, drafter.draft_tokenizer
    row = torch.tensor(encode(target, "the fox walked to the"))
    drafted = encode(draft, " river and")
    assert drafter._target_tokens(row, drafted) == encode(target, " river and")
    # The draft's text continues the row's last word: the target's tokens of the rest of it.
    cut = torch.tensor(encode(target, "the fox walked to the riv"))
    continued = drafter._target_tokens(cut, encode(draft, "er and"))
    assert _spelled(drafter.target_spellings, continued) == b"er and"
    # The draft ends the text: the target's EOS ends the draft, and nothing after it counts.
    ended = drafter._target_tokens(row, [*encode(draft, " river"), draft.eos_token_id, *encode(draft, " x")])
    assert ended == [*encode(target, " river"), target.eos_token_id]


def test_a_target_whose_head_is_wider_than_its_tokenizer_drafts_through_text():
    """A target with a padded head (Qwen2.5's, Phi-3's) can emit ids its tokenizer has no token for,
    as plain decoding does: they spell no text, and the row goes on drafting through the rest."""
    target_tok, draft_tok = byte_level_bpe(400, CORPUS + PROBE_TEXT), metaspace_bpe(90, CORPUS + PROBE_TEXT)
    target = tiny_llama(2, len(target_tok) + 48, eos_token_id=None)
    with torch.no_grad():
        target.lm_head.weight[len(target_tok) :] *= 3  # the padded ids win often
    inputs = target_tok(["the fox walked to the"], return_tensors="pt")
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=20)
    assert (plain[0, inputs["input_ids"].shape[1] :] >= len(target_tok)).any()
    spec = dict(
        method="draft_model",
        draft=tiny_llama(12, len(draft_tok), eos_token_id=None),
        draft_tokenizer=draft_tok,
        options=dict(translation="text"),
    )
    out = target.generate(
        **inputs, do_sample=False, max_new_tokens=20, tokenizer=target_tok, speculative=spec
    )
    assert torch.equal(out, plain)


def _through_text(target_tok, draft_tok):
    """A target and a draft of another tokenizer, and speculative= drafting through text (UAD)."""
    target = tiny_llama(3, len(target_tok), eos_token_id=None)
    spec = dict(
        method="draft_model",
        draft=tiny_llama(13, len(draft_tok), eos_token_id=None),
        draft_tokenizer=draft_tok,
        options=dict(translation="text"),
    )
    return target, spec


def test_drafting_through_text_leaves_the_callers_tokenizers_as_they_were():
    """UAD re-tokenizes text with special tokens' names read as text. transformers' fast tokenizers
    do that by setting a flag on their backend, which the next call of any other setting sets back:
    set on the caller's tokenizers it stayed set after generate, for the backend's own users."""
    target_tok, draft_tok = byte_level_bpe(400, CORPUS + PROBE_TEXT), metaspace_bpe(200, CORPUS + PROBE_TEXT)
    target, spec = _through_text(target_tok, draft_tok)
    inputs = target_tok(["the fox walked to the"], return_tensors="pt")
    target.generate(**inputs, do_sample=False, max_new_tokens=12, tokenizer=target_tok, speculative=spec)
    for tokenizer in (target_tok, draft_tok):
        assert not tokenizer.backend_tokenizer.encode_special_tokens
        eos = tokenizer.backend_tokenizer.encode(f"the fox{tokenizer.eos_token}").ids[-1]
        assert eos == tokenizer.eos_token_id
