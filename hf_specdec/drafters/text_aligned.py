"""A draft model of another tokenizer drafting through text: universal assisted decoding (UAD).

The draft reads the row's text in its own tokens and drafts greedily in them; its draft's text is
re-tokenized into the target's tokens, which the target verifies greedily. This is transformers'
`AssistedCandidateGeneratorDifferentTokenizers` (the string-level exact match of Timor et al. 2025,
arXiv 2502.05202), batched over ragged rows, with each side's re-tokenization aligned on a
lookbehind of `LOOKBEHIND` tokens as there:

- target -> draft: the text since the last point, at least `LOOKBEHIND` target tokens back, where
  both tokenizations had a token boundary is tokenized again with what the target added since, so
  the draft reads its own tokenization of the text (a word split over two steps is one token
  again) while the work per step stays bounded;
- draft -> target: the draft's text is tokenized after the text of the row's last `LOOKBEHIND`
  target tokens, and the target tokens after the boundary between the two are the draft (the
  draft's text alone where the two merge into a token across that boundary).

Texts are the tokens' bytes (`tokenizer_check.token_spellings`), special tokens left out, as
transformers decodes with `skip_special_tokens`; the draft proposing its EOS proposes the target's.
Only greedy verification is exact: no distribution over the target's tokens is drafted from, so
`choose_translation` picks this where token-level intersection would draft poorly, and sampling is
refused (`supports_sampling`). Tokenizers that put a space before every text they encode (Llama 2's
legacy SentencePiece) misalign at the boundaries and draft less well, never wrongly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..core.draft import Draft
from ..core.processing import ScoreProcessor
from ..hub.tokenizer_check import spelling, token_spellings
from .chain import chain, real_tokens
from .decoder import DecoderDrafter
from .vocabulary import encode, start_tokens

if TYPE_CHECKING:
    from ..core.draft import DraftRequest
    from .decoder import DraftDecoder

# Tokens re-tokenized with what follows them, on each side (transformers' `target_lookbehind` and
# `assistant_lookbehind` default to 10 as well).
LOOKBEHIND = 10


@dataclass
class _RowText:
    """One row's text as the draft reads it."""

    target: torch.Tensor  # the row's target tokens read so far
    # The draft's start tokens, then its tokens of their text: what it is fed. Kept as a tensor, so
    # that a step converts only the re-tokenized tail from Python, not the whole context.
    sequence: torch.Tensor
    # (target tokens, draft tokens) at which both spell the same text, in order, from where the
    # last step tokenized the text again.
    syncs: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])


class TextAlignedDrafter(DecoderDrafter):
    """Drafts greedily with a PyTorch model of another tokenizer, through text (UAD). Built by
    `draft_model` where its `choose_translation` says so; not a method of its own."""

    name: ClassVar[str] = "draft_model"
    supports_sampling: ClassVar[bool] = False
    supports_tree: ClassVar[bool] = False

    def __init__(
        self,
        decoder: DraftDecoder,
        min_confidence: float,
        device: torch.device,
        target_tokenizer: Any,
        draft_tokenizer: Any,
        translation: str,
    ) -> None:
        super().__init__(decoder, min_confidence, device)
        self.translation = translation
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.target_spellings = token_spellings(target_tokenizer)
        self.draft_spellings = token_spellings(draft_tokenizer)
        self.start = start_tokens(draft_tokenizer)
        self.texts: dict[int, _RowText] = {}  # by the row's index in the user's batch

    def propose(self, request: DraftRequest) -> Draft:
        self._follow_rows(request)
        rows = range(len(request.row_ids))
        real = [real_tokens(request, b) for b in rows]
        sequences = [self._draft_sequence(request.row_ids[b], real[b]) for b in rows]
        first, catch_up_seconds = self._catch_up(sequences, request)
        # The draft's own greedy chain in its own ids: no processor of the target's reads them.
        own = dataclasses.replace(request, processor=ScoreProcessor(None, first.shape[-1], len(rows)))
        drafted = chain(own, request.max_tokens, self.min_confidence, self._logits_after(first))
        fed = [max(n - 1, 0) for n in drafted.lengths]  # a row's last draft token is never fed
        self.cached = [
            torch.cat([seq, drafted.tokens[b, : fed[b]].to(seq.device)]) for b, seq in enumerate(sequences)
        ]
        vocab = request.processor.vocab_size  # the target's head: a tokenizer may list more ids
        proposals = []
        for b in rows:
            proposal = self._target_tokens(real[b], drafted.tokens[b, : drafted.lengths[b]].tolist())
            beyond = next((i for i, t in enumerate(proposal) if t >= vocab), len(proposal))
            proposals.append(proposal[: min(beyond, request.max_tokens[b])])
        tokens = torch.zeros(len(proposals), max(map(len, proposals)), dtype=torch.long)
        for b, proposal in enumerate(proposals):
            tokens[b, : len(proposal)] = torch.tensor(proposal, dtype=torch.long)
        draft = Draft(tokens.to(self.device), [len(p) for p in proposals])
        draft.catch_up_seconds = catch_up_seconds
        return draft

    def compile_forwards(self, config: Any, capacity: int, widths: tuple[int, ...], batch_size: int) -> None:
        """Drafts eagerly: its sequences are in its own tokens, which the target's capacity does not
        bound."""

    def _draft_sequence(self, row: int, real: torch.Tensor) -> torch.Tensor:
        """Row `row`'s text in the draft's tokens, after its start tokens: the text since the last
        sync point `LOOKBEHIND` target tokens back or more is tokenized again with what came since."""
        text = self.texts.get(row)
        if text is None:
            start = torch.tensor(self.start, dtype=torch.long, device=real.device)
            text = self.texts[row] = _RowText(real[:0], start)
        head = len(self.start)  # the sequence's start tokens, before its text's
        n = min(len(text.target), len(real))
        differs = torch.nonzero(text.target[:n] != real[:n].to(text.target.device))
        same = int(differs[0]) if differs.numel() else n
        settled = [s for s in text.syncs if s[0] <= max(same - LOOKBEHIND, 0)]
        t0, d0 = settled[-1] if settled else (0, 0)  # none: the row's text changed before them
        target_tail = real[t0:].tolist()
        draft_tail = encode(self.draft_tokenizer, _text(self.target_spellings, target_tail))
        tail = torch.tensor(draft_tail, dtype=torch.long, device=text.sequence.device)
        text.sequence = torch.cat([text.sequence[: head + d0], tail])
        text.target = real
        # Where the two tokenizations of the tail have a token boundary at the same byte, both sides
        # spell the same text up to there: later steps may re-tokenize from any of them.
        target_ends = dict(zip(_ends(self.target_spellings, target_tail), range(1, len(target_tail) + 1)))
        text.syncs = [(t0, d0)] + [
            (t0 + target_ends[end], d0 + d)
            for d, end in enumerate(_ends(self.draft_spellings, draft_tail), start=1)
            if end in target_ends
        ]
        whole = (len(real), len(text.sequence) - head)  # the whole text: a sync point by construction
        if text.syncs[-1] != whole:
            text.syncs.append(whole)
        return text.sequence if len(text.sequence) else text.sequence.new_zeros(1)

    def _target_tokens(self, real: torch.Tensor, drafted: list[int]) -> list[int]:
        """The draft's tokens `drafted` as the target's, following the row's tokens `real`."""
        spellings = [spelling(self.draft_spellings, d) for d in drafted]
        stop = next((i for i, text in enumerate(spellings) if text is None), len(drafted))
        proposed = b"".join(spellings[:stop])
        window = _bytes(self.target_spellings, real[-LOOKBEHIND:].tolist())
        tokens = encode(self.target_tokenizer, (window + proposed).decode("utf-8", "replace"))
        ends = list(_ends(self.target_spellings, tokens))
        if not window:
            after = tokens
        elif len(window) in ends:  # a token boundary where the draft's text starts
            after = tokens[ends.index(len(window)) + 1 :]
        else:  # the draft's text merges with the row's last token: its own tokens
            after = encode(self.target_tokenizer, proposed.decode("utf-8", "replace"))
        eos = self.target_tokenizer.eos_token_id
        if stop < len(drafted) and drafted[stop] == self.draft_tokenizer.eos_token_id and eos is not None:
            after = [*after, eos]
        return after


def _bytes(spellings: list[bytes | None], ids: list[int]) -> bytes:
    """The text the tokens spell; special tokens and ids past the tokenizer's spell nothing (a
    target with a padded head can emit those, as plain decoding does)."""
    return b"".join(spelling(spellings, i) or b"" for i in ids)


def _text(spellings: list[bytes | None], ids: list[int]) -> str:
    return _bytes(spellings, ids).decode("utf-8", "replace")


def _ends(spellings: list[bytes | None], ids: list[int]) -> accumulate:
    """The byte offset at which each token's spelling ends, in the text the tokens spell."""
    return accumulate(len(spelling(spellings, i) or b"") for i in ids)
