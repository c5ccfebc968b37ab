"""Where a model computes, also when accelerate split it over devices (`device_map=`).

A model loaded with a `device_map` that offloads modules to `"cpu"` or `"disk"` keeps those weights
on the `meta` device, and `model.device` (its first parameter's) can then be `meta`. Its hooks run
each module on the main device: the first accelerator in the map, else the CPU (accelerate's
`dispatch_model`). Anything placed next to the model, a draft model included, belongs there.
"""

from __future__ import annotations

from typing import Any

import torch

_OFFLOADED = ("cpu", "disk", "meta")


def execution_device(model: Any) -> torch.device:
    """The device `model` computes on: `model.device`, or for a dispatched model its main device."""
    device_map = getattr(model, "hf_device_map", None) or {}
    placed = [device for device in device_map.values() if device not in _OFFLOADED]
    if placed:
        return torch.device(placed[0])
    if device_map:
        return torch.device("cpu")
    return model.device


def module_weight(module: Any) -> torch.Tensor:
    """`module.weight`, detached; read from accelerate's offload (CPU or disk) when the module keeps it
    on `meta` until it runs. A head that scores with the target's LM head reads it this way."""
    weight = module.weight
    if weight.device.type != "meta":
        return weight.detach()
    from accelerate.utils import align_module_device

    with align_module_device(module):
        return module.weight.detach()
