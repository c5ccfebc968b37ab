"""The speculative decoding loop: propose, verify, accept and roll back, observe, stop?

It runs as a transformers `custom_generate` callable, so `generate` has already prepared the
generation config, the logits processors, the stopping criteria and the KV cache, exactly as for
plain decoding; this module only replaces the token-by-token loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .compat import generate_cache
from .draft import Draft, Drafter, DraftRequest
from .inputs import ModelInputs
from .kv import RaggedKV
from .output import OutputCollector, TokenOutputs, prompt_outputs, step_outputs
from .policy import DraftLengthPolicy
from .processing import ScoreProcessor
from .stats import SpeculativeStats
from .timing import clock
from .verify import greedy_verify, rejection_sample, tree_verify


def speculative_decode(
    model: Any,
    input_ids: torch.Tensor,  # [B, prompt_len], left-padded
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    drafter: Drafter,
    policy: DraftLengthPolicy,
    tree: bool = False,
    max_tree_nodes: int | None = None,
    streamer: Any = None,
    **model_kwargs: Any,
) -> Any:
    """Generate with speculative decoding; returns what `generate` would (plus `speculative_stats`).

    The caller has checked the inputs (`checks.check_supported`) and chosen the `drafter` and the
    draft-length `policy`; `tree`: draft trees (the drafter grows them), of at most `max_tree_nodes`.
    """
    inputs = ModelInputs(model, input_ids, model_kwargs)
    stats = SpeculativeStats(method=drafter.name)
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    vocab = model.config.get_text_config().vocab_size
    score = ScoreProcessor(logits_processor, vocab, batch)
    out = OutputCollector(input_ids, model_kwargs.get("attention_mask"), generation_config, streamer)
    target = RaggedKV(model, generate_cache(model_kwargs), batch, device)

    # The prefill is plain decoding's first step: the whole prompt, whose last logits give each
    # row's first token. From then on the target's cache holds every token of a row but its last:
    # each step feeds that last token followed by the draft, so output position i scores draft
    # token i.
    layers = drafter.hidden_state_layers
    features = _Features(layers, batch)
    prompt_mask = out.attention_mask.bool()
    returned = _Returned(out, target, bool(layers))
    prefill = target.forward(
        input_ids,
        prompt_mask,
        logits_to_keep=1,
        positions=inputs.prompt_positions,
        **returned.switches,
        **inputs.prefill(),
    )
    features.add(prefill, prompt_mask, list(range(batch)), torch.arange(batch, device=device))
    if out.active_rows:  # none when the prompt already fills max_length
        rows = out.active_rows
        request = _request(out, rows, 0, generation_config, score, features)
        no_draft = Draft.empty(len(rows), device)
        first = _accept(request, no_draft, prefill.logits[rows])
        first.extras = returned.prompt(prefill, rows)
        stats.draft_lengths.append(0)
        stats.verified_widths.append(1)
        stats.verify_times.append(None)
        _emit(out, stats, request, no_draft, first, stopping_criteria)

    seconds = drafter.probe_seconds(len(out.active_rows)) if out.active_rows else None
    if seconds is not None:
        policy.expect_draft_cost(seconds)  # a draft too slow to ever pay is then never explored
        stats.draft_seconds += seconds

    cached_rows = list(range(batch))  # rows of the user's batch in the target's cache, in order
    while out.active_rows:
        rows = out.active_rows
        # Finished rows stop drafting at once but leave the target's batch only once half of it
        # has finished: removing them copies the whole cache, and on CPU an odd batch of 15 runs
        # slower than 16, so dropping rows one at a time costs more than it saves.
        if len(rows) <= len(cached_rows) // 2:
            target.select_rows(torch.tensor([cached_rows.index(r) for r in rows], device=device))
            cached_rows = rows
        slots = [cached_rows.index(r) for r in rows]
        k = policy.draft_length(len(rows))
        if tree and max_tree_nodes is not None:
            k = min(k, max_tree_nodes)
        stats.draft_lengths.append(k)
        request = _request(out, rows, k, generation_config, score, features, tree)

        start = clock(device)  # every clock read waits for the device: the policy learns from these
        draft = drafter.propose(request) if k > 0 else Draft.empty(len(rows), device)
        proposed_at = clock(device)
        draft = policy.trim(draft, len(rows), [out.room(r) for r in rows])
        draft.check_token_ids(vocab, f"{type(drafter).__name__} (method={drafter.name!r})")
        drafted_at = clock(device)
        extra_inputs = functools.partial(inputs.step, rows=cached_rows)
        step = _verify(target, slots, request, draft, features, returned, extra_inputs)
        verified_at = clock(device)

        drafter.observe(draft, step.accepted)
        _emit(out, stats, request, draft, step, stopping_criteria)
        # Tree steps also tell the policy which nodes were accepted: what sizes the trees to come.
        paths = {} if step.paths is None else {"paths": step.paths}
        # The drafter's own time: the policy's cut is the loop's overhead, not a cost of drafting.
        policy.update(len(rows), draft, step.accepted, proposed_at - start, verified_at - drafted_at, **paths)
        stats.draft_seconds += drafted_at - start
        stats.verify_seconds += verified_at - drafted_at
        stats.verified_widths.append(1 + max(draft.lengths, default=0))
        stats.verify_times.append(verified_at - drafted_at)

    stats.emitted = out.emitted
    return out.finish(stats, target.finished_cache())


def _request(
    out: OutputCollector,
    rows: list[int],
    k: int,
    generation_config: GenerationConfig,
    score: ScoreProcessor,
    features: _Features,
    tree: bool = False,
) -> DraftRequest:
    """What a drafter is told about the active `rows` when asked for up to `k` tokens each."""
    # While every row is active the drafter reads the collector's own tensors (no copy per step).
    select = slice(None) if len(rows) == len(out.lengths) else rows
    return DraftRequest(
        tokens=out.tokens[select],
        attention_mask=out.mask[select],
        lengths=[out.lengths[r] for r in rows],
        max_tokens=[min(k, out.room(r) - 1) for r in rows],
        do_sample=generation_config.do_sample,
        processor=score,
        row_ids=rows,
        hidden_states=features.take(rows) if k > 0 else None,  # kept for the next draft
        tree=tree,
    )


def _emit(
    out: OutputCollector,
    stats: SpeculativeStats,
    request: DraftRequest,
    draft: Draft,
    step: _Verified,
    stopping_criteria: StoppingCriteriaList,
) -> None:
    """Append each row's accepted drafts and the target's own token; count the step."""
    stats.target_forwards += 1
    depths = [None] * len(request.row_ids) if draft.parents is None else draft.depths()
    for b, row in enumerate(request.row_ids):
        n = step.accepted[b] + 1  # accepted drafts and the target's own token
        stats.record_step(draft.lengths[b], step.accepted[b], depths[b])
        at = slice(0, n) if step.paths is None else step.fed(b)
        scores = step.scores[b, at] if out.keep_scores else None  # sliced only when returned
        logits = step.logits[b, at] if out.keep_logits else None
        extras = None if step.extras is None else step.extras[b]
        out.emit(row, step.tokens[b, :n], scores, logits, stopping_criteria, extras)


@dataclass
class _Verified:
    accepted: list[int]  # [B] draft tokens accepted per row
    tokens: torch.Tensor  # [B, k + 1] row b emits tokens[b, : accepted[b] + 1]
    scores: torch.Tensor  # [B, k + 1, V] processed target scores at those positions
    logits: torch.Tensor  # [B, k + 1, V] raw target logits
    paths: list[list[int]] | None = None  # tree drafts: the accepted nodes of each row, root first
    extras: list[TokenOutputs] | None = None  # [B] attentions and hidden states, when returned

    def fed(self, b: int) -> list[int]:
        """The fed positions row b's emitted tokens were chosen at: along the accepted path of a tree."""
        if self.paths is None:
            return list(range(self.accepted[b] + 1))
        return [0] + [1 + node for node in self.paths[b]]


def _verify(
    target: RaggedKV,
    slots: list[int],
    request: DraftRequest,
    draft: Draft,
    features: _Features,
    returned: _Returned,
    inputs: Callable[[int], dict[str, Any]],
) -> _Verified:
    """One target forward over [last token, draft...] per row; accept; roll the cache back.

    The target's cache holds every token of a row but its last, so the logits at position i of
    this forward are the target's prediction for draft token i (and, after the draft, the bonus).
    Request row b sits at `slots[b]` of the target's batch; other (finished) rows get holes.
    `inputs(width)`: the model's extra inputs for a forward of that width.
    """
    device = draft.tokens.device
    width = 1 + draft.tokens.shape[1]
    lengths = torch.tensor([request.lengths, draft.lengths], device=device)  # one copy to the device
    last = request.tokens.gather(1, lengths[0, :, None] - 1)
    feed = torch.cat([last, draft.tokens], dim=1) if width > 1 else last  # [B, width]
    tree = None if draft.parents is None else _tree_layout(draft.parents)
    # Known on the host, so the common step skips the work: whether finished rows wait in the
    # cache (else request row b is cache row b), and whether every row fills the width (no holes).
    whole = len(slots) == target.mask.shape[0]
    full = min(draft.lengths, default=0) == width - 1
    valid = None if whole and full else torch.arange(width, device=device)[None, :] <= lengths[1, :, None]
    index = slice(None) if whole else torch.tensor(slots, device=device)
    if whole:
        feed_all, valid_all, tree_all = feed, valid, tree
    else:
        feed_all = feed.new_zeros(target.mask.shape[0], width).index_copy_(0, index, feed)
        valid_all = valid.new_zeros(target.mask.shape[0], width).index_copy_(0, index, valid)
        tree_all = None if tree is None else _tree_layout(draft.parents, target.mask.shape[0], index)
    output = target.forward(
        feed_all, valid_all, logits_to_keep=width, tree=tree_all, **returned.switches, **inputs(width)
    )
    step = _accept(request, draft, output.logits if whole else output.logits[index])
    if returned.wanted:  # before the cache is rolled back: the columns each token attended to
        step.extras = returned.step(output, slots, step, width)
    if step.paths is not None:  # move each row's accepted path to the front of its fed columns
        order = torch.arange(width, device=device).repeat(target.mask.shape[0], 1)
        for b, path in enumerate(step.paths):
            order[slots[b], 1 : 1 + len(path)] = torch.tensor(path, device=device) + 1
        target.reorder_tail(order)
    # Keep the fed last token and the accepted drafts; the row's new token is not in the cache yet.
    rejected = [n - a for n, a in zip(draft.lengths, step.accepted)]
    if any(rejected):  # decided on the host: a step that kept its whole draft rolls nothing back
        kept_lengths = target.lengths.clone()
        kept_lengths[index] -= torch.tensor(rejected, device=device)
        target.truncate(kept_lengths)
    if features.layers:
        accepted = torch.tensor(step.accepted, device=device)
        kept = torch.arange(width, device=device)[None, :] <= accepted[:, None]
        features.add(output, kept, request.row_ids, index)
    return step


def _accept(request: DraftRequest, draft: Draft, logits: torch.Tensor) -> _Verified:
    """Score each row's draft with the target's `logits` [B, k + 1, V] and accept what the
    target agrees with (greedy) or what rejection sampling keeps."""
    # Only processors that read tokens need each row's sequence (plain greedy has none).
    contexts = [request.row(b) for b in range(len(request.row_ids))] if request.processor.processors else []
    scores = request.processor.positions(
        contexts, request.row_ids, draft.tokens, draft.lengths, logits, draft.parents
    )
    if draft.parents is not None:
        if draft.probs is not None:  # the walk below is exact only for trees chosen without draws
            raise NotImplementedError("Sampled tree drafts need multi-draft rejection sampling.")
        paths, tokens = tree_verify(draft.tokens, draft.lengths, draft.parents, scores, request.do_sample)
        return _Verified([len(path) for path in paths], tokens, scores, logits, paths)
    if not request.do_sample and not any(draft.lengths):  # nothing drafted: a plain greedy step
        return _Verified([0] * len(draft.lengths), scores.argmax(dim=-1), scores, logits)
    draft_lengths = torch.tensor(draft.lengths, device=logits.device)
    if request.do_sample:
        accepted, tokens = rejection_sample(draft.tokens, draft_lengths, draft.probs, scores.softmax(-1))
    else:
        accepted, tokens = greedy_verify(draft.tokens, draft_lengths, scores)
    return _Verified(accepted.tolist(), tokens, scores, logits)


def _tree_layout(
    parents: torch.Tensor, batch: int | None = None, slots: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a forward over [last token, tree nodes...]: which fed tokens each one sees (its
    ancestors and itself), [B, T, T], and each one's depth below the last token, [B, T].
    Rows of a target batch of `batch` rows not in `slots` see only themselves."""
    rows, nodes = parents.shape
    width = nodes + 1
    parent_column = torch.cat([parents.new_zeros(rows, 1), parents + 1], dim=1)  # [B, T]
    visible = torch.eye(width, dtype=torch.bool, device=parents.device).repeat(rows, 1, 1)
    every_row = torch.arange(rows, device=parents.device)
    for i in range(1, width):  # a parent's column comes before its children's
        visible[:, i] |= visible[every_row, parent_column[:, i].clamp(0, i - 1)]
    depths = visible.sum(dim=-1) - 1
    if slots is None:
        return visible, depths
    visible_all = torch.eye(width, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    depths_all = torch.arange(width, device=parents.device).repeat(batch, 1)
    return visible_all.index_copy_(0, slots, visible), depths_all.index_copy_(0, slots, depths)


class _Returned:
    """The attentions and hidden states a call returns, sliced from the target's forwards."""

    def __init__(self, out: OutputCollector, target: RaggedKV, drafter_hidden_states: bool) -> None:
        self.out = out
        self.target = target
        self.wanted = out.keep_attentions or out.keep_hidden_states
        self.switches = {}  # asked of every target forward: only then does the model compute them
        if out.keep_attentions:
            self.switches["output_attentions"] = True
        if out.keep_hidden_states or drafter_hidden_states:
            self.switches["output_hidden_states"] = True

    def prompt(self, output: Any, rows: list[int]) -> list[TokenOutputs] | None:
        if not self.wanted:
            return None
        keep = self.out.keep_attentions, self.out.keep_hidden_states
        return [prompt_outputs(output, row, *keep) for row in rows]

    def step(self, output: Any, slots: list[int], step: _Verified, width: int) -> list[TokenOutputs]:
        past = self.target.width - width
        return [
            step_outputs(
                output,
                slot,
                self.target.sequence_columns(slot, past),
                past,
                step.fed(b),
                self.target.layer_windows,
                self.out.keep_attentions,
                self.out.keep_hidden_states,
            )
            for b, slot in enumerate(slots)
        ]


class _Features:
    """Target hidden states a drafter asked for, gathered per row until its next request."""

    def __init__(self, layers: tuple[int, ...], batch: int) -> None:
        self.layers = layers
        self.pending: dict[int, list[torch.Tensor]] = {row: [] for row in range(batch)}

    def add(self, output: Any, kept: torch.Tensor, row_ids: list[int], slots: torch.Tensor | slice) -> None:
        """Keep the hidden states of the positions `kept` [B, T] that stay in the target's cache;
        request row b is row `slots[b]` of `output`."""
        if not self.layers:
            return
        hidden = torch.cat(
            [output.hidden_states[i][slots] for i in self.layers], dim=-1
        )  # [B, T, layers * H]
        for b, row in enumerate(row_ids):
            self.pending[row].append(hidden[b][kept[b]])

    def take(self, row_ids: list[int]) -> list[torch.Tensor] | None:
        if not self.layers:
            return None
        taken = [torch.cat(self.pending[row]) if self.pending[row] else None for row in row_ids]
        for row in row_ids:
            self.pending[row] = []
        return taken
