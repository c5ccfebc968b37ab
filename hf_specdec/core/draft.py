"""The drafter protocol: what a drafter is asked (`DraftRequest`), what it answers (`Draft`), and the
`Drafter` base class whose methods the loop calls. Plain data shared by the loop, the drafters and the
draft-length policy; imports nothing of ours at runtime but `tree` (what a tree draft's `parents`
imply), so that a module reading drafts (the policy) never loads the drafters."""

from __future__ import annotations

import dataclasses
import enum
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .tree import node_depths

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig
    from .processing import ScoreProcessor


@dataclass
class DraftRequest:
    """What the loop knows when it asks for a draft: the same object for every drafter.

    Row b's sequence so far is `tokens[b, :lengths[b]]`: its left-padded prompt (padding is where
    `attention_mask` is 0) followed by every token generated for it.
    """

    tokens: torch.Tensor  # [B, capacity]
    attention_mask: torch.Tensor  # [B, capacity], 1 on real tokens
    lengths: list[int]  # [B]
    max_tokens: list[int]  # [B] most draft tokens worth proposing per row; 0 means none
    do_sample: bool  # propose by sampling, and return the distributions sampled from
    processor: ScoreProcessor  # turns draft logits into scores exactly as the target's are processed
    row_ids: list[int]  # [B] each row's index in the user's batch; finished rows drop out
    # For drafters that declare `hidden_state_layers`: per row, the target's hidden states
    # [n_b, layers * H] of the tokens it cached since the previous request (the prompt at first,
    # then the fed last token and the accepted drafts of each step), in sequence order.
    hidden_states: list[torch.Tensor] | None = None
    # Whether the drafter may propose a tree (`Draft.parents`) of up to `max_tokens[b]` nodes.
    tree: bool = False
    # For drafters that declare `reads_target_kv`: the target's cache as it stands after the last
    # step's roll-back (`kv.RaggedKV` or `static_kv.StaticKV`), and the cache row of each request row.
    target_kv: Any = None
    target_rows: list[int] | None = None

    @property
    def score(self) -> ScoreProcessor:
        """Deprecated name of `processor`, read-only, kept for one release."""
        warnings.warn(
            "DraftRequest.score is deprecated and will be removed in the next release: read "
            "DraftRequest.processor (the same ScoreProcessor).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.processor

    def row(self, b: int) -> torch.Tensor:
        """Row b's sequence so far, [1, lengths[b]]."""
        return self.tokens[b : b + 1, : self.lengths[b]]

    def is_catch_up(self, fed: int) -> bool:
        """Whether a drafter's first forward, feeding up to `fed` tokens a row, is catching up (on the
        prompt, or after plain steps) rather than a steady step, which feeds the last draft's accepted
        tokens and the target's own: a one-off the policy must not count as a cost of draft tokens."""
        return fed > 1 + max(self.max_tokens, default=0)


@dataclass
class Draft:
    """Proposed tokens for every row; row b proposes `tokens[b, :lengths[b]]`."""

    tokens: torch.Tensor  # [B, k], padding past each row's length is ignored
    lengths: list[int]  # [B]
    probs: torch.Tensor | None = None  # [B, k, V] the processed distributions sampled from; None = certain
    # [B, k] the drafter's estimate that token i is accepted given tokens < i were (a tree's node:
    # given its parent was); None = no estimate.
    confidence: torch.Tensor | None = None
    # Of the time this draft took, what went into catching the draft up (on the prompt at first, on
    # the tokens of plain steps later; see `DraftRequest.is_catch_up`). Not a cost of draft tokens:
    # it must not make every later one look dear.
    catch_up_seconds: float = 0.0
    # A tree draft: [B, k] node i's parent node, -1 for the children of the row's last token; each
    # node comes after its parent, so any prefix of the nodes is a tree too. None: a chain.
    parents: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch_size: int, device: torch.device) -> Draft:
        return cls(torch.zeros(batch_size, 0, dtype=torch.long, device=device), [0] * batch_size)

    def truncated(self, lengths: list[int]) -> Draft:
        """The same draft with row b cut to `lengths[b]` tokens (never longer than proposed)."""
        lengths = [min(n, m) for n, m in zip(lengths, self.lengths)]
        width = max(lengths, default=0)
        return Draft(
            self.tokens[:, :width],
            lengths,
            None if self.probs is None else self.probs[:, :width],
            None if self.confidence is None else self.confidence[:, :width],
            self.catch_up_seconds,
            None if self.parents is None else self.parents[:, :width],
        )

    def widened(self, width: int) -> Draft:
        """The same chain draft fed `width` columns a row: the columns past each row's tokens are
        holes (id 0, confidence 0, no distribution), which the loop feeds masked and verifies
        nothing at; for feeding at a width the device has already paid for (`CostModel.feeding`)."""
        extra = width - self.tokens.shape[1]
        if extra <= 0:
            return self
        if self.parents is not None:
            raise ValueError("Only a chain draft is widened: a tree's nodes after its own are not holes.")

        def pad(values: torch.Tensor | None) -> torch.Tensor | None:
            if values is None:
                return None
            return torch.cat([values, values.new_zeros(values.shape[0], extra, *values.shape[2:])], dim=1)

        return dataclasses.replace(
            self, tokens=pad(self.tokens), probs=pad(self.probs), confidence=pad(self.confidence)
        )

    def depths(self) -> list[int]:
        """Tokens on each row's longest root-to-leaf path: its length for a chain."""
        if self.parents is None:
            return list(self.lengths)
        return [max(node_depths(row[:n]), default=0) for row, n in zip(self.parents.tolist(), self.lengths)]

    def check(self, vocab_size: int, drafter: str) -> None:
        """Refuse what the target cannot take or the policy cannot read: ids the target cannot
        embed (every column of `tokens` is fed to it, padding too), and confidences that are no
        probability (the policy takes them as each token's odds, `AdaptiveDraftLength.trim`, so one
        above 1 would keep any draft whole).

        One read of the ids' and confidences' min and max to the host; the loop calls it right
        before its clock read, which waits for the device anyway, so it adds a copy of four numbers
        but no stall. As float32, ids are exact up to 2**24, beyond any vocabulary.
        """
        if self.tokens.dtype not in (torch.long, torch.int):
            raise TypeError(
                f"The drafter {drafter} returned Draft.tokens of dtype {self.tokens.dtype}; token ids are "
                "integers: return a torch.long tensor."
            )
        if self.tokens.numel() == 0:
            return
        extremes = [*torch.aminmax(self.tokens)]
        scored = self.confidence is not None and self.confidence.numel() > 0
        if scored:
            extremes += torch.aminmax(self.confidence.to(self.tokens.device))
        read = torch.stack([x.float() for x in extremes]).tolist()
        low, high = int(read[0]), int(read[1])
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"The drafter {drafter} proposed token id {low if low < 0 else high}, outside the target's "
                f"vocabulary (ids 0..{vocab_size - 1}). Draft.tokens must hold the target's token ids, "
                "padding past each row's length included (pad with 0)."
            )
        if scored and not 0.0 <= read[2] <= read[3] <= 1.0:  # NaN fails every comparison
            raise ValueError(
                f"The drafter {drafter} returned Draft.confidence from {read[2]} to {read[3]}; each is its "
                "estimate that a token is accepted given the ones before it were, a probability from "
                "0 to 1 (pad with 0), or leave Draft.confidence None."
            )


class DraftCost(enum.Enum):
    """How the seconds a drafter spends on one draft grow with its length: what a draft-length policy
    prices a draft of k tokens (or a tree of depth d) at."""

    FREE = "free"  # a look-up (n-gram, suffix): next to nothing whatever the length
    PER_TOKEN = "per_token"  # one draft forward per token of a chain; a tree's cost grows per level
    PER_BLOCK = "per_block"  # one forward for a whole block whatever its length (DFlash, DSpark)


class Drafter:
    """A draft source: subclass it, one per module in `hf_specdec/drafters/`, and register it by name.

    The loop calls every method below on every drafter; the defaults say what a drafter without the
    capability does, so that nothing is probed with `getattr`.
    """

    name: ClassVar[str]
    # Whether `propose` can sample (`DraftRequest.do_sample`) and return the distributions it
    # sampled from; a greedy-only drafter is refused before generating with do_sample=True.
    supports_sampling: ClassVar[bool] = True
    # Target layers whose hidden states the drafter reads (EAGLE/Medusa-style heads); () for none.
    # Indices into the model's `hidden_states` output (0 = embeddings, -1 = last). A drafter that
    # learns them from its head sets them on the instance.
    hidden_state_layers: tuple[int, ...] = ()
    # Whether `propose` reads the target's own KV cache (`DraftRequest.target_kv`): an assistant that
    # attends to the target's keys and values rather than keeping a cache of its own (Gemma 4's).
    reads_target_kv: ClassVar[bool] = False
    # Whether `from_config` reads `SpeculativeConfig.draft` (a model, a head, a folder): False for a
    # drafter that needs none of the user's (prompt lookup, a copy of the target it builds itself),
    # to which a draft given is refused rather than left unused.
    takes_draft: ClassVar[bool] = True
    # Whether `from_config` reads `SpeculativeConfig.draft_tokenizer` (a loaded draft model's own):
    # False for a drafter whose draft speaks the target's tokenizer (a head, an assistant), to
    # which one given is refused rather than left unused.
    takes_draft_tokenizer: ClassVar[bool] = True
    # Whether `from_config` reads `SpeculativeConfig.trust_remote_code`: True for a drafter that loads
    # a draft named by folder or repo through transformers' Auto classes, which run the code it ships.
    # Elsewhere, trust_remote_code=True draws a warning that it is not read.
    takes_trust_remote_code: ClassVar[bool] = False
    # The dataclass `SpeculativeConfig.options` fill (unknown keys refused by `options_to_config`),
    # whose fields say when a call reads them (`config.read_when`); None: the drafter declares none,
    # and its options are its own to check.
    options_class: ClassVar[type | None] = None
    # Whether `propose` can answer `DraftRequest.tree` with a tree of candidates (`Draft.parents`);
    # `SpeculativeConfig(tree=True)` is refused for drafters that only draft chains.
    supports_tree: ClassVar[bool] = False
    # How a draft's cost grows with its length; a tree drafted PER_TOKEN costs a forward per level.
    draft_cost: ClassVar[DraftCost] = DraftCost.PER_TOKEN
    # How the drafter's tokens become the target's where they are not the same ids (a draft model
    # of another tokenizer), in one sentence that says which translation and why; "" where they are.
    # The loop reports it as `SpeculativeStats.translation`. Set on the instance.
    translation: str = ""

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        """Build the drafter for one `generate` call (state lives in the instance, i.e. the call)."""
        raise NotImplementedError

    def propose(self, request: DraftRequest) -> Draft:
        """Propose up to `request.max_tokens[b]` tokens for each row b."""
        raise NotImplementedError

    def observe(self, draft: Draft, accepted: list[int]) -> None:
        """Learn that row b of `draft` (as verified, possibly cut shorter than proposed) had its
        first `accepted[b]` tokens accepted. By default nothing is learnt."""

    def finish(self, sequences: list[torch.Tensor], prompt_lengths: list[int]) -> None:
        """The call is over: row b's whole sequence, its padding left out, is `sequences[b]` [n_b],
        its first `prompt_lengths[b]` tokens its prompt and the rest what the call generated (up to
        where the row stopped). Called once, after the last step, for drafters that learn across
        calls (a corpus of earlier outputs); not called for a call that raised. By default nothing
        is kept."""

    def counters(self) -> dict[str, int]:
        """This call's counters of the drafter's own, by name: what the loop cannot see (say, how
        many drafts came from a corpus). Read once, after `finish`, into
        `SpeculativeStats.drafter_counters`, which adds them up across calls. By default none."""
        return {}

    def compile_forwards(self, config: Any, capacity: int, widths: tuple[int, ...], batch_size: int) -> None:
        """The target's forwards after the prompt's are compiled (a compiled static cache, by
        `config`, a `CompileConfig`, padded to `widths`, over `capacity` positions): compile the
        drafter's own per-token forwards alike where it runs any, before anything is timed. Called
        once, after the prompt's forward and before `probe_seconds`. By default nothing is compiled."""

    def probe_seconds(self, batch_size: int) -> float | None:
        """The seconds one draft token costs for `batch_size` rows, timed without touching the
        drafter's state, so that a draft too slow to ever pay is never explored (exploring also pays
        the draft's catch-up over the prompt). None (the default): it cannot be timed up front, as
        for drafters whose tokens cost next to nothing."""
        return None
