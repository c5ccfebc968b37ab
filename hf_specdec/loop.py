"""The speculative decoding loop: propose, verify, accept and roll back, observe, stop?

It runs as a transformers `custom_generate` callable, so `generate` has already prepared the
generation config, the logits processors, the stopping criteria and the KV cache, exactly as for
plain decoding; this module only replaces the token-by-token loop.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .config import SpeculativeConfig
from .drafters import Draft, DraftRequest, build_drafter
from .kv import RaggedKV
from .output import OutputCollector
from .policy import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from .processing import ScoreProcessor
from .stats import SpeculativeStats
from .verify import greedy_verify, rejection_sample


def speculative_decode(
    model: Any,
    input_ids: torch.Tensor,  # [B, prompt_len], left-padded
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    speculative: SpeculativeConfig,
    streamer: Any = None,
    tokenizer: Any = None,
    **model_kwargs: Any,
) -> Any:
    """Generate with speculative decoding; returns what `generate` would (plus `speculative_stats`)."""
    from .checks import check_supported, resolve_method

    check_supported(model, input_ids, generation_config, model_kwargs, streamer)
    speculative = resolve_method(speculative, model)
    drafter = build_drafter(speculative, model, tokenizer)
    if generation_config.do_sample and not drafter.supports_sampling:
        raise ValueError(
            f"method={speculative.method!r} supports greedy decoding only; pass do_sample=False."
        )
    policy = _default_policy(speculative)
    stats = SpeculativeStats(method=speculative.method)
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    vocab = model.config.get_text_config().vocab_size
    score = ScoreProcessor(logits_processor, vocab, batch)
    out = OutputCollector(input_ids, model_kwargs.get("attention_mask"), generation_config, streamer)
    target = RaggedKV(model, model_kwargs.get("cache"), batch, device)

    # The target's cache always holds every token of a row but its last: each step feeds that
    # last token followed by the draft, so position i of the output scores draft token i.
    if prompt_len > 1:
        target.forward(input_ids[:, :-1], out.attention_mask[:, :-1].bool(), logits_to_keep=1)

    cached_rows = list(range(batch))
    while out.active_rows:
        rows = out.active_rows
        if rows != cached_rows:  # finished rows leave the batch and stop costing work
            target.select_rows(torch.tensor([cached_rows.index(r) for r in rows], device=device))
            cached_rows = rows
        k = policy.draft_length(len(rows))
        stats.draft_lengths.append(k)
        request = DraftRequest(
            tokens=out.tokens[rows],
            attention_mask=out.mask[rows],
            lengths=[out.lengths[r] for r in rows],
            max_tokens=[min(k, out.room(r) - 1) for r in rows],
            do_sample=generation_config.do_sample,
            score=score,
            row_ids=rows,
        )

        start = time.perf_counter()
        draft = drafter.propose(request) if k > 0 else Draft.empty(len(rows), device)
        drafted_at = time.perf_counter()

        # Verify: one target forward over [last token, draft...] for every row.
        width = 1 + draft.tokens.shape[1]
        feed = torch.cat(
            [request.tokens.gather(1, _last_index(request.lengths, device)), draft.tokens], dim=1
        )
        valid = (
            torch.arange(width, device=device)[None, :] <= torch.tensor(draft.lengths, device=device)[:, None]
        )
        logits = target.forward(feed, valid, logits_to_keep=width)
        contexts = [request.row(b) for b in range(len(rows))]
        scores = score.positions(contexts, rows, draft.tokens, draft.lengths, logits)
        draft_lengths = torch.tensor(draft.lengths, device=device)
        if generation_config.do_sample:
            accepted_t, tokens = rejection_sample(
                draft.tokens, draft_lengths, draft.probs, scores.softmax(-1)
            )
        else:
            accepted_t, tokens = greedy_verify(draft.tokens, draft_lengths, scores)
        accepted = accepted_t.tolist()  # the one host sync of the step
        verified_at = time.perf_counter()

        # Keep each row's last token and its accepted drafts in the cache; its new token is not in it.
        target.truncate(target.lengths - valid.sum(dim=1) + accepted_t + 1)
        drafter.observe(accepted)
        stats.target_forwards += 1
        for b, row in enumerate(rows):
            stats.record_step(draft.lengths[b], accepted[b])
            out.emit(
                row,
                tokens[b, : accepted[b] + 1],
                scores[b, : accepted[b] + 1],
                logits[b, : accepted[b] + 1],
                stopping_criteria,
            )
        policy.update(len(rows), draft.lengths, accepted, drafted_at - start, verified_at - drafted_at)
        stats.draft_seconds += drafted_at - start
        stats.verify_seconds += verified_at - drafted_at

    stats.emitted = out.emitted
    return out.finish(stats, target.cache)


def _default_policy(config: SpeculativeConfig) -> DraftLengthPolicy:
    if config.num_draft_tokens == "auto":
        return AdaptiveDraftLength()  # a fresh one per call: nothing learnt leaks into the next
    if isinstance(config.num_draft_tokens, int):
        return FixedDraftLength(config.num_draft_tokens)
    return config.num_draft_tokens  # the user's own policy object, kept across their calls


def _last_index(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(lengths, device=device)[:, None] - 1
