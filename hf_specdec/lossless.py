"""What "lossless" means for greedy decoding, checked: identical, a rounding tie, or a mismatch.

Sampling is exact in distribution (Leviathan et al. 2023, Theorem 1), and with drafts chosen without
draws a seeded call gives plain's sample, up to the same rounding (docs/lossless.md). Greedy
speculative output is plain greedy `generate`'s, token for token, up to floating-point rounding:
the target verifying
several tokens in one forward computes each position's scores with other kernels and summation
orders than one-token decoding does (plain `generate` itself is not batch-invariant either), so
where the target's two best tokens score within a rounding error of each other either one is the
target's choice. `check_greedy` classifies each output row (`check_sampled` a seeded sampled one, on
the scores less the logarithm of plain's draws):

- `identical`: the generated tokens (up to and including the first EOS) equal plain `generate`'s;
- `tie`: at the first position where they differ, the plain target's processed scores, recomputed
  by one forward over the plain prefix, put both tokens there (plain's and speculation's) at most
  `rounding_bound` below the best score: the two are among the tokens rounding cannot tell apart
  (usually the top two; where three or more tie, the recomputation may rank a third first); and
  from there on speculation's row is the target's greedy continuation of its own prefix, up to the
  same rounding: each later token at most the bound below the best score after the tokens before
  it (the same forward, over speculation's row). A tie ends plain's and speculation's agreement,
  not the contract: a bug that strikes after it must not pass for the tie;
- `mismatch`: anything else, i.e. a bug.

The bound is the drift rounding can cause through the model's depth, from the dtype the target ran
in, at the magnitude |s| of the row's largest score (e = floor(log2 |s|)); for sampled scores, the
logits over a temperature T, at the logits' magnitude |s| · T and divided by T. Every score of a row
is the same final hidden state times a row of the LM head, so they share its rounding error,
whatever their own size: two tokens scoring 3.3 and 3.2 in a row whose scores reach |28| drift as
far apart as two scoring 28 and 27.9 (seen in bf16 on SmolLM2: feeding the same prefix one token
or seven tokens at a time moved such a gap between 0.016 and 0.20).

- float32: 1e-4 · max(|s|, 1) (about 1e-4 relative: the last bits of a 30-layer forward);
- bfloat16: 4 · 2^(e - 7), four bf16 rounding steps at that magnitude (0.5 at 16-32). It covers
  the ties seen on SmolLM2-135M but, measured directly (benchmarks/micro/logit_drift.py,
  docs/lossless.md), not every drift: it has no step of margin left. It stays ~3% of the score,
  far below what a real bug (a token outside the top two, or a gap of whole units) produces. The
  drift follows the largest |logit|, often a negative one: not the largest score;
- float16: 4 · 2^(e - 10), the same four steps of fp16's finer significand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from .core.compat import forward_takes, greedy_processors
from .core.draws import default_generator, plain_draw
from .loading import eos_token_ids as eos_token_ids_of

IDENTICAL, TIE, MISMATCH = "identical", "tie", "mismatch"
KINDS = (IDENTICAL, TIE, MISMATCH)

FP32_RELATIVE_BOUND = 1e-4
ROUNDING_STEPS = 4  # bf16/fp16: the drift measured reaches it (docs/lossless.md)
_SIGNIFICAND_BITS = {torch.bfloat16: 7, torch.float16: 10}


@dataclass(frozen=True)
class RowCheck:
    """How one output row compares with plain greedy `generate`.

    `position` is the index, among the generated tokens, of the first difference (None when
    identical); `top_two` the plain target's two best tokens there and `gap` how far below the best
    score the further of plain's and speculation's tokens lies,
    `bound` the rounding bound it was held to. A mismatch later in a row that first differed at a
    tie has `tie_at`, the tie's position: there `position` is the later token's, `plain_token` None
    (plain's row went its own way at the tie), and `top_two` and `gap` are the target's scores after
    speculation's own prefix.
    """

    kind: str
    position: int | None = None
    plain_token: int | None = None
    speculative_token: int | None = None
    top_two: tuple[int, int] | None = None
    gap: float | None = None
    bound: float | None = None
    tie_at: int | None = None
    # Sampling: plain's token lay at a truncating processor's cut-off, where rounding can cut it
    # (`check_sampled`): `gap` and `top_two` are then those of the tokens rounding cannot cut.
    at_cut_off: bool = False

    def describe(self) -> str:
        if self.kind == IDENTICAL:
            return "identical"
        if self.top_two is None:
            return f"{self.kind}: lengths differ after {self.position} equal generated tokens"
        if self.tie_at is not None:
            return (
                f"{self.kind} at generated token {self.position}, after a tie at {self.tie_at}: speculative "
                f"took {self.speculative_token}, {self.gap:.3g} below the best score after its own prefix "
                f"(rounding bound {self.bound:.3g}; the target's top two there: {self.top_two})"
            )
        if self.at_cut_off:
            return (
                f"{self.kind} at generated token {self.position}: plain took {self.plain_token}, which lay "
                "within rounding of the processors' cut-off (top-k, top-p), speculative "
                f"{self.speculative_token}, {self.gap:.3g} below the best draw of the tokens rounding "
                f"cannot cut (rounding bound {self.bound:.3g}; their top two: {self.top_two})"
            )
        return (
            f"{self.kind} at generated token {self.position}: plain took {self.plain_token}, speculative "
            f"{self.speculative_token}; the further of the two scores {self.gap:.3g} below the best "
            f"(rounding bound {self.bound:.3g}; the target's top two there: {self.top_two})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rounding_bound(score: float, dtype: torch.dtype) -> float:
    """How far apart two scores of magnitude |score| may be and still count as a rounding tie in `dtype`."""
    magnitude = max(abs(score), 1e-6)
    bits = _SIGNIFICAND_BITS.get(dtype)
    if bits is None:  # float32 (and anything wider)
        return FP32_RELATIVE_BOUND * max(magnitude, 1.0)
    return ROUNDING_STEPS * 2.0 ** (math.floor(math.log2(magnitude)) - bits)


def bound_formula(dtype: torch.dtype | str) -> str:
    """`rounding_bound` in words, for reports."""
    name = str(dtype).removeprefix("torch.")
    bits = _SIGNIFICAND_BITS.get(getattr(torch, name, None))
    if bits is not None:
        example = rounding_bound(20.0, getattr(torch, name))
        return f"{ROUNDING_STEPS} · 2^(e-{bits}) at |score| in [2^e, 2^(e+1)) ({example:g} at 16-32)"
    return f"{FP32_RELATIVE_BOUND:g} · max(|score|, 1)"


@torch.no_grad()
def check_greedy(
    model: Any,
    input_ids: torch.Tensor,  # [B, P] the prompts, left-padded
    plain: torch.Tensor,  # [B, P + N] plain greedy `generate` output
    speculative: torch.Tensor,  # [B, P + N'] speculative output for the same inputs
    attention_mask: torch.Tensor | None = None,  # [B, P]
    *,
    eos_token_ids: Iterable[int] | None = None,
    logits_processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> list[RowCheck]:
    """Classify each row of `speculative` against `plain` as identical, tie or mismatch (module docstring).

    `eos_token_ids` (default: the model's generation config's) end a row's comparison, so the
    padding after it does not count. `logits_processor` (e.g. the `LogitsProcessorList` of a
    repetition penalty) turns the recomputed logits into the processed scores greedy decoding
    compares; without one, those plain greedy `generate` builds from the model's generation config
    (`core.compat.greedy_processors`: a `repetition_penalty` there applies to both runs compared), so
    only processors the call itself added need passing.
    """
    if eos_token_ids is None:
        eos_token_ids = eos_token_ids_of(model)
    prompt_length, checks, eos = input_ids.shape[1], [], set(eos_token_ids)
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    first = _first_differences(plain, speculative, prompt_length, eos)
    for row in range(plain.shape[0]):
        if row not in first:
            checks.append(RowCheck(IDENTICAL))
            continue
        at, plain_token, spec_token = first[row]
        if plain_token is None or spec_token is None:
            checks.append(RowCheck(MISMATCH, position=at))
            continue
        mask = None if attention_mask is None else attention_mask[row]
        processors = logits_processor
        if processors is None:  # built for the row alone: its padding is spared as plain spares it
            processors = greedy_processors(model, prompt_length, None if mask is None else mask[None])
        generated = _generated(speculative[row, prompt_length:].tolist(), eos)
        generated = generated[: max(_unpadded_length(generated, eos, pad), at + 1)]
        scores = _scores_along(model, speculative[row], prompt_length, at, len(generated), mask, processors)
        checks.append(_classify_along(scores, generated, at, plain_token, _compute_dtype(model)))
    return checks


@torch.no_grad()
def check_sampled(
    plain: torch.Tensor,  # [B, P + N] plain seeded sampling's sequences
    plain_scores: Sequence[torch.Tensor],  # N x [B, V]: its `scores` (output_scores=True), sampled from
    speculative: torch.Tensor,  # [B, P + N'] speculative sampling's, seeded alike
    prompt_length: int,
    seed: int,  # what `torch.manual_seed` was given before each of the two calls
    dtype: torch.dtype,  # the dtype the target computed in
    *,
    eos_token_ids: Iterable[int],
    temperature: float = 1.0,  # the temperature both calls sampled at
    plain_logits: Sequence[torch.Tensor] | None = None,  # N x [B, V]: its `logits` (output_logits=True)
) -> list[RowCheck]:
    """Classify each row of a seeded sampled `speculative` output against plain's, as `check_greedy`
    does greedy output. Plain sampling takes argmax(p_t / E_t), E_t the t-th Exp(1) draw [B, V] of
    the seeded default generator, i.e. the argmax of u_t = s_t - log E_t over its processed scores
    s_t; with drafts chosen without draws, speculation takes the same argmax over its verify
    forward's scores (docs/lossless.md#sampling). So at the first difference the two tokens are a
    `tie` where both lie within `rounding_bound` of the largest u_t (the scores' rounding, not the
    draw's, moves u_t), else a `mismatch`. Where plain's token lies within that bound of a truncating
    processor's cut-off (the lowest score kept: top-k's k-th), rounding can cut it from speculation's
    scores, and speculation's token is held to the best draw of the tokens it cannot cut instead
    (`_classify_draw`). E_t is drawn again here, on the scores' device, which
    must be one `can_check_sampled` names; plain's own token must be the argmax it reproduces, else
    this raises. Only speculation that verified every step with plain's draws is expected to match
    (`SpeculativeStats.rejection_sampled_steps` 0): rejection-sampled drafts are exact in
    distribution, not token for token.

    The scores are the logits divided by `temperature`, but the rounding happened in the logits: the
    bound is the one at the logits' magnitude, max |s| · T, divided by T as they were.
    Pass the temperature the calls sampled at (the call's, else the generation config's): at any
    other, the bound is taken at the wrong magnitude and scale, too tight (a tie reported as a
    mismatch) or too loose. Pass plain's raw `logits` too where a truncating processor (top-k,
    top-p) ran: the rounding follows the row's largest |logit|, often a negative one such processors
    mask with -inf, so the kept scores alone can put the bound octaves too low (a tie reported as a
    mismatch); with `plain_logits` the bound is taken at those. A repetition penalty rescales only
    the tokens it penalises, by its factor or its inverse, and is not accounted for."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, as sampling requires; got {temperature}")
    device = plain_scores[0].device
    if not can_check_sampled(device):
        raise ValueError(
            f"check_sampled cannot reproduce plain sampling's draws on {device}: only where "
            "torch.multinomial's default generator is known (CPU and CUDA): run both calls on one of those."
        )
    eos, checks = set(eos_token_ids), []
    first = _first_differences(plain, speculative, prompt_length, eos)
    generator = torch.Generator(device=device).manual_seed(seed)
    last = max((at for at, token, _ in first.values() if token is not None), default=-1)
    noise = [plain_draw(generator, *plain_scores[t].shape) for t in range(last + 1)]
    for row in range(plain.shape[0]):
        if row not in first:
            checks.append(RowCheck(IDENTICAL))
            continue
        at, plain_token, spec_token = first[row]
        if plain_token is None or spec_token is None:
            checks.append(RowCheck(MISMATCH, position=at))
            continue
        scores = plain_scores[at][row].float()
        drawn = scores - noise[at][row].log()
        if int((scores.softmax(-1) / noise[at][row]).argmax()) != plain_token:  # as sampling picks it
            raise ValueError(
                f"Row {row}: plain's token at generated position {at} is not the argmax of its scores over "
                f"the Exp(1) draws of seed {seed}: pass the seed given to torch.manual_seed before both "
                "calls, on the device the scores are on, and plain's own `scores`."
            )
        # The bound is the logits' rounding, over T: at the unmasked row where given, else as kept.
        logits = scores * temperature if plain_logits is None else plain_logits[at][row].float()
        bound = _bound(logits, dtype) / temperature
        checks.append(_classify_draw(scores, drawn, at, plain_token, spec_token, bound))
    return checks


def can_check_sampled(device: torch.device | str) -> bool:
    """Whether `check_sampled` reproduces plain sampling's draws on `device`: where `core.draws`
    knows the generator `torch.multinomial` draws from (CPU and CUDA), which is also where seeded
    speculation verifies drafts chosen without draws with plain's own draws."""
    return default_generator(torch.device(device)) is not None


def count_kinds(checks: Iterable[RowCheck]) -> dict[str, int]:
    """How many rows are identical, ties and mismatches (every kind present, possibly 0)."""
    counts = dict.fromkeys(KINDS, 0)
    for check in checks:
        counts[check.kind] += 1
    return counts


def _first_differences(
    plain: torch.Tensor, speculative: torch.Tensor, prompt_length: int, eos: set[int]
) -> dict[int, tuple[int, int | None, int | None]]:
    """Per row that differs: (generated position, plain's token, speculation's token) of its first
    difference; the tokens None where one row is a strict prefix of the other (no tie explains that)."""
    out: dict[int, tuple[int, int | None, int | None]] = {}
    for row in range(plain.shape[0]):
        ours = _generated(plain[row, prompt_length:].tolist(), eos)
        theirs = _generated(speculative[row, prompt_length:].tolist(), eos)
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            out[row] = (min(len(ours), len(theirs)), None, None) if at is None else (at, ours[at], theirs[at])
    return out


def _bound(scores: torch.Tensor, dtype: torch.dtype) -> float:
    finite = scores[torch.isfinite(scores)]  # processors mask tokens with -inf
    return rounding_bound(float(finite.abs().max()), dtype)


def _classify(scores: torch.Tensor, at: int, plain_token: int, spec_token: int, bound: float) -> RowCheck:
    values, tokens = scores.topk(2)
    top_two = (int(tokens[0]), int(tokens[1]))
    best = float(values[0])
    # How far below the best score the further of the two tokens lies (the top-two gap when they
    # are the top two).
    gap = best - min(float(scores[plain_token]), float(scores[spec_token]))
    return RowCheck(TIE if gap <= bound else MISMATCH, at, plain_token, spec_token, top_two, gap, bound)


def _classify_draw(
    scores: torch.Tensor,  # [V] plain's processed scores at the first difference
    drawn: torch.Tensor,  # [V] those less the logarithm of plain's draws there
    at: int,
    plain_token: int,
    spec_token: int,
    bound: float,
) -> RowCheck:
    """`_classify` over the draws, where a truncating processor (top-k, top-p) may have cut plain's
    token from speculation's scores: it keeps the tokens scoring at least a cut-off, the lowest
    score it kept, and a token kept within `bound` of that cut-off is one the verify forward's
    rounding can drop below it (seen in bf16: plain's token tied at top-k's 50th logit, one rounding
    step lower in the verify forward, cut there, its draw the best). Speculation then takes the best
    draw of the rest: its token must lie within the bound of the best draw among the tokens rounding
    cannot cut. A token plain's processors cut is not judged from plain's scores: a mismatch."""
    kept = torch.isfinite(scores)
    cut_off = float(scores[kept].min())
    certain = kept & (scores > cut_off + bound)  # kept whatever the rounding
    if bool(certain[plain_token]):
        return _classify(drawn, at, plain_token, spec_token, bound)
    rest = drawn.masked_fill(~certain, -math.inf)
    rest[spec_token] = drawn[spec_token]
    check = _classify(rest, at, spec_token, spec_token, bound)
    return replace(check, plain_token=plain_token, at_cut_off=True)


def _classify_along(
    scores: torch.Tensor,  # [N' - at, V] the target's, before each of speculation's tokens from `at` on
    generated: list[int],  # [N'] speculation's generated tokens
    at: int,
    plain_token: int,
    dtype: torch.dtype,
) -> RowCheck:
    """The first difference, a tie or not (`_classify`); after a tie, the first of speculation's later
    tokens that is not the target's greedy choice after its own prefix, up to rounding, is a mismatch."""
    first = _classify(scores[0], at, plain_token, generated[at], _bound(scores[0], dtype))
    if first.kind == MISMATCH:
        return first
    for t in range(at + 1, len(generated)):
        later = _classify(scores[t - at], t, generated[t], generated[t], _bound(scores[t - at], dtype))
        if later.kind == MISMATCH:
            return replace(later, plain_token=None, tie_at=at)
    return first


def _scores_along(
    model: Any,
    row: torch.Tensor,  # [P + N'] speculation's row
    prompt_length: int,
    start: int,  # the first generated position scored (the first difference)
    end: int,  # one past the last generated position scored (the row's EOS, or its end)
    prompt_mask: torch.Tensor | None,  # [P]
    logits_processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """The target's processed scores [end - start, vocab] for generated tokens start..end - 1 of
    `row`, each after the tokens before it, from one forward. Up to the first difference speculation's
    prefix is plain's, so the first are the plain target's scores there.

    Positions follow the attention mask as `generate` computes them, so left padding changes nothing
    (for a model that takes position_ids: another counts its cache columns, as in plain decoding)."""
    device = model.device
    ids = row[None, : prompt_length + end - 1].to(device)  # the last token scored needs no successor
    kwargs: dict[str, Any] = {}
    if prompt_mask is not None:
        generated = torch.ones(ids.shape[1] - len(prompt_mask), dtype=prompt_mask.dtype, device=device)
        mask = torch.cat([prompt_mask.to(device), generated])[None]
        kwargs = {"attention_mask": mask}
        if forward_takes(model, "position_ids"):  # else generate gives none: the model counts cache columns
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    kept = end - start
    if forward_takes(model, "logits_to_keep"):  # the scored positions' only
        kwargs["logits_to_keep"] = kept
    logits = model(input_ids=ids, **kwargs).logits[0, -kept:].float()  # [end - start, vocab]
    if logits_processor is None:
        return logits
    return torch.cat(
        [logits_processor(ids[:, : prompt_length + start + i], logits[i : i + 1]) for i in range(kept)]
    )


def _generated(tokens: list[int], eos: set[int]) -> list[int]:
    """Generated tokens up to and including the first EOS (what follows is padding)."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


def _unpadded_length(generated: list[int], eos: set[int], pad: int | None) -> int:
    """`generated`'s length without the padding after a row that stopped other than at an EOS (a stop
    string): the target never chose it, so it is not held to the target's choice."""
    end = len(generated)
    if generated and generated[-1] not in eos:
        while end and generated[end - 1] == pad:
            end -= 1
    return end


def _compute_dtype(model: Any) -> torch.dtype:
    return getattr(model, "dtype", torch.float32)
