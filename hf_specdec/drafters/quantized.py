"""Self-drafting: an int8 ONNX copy of the target itself (`method="quantized"`), weights in blocks
of 32, built once into the cache (`ort.cache.quantized_copy`) and drafted with as `onnx` does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch.onnx import OnnxExporterError

from ..core.devices import execution_device
from ..ort.cache import quantized_copy
from .base import options_to_config
from .onnx import OnnxDrafter, load_decoder
from .registry import register_drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


@register_drafter
class QuantizedDrafter(OnnxDrafter):
    """Drafts with an int8 ONNX copy of the target, exported on first use."""

    name: ClassVar[str] = "quantized"
    takes_draft: ClassVar[bool] = False  # an int8 copy of the target, exported here

    @classmethod
    def from_config(
        cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any
    ) -> QuantizedDrafter:
        options = options_to_config(cls.options_class, config.options)
        try:
            folder = quantized_copy(target, tokenizer)
        except OnnxExporterError as err:
            raise ValueError(
                f"method='quantized' drafts with an int8 ONNX copy of the target, and torch.onnx could not "
                f"export {type(target).__name__} (the error above; weights already quantized, as by "
                "optimum-quanto, may use operators ONNX lacks). Use another method (speculative=True, "
                "'ngram', or a draft model), or load the target unquantized for method='quantized'."
            ) from err
        decoder = load_decoder(folder, options, target)
        return cls(decoder, options.min_confidence, execution_device(target), options.tree_top_k)
