"""What identifies a model's weights, for the caches built from a model object (int8 ONNX copies,
`train-draft`'s data): a digest read from the weights themselves, since a model object may carry no
id, and one with an id may have been fine-tuned in place since it was loaded."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Fingerprints by model object, with the `weights_state` they were read at: reading every weight
# costs a device sync and an fp32 copy per tensor, which one model should pay once, not on every
# `generate` call, nor miss when the model is fine-tuned in place.
_FINGERPRINTS: weakref.WeakKeyDictionary[Any, tuple[tuple, str]] = weakref.WeakKeyDictionary()


def weights_fingerprint(model: PreTrainedModel) -> str:
    """Identifies a model's weights: read on first use, and read again only once a weight changed
    in place (an optimizer step, `load_state_dict`) or was replaced since. The adapters each
    adapter layer applies are part of it (`adapter_state`)."""
    state = weights_state(model)
    known = _FINGERPRINTS.get(model)
    if known is None or known[0] != state:
        _FINGERPRINTS[model] = (state, _read_fingerprint(model))
    return _FINGERPRINTS[model][1]


def weights_state(model: PreTrainedModel) -> tuple:
    """Where each weight lives and its version counter, which every in-place write bumps: tells a
    changed weight apart without reading any."""
    return adapter_state(model) + tuple(
        (t.data_ptr(), t._version)
        for weight in model.state_dict().values()
        for _, t in _plain_tensors(weight)
    )


def adapter_state(model: PreTrainedModel) -> tuple:
    """Which adapters each adapter layer applies, and at what scale (PEFT's tuner layers, told by
    their `active_adapters` and boolean `disable_adapters`; LoRA's `scaling`): every adapter's
    weights are in the state dict whichever is active, so `set_adapter`, `disable_adapter()` and
    `set_scale` change what the model computes without changing a tensor."""
    return tuple(
        (name, tuple(module.active_adapters), module.disable_adapters, repr(getattr(module, "scaling", None)))
        for name, module in model.named_modules()
        if isinstance(getattr(module, "disable_adapters", None), bool) and hasattr(module, "active_adapters")
    )


def clear_fingerprints() -> None:
    """Forget the fingerprints read so far: the next `weights_fingerprint` of a model reads its
    weights again."""
    _FINGERPRINTS.clear()


def _read_fingerprint(model: PreTrainedModel) -> str:
    """A sum and a few values of every tensor, with its name and shape.

    Not the config: `generate` writes into it (attention implementation, cache flags), which must
    not trigger a rebuild.
    """
    digest = hashlib.sha256(type(model).__name__.encode())
    adapters = adapter_state(model)
    if adapters:  # a model without adapters keeps the fingerprint (and the cached copies) it had
        digest.update(repr(adapters).encode())
    dtype = str(model.dtype).removeprefix("torch.")
    with torch.no_grad():
        for name, weight in model.state_dict().items():
            for part, p in _plain_tensors(weight):
                flat = p.detach().flatten()
                summary = torch.cat([flat[:8].float().cpu(), flat.float().sum().cpu()[None]])
                digest.update(f"{name}{part}{tuple(p.shape)}".encode() + summary.numpy().tobytes())
    return f"{dtype}:{digest.hexdigest()}"


def _plain_tensors(tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain tensors that hold a weight's values, each with its path inside it ("" for a plain
    tensor): a quantized weight such as torchao's `Int8Tensor` is a wrapper subclass whose int8 data
    and scales sit in inner tensors, and it refuses the views (`flatten`) read from a plain one."""
    if not is_traceable_wrapper_subclass(tensor):
        yield "", tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        for part, inner in _plain_tensors(getattr(tensor, name)):
            yield f".{name}{part}", inner
