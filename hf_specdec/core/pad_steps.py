"""What plain decoding returns for a row at the steps after it stopped, where it pads the row.

Plain `generate` pads a row once a stopping criterion has ended it (where an EOS criterion is among
them), yet keeps decoding it with the batch: until the last row stops, it feeds the row its last
token then pad tokens, and returns the model's scores, logits, attentions and hidden states at
those steps. Speculation stops feeding a finished row at once; where a call returns any of these
per-token outputs, the rows that stopped before the others keep their cache
(`OutputCollector.rows_cached`) and one forward at the end feeds each what plain decoding fed it,
through a copy of its cache rows.
"""

from __future__ import annotations

from typing import Any

import torch

from .inputs import ModelInputs
from .kv import RaggedKV, positions
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
    """Give each row that stopped before the batch's longest its outputs at the remaining steps."""
    length = max(out.lengths, default=0)
    rows = [row for row, n in enumerate(out.lengths) if n < length]
    if not out.keeps_per_token or not rows:
        return
    widths = [length - out.lengths[row] for row in rows]  # steps per row: its last token, then pads
    width = max(widths)
    device = out.tokens.device
    feed = out.tokens.new_empty(len(rows), width)  # [R, width]
    feed[:] = out.pad
    feed[:, 0] = out.tokens[rows, [out.lengths[row] - 1 for row in rows]]
    steps = torch.tensor(widths, device=device)
    valid = None if min(widths) == width else torch.arange(width, device=device)[None, :] < steps[:, None]
    kv: RaggedKV = target.rows_apart(positions(cached_rows, rows))
    output = kv.forward(feed, valid, logits_to_keep=width, **returned.switches, **inputs.step(width, rows))
    stats.record_forward(0, width)  # a target forward, but no step: it verified nothing
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
