"""Where a model computes, also when accelerate split it over devices (`device_map=`).

A model loaded with a `device_map` that offloads modules to `"cpu"` or `"disk"` keeps those weights
on the `meta` device, and `model.device` (its first parameter's) can then be `meta`. Its hooks run
each module on the main device: the first accelerator in the map, else the CPU (accelerate's
`dispatch_model`). Anything placed next to the model, a draft model included, belongs there.

A module given to us already loaded (an assistant, a model's MTP layers) is not moved: where it
must run beside the target and does not, `check_placed` refuses it, naming both devices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_OFFLOADED = ("cpu", "disk", "meta")


def execution_device(model: Any) -> torch.device:
    """The device `model` computes on: `model.device`, or for a dispatched model its main device."""
    device_map = getattr(model, "hf_device_map", None) or {}
    placed = [device for device in device_map.values() if device not in _OFFLOADED]
    if placed:
        return torch.device(placed[0])
    if device_map:
        return torch.device("cpu")
    # A target that is no torch module (an exported session's wrapper) says where it runs itself.
    return module_device(model) if isinstance(model, nn.Module) else torch.device(model.device)


def module_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: its parameters' (the first one's); for a module accelerate
    offloaded (its weights on `meta` until it runs), the device its hook runs it on; `meta` for a
    module whose weights were never loaded (built on the meta device)."""
    weight = next(module.parameters())
    if weight.device.type != "meta":
        return weight.device
    from accelerate.hooks import AlignDevicesHook

    for part in module.modules():  # the hook sits on the module the device map named, or below it
        hook = getattr(part, "_hf_hook", None)  # accelerate's attribute, set by `dispatch_model`
        if isinstance(hook, AlignDevicesHook) and hook.execution_device is not None:
            return torch.device(hook.execution_device)
    return weight.device


def check_placed(module: nn.Module, device: torch.device | None, what: str, remedy: str) -> torch.device:
    """Where `module` computes (`execution_device`). ValueError, naming both devices and `remedy`, where
    that is not `device`, or (for any `device`, None included) where it holds no weights: the one
    check for a module we run as we were given it rather than move."""
    placed = execution_device(module)
    if placed.type == "meta":
        raise ValueError(
            f"{what} has no weights: its parameters are on the meta device (built with "
            "init_empty_weights or device='meta', and never loaded). Load its weights, then pass it again."
        )
    if device is not None and not _same_device(placed, device):
        raise ValueError(f"{what} is on {placed}, and must run on {device}: {remedy}")
    return placed


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` are one device; one without an index (`cuda`, as a device map may name
    it) is taken as the one of its type the other names."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def module_weight(module: Any) -> torch.Tensor:
    """`module.weight`, detached; read from accelerate's offload (CPU or disk) when the module keeps it
    on `meta` until it runs. A head that scores with the target's LM head reads it this way."""
    weight = module.weight
    if weight.device.type != "meta":
        return weight.detach()
    from accelerate.utils import align_module_device

    with align_module_device(module):
        return module.weight.detach()
