"""A draft model run by ONNX Runtime from an exported folder (`method="onnx"`).

Drafting is `decoder.DecoderDrafter`'s, token for token, as for `draft_model`; only the decoder
differs: an ONNX Runtime session with its KV cache in IO-bound buffers (`hf_specdec.ort`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..config import GREEDY_CHAINS_AND_TREES, TREES, read_when
from ..core.devices import execution_device
from ..core.fields import check_fields
from ..ort.session import PROVIDERS, OnnxDecoder
from .base import options_to_config
from .decoder import DecoderDrafter
from .draft_model import check_compatible, local_tokenizer
from .registry import register_drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


@dataclass
class OnnxDraftConfig:
    """Settings of the `onnx` and `quantized` drafters.

    Args:
        provider: "auto" (CUDA on the target's GPU when the target is on one and onnxruntime-gpu
            has it, else CPU), "cpu" or "cuda". CUDA without a GPU falls back to CPU with a warning.
            A CPU session drafts for a GPU target too: its logits move to the target's device.
        threads: ONNX Runtime intra-op threads on CPU; 0: as many as torch uses
            (`torch.get_num_threads()`), since draft and target take turns on the same cores.
        min_confidence: as for `draft_model`: stop a greedy draft once its confidence drops below.
        tokenizer_verified: skip the tokenizer / vocabulary check.
        tree_top_k: as for `draft_model`: with `SpeculativeConfig(tree=...)`, the children drafted
            per expanded node and the nodes expanded per level.
    """

    provider: str = "auto"
    threads: int = 0
    min_confidence: float = read_when(GREEDY_CHAINS_AND_TREES, 0.0)
    tokenizer_verified: bool = False
    tree_top_k: int = read_when(TREES, 4)

    def __post_init__(self) -> None:
        check_fields(
            self,
            ranges={"threads": (0, None), "min_confidence": (0, 1), "tree_top_k": (1, None)},
            choices={"provider": PROVIDERS},
        )


@register_drafter
class OnnxDrafter(DecoderDrafter):
    """Drafts with an exported decoder folder through ONNX Runtime (`draft=FOLDER`)."""

    name: ClassVar[str] = "onnx"
    supports_sampling: ClassVar[bool] = True
    # Top-k branching as for `draft_model`: under our exports' `tree_attention_mask`, and for graphs
    # without it (the Hub's) each node in a batch row of its own (`decoder.BranchRows`).
    supports_tree: ClassVar[bool] = True
    options_class: ClassVar[type] = OnnxDraftConfig

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> OnnxDrafter:
        if not isinstance(config.draft, (str, Path)):
            raise ValueError(
                f"method={cls.name!r} needs draft= a folder exported with `hf-specdec export-onnx` "
                "(holding model.onnx or onnx/model.onnx)."
            )
        options = options_to_config(cls.options_class, config.options)
        decoder = load_decoder(config.draft, options, target)
        if not options.tokenizer_verified:
            draft_tokenizer = config.draft_tokenizer or decoder.tokenizer
            if tokenizer is None and draft_tokenizer is not None:  # as draft_model: the target's folder's
                tokenizer = local_tokenizer(target)
            check_compatible(target, tokenizer, decoder, draft_tokenizer)
        return cls(decoder, options.min_confidence, execution_device(target), options.tree_top_k)


def load_decoder(folder: str | Path, options: OnnxDraftConfig, target: PreTrainedModel) -> OnnxDecoder:
    """The session of `folder`'s decoder, on the target's own GPU unless `options` say otherwise."""
    return OnnxDecoder.load(folder, options.provider, options.threads, target_device=execution_device(target))
