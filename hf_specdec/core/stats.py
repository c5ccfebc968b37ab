"""Acceptance statistics: plain counters, with every derived figure computed here and only here."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculativeStats:
    """Counters of one speculative `generate` call.

    `steps` counts verification steps of a row (one per row per target forward after the prompt's,
    which verifies nothing; `target_forwards` counts the forwards themselves, the prompt's
    included, and the one that feeds finished rows their padding where per-token outputs are
    returned: `pad_steps`); `speculative_steps` of them verified a non-empty draft and
    `plain_steps` decoded one token without a draft. `rejection_sampled_steps` of them, of either
    kind, had their tokens chosen by rejection sampling (`verify.rejection_sample`: a draft sampled
    from a drafter's q, as draft models and heads' chains draft) rather than by plain sampling's own
    draws: a call with any samples exactly the target's distribution but is not expected to repeat
    plain `generate`'s seeded sample token for token, so `hf_specdec.lossless.check_sampled` judges
    only calls where it is 0 (always 0 greedy). `drafted` and `accepted` count draft tokens;
    `position_drafted[i]` counts drafts that had an i-th token and `position_accepted[i]` those
    whose first i + 1 tokens were all accepted (vLLM's `num_accepted_tokens_per_pos`). `emitted`
    counts tokens the call produced (the prompt forward's first token a row, then accepted drafts
    plus one target token a step, cut at EOS / max length).

    A tree draft counts its nodes as drafted tokens: every node is fed to, and verified by, the
    target's forward, whichever path is accepted. `tree_steps` counts the speculative steps that
    verified a tree and `tree_depth` sums those trees' depths (their longest root-to-leaf paths, the
    most a step could accept), so a tree's extra nodes show as `mean_nodes_verified` above
    `mean_tree_depth`; for chains, depth and nodes are one number and the tree counters stay 0.

    Two mean accepted lengths, both counting the target's own token and neither the prompt's
    forward, differ in what they divide by: `mean_accepted_length` = 1 + accepted / steps, the
    tokens a row gains per verify forward, plain steps included (what the call got: the benchmarks'
    "tokens per target forward", plain decoding's 1.0); `mean_accepted_length_speculative` = 1 +
    accepted / speculative_steps, per step that verified a draft: vLLM's "mean acceptance length"
    and Spec-Bench's τ (how good the drafts were). They are equal when every step drafted.
    """

    # The drafter's method; "plain" where `"auto"` decoded the call with generate's own loop, drafting
    # nothing and counting nothing (`selection` says why: `selection.method.plain_instead`).
    method: str = ""
    # How the drafter's tokens became the target's, where it drafts in another vocabulary (a draft
    # model of another tokenizer: `Drafter.translation`); "" where drafts are the target's own ids.
    translation: str = ""
    # With method="auto": why this drafter was chosen (the selection's reason); "" for a named method.
    selection: str = ""
    target_forwards: int = 0
    steps: int = 0
    speculative_steps: int = 0
    plain_steps: int = 0
    rejection_sampled_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # The drafter's end-of-call work (`Drafter.finish`: a corpus's add), timed by the loop.
    finish_seconds: float = 0.0
    tree_steps: int = 0
    tree_depth: int = 0
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    # What the draft-length policy asked for and what it then verified, per target forward (the
    # prefill's first token counts as a step with nothing drafted): `draft_lengths` the tokens it
    # asked the drafter for, `verified_widths` the tokens each row fed the forward (1 + the longest
    # draft left after its cut, and any holes fed after it: `Draft.widened`; 1 is a plain step),
    # `verify_times` that forward's seconds (None for the prefill). Enough to answer "why plain?"
    # on a new machine.
    draft_lengths: list[int] = field(default_factory=list)
    verified_widths: list[int] = field(default_factory=list)
    verify_times: list[float | None] = field(default_factory=list)
    # The drafter's own counters of the call (`Drafter.counters`: e.g. `suffix`'s corpus drafts),
    # by name; summed across calls by `merge`.
    drafter_counters: dict[str, int] = field(default_factory=dict)

    def record_forward(
        self, asked: int, width: int, draft_seconds: float = 0.0, verify_seconds: float | None = None
    ) -> None:
        """Note one target forward: the draft length the policy asked for, the width it verified,
        and the seconds spent drafting and verifying (None for the prefill, which is not timed)."""
        self.target_forwards += 1
        self.draft_lengths.append(asked)
        self.verified_widths.append(width)
        self.verify_times.append(verify_seconds)
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds or 0.0

    def record_steps(
        self,
        drafted: list[int],
        accepted: list[int],
        tree_depths: list[int] | None,
        rejection_sampled: bool = False,
    ) -> None:
        """Count one verify forward's steps, a row each: row b checked `drafted[b]` tokens and kept
        `accepted[b]`; `tree_depths` is given for a tree draft, None for chains; `rejection_sampled`
        where rejection sampling chose the forward's tokens (`Verdict.rejection_sampled`)."""
        for b, (n, a) in enumerate(zip(drafted, accepted)):
            self.record_step(n, a, None if tree_depths is None else tree_depths[b], rejection_sampled)

    def record_step(
        self, drafted: int, accepted: int, tree_depth: int | None = None, rejection_sampled: bool = False
    ) -> None:
        """Count one verification step that checked `drafted` tokens (a tree's nodes) and kept
        `accepted` of them; `tree_depth` is given for a tree draft, None for a chain;
        `rejection_sampled` where rejection sampling chose its tokens."""
        self.steps += 1
        if rejection_sampled:
            self.rejection_sampled_steps += 1
        if drafted == 0:
            self.plain_steps += 1
            return
        self.speculative_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if tree_depth is not None:
            self.tree_steps += 1
            self.tree_depth += tree_depth
        grow = drafted - len(self.position_drafted)
        if grow > 0:
            self.position_drafted.extend([0] * grow)
            self.position_accepted.extend([0] * grow)
        for i in range(drafted):
            self.position_drafted[i] += 1
        for i in range(accepted):
            self.position_accepted[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target accepted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a row gains per verify forward (the prompt's left out), plain steps included:
        1 + accepted / steps (0 when there were no steps)."""
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def mean_accepted_length_speculative(self) -> float:
        """τ as vLLM ("mean acceptance length") and Spec-Bench report it: tokens a row gains per step
        that verified a draft, 1 + accepted / speculative_steps (0 when nothing was drafted)."""
        return 1.0 + self.accepted / self.speculative_steps if self.speculative_steps else 0.0

    @property
    def mean_nodes_verified(self) -> float:
        """Draft tokens the target verified per step that verified a draft: a tree's nodes, a chain's
        length, drafted / speculative_steps (0 when nothing was drafted). Set beside τ, it says
        what each accepted token cost in verify width."""
        return self.drafted / self.speculative_steps if self.speculative_steps else 0.0

    @property
    def mean_tree_depth(self) -> float:
        """The longest root-to-leaf path per tree step, tree_depth / tree_steps (0 without trees)."""
        return self.tree_depth / self.tree_steps if self.tree_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Per draft position i: the fraction of drafts that had an i-th token whose tokens 0..i were
        all accepted, position_accepted[i] / position_drafted[i]. vLLM divides the same counts by
        every draft instead (position_accepted[i] / speculative_steps); the two agree when every
        draft has the same length, as with a fixed `num_draft_tokens`."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def merge(self, other: SpeculativeStats) -> None:
        """Add another call's counters to these (for benchmarks that sum over prompts)."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.position_drafted, other.position_drafted),
            (self.position_accepted, other.position_accepted),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, count in enumerate(theirs):
                mine[i] += count
        for name, count in other.drafter_counters.items():
            self.drafter_counters[name] = self.drafter_counters.get(name, 0) + count
        self.method = self.method or other.method
        self.translation = self.translation or other.translation
        self.selection = self.selection or other.selection

    def to_dict(self) -> dict:
        """Counters and derived figures, for JSON reports."""
        return {
            "method": self.method,
            "translation": self.translation,
            "selection": self.selection,
            **{name: getattr(self, name) for name in _SUMMED},
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "mean_accepted_length_speculative": self.mean_accepted_length_speculative,
            "mean_nodes_verified": self.mean_nodes_verified,
            "mean_tree_depth": self.mean_tree_depth,
            "per_position_acceptance": self.per_position_acceptance,
            # The counts behind it: what `hf-specdec export-serving --from-bench` reads back.
            "position_drafted": list(self.position_drafted),
            "position_accepted": list(self.position_accepted),
            "drafter_counters": dict(self.drafter_counters),
        }

    def __str__(self) -> str:
        trees = (
            f", {self.mean_nodes_verified:.1f} tree nodes verified per speculative step "
            f"(mean depth {self.mean_tree_depth:.1f})"
            if self.tree_steps
            else ""
        )
        translation = f" ({self.translation})" if self.translation else ""
        return (
            f"{self.method}{translation}: {self.steps} steps ({self.speculative_steps} speculative), "
            f"{self.accepted}/{self.drafted} drafted tokens accepted ({self.acceptance_rate:.0%}), "
            f"mean accepted length {self.mean_accepted_length:.2f} per step, "
            f"{self.mean_accepted_length_speculative:.2f} per speculative step{trees}"
        )


# Counters that add up across calls (but the method, the per-position lists and the drafter's own).
_SUMMED = (
    "target_forwards",
    "steps",
    "speculative_steps",
    "plain_steps",
    "rejection_sampled_steps",
    "drafted",
    "accepted",
    "tree_steps",
    "tree_depth",
    "emitted",
    "draft_seconds",
    "verify_seconds",
    "finish_seconds",
)
