"""The speculative decoding loop: propose, verify, accept and roll back, observe, stop?

It runs as a transformers `custom_generate` callable, so `generate` has already prepared the
generation config, the logits processors, the stopping criteria and the KV cache, exactly as for
plain decoding; this module only replaces the token-by-token loop. The mechanisms live with their
data: rows fed into the target's batch and rolled back in `kv`, the acceptance rule in `verify`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .draft import Draft, Drafter, DraftRequest
from .draws import PlainDraws, default_generator
from .features import DrafterFeatures
from .inputs import ModelInputs
from .kv import Slots, check_trees, positions
from .output import OutputCollector, ReturnedStates, TokenOutputs
from .pad_steps import keep_pad_steps
from .policy import DraftLengthPolicy
from .processing import ScoreProcessor
from .static_kv import target_cache
from .stats import SpeculativeStats
from .timing import clock
from .verify import Verdict, accept


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
    cache_given: bool = False,
    **model_kwargs: Any,
) -> Any:
    """Generate with speculative decoding; returns what `generate` would (plus `speculative_stats`).

    The caller has checked the inputs (`checks.check_supported`) and chosen the `drafter` and the
    draft-length `policy`; `tree`: draft trees (the drafter grows them), of at most `max_tree_nodes`.
    `cache_given`: the user passed `generate` the cache, which then holds what plain decoding's would.
    """
    out = OutputCollector(input_ids, model_kwargs.get("attention_mask"), generation_config, streamer)
    # Sampling takes each token with plain decoding's draw at its position (`draws`).
    generator = default_generator(input_ids.device) if generation_config.do_sample else None
    draws = PlainDraws(input_ids.shape[0], input_ids.shape[1], generator) if generator is not None else None
    try:
        return _decode(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            out,
            draws,
            drafter=drafter,
            policy=policy,
            tree=tree,
            max_tree_nodes=max_tree_nodes,
            cache_given=cache_given,
            **model_kwargs,
        )
    finally:
        # Ended or raised (an error, a KeyboardInterrupt), the call leaves torch's default generator
        # where plain sampling leaves it after as many tokens as the call's longest row got, never
        # on the stream it moved it to meanwhile (docs/lossless.md#sampling).
        if draws is not None:
            draws.finish(max(out.lengths) - input_ids.shape[1])


def _decode(
    model: Any,
    input_ids: torch.Tensor,  # [B, prompt_len], left-padded
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    out: OutputCollector,
    draws: PlainDraws | None,
    *,
    drafter: Drafter,
    policy: DraftLengthPolicy,
    tree: bool,
    max_tree_nodes: int | None,
    cache_given: bool,
    **model_kwargs: Any,
) -> Any:
    """`speculative_decode`'s call, with its collector `out` and its sampling `draws` made."""
    inputs = ModelInputs(model, input_ids, model_kwargs)
    stats = SpeculativeStats(method=drafter.name, translation=drafter.translation)
    batch, device = input_ids.shape[0], input_ids.device
    target = target_cache(model, batch, device, generation_config, model_kwargs)
    # A cache the call hands back keeps the rows that leave the batch, for `pad_steps` to join back.
    target.hands_back = bool(generation_config.return_dict_in_generate) or cache_given
    if tree:  # before the prompt's forward: refused whatever the policy would have drafted
        check_trees(model, target.tree_refusal)
    features = DrafterFeatures(drafter.hidden_state_layers, batch, device)
    returned = ReturnedStates(out, target, bool(drafter.hidden_state_layers))

    def request(rows: list[int], k: int) -> DraftRequest:
        hidden_states = features.take(rows) if k > 0 else None  # kept for the next draft
        return out.draft_request(rows, k, generation_config.do_sample, processor, hidden_states, tree)

    # The prefill is plain decoding's first step: the whole prompt (what a filled cache does not
    # hold of it yet), whose last logits give each row's first token. From then on the target's
    # cache holds every token of a row but its last: each step feeds that last token followed by
    # the draft, so output position i scores draft token i.
    prompt_mask = out.attention_mask.bool()[:, inputs.uncached]
    switches = returned.switches | inputs.prefill()
    new_tokens = input_ids[:, inputs.uncached]
    prefill = target.forward(
        new_tokens, prompt_mask, logits_to_keep=1, positions=inputs.prompt_positions, **switches
    )
    # The target's scores are as wide as its head makes them (ImageGPT's is one id narrower than
    # its config's vocabulary, which it embeds): plain generate returns and samples from that width.
    vocab = prefill.logits.shape[-1]
    embedded = max(vocab, model.config.get_text_config().vocab_size)
    processor = ScoreProcessor(logits_processor, vocab, batch)
    features.add(prefill, prompt_mask, list(range(batch)), slice(None))
    if out.active_rows:  # none when the prompt already fills max_length
        rows = out.active_rows
        no_draft = Draft.empty(len(rows), device)
        first = accept(request(rows, 0), no_draft, prefill.logits[rows], draws)
        stats.record_forward(0, 1)  # a target forward, but no step: it verified nothing
        _emit(out, rows, first, returned.prompt(prefill, rows), stopping_criteria)

    policy.begin_call(target.verify_shape, drafter.draft_cost, input_ids.shape[1])
    if target.compiled:  # the draft's own forwards compiled alike, before any forward is timed
        drafter.compile_forwards(target.compile_config, target.capacity, target.widths, batch)
    seconds = drafter.probe_seconds(len(out.active_rows)) if out.active_rows else None
    if seconds is not None:
        policy.expect_draft_cost(seconds)  # a draft too slow to ever pay is then never explored
        stats.draft_seconds += seconds

    cached_rows = list(range(batch))  # rows of the user's batch in the target's cache, in order
    while out.active_rows:
        rows = out.active_rows
        # Finished rows stop drafting at once; the cache says when they leave its batch, unless
        # the policy keeps the forward's shape (a device that pays a one-off per new shape) or
        # their padding is fed at the end (`pad_steps`, `OutputCollector.rows_cached`).
        kept = out.rows_cached()
        if len(kept) < len(cached_rows):
            cached_rows = target.release_rows(cached_rows, kept, keep_shape=policy.keeps_batch_shape())
        fed = len(cached_rows)  # the verify forward's batch: what the policy prices
        k = policy.draft_length(fed)
        if tree and max_tree_nodes is not None:
            k = min(k, max_tree_nodes)
        k = max(min(k, target.widest(k + 1) - 1), 0)  # a static cache's room (0: its error comes next)
        asked = request(rows, k)
        where = positions(cached_rows, rows)  # each row's place in the target's cache
        if drafter.reads_target_kv:
            asked.target_kv, asked.target_rows = target, where

        start = clock(device)  # every clock read waits for the device: the policy learns from these
        draft = drafter.propose(asked) if k > 0 else Draft.empty(len(rows), device)
        proposed_at = clock(device)
        # Checked as proposed: a bad id must not pass because the policy happened to cut it off.
        draft.check(embedded, f"{type(drafter).__name__} (method={drafter.name!r})")
        draft = policy.trim(draft, fed, [out.room(r) for r in rows])
        target.verify_shape.check(draft, type(policy).__name__)
        drafted_at = clock(device)

        # Verify: one target forward over [last token, draft...] a row, finished rows fed holes.
        width = 1 + draft.tokens.shape[1]
        lengths = torch.tensor([asked.lengths, draft.lengths], device=device)  # one copy to the device
        last = asked.tokens.gather(1, lengths[0, :, None] - 1)
        feed = torch.cat([last, draft.tokens], dim=1) if width > 1 else last  # [B, width]
        full = min(draft.lengths, default=0) == width - 1  # known on the host: no holes to mask
        valid = None if full else torch.arange(width, device=device)[None, :] <= lengths[1, :, None]
        slots = Slots(where, len(cached_rows), device)
        switches = returned.switches | inputs.step(width, cached_rows)
        output = target.forward_rows(slots, feed, valid, draft.parents, **switches)
        verdict = accept(asked, draft, slots.gather(output.logits), draws)
        extras = returned.step(output, slots.rows, verdict, width)  # before the cache is rolled back
        # Keep the fed last token and the accepted drafts; the row's new token is not in the cache yet.
        rejected = [n - a for n, a in zip(draft.lengths, verdict.accepted)]
        target.roll_back(slots, width, rejected, verdict.paths, widened=width - 1 > max(draft.lengths))
        features.add_accepted(output, verdict.accepted, rows, slots.index)
        verified_at = clock(device)

        drafter.observe(draft, verdict.accepted)
        depths = None if draft.parents is None else draft.depths()
        stats.record_steps(draft.lengths, verdict.accepted, depths, verdict.rejection_sampled)
        _emit(out, rows, verdict, extras, stopping_criteria)
        # The drafter's own time: the policy's cut is the loop's overhead, not a cost of drafting.
        # A compiled width's first forward is its compile, no verify cost: the policy is not told it.
        verify_seconds = None if target.compiling else verified_at - drafted_at
        policy.update(fed, draft, verdict.accepted, proposed_at - start, verify_seconds, verdict.paths)
        policy.observe_target(verdict.tokens)
        stats.record_forward(k, width, drafted_at - start, verified_at - drafted_at)

    stats.emitted = out.emitted
    # A row that stopped inside its accepted drafts (an EOS, a stop string, max_length) has drafts
    # past its end cached: the cache handed back holds each row's sequence but its last token, as
    # plain decoding's does, so that a next turn can continue it.
    target.truncate(out.cached_lengths(cached_rows))
    # Rows that stopped early, and where the cache is handed back, every row joined in plain's layout.
    keep_pad_steps(target, cached_rows, out, processor, returned, inputs, stats)
    finishing = clock(device)
    drafter.finish(*out.sequences())  # what a drafter learning across calls keeps of this one
    stats.finish_seconds = clock(device) - finishing
    stats.drafter_counters = dict(drafter.counters())
    return out.finish(stats, target.finished_cache())


def _emit(
    out: OutputCollector,
    rows: list[int],
    verdict: Verdict,
    extras: list[TokenOutputs] | None,
    stopping_criteria: StoppingCriteriaList,
) -> None:
    """Append each row's accepted drafts and the target's own token."""
    for b, row in enumerate(rows):
        out.emit_verdict(row, verdict, b, None if extras is None else extras[b], stopping_criteria)
