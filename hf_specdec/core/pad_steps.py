"""What plain decoding returns for a row at the steps after it stopped, where it pads the row.

Plain `generate` pads a row once a stopping criterion has ended it (where an EOS criterion is among
them), yet keeps decoding it with the batch: until the last row stops, it feeds the row its last
token then pad tokens, and returns the model's scores, logits, attentions and hidden states at
those steps, and a cache whose every row holds its whole sequence, those pads included. Speculation
stops feeding a finished row at once; where a call returns any of these per-token outputs, the rows
that stopped before the others keep their cache (`OutputCollector.rows_cached`), and where it hands
its cache back (`hands_back`), the rows that left the batch are kept aside (`RaggedKV.release_rows`,
`StaticKV.compact`). One forward at the end feeds each what plain decoding fed it, through a copy of
its cache rows, which, where the cache is handed back, then joins the others in plain's layout.
"""

from __future__ import annotations

from typing import Any

import torch

from .inputs import ModelInputs
from .kv import RaggedKV, join_rows, positions
from .output import OutputCollector, ReturnedStates
from .processing import ScoreProcessor
from .stats import SpeculativeStats


def keep_pad_steps(
    target: Any,  # RaggedKV or StaticKV, each row holding its sequence but its last token
    cached_rows: list[int],  # the user's row at each of its rows
    out: OutputCollector,
    processor: ScoreProcessor,
    returned: ReturnedStates,
    inputs: ModelInputs,
    stats: SpeculativeStats,
) -> None:
    """Give each row that stopped before the batch's longest its outputs at the remaining steps and,
    where the call hands its cache back, its columns at those steps: the cache plain decoding leaves."""
    length = max(out.lengths, default=0)
    rows = [row for row, n in enumerate(out.lengths) if n < length]
    # Nothing to join or move (no copy of the cache): no row set aside, none padded, no hole.
    laid_out = not rows and not target.aside and target.plain_layout()
    whole = None if laid_out else _every_row(target, cached_rows, out)
    if rows and (out.keeps_per_token or whole is not None):
        held = whole if whole is not None else target
        apart = held.rows_apart(rows if whole is not None else positions(cached_rows, rows))
        _feed_pads(apart, rows, length, out, processor, returned, inputs, stats)
        if whole is not None:  # the padded rows take the place of theirs
            padded = set(rows)
            held = [-1 if row in padded else row for row in range(len(out.lengths))]
            whole = join_rows([(whole, held), (apart, rows)], len(out.lengths))
    if whole is not None:
        whole.lay_out(out.attention_mask)
        target.hand_back(whole)


def _every_row(target: Any, cached_rows: list[int], out: OutputCollector) -> RaggedKV | None:
    """Every row of the call in one cache, in order, each holding its sequence but its last token,
    where the call hands its cache back and its layers can be joined (`rejoins`); else None."""
    if not target.hands_back or not target.rejoins:
        return None
    batch = len(out.lengths)
    whole = join_rows(target.held_rows(cached_rows), batch)
    # Rows set aside as they stopped may hold drafts accepted past their end.
    whole.truncate(out.cached_lengths(list(range(batch))))
    return whole


def _feed_pads(
    kv: RaggedKV,  # the padded `rows` alone, in order
    rows: list[int],
    length: int,  # the length every row ends at
    out: OutputCollector,
    processor: ScoreProcessor,
    returned: ReturnedStates,
    inputs: ModelInputs,
    stats: SpeculativeStats,
) -> None:
    """Feed each of `rows` through `kv` what plain decoding fed it after it stopped, and keep the
    per-token outputs the call returns at those steps."""
    widths = [length - out.lengths[row] for row in rows]  # steps per row: its last token, then pads
    width = max(widths)
    device = out.tokens.device
    feed = out.tokens.new_empty(len(rows), width)  # [R, width]
    feed[:] = out.pad
    feed[:, 0] = out.tokens[rows, [out.lengths[row] - 1 for row in rows]]
    steps = torch.tensor(widths, device=device)
    valid = None if min(widths) == width else torch.arange(width, device=device)[None, :] < steps[:, None]
    switches = returned.switches if out.keeps_per_token else {}
    kept = width if out.keeps_per_token else 1  # the cache alone needs no logits
    output = kv.forward(feed, valid, logits_to_keep=kept, **switches, **inputs.step(width, rows))
    stats.record_forward(0, width)  # a target forward, but no step: it verified nothing
    if not out.keeps_per_token:
        return
    scores = None
    if out.keep_scores:  # processed after the row's sequence and the pads before each step
        contexts = [out.row(row) for row in rows] if processor.reads_context else []
        scores = processor.positions(contexts, rows, feed[:, 1:], [n - 1 for n in widths], output.logits)
    extras = returned.padded(output, kv, widths)
    for b, (row, n) in enumerate(zip(rows, widths)):
        out.keep_padded(
            row,
            n,
            None if scores is None else scores[b, :n],
            output.logits[b, :n],
            None if extras is None else extras[b],
        )
