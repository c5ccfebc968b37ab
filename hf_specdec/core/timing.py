"""Clock reads that wait for the device: on a GPU, work is queued, and a timer that does not
synchronize measures the queueing, not the work (gpt-fast's `device_sync`)."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait until `device` has finished the work queued on it (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def clock(device: torch.device | str) -> float:
    """`time.perf_counter()` once `device` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()
