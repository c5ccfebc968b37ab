"""What hf-specdec keeps loaded between `generate` calls, and `clear_cache()`, which frees it."""

from __future__ import annotations

import gc

import torch

from .core.policy import DEVICE_COSTS
from .drafters import draft_model, mtp, suffix
from .hub.tokenizer_check import clear_checks
from .ort import session
from .selection.select import clear_failed_searches
from .store.fingerprint import clear_fingerprints


def clear_cache() -> None:
    """Free everything hf-specdec keeps between `generate` calls so as not to load it again.

    That is the last draft model loaded by name or folder (`draft=` a path or Hub id, or chosen by
    `method="auto"`), the MTP layers read out of a target's checkpoint (`method="mtp"`) or why they
    did not load, with the safetensors headers read for them, the ONNX Runtime sessions of `onnx` /
    `quantized` drafts with their device buffers, tokenizers read from a target's folder,
    remembered tokenizer comparisons and weight fingerprints, what verifying cost on each model in
    earlier calls (`DEVICE_COSTS`, which the next call's draft-length policy would start from),
    each model's `suffix` corpus of earlier prompts and outputs, and the Hub searches that failed
    (each asked again a minute later, or at once after this). Once nothing else refers to them,
    their memory is released, and the CUDA caching allocator's unused blocks go back to the GPU
    (`torch.cuda.empty_cache()`, when CUDA is in use).
    The next call that needs one loads it again.
    """
    draft_model.clear_loaded()
    mtp.clear_loaded()
    session.clear_loaded()
    clear_fingerprints()
    clear_checks()
    DEVICE_COSTS.clear()
    suffix.clear_corpora()
    clear_failed_searches()
    gc.collect()  # models caught in reference cycles go now, not at some later collection
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


__all__ = ["clear_cache"]
