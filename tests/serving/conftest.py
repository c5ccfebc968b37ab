"""What the serving tests share: tiny offline targets, drafts and heads saved as folders, and the
export cases the golden files and the engine checks run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import build_head, save_head
from hf_specdec.heads.medusa import MedusaHeadConfig
from hf_specdec.serving import export_serving

from ..conftest import tiny_llama
from ..helpers import assistant, mtp
from ..helpers.tokenizers import word_level


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Targets, drafts and heads saved as folders, as a user would pass them."""
    root = tmp_path_factory.mktemp("models")
    tiny_llama(0).save_pretrained(root / "target")
    tiny_llama(1).save_pretrained(root / "draft")
    tiny_llama(2, vocab_size=96).save_pretrained(root / "draft-vocab96")
    # Two tokenizers of the same size whose ids mean other words: a pair only generate can draft with.
    words = [f"w{i}" for i in range(64)]
    tiny_llama(0).save_pretrained(root / "target-words")
    word_level(words).save_pretrained(root / "target-words")
    tiny_llama(1).save_pretrained(root / "draft-other-words")
    word_level(words[:1] + words[:0:-1]).save_pretrained(root / "draft-other-words")
    tiny_llama(1).save_pretrained(root / "draft-broken-tokenizer")  # its tokenizer.json cut short
    word_level(words).save_pretrained(root / "draft-broken-tokenizer")
    broken = root / "draft-broken-tokenizer" / "tokenizer.json"
    broken.write_bytes(broken.read_bytes()[:40])
    target8 = tiny_llama(0, layers=8)
    target8.save_pretrained(root / "target8")
    torch.manual_seed(5)
    eagle3 = EagleHeadConfig.for_target(
        target8, variant="eagle3", feature_layers=[1, 3, 6], draft_vocab_size=40
    )
    save_head(build_head(eagle3, target8), root / "head-eagle3")
    target = tiny_llama(0)
    save_head(build_head(EagleHeadConfig.for_target(target, input_norms=True), target), root / "head-ours")
    save_head(build_head(MedusaHeadConfig.for_target(target, num_heads=2), target), root / "head-medusa")
    onnx = root / "draft-onnx"  # an export-onnx folder: config, no PyTorch weights
    onnx.mkdir()
    (onnx / "model.onnx").write_bytes(b"")
    config = json.loads((root / "draft" / "config.json").read_text())
    (onnx / "config.json").write_text(json.dumps({**config, "_name_or_path": str(root / "draft")}))
    mtp.checkpoint(root / "mtp-target")  # DeepSeek-V3's layout, its MTP layer as layer 61
    target4, helper = assistant.pair()
    target4.save_pretrained(root / "gemma4-target")
    helper.save_pretrained(root / "gemma4-assistant")
    return root


CASES = {
    "ngram": lambda m: dict(model=m / "target", method="ngram", options={"max_ngram": 3}),
    "draft_model": lambda m: dict(model=m / "target", method="draft_model", draft=m / "draft"),
    "eagle3-head": lambda m: dict(model=m / "target8", head=m / "head-eagle3"),
    "onnx": lambda m: dict(model=m / "target", method="onnx", draft=m / "draft-onnx"),
    "mtp": lambda m: dict(model=m / "mtp-target", method="mtp"),
    "assistant": lambda m: dict(model=m / "gemma4-target", method="assistant", draft=m / "gemma4-assistant"),
}


def export_case(models: Path, out: Path, engine: str, case: str, k: int = 3) -> dict:
    kwargs = {key: str(v) if isinstance(v, Path) else v for key, v in CASES[case](models).items()}
    return export_serving(engine=engine, num_draft_tokens=k, out=out, **kwargs)
