"""A draft model of another tokenizer: which translation carries its drafts to the target's tokens,
and the one that works token by token.

Across model families two tokenizers rarely give a text the same ids, but they often share most of
their tokens, spelled alike (`hub.tokenizer_check.shared_token_pairs`). Timor et al. (2025,
"Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies", arXiv 2502.05202) draft across vocabularies losslessly in two ways, both in
transformers:

- **token-level intersection (TLI)**, `TokenIntersection` here (transformers'
  `AssistantToTargetTranslator`, vLLM's `use_heterogeneous_vocab`): the draft drafts over the shared
  tokens only, its distribution restricted to them and renormalised, each token carried to the
  target's id; the target verifies as usual. Exact for sampling too.
- **string-level exact match** through text, which transformers calls universal assisted decoding
  (UAD, `AssistedCandidateGeneratorDifferentTokenizers`): the draft drafts in its own tokens and its
  text is re-tokenized into the target's (`text_aligned.TextAlignedDrafter`). There is no draft
  distribution over the target's tokens, so it verifies greedily only.

`choose_translation` picks one from the two tokenizers (the rule is at `MIN_SHARED_COVERAGE`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..hub.tokenizer_check import (
    dropping_refs,
    own_copy,
    shared_token_pairs,
    spelling,
    token_spellings,
    vocabulary_overlap,
)

TRANSLATIONS = ("auto", "intersection", "text")  # `DraftModelConfig.translation`

# TLI where the shared tokens are at least this share of each tokenizer's own tokens on the probe
# text (`vocabulary_overlap`), else UAD. A draft over the shared tokens can neither propose a target
# token outside them nor follow its own wish for a draft token outside them. At a coverage c such a
# token comes once every 1 / (1 - c) tokens on average: every 10 at 0.9, past the drafts one step
# verifies (the policy rarely asks for more than 8), so the intersection seldom cuts a draft that
# would have been accepted. Below it, UAD, which reaches every target token through text, drafts
# further (greedy only).
MIN_SHARED_COVERAGE = 0.9


@dataclass(frozen=True)
class Translated:
    """A row's target tokens in the draft's, remembered by the drafter per row so that the next
    draft translates only the tokens added since (or since where the row's tokens changed)."""

    target: torch.Tensor  # [n] the row's target tokens
    sequence: torch.Tensor  # [m] them in the draft's tokens, its start tokens first: what it is fed
    # [n] the length of `sequence` after each target token's translation; None where one for one.
    ends: torch.Tensor | None = None


class DraftVocabulary(Protocol):
    """How a `DecoderDrafter`'s draft reads the target's tokens and answers in them."""

    # Whether a target sequence becomes a draft sequence of the same length, token for token (a
    # compiled draft's static cache is sized by the target's sequence lengths).
    keeps_length: bool

    def draft_sequence(self, target_ids: torch.Tensor, before: Translated | None = None) -> Translated:
        """A row's tokens [n] of the target as the draft's [m], to feed it. `before`: the row's
        translation at its previous draft, of which what `target_ids` still begins with is kept."""
        ...

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Tokens the draft itself proposed, of any shape, back in its own ids (id 0 for holes)."""
        ...

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_draft] as logits over the target's vocabulary [..., V_target]."""
        ...


class SharedVocabulary:
    """The draft shares the target's tokenizer: ids pass through (a padded vocabulary is fitted by
    `ScoreProcessor.fit_vocab`)."""

    keeps_length = True

    def draft_sequence(self, target_ids: torch.Tensor, before: Translated | None = None) -> Translated:
        return Translated(target_ids, target_ids)

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        return target_ids

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return draft_logits


class TokenIntersection:
    """Token-level intersection (TLI): the draft's logits are kept on the tokens both vocabularies
    spell alike and moved to those tokens' target ids, -inf elsewhere; the target's tokens it reads
    become its own ids where shared, and its own tokenization of their text where not.

    Why sampling stays exact: the drafter processes these logits as the target's are processed and
    samples each draft token from the distribution it returns as `Draft.probs`: the draft's own
    distribution restricted to the shared tokens and renormalised, a distribution over the target's
    ids that is zero off the intersection. Rejection sampling (`verify.rejection_sample`, Leviathan
    et al. 2023) emits tokens distributed exactly as the target's for any proposal distribution q,
    provided each draft token was drawn from the q it is judged by; a target token q never proposes
    is still emitted at its probability, through the residual max(0, p - q). The translation of the
    context changes only how good q is, never what is emitted.
    """

    keeps_length = False

    def __init__(
        self,
        target_tokenizer: Any,
        draft_tokenizer: Any,
        target_vocab_size: int,
        draft_vocab_size: int,
        device: torch.device,
    ) -> None:
        pairs = shared_token_pairs(target_tokenizer, draft_tokenizer)  # draft id -> target id
        eos = (draft_tokenizer.eos_token_id, target_tokenizer.eos_token_id)
        if None not in eos:
            pairs[eos[0]] = eos[1]  # the draft may propose the end of the text
        pairs = {d: t for d, t in pairs.items() if d < draft_vocab_size and t < target_vocab_size}
        self.draft_index = torch.tensor(list(pairs), dtype=torch.long, device=device)  # [S]
        self.target_index = torch.tensor(list(pairs.values()), dtype=torch.long, device=device)  # [S]
        self.to_draft = torch.full((target_vocab_size,), -1, dtype=torch.long, device=device)
        self.to_draft[self.target_index] = self.draft_index
        self.target_vocab_size = target_vocab_size
        self.start = torch.tensor(start_tokens(draft_tokenizer), dtype=torch.long, device=device)
        # What a draft reads where the target's tokens give it nothing (a lone BOS): its EOS.
        self.nothing = torch.tensor([eos[0] or 0], dtype=torch.long, device=device)
        self.target_spellings = token_spellings(target_tokenizer)
        self.draft_tokenizer = draft_tokenizer
        self._spelled: dict[int, torch.Tensor] = {}  # target id outside the intersection -> draft ids

    def draft_sequence(self, target_ids: torch.Tensor, before: Translated | None = None) -> Translated:
        """The draft's start tokens (its BOS), then each target token's draft id where it is shared,
        else the draft's tokenization of its text; special tokens without a counterpart (the target's
        BOS, chat markers) are left out, as transformers' UAD decodes with `skip_special_tokens`.
        Token by token, so a longer sequence translates to a longer one with the same start, which
        keeps the draft's cache, and the tokens `before` translated that `target_ids` still begins
        with keep their translation: a step's host work follows the tokens it adds, not the context
        (spelling a CJK context of 4,000 tokens again cost ~9 ms a step)."""
        kept = 0 if before is None else shared_prefix(before.target, target_ids)
        done = int(before.ends[kept - 1]) if kept else len(self.start)  # draft tokens of those
        new = target_ids[kept:]
        mapped = self.to_draft[new]
        outside = (mapped < 0).nonzero().flatten().tolist()
        spelled = [self._spell(t) for t in new[outside].tolist()]
        pieces, start = [before.sequence[:done] if kept else self.start], 0
        for i, piece in zip(outside, spelled):
            pieces += [mapped[start:i], piece]
            start = i + 1
        pieces.append(mapped[start:])
        sequence = torch.cat(pieces)
        lengths = torch.ones(len(new), dtype=torch.long)  # draft tokens per new target token
        lengths[outside] = torch.tensor([len(piece) for piece in spelled], dtype=torch.long)
        ends = done + lengths.cumsum(0)
        if kept:
            ends = torch.cat([before.ends[:kept], ends])
        return Translated(target_ids, sequence if len(sequence) else self.nothing, ends)

    def draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.to_draft[target_ids].clamp(min=0)

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.target_vocab_size), float("-inf"))
        out[..., self.target_index] = draft_logits[..., self.draft_index]
        return out

    def drafting_with(self, draft_tokenizer: Any) -> TokenIntersection:
        """This translation spelling the target's other tokens with `draft_tokenizer` (None: with
        none yet, as `choose_translation` remembers it, keeping no tokenizer alive); what it built
        is shared."""
        bound = copy.copy(self)
        bound.draft_tokenizer = draft_tokenizer
        return bound

    def _spell(self, target_id: int) -> torch.Tensor:
        spelled = self._spelled.get(target_id)
        if spelled is None:
            text = spelling(self.target_spellings, target_id)
            ids = [] if not text else encode(self.draft_tokenizer, text.decode("utf-8", "replace"))
            spelled = torch.tensor(ids, dtype=torch.long, device=self.to_draft.device)
            self._spelled[target_id] = spelled
        return spelled


@dataclass(frozen=True)
class Translation:
    """How a draft model's tokens reach the target's, as chosen for one pair of tokenizers."""

    kind: str  # "shared" (one tokenizer), "intersection" (TLI) or "text" (UAD)
    statement: str  # what `SpeculativeStats.translation` says; "" for a shared tokenizer
    vocabulary: DraftVocabulary | None  # for "shared" and "intersection"; None for "text"


SHARED = Translation("shared", "", SharedVocabulary())


def choose_translation(
    target_tokenizer: Any,
    draft_tokenizer: Any,
    requested: str,
    target_vocab_size: int,
    draft_vocab_size: int,
    device: torch.device,
) -> Translation:
    """The translation for a draft whose tokenizer differs from the target's: `requested`
    ("intersection" or "text"), or for "auto" TLI where both coverages reach `MIN_SHARED_COVERAGE`
    and UAD otherwise. Remembered per pair of tokenizer objects (a 262k-token vocabulary takes
    seconds to pair).

    Raises:
        ValueError: TLI over vocabularies that share no token.
    """
    key = (id(target_tokenizer), id(draft_tokenizer), len(target_tokenizer), len(draft_tokenizer))
    key += (requested, target_vocab_size, draft_vocab_size, str(device))
    known = _CHOSEN.get(key)
    if known is not None and known[0]() is target_tokenizer and known[1]() is draft_tokenizer:
        return _drafting_with(known[2], draft_tokenizer)
    overlap = vocabulary_overlap(target_tokenizer, draft_tokenizer)
    coverage = (
        f"{overlap.target_coverage:.0%} of the target's tokens and {overlap.draft_coverage:.0%} of the "
        "draft's on a probe text are shared"
    )
    enough = min(overlap.target_coverage, overlap.draft_coverage) >= MIN_SHARED_COVERAGE
    kind = ("intersection" if enough else "text") if requested == "auto" else requested
    why = (
        "as asked"
        if requested != "auto"
        else f"{'at least' if enough else 'under'} {MIN_SHARED_COVERAGE:.0%} each"
    )
    if kind == "intersection":
        if overlap.shared == 0:
            raise ValueError(
                "The draft's vocabulary shares no token with the target's, so it cannot draft over "
                "the shared tokens (translation='intersection'): use options={'translation': 'text'} "
                "(greedy only), a draft of the target's family, or method='ngram'."
            )
        vocabulary = TokenIntersection(
            target_tokenizer, draft_tokenizer, target_vocab_size, draft_vocab_size, device
        )
        statement = (
            f"token-level intersection (TLI) over the {overlap.shared} tokens both vocabularies spell "
            f"alike; {coverage} ({why})"
        )
        translation = Translation(kind, statement, vocabulary)
    else:
        statement = f"text re-tokenization (UAD), greedy only: {coverage} ({why})"
        if requested == "auto":
            statement += (
                "; token-level intersection (TLI) samples exactly too, but drafts poorly under that "
                "coverage: options={'translation': 'intersection'} uses it anyway"
            )
        translation = Translation(kind, statement, None)
    with contextlib.suppress(TypeError):  # no weak references to them: chosen every time
        # Gone once either tokenizer is, and holding neither: a tokenizer made for each call must
        # not leave itself and its vocabulary's spellings behind every time.
        refs = dropping_refs(_CHOSEN, key, target_tokenizer, draft_tokenizer)
        _CHOSEN[key] = (*refs, _drafting_with(translation, None))
    return translation


def _drafting_with(translation: Translation, draft_tokenizer: Any) -> Translation:
    """`translation` with its token-level intersection spelling with `draft_tokenizer`."""
    if not isinstance(translation.vocabulary, TokenIntersection):
        return translation
    return dataclasses.replace(translation, vocabulary=translation.vocabulary.drafting_with(draft_tokenizer))


_CHOSEN: dict[tuple, tuple[weakref.ref, weakref.ref, Translation]] = {}


def clear_translations() -> None:
    """Forget the translations `choose_translation` remembers."""
    _CHOSEN.clear()


def start_tokens(tokenizer: Any) -> list[int]:
    """The tokens a tokenizer puts before a text of its own accord (a BOS), which its model expects
    at the start of every sequence."""
    plain = encode(tokenizer, "a")
    framed = own_copy(tokenizer)("a", split_special_tokens=True)["input_ids"]
    for i in range(len(framed) - len(plain) + 1):
        if framed[i : i + len(plain)] == plain:
            return framed[:i]
    return []


def encode(tokenizer: Any, text: str) -> list[int]:
    """A text's token ids, without the special tokens a tokenizer adds around a whole text, and
    without any inside it: a special token's name in the text ("<eos>" written out) is text too.
    Encoded by a copy (`own_copy`): the caller's tokenizer is left as it was, on every thread."""
    return own_copy(tokenizer)(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many tokens two sequences [n], [m] begin with alike."""
    n = min(len(a), len(b))
    differs = torch.nonzero(a[:n] != b[:n].to(a.device))
    return int(differs[0]) if differs.numel() else n
