"""The target's view of the training text: its features at every position and its next-token choices."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..store.fingerprint import weights_fingerprint
from ..store.manifest import write_atomically
from .data import Sequence, read_cache_file, token_digest


@dataclass
class Example:
    """One training sequence as the head sees it."""

    ids: torch.Tensor  # [L] tokens
    features: torch.Tensor  # [L, layers * H] the target's hidden states (bfloat16 to halve memory)
    labels: torch.Tensor  # [L] the target's greedy next token at each position
    answer_start: int  # positions before this are prompt text, after it the target's own answer


def cached_target_features(
    model: Any, sequences: list[Sequence], layers: tuple[int, ...], cache_file: Path
) -> list[Example]:
    """`target_features`, kept in `cache_file` so that resuming (or training another head on the
    same text) does not run the target over everything again: the cache is used where its key, a
    digest of every sequence's token ids, the layers read and the target's weights, is this call's."""
    key = token_digest(
        {"layers": list(layers), "weights": weights_fingerprint(model)}, (s.ids for s in sequences)
    )
    cached = read_cache_file(cache_file)
    if cached is not None and cached.get("key") == key:
        return [
            Example(s.ids, features, labels, s.answer_start)
            for s, features, labels in zip(sequences, cached["features"], cached["labels"])
        ]
    examples = target_features(model, sequences, layers)
    saved = {"key": key, "features": [e.features for e in examples], "labels": [e.labels for e in examples]}
    write_atomically(cache_file, lambda tmp: torch.save(saved, tmp))
    return examples


@torch.no_grad()
def target_features(
    model: Any, sequences: list[Sequence], layers: tuple[int, ...], batch_tokens: int = 4096
) -> list[Example]:
    """Run the target over every sequence once (batched by similar length)."""
    lm_head = model.get_output_embeddings()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))
    examples: dict[int, Example] = {}
    with tqdm(total=sum(len(s.ids) for s in sequences), desc="target features", unit="tok") as bar:
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * len(sequences[order[end]].ids) <= batch_tokens:
                end += 1
            batch = [sequences[i] for i in order[start:end]]
            width = max(len(s.ids) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for b, s in enumerate(batch):  # right-padded: positions count from 0 in every row
                ids[b, : len(s.ids)] = s.ids
                mask[b, : len(s.ids)] = 1
            out = model(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                output_hidden_states=True,
                logits_to_keep=1,
            )
            hidden = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
            last = out.hidden_states[-1]
            for b, s in enumerate(batch):
                n = len(s.ids)
                labels = torch.cat([lm_head(chunk).argmax(-1) for chunk in last[b, :n].split(1024)])
                examples[order[start + b]] = Example(
                    s.ids, hidden[b, :n].to(torch.bfloat16).cpu(), labels.cpu(), s.answer_start
                )
            bar.update(sum(len(s.ids) for s in batch))
            start = end
    return [examples[i] for i in range(len(sequences))]
