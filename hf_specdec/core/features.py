"""The target's hidden states a drafter reads (`Drafter.hidden_state_layers`: EAGLE / Medusa heads)."""

from __future__ import annotations

from typing import Any

import torch


class DrafterFeatures:
    """Target hidden states a drafter asked for, gathered per row until its next request."""

    def __init__(self, layers: tuple[int, ...], batch: int, device: torch.device) -> None:
        """`device`: the call's, where the loop's tensors of positions live."""
        self.layers = layers
        self.device = device
        self.pending: dict[int, list[torch.Tensor]] = {row: [] for row in range(batch)}

    def add(self, output: Any, kept: torch.Tensor, row_ids: list[int], slots: torch.Tensor | slice) -> None:
        """Keep the hidden states of the positions `kept` [B, T] that stay in the target's cache;
        request row b is row `slots[b]` of `output`."""
        if not self.layers:
            return
        states = [output.hidden_states[i] for i in self.layers]
        if states[0].dim() != 3:
            raise ValueError(
                "The drafter reads the target's hidden states, and this target returns them of shape "
                f"{tuple(states[0].shape)}, not [batch, positions, hidden] (Gemma 3n's carry their AltUp "
                "streams first), which no head, block draft or MTP layer is built on: draft with "
                "method='draft_model', 'ngram' or 'suffix'."
            )
        hidden = torch.cat([state[slots] for state in states], dim=-1)  # [B, T, layers * H]
        for b, row in enumerate(row_ids):
            self.pending[row].append(hidden[b][kept[b]])

    def add_accepted(
        self, output: Any, accepted: list[int], row_ids: list[int], slots: torch.Tensor | slice
    ) -> None:
        """`add` for a verify forward over [last token, draft...]: each row keeps its fed last token
        and its `accepted[b]` accepted drafts, the first positions."""
        if not self.layers:
            return
        width = output.hidden_states[0].shape[1]
        last_kept = torch.tensor(accepted, device=self.device)[:, None]
        kept = torch.arange(width, device=self.device)[None, :] <= last_kept
        self.add(output, kept, row_ids, slots)

    def take(self, row_ids: list[int]) -> list[torch.Tensor] | None:
        """What each of `row_ids` gathered since it was last taken (None if no drafter reads any)."""
        if not self.layers:
            return None
        taken = [torch.cat(self.pending[row]) if self.pending[row] else None for row in row_ids]
        for row in row_ids:
            self.pending[row] = []
        return taken
