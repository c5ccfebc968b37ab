"""Suffix decoding: prompt lookup plus a corpus of the earlier calls' prompts and outputs.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; vLLM's `method="suffix"`, over the
`arctic-inference` suffix tree) drafts without a model from two sources: the request's own
context and a bounded cache of earlier responses. At each step it matches the context's last
tokens in each, follows the continuation its occurrences most often took, speculates more tokens
the longer the match (at most `max_spec_factor * match + max_spec_offset`), stops where the
continuation's estimated probability falls under `min_token_prob`, and takes the better scoring
source. Here:

- **The context** is searched by the `ngram` drafter (its hash index and vote, its measured odds),
  which this drafter wraps: where the corpus has nothing better, the draft is prompt lookup's.
- **The corpus** is per model, in memory, bounded in tokens (`max_corpus_tokens`); each finished
  `generate` call adds every row's prompt and output (`Drafter.finish`), and the oldest sequences
  go first once it is full. Its index is a suffix array of the reversed sequences, which finds the
  longest match of the context's last tokens and its occurrences in one vectorised binary search
  (`suffix_array.py`, with why this structure and not a suffix tree). The continuation is voted
  token by token among those occurrences, each weighing 2^(-age / `recency_half_life`) (age in
  sequences added since: frequency and recency); its tokens carry odds of acceptance by match
  length and by how the occurrences agreed, as `ngram`'s do, learnt across calls, so that the two
  sources' drafts compare on one scale. A tree (`SpeculativeConfig(tree=True)`) grows best-first
  over the corpus's continuations and is merged with prompt lookup's trie (`suffix_speculation.py`).
- **When the corpus drafts.** Before the call's rows are added, the outputs of its last
  `RECORD_ROWS` rows are replayed against the corpus as it was: at each step the loop would have
  taken, what prompt lookup alone and what this drafter would have drafted, and how many tokens of
  each the output held (greedy acceptance; a sample holds a drafted token with the probability
  the target gave it, as verification accepts it). The corpus drafts only while its recent
  replays gave at least `min_gain` times prompt lookup's tokens per step, or where a row's context
  begins an earlier sequence (its last `MAX_MATCH` tokens held at the same offset from that
  sequence's start: a request repeating an earlier one, of which the replays of calls that were no
  repeat say nothing); otherwise its drafts are prompt lookup's exactly, and replays grow rarer
  (`MAX_REPLAY_EVERY`). `method="auto"` drafts with it wherever no draft model is chosen, so
  that a workload that repeats itself across calls gains, and one that does not loses nothing but
  the add and the occasional replay.

What the corpus holds is the users' text: in memory only, never written to disk, emptied by
`hf_specdec.clear_cache()` (docs/security.md).
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..config import CORPUS, read_when
from ..core.draft import Draft, DraftCost, DraftRequest
from ..core.fields import check_fields
from ..core.policy.acceptance import MAX_DRAFT
from ..core.policy.decision import expected_gains
from .base import Drafter, options_to_config
from .ngram import NgramConfig, NgramDrafter, NgramIndex, Proposal, pack
from .ngram import chain_odds as context_odds
from .registry import register_drafter
from .suffix_array import MAX_MATCH, Match, Snapshot, unit_bytes
from .suffix_speculation import Chain, CorpusOdds, corpus_tree, merge_trees, voted_chain

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig

REPLAY_TOKENS = 256  # of each row's output, replayed against the corpus at the call's end
RECORD_ROWS = 8  # rows whose replays decide whether the corpus drafts
MIN_RECORD_TOKENS = 32  # replayed output tokens needed before they decide
MAX_REPLAY_EVERY = 4  # calls between replays, at most, while the corpus does not pay


@dataclass
class SuffixConfig(NgramConfig):
    """Settings of the `suffix` drafter: `ngram`'s for the context (`max_ngram`, `min_ngram`,
    `max_matches`), and the corpus's.

    Args:
        max_corpus_tokens: the corpus's bound, in tokens (prompts and outputs of earlier calls on
            the model); the oldest sequences go first. 0: no corpus (prompt lookup alone).
        min_match: shortest match in the corpus that drafts.
        max_spec_factor, max_spec_offset: a corpus match of m tokens drafts at most
            `max_spec_factor * m + max_spec_offset` tokens (SuffixDecoding's adaptive length).
        min_token_prob: a corpus continuation stops where the product of its tokens' shares of
            the vote falls below this.
        recency_half_life: an occurrence's vote halves with every this many sequences added to the
            corpus after it; None: frequency alone.
        min_gain: the corpus drafts while its recent replays gave at least this many times prompt
            lookup's tokens per step (module docstring); 0: whenever it has a better draft.
    """

    max_corpus_tokens: int = 1 << 18
    min_match: int = read_when(CORPUS, 1)
    max_spec_factor: float = read_when(CORPUS, 1.0)
    max_spec_offset: float = read_when(CORPUS, 8.0)
    min_token_prob: float = read_when(CORPUS, 0.1)
    recency_half_life: float | None = read_when(CORPUS, 256.0)
    min_gain: float = read_when(CORPUS, 1.05)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            ranges={
                "max_corpus_tokens": (0, None),
                "min_match": (1, MAX_MATCH),
                "max_spec_factor": (0.0, None),
                "max_spec_offset": (0.0, None),
                "min_token_prob": (0.0, 1.0),
                "min_gain": (0.0, None),
            },
        )
        if self.recency_half_life is not None and self.recency_half_life <= 0:
            raise ValueError(
                f"`recency_half_life` of SuffixConfig must be a positive number of sequences or None "
                f"(frequency alone), got {self.recency_half_life!r}."
            )


def draft_limit(size: int, budget: int, config: SuffixConfig) -> int:
    """Tokens a match of `size` tokens may draft (SuffixDecoding's adaptive length)."""
    return max(0, min(budget, int(config.max_spec_factor * size + config.max_spec_offset + 1e-6)))


def corpus_match(snapshot: Snapshot, tail: list[int], config: SuffixConfig) -> Match | None:
    """The longest match of `tail` in the corpus, if it is long enough to draft (`min_match`)."""
    match = snapshot.match(tail, config.recency_half_life)
    return match if match is not None and match.size >= config.min_match else None


def corpus_chain(snapshot: Snapshot, tail: list[int], budget: int, config: SuffixConfig) -> Chain | None:
    """The chain the corpus drafts after `tail` (a step's `budget` tokens at most): the voted
    continuation of its match, as long as `draft_limit` lets it be; None without a match."""
    match = corpus_match(snapshot, tail, config)
    if match is None:
        return None
    return voted_chain(match, draft_limit(match.size, budget, config), config.min_token_prob)


def expected_tokens(odds: list[float]) -> float:
    """Tokens a draft with these per-token odds adds in expectation, Σ_j Π_{i≤j} odds_i."""
    return expected_gains(odds)[-1] if odds else 0.0


def corpus_wins(corpus_odds: list[float], lookup_odds: list[float]) -> bool:
    """Whether the corpus's chain, not prompt lookup's, drafts the step: the one the drafter takes
    and the replays that decide whether the corpus drafts at all must not disagree."""
    return expected_tokens(corpus_odds) > expected_tokens(lookup_odds)


# ---------------------------------------------------------------------------------------------
# The corpus: one per model, thread-safe
# ---------------------------------------------------------------------------------------------


def tokens_held(drafted: list[int], actual: list[int]) -> int:
    """How many of `drafted` the `actual` continuation begins with."""
    held = 0
    for token, real in zip(drafted, actual):
        if token != real:
            break
        held += 1
    return held


class SuffixCorpus:
    """One model's corpus of earlier prompts and outputs, its learnt odds and its replay record.

    Readers take `snapshot` (one attribute read) and never wait; writers (`add`) hold a lock while
    they replay the call's rows against the corpus and build the next snapshot."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the model's when the corpus was made: its keys' width
        self.snapshot = Snapshot.empty(unit_bytes(vocab_size))
        self.odds = CorpusOdds()
        # Per replayed row: (steps, tokens prompt lookup alone would have given, tokens ours would have).
        self.record: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=RECORD_ROWS)
        self._lock = threading.Lock()
        # While a whole record of replays says the corpus does not pay, they grow rarer: every 2nd
        # call, then every MAX_REPLAY_EVERY-th (a call of a workload that does not repeat pays
        # nothing else for the corpus), and every call again once it pays.
        self.replay_every = 1
        self._until_replay = 0
        self.replayed_calls = 0

    def gain(self) -> float | None:
        """Tokens per step this drafter's replays gave over prompt lookup's alone (at the same
        steps), or None while too little output was replayed to say."""
        record = list(self.record)  # one copy (a writer may append meanwhile: no iterating it)
        ours = sum(r[2] for r in record)
        return ours / sum(r[1] for r in record) if ours >= MIN_RECORD_TOKENS else None

    def drafts(self, min_gain: float) -> bool:
        """Whether a call starting now should draft from the corpus."""
        if not self.snapshot.num_tokens:
            return False
        if min_gain == 0:
            return True
        gain = self.gain()
        return gain is not None and gain >= min_gain

    def add(self, sequences: list[list[int]], prompt_lengths: list[int], config: SuffixConfig) -> None:
        """Replay the last `RECORD_ROWS` rows' outputs against the corpus as it is (learning the
        odds and recording the gain), then add every row, dropping the oldest sequences beyond
        `max_corpus_tokens`."""
        with self._lock:
            snapshot = self.snapshot
            if snapshot.num_tokens and self._until_replay == 0:
                # The record keeps the last RECORD_ROWS rows with an output, so only those are
                # replayed: a row costs up to REPLAY_TOKENS look-ups in the corpus, and a wide
                # batch's other rows would decide nothing (the odds learn from these rows alone).
                answered = [i for i, (s, p) in enumerate(zip(sequences, prompt_lengths)) if len(s) > p]
                for i in answered[-RECORD_ROWS:]:
                    self.record.append(self._replay(snapshot, sequences[i], prompt_lengths[i], config))
                self.replayed_calls += 1
                gain = self.gain()
                # Backing off only once a whole record says the corpus does not pay: a workload
                # whose first calls gain nothing may repeat itself from the next ones.
                paid = len(self.record) < RECORD_ROWS or gain is None or gain >= config.min_gain
                self.replay_every = 1 if paid else min(2 * self.replay_every, MAX_REPLAY_EVERY)
                self._until_replay = self.replay_every
            self._until_replay = max(self._until_replay - 1, 0)
            self.snapshot = snapshot.added(sequences, config.max_corpus_tokens)

    def _replay(
        self, snapshot: Snapshot, sequence: list[int], prompt_length: int, config: SuffixConfig
    ) -> tuple[int, int, int]:
        """Walk the output as the loop would have, drafting `MAX_DRAFT` tokens a step with this
        drafter's rule and accepting what the output holds: (steps, tokens prompt lookup's drafts
        would have given at those steps, tokens this drafter's did)."""
        index = NgramIndex(range(config.min_ngram, config.max_ngram + 1), config.max_matches)
        index.extend(sequence[:prompt_length])
        at, end = prompt_length, min(len(sequence), prompt_length + REPLAY_TOKENS)
        steps = by_lookup = ours = 0
        while at < end:
            actual = sequence[at : at + MAX_DRAFT]
            lookup, size, agreement = index.lookup(MAX_DRAFT)
            held = tokens_held(lookup, actual)
            by_lookup += 1 + held
            chain = corpus_chain(snapshot, sequence[max(0, at - MAX_MATCH) : at], MAX_DRAFT, config)
            if chain is not None and chain.tokens:
                self.odds.observe(chain, actual)
                if corpus_wins(self.odds.chain(chain), context_odds(size, agreement)):
                    held = tokens_held(chain.tokens, actual)
            ours += 1 + held
            steps += 1
            index.extend(sequence[at : at + held + 1])
            at += held + 1
        return steps, by_lookup, ours

    @property
    def num_tokens(self) -> int:
        return self.snapshot.num_tokens

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes


_CORPORA: weakref.WeakKeyDictionary[Any, SuffixCorpus] = weakref.WeakKeyDictionary()
_CORPORA_LOCK = threading.Lock()


def corpus_for(model: Any) -> SuffixCorpus:
    """The corpus of `model` (made empty on first use; it goes with the model, held weakly). A
    model whose vocabulary was resized since starts a new one: its keys may need wider units, and
    the old text may hold ids the model no longer has."""
    vocab_size = model.config.get_text_config().vocab_size
    with _CORPORA_LOCK:
        corpus = _CORPORA.get(model)
        if corpus is None or corpus.vocab_size != vocab_size:
            corpus = _CORPORA[model] = SuffixCorpus(vocab_size)
        return corpus


def clear_corpora() -> None:
    """Forget every model's corpus (`hf_specdec.clear_cache()`)."""
    with _CORPORA_LOCK:
        _CORPORA.clear()


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


@register_drafter
class SuffixDrafter(Drafter):
    """Prompt lookup plus a per-model corpus of earlier calls' prompts and outputs (module docstring)."""

    name: ClassVar[str] = "suffix"
    supports_sampling: ClassVar[bool] = True  # its drafts are a function of the context: certain
    supports_tree: ClassVar[bool] = True
    draft_cost: ClassVar[DraftCost] = DraftCost.FREE
    takes_draft: ClassVar[bool] = False
    options_class: ClassVar[type] = SuffixConfig

    def __init__(self, config: SuffixConfig, corpus: SuffixCorpus | None) -> None:
        self.config = config
        self.lookup = NgramDrafter(config)  # a SuffixConfig is an NgramConfig
        self.corpus = corpus
        # Decided once, at the call's start: from the corpus's record (module docstring), else at its
        # first step where a row's prompt ends as a sequence in the corpus does (`_repeats`).
        self.drafting = corpus is not None and corpus.drafts(config.min_gain)
        self.decided = self.drafting or corpus is None or not corpus.num_tokens
        self.corpus_drafts = 0  # rows' drafts in this call that the corpus made or added nodes to

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> SuffixDrafter:
        options = options_to_config(cls.options_class, config.options)
        return cls(options, corpus_for(target) if options.max_corpus_tokens else None)

    def propose(self, request: DraftRequest) -> Draft:
        proposals = self.lookup.proposals(request)
        if not self.decided:
            self.decided, self.drafting = True, self._repeats(request)
        if self.drafting:
            self._from_corpus(request, proposals)
        return pack(proposals, request.tokens.device, request.tree)

    def _repeats(self, request: DraftRequest) -> bool:
        """Whether a row's context is an earlier sequence's beginning, as far as its last `MAX_MATCH`
        tokens and its length tell (held at the same offset from that sequence's start): a request
        that repeats an earlier one (retried, or an eval run again) drafts from the corpus at once,
        where the replays of calls that were no repeat would hold it back. Prompts that only end
        alike (a shared trailing instruction) are no repeat."""
        snapshot = self.corpus.snapshot
        for row_id in request.row_ids:
            tokens = self.lookup.rows[row_id].tokens
            if len(tokens) < MAX_MATCH:
                continue
            occurrences, size = snapshot.occurrences(tokens[-MAX_MATCH:])
            if size == MAX_MATCH and np.isin(occurrences - len(tokens), snapshot.starts).any():
                return True
        return False

    def _from_corpus(self, request: DraftRequest, proposals: list[Proposal]) -> None:
        """Each row's prompt-lookup proposal, in place: a corpus chain that scores better instead, or
        a tree merged with the corpus's."""
        snapshot = self.corpus.snapshot
        for b, row_id in enumerate(request.row_ids):
            budget = request.max_tokens[b]
            if budget <= 0:
                continue
            tail = self.lookup.rows[row_id].tokens[-MAX_MATCH:]
            match = corpus_match(snapshot, tail, self.config)
            if match is None:
                continue
            limit = draft_limit(match.size, budget, self.config)  # tokens of a chain, levels of a tree
            tokens, parents, odds = proposals[b]
            if request.tree:
                grown = corpus_tree(match, budget, limit, self.config.min_token_prob, self.corpus.odds)
                if grown:
                    proposals[b] = merge_trees([list(zip(tokens, parents or [], odds)), grown], budget)
                    self.corpus_drafts += 1
                continue
            chain = voted_chain(match, limit, self.config.min_token_prob)
            chain_odds = self.corpus.odds.chain(chain)
            if chain.tokens and corpus_wins(chain_odds, odds):
                proposals[b] = (chain.tokens, None, chain_odds)
                self.corpus_drafts += 1

    def finish(self, sequences: list[torch.Tensor], prompt_lengths: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.add([s.tolist() for s in sequences], prompt_lengths, self.config)

    def counters(self) -> dict[str, int]:
        """`corpus_drafting`: 1 where the corpus drafted in this call (summed over calls: in how
        many it did); `corpus_drafts`: the rows' drafts it made or added nodes to."""
        return {"corpus_drafting": int(self.drafting), "corpus_drafts": self.corpus_drafts}


__all__ = ["SuffixConfig", "SuffixCorpus", "SuffixDrafter", "clear_corpora", "corpus_for"]
