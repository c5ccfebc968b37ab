"""EAGLE and Medusa heads built by hand so that they really agree with their target part of the time.

For a one-layer target, an EAGLE head whose fc passes the next token's embedding through and whose
layer is a copy of the target's layer computes almost the target's own next hidden state (it only
lacks the first token in its context); the target's final norm has unit weights, so the LM head
ranks tokens the same. A Medusa head starts as the identity, i.e. it guesses that the next token
repeats, which a small random model does now and then.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import build_head
from hf_specdec.heads.medusa import MedusaHeadConfig


def copied_layer_eagle(target, draft_vocab: torch.Tensor | None = None, **config):
    """`config`: other `EagleHeadConfig` fields (`method="mtp", output_norm=True`: an MTP head of ours)."""
    hidden = target.config.hidden_size
    size = 0 if draft_vocab is None else len(draft_vocab)
    settings = dict(draft_vocab_size=size, input_norm=True, **config)
    head = build_head(EagleHeadConfig.for_target(target, **settings), target)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)  # the layer reads the token embedding only
        head.layer.load_state_dict(target.model.layers[0].state_dict())
    if draft_vocab is not None:
        head.set_draft_vocab(draft_vocab)
    return head


def identity_medusa(target, draft_vocab: torch.Tensor | None = None, heads: int = 3):
    size = 0 if draft_vocab is None else len(draft_vocab)
    head = build_head(MedusaHeadConfig.for_target(target, draft_vocab_size=size, num_heads=heads), target)
    if draft_vocab is not None:
        head.set_draft_vocab(draft_vocab)
    return head


ROOT = Path(__file__).resolve().parents[2]
# How much of the project's own docs heads train on in the tests: about 3,100 SmolLM2 tokens, over
# `train.data.MIN_TOKENS` (2,000) with room, and fixed, so that the README's length does not set the
# cost of the target's features (linear in the tokens: most of a short training run on a CPU).
CORPUS_CHARS = 10_000


def training_corpus(folder: Path) -> Path:
    """A text file of the first CORPUS_CHARS characters of the README and docs/, in `folder`."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n\n".join(page.read_text() for page in pages)[:CORPUS_CHARS])
    return corpus
