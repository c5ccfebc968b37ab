"""Device cost regimes emulated on the CPU: the model computes every token for real, so what is
accepted is real, while the clock that everyone reads (our timers, the draft-length policy, the
benchmark) advances by what a cost profile says each forward would cost on the emulated device.

`emulate(model, profile)` wraps `model.forward` (`functools.wraps`, so signature checks still see
the model's parameters) and patches `time.perf_counter`, which `hf_specdec.core.timing.clock` reads at
call time, to a host clock plus an offset; after each forward the offset moves by the profile's
cost minus what the forward took on the host clock. Host work between forwards (drafting, the
loop's own work) still counts, as it does on a GPU, where the host is part of every step's cost;
it counts at the CPU time of the calling thread (`time.thread_time`), so that other processes
sharing the machine do not move the emulated clock (on a busy 2-core machine the loop's wall time
between forwards tripled, its CPU time did not). Padding with sleep would be the alternative, but
it fails where the CPU is slower than the emulated device (an fp32 forward on a 2-core CPU takes
longer than a GPU step).

Every forward is also recorded (`Forward`), so a run whose decisions do not read the clock (plain
`generate`, fixed draft lengths, transformers' prompt lookup) can be priced under any profile
afterwards without running it again (`priced`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.timing import clock


@dataclass(frozen=True)
class Forward:
    """One target forward: `batch` rows feeding `width` tokens each after `past` cached positions,
    and what it took on the wall clock and on the host clock (`host_clock`)."""

    batch: int
    width: int
    past: int
    wall_seconds: float = 0.0
    host_seconds: float = 0.0

    @property
    def prefill(self) -> bool:
        """A prompt's forward (nothing cached, more than one token): its shape is new with every
        prompt, and it pays no one-off (`CostProfile.seconds`)."""
        return self.past == 0 and self.width > 1


host_clock = time.thread_time  # what host work is counted in under an emulated profile


@dataclass(frozen=True)
class CostProfile:
    """What a forward costs on an emulated device, in seconds.

    A forward that feeds `n = batch * width` tokens costs `step * (1 + per_token * (n - 1))` while
    `n <= knee` (memory- or launch-bound: the weights are read once whatever the tokens), and grows
    in proportion to `n` beyond the knee (compute-bound); or, where `curve` is given, `step` times
    the cost it lists for `n` tokens (interpolated between its points, beyond the last one along
    its last segment): a measured curve of any shape. A prefill (nothing cached yet) is priced
    by the same rule over the prompt's tokens, with its own `prefill_per_token` (GPUs run a
    prompt's tokens as one large, efficient matmul). `oneoff` steps are added the first time a call
    feeds a (batch, width) shape: what a GPU's first call at a new shape can pay (kernel selection,
    allocator growth, graph capture; prefills, whose shape changes with every prompt, are left
    out): once per process (`oneoff_scope="process"`, as kernels and
    graphs stay cached), or, harsher, once per `generate` call (`"call"`). The real profile
    (`REAL`) has no costs: the clock is the machine's own.
    """

    name: str
    step: float = 0.020  # a plain batch-1 decoding step, seconds
    per_token: float = 0.01
    knee: int = 1 << 30
    prefill_per_token: float = 1 / 256
    oneoff: float = 0.0  # in steps
    oneoff_scope: str = "process"  # or "call"
    # A shared machine's jitter: each decoding forward's cost times exp(noise * z), z ~ N(0, 1) drawn
    # from the caller's seeded generator (median 1; at 0.3 one forward in six is 35% dearer or more).
    noise: float = 0.0
    # A machine whose speed wanders (another process starting and stopping): each decoding forward's
    # cost times exp(drift * level), where the level drifts from forward to forward (`Jitter.drift`:
    # a random walk pulled back to 0, correlated over about 50 forwards, standard deviation 1), so
    # forwards timed a second apart may differ by half and those timed together hardly at all.
    drift: float = 0.0
    # (tokens, cost in steps) points, tokens increasing from (1, 1.0): replaces per_token and knee.
    curve: tuple[tuple[int, float], ...] = ()
    description: str = ""

    @property
    def emulated(self) -> bool:
        return self.name != "real"

    def seconds(self, forward: Forward, first_of_shape: bool = False, rng: Jitter | None = None) -> float:
        n = forward.batch * forward.width
        if forward.prefill:
            return self.step * (1 + self.prefill_per_token * (n - 1))
        if self.curve:
            cost = self.step * _along(self.curve, n)
        else:
            cost = self.step * (1 + self.per_token * (min(n, self.knee) - 1)) * max(1.0, n / self.knee)
        if self.noise and rng is not None:
            cost *= math.exp(self.noise * rng.gauss(0.0, 1.0))
        if self.drift and rng is not None:
            cost *= math.exp(self.drift * rng.drift())
        return cost + (self.oneoff_seconds if first_of_shape else 0.0)

    @property
    def oneoff_seconds(self) -> float:
        """What a forward at a shape new to the process (or call: `oneoff_scope`) costs on top."""
        return self.step * self.oneoff

    def with_step(self, step: float) -> CostProfile:
        return CostProfile(**{**self.__dict__, "step": step})


class Jitter(random.Random):
    """The seeded source of a profile's noise, holding the level its drift has reached."""

    PERSISTENCE = 0.98  # per forward: the level's correlation decays over ~1 / (1 - 0.98) = 50 forwards

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.level = 0.0

    def drift(self) -> float:
        """The level at the next forward: an AR(1) walk whose stationary deviation is 1."""
        p = self.PERSISTENCE
        self.level = p * self.level + math.sqrt(1 - p * p) * self.gauss(0.0, 1.0)
        return self.level


def _along(curve: tuple[tuple[int, float], ...], n: int) -> float:
    """The cost `curve` lists for `n` tokens: interpolated between its points, extrapolated along
    its last segment beyond them."""
    (n0, c0), (n1, c1) = curve[0], curve[1]
    for (a, ca), (b, cb) in itertools.pairwise(curve):
        (n0, c0), (n1, c1) = (a, ca), (b, cb)
        if n <= b:
            break
    return c0 + (c1 - c0) * (n - n0) / (n1 - n0)


# fp32 SmolLM2-135M at batch 1 on a 2-core AMD EPYC with AVX2 only (no native bf16), torch 2.13's
# MKL, ~100-400 cached tokens: cost of a forward of n tokens in plain steps, from
# `python benchmarks/micro/batch_costs.py --dtype float32 --batch 1 --widths ...` (two runs,
# open and grounded prompts, averaged and rounded). A few rows run far less efficiently than one,
# so the first extra token costs about half a step and each later one less.
SMALL_GEMM_CURVE = (
    (1, 1.0), (2, 1.47), (3, 1.73), (4, 1.95), (5, 2.05),
    (8, 2.4), (11, 2.5), (16, 2.8), (24, 3.3), (32, 3.8),
)  # fmt: skip

# bf16 SmolLM2-135M at batch 1 on a 2-core AMD EPYC with native bf16 (avx512_bf16, no amx), torch
# 2.13: `python benchmarks/micro/batch_costs.py --kind open|grounded --batch 1 --rounds 15 --widths
# 1,2,3,4,5,8,11,16,24,32` (40 and 367 cached tokens), the two runs averaged and rounded. Nearly
# flat up to 4 tokens, then in steps (the matrix kernels' blocks), a third of a step dearer at 16.
BF16_CPU_CURVE = (
    (1, 1.0), (2, 1.0), (3, 1.03), (4, 1.03), (5, 1.15),
    (8, 1.16), (11, 1.28), (16, 1.33), (24, 1.55), (32, 1.69),
)  # fmt: skip

PROFILES: dict[str, CostProfile] = {
    profile.name: profile
    for profile in (
        CostProfile(
            "flat",
            per_token=0.01,
            description="memory- or launch-bound decoding (a GPU at batch 1): +1% of a step per extra token",
        ),
        CostProfile(
            "flat+oneoff",
            per_token=0.01,
            oneoff=6.0,
            description="flat, plus six steps the first time the process feeds each (batch, width) shape",
        ),
        CostProfile(
            "flat+oneoff-call",
            per_token=0.01,
            oneoff=6.0,
            oneoff_scope="call",
            description="flat, plus six steps the first time each call feeds each (batch, width) shape",
        ),
        CostProfile(
            "flat+noise",
            per_token=0.01,
            noise=0.3,
            description="flat on a shared, noisy machine: each forward x a log-normal jitter (σ 0.3)",
        ),
        CostProfile(
            "gpu-batch",
            per_token=0.004,
            knee=128,
            description=(
                "a roofline for a GPU serving a batch: +0.4% of a step per token fed in total (the "
                "weights are read once per forward, the KV reads and launches grow slowly) up to 128 "
                "tokens per forward, then in proportion to the tokens (compute-bound: an H100's 990 "
                "bf16 TFLOP/s over 3.35 TB/s is ~300 flop per byte read, ~150 tokens per forward "
                "for 2 flop per 2-byte weight)"
            ),
        ),
        CostProfile(
            "linear",
            per_token=0.6,
            prefill_per_token=0.6 / 24,
            description="compute-bound (big batches; fp32 on a CPU): each fed token costs 60% of a step",
        ),
        CostProfile(
            "linear+noise",
            per_token=0.6,
            prefill_per_token=0.6 / 24,
            noise=0.3,
            description="linear on a shared, noisy machine: each forward x a log-normal jitter (σ 0.3)",
        ),
        CostProfile(
            "concave",
            curve=SMALL_GEMM_CURVE,
            prefill_per_token=0.6 / 24,
            description=(
                "a CPU whose matrix products run a few rows far less efficiently than one (fp32 "
                "SmolLM2 on an AVX2-only EPYC, measured): a second token costs half a step, each "
                "later one less (16 tokens 2.8 steps)"
            ),
        ),
        CostProfile(
            "concave+noise",
            curve=SMALL_GEMM_CURVE,
            prefill_per_token=0.6 / 24,
            noise=0.3,
            description="concave on a shared, noisy machine: each forward x a log-normal jitter (σ 0.3)",
        ),
        CostProfile(
            "bf16-cpu",
            curve=BF16_CPU_CURVE,
            step=0.065,  # its plain step (60-71 ms), as the drafting and host time are real
            prefill_per_token=0.016,  # measured alike: 40 tokens 1.6 steps, 367 tokens 6.9
            description=(
                "bf16 SmolLM2 on a CPU with native bf16 (a 2-core EPYC with avx512_bf16, measured): "
                "nearly flat to 4 tokens, 16 tokens 1.33 steps; the real clock's costs without its noise"
            ),
        ),
        CostProfile(
            "flat+drift",
            per_token=0.01,
            drift=0.3,
            description="flat on a machine whose speed wanders: x a level drifting over ~50 forwards (σ 0.3)",
        ),
        CostProfile(
            "bf16-cpu+drift",
            curve=BF16_CPU_CURVE,
            step=0.065,
            prefill_per_token=0.016,
            drift=0.3,
            description="bf16-cpu on a machine whose speed wanders (σ 0.3, over ~50 forwards)",
        ),
        CostProfile("real", description="the machine as it is: the real clock, nothing emulated"),
    )
}
REAL = PROFILES["real"]


@dataclass
class Emulation:
    """The state of one emulated device: the clock's offset, the forwards of the current call, and
    the shapes already paid for (shared with other emulations of the same process: `emulate(shapes=)`)."""

    profile: CostProfile
    offset: float = 0.0
    forwards: list[Forward] = field(default_factory=list)
    shapes: set[tuple[int, int]] = field(default_factory=set)
    rng: Jitter = field(default_factory=Jitter)  # the profile's noise, seeded

    def new_call(self) -> None:
        """Start a `generate` call: forget its forwards (and, per call, the shapes seen)."""
        self.forwards = []
        if self.profile.oneoff_scope == "call":
            self.shapes.clear()

    def record(self, forward: Forward) -> None:
        self.forwards.append(forward)
        if self.profile.emulated:
            self.offset += _cost(self.profile, forward, self.shapes, self.rng) - forward.host_seconds


def _cost(
    profile: CostProfile, forward: Forward, shapes: set[tuple[int, int]], rng: Jitter | None = None
) -> float:
    shape = (forward.batch, forward.width)
    first = shape not in shapes
    shapes.add(shape)
    return profile.seconds(forward, first, rng)


_real_perf_counter = time.perf_counter


@contextlib.contextmanager
def emulate(
    model: Any, profile: CostProfile = REAL, shapes: set[tuple[int, int]] | None = None
) -> Iterator[Emulation]:
    """Run `model` as if on the device `profile` describes (see the module docstring); with `REAL`
    the clock stays the machine's and forwards are only recorded. `shapes`: those the emulated
    device has already paid its one-off cost for (updated in place)."""
    state = Emulation(profile, shapes=shapes if shapes is not None else set())
    own = vars(model).get("forward")  # a forward set on the instance (e.g. compiled) is put back
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
        wall, host = _real_perf_counter(), host_clock()
        out = original(*args, **kwargs)
        forward = Forward(ids.shape[0], ids.shape[1], past, _real_perf_counter() - wall, host_clock() - host)
        state.record(forward)
        return out

    model.forward = forward
    if profile.emulated:
        time.perf_counter = lambda: host_clock() + state.offset
    try:
        yield state
    finally:
        time.perf_counter = _real_perf_counter
        if own is None:
            del model.forward  # the class's own forward again
        else:
            model.forward = own


def timed_generate(
    model: Any, profile: CostProfile = REAL, shapes: set[tuple[int, int]] | None = None, **kwargs: Any
) -> tuple[float, float, float, list[Forward], Any]:
    """One `model.generate(**kwargs)` call under `profile` (`emulate`): (seconds on its clock, wall
    seconds, host-clock seconds, the forwards it ran, its output)."""
    with emulate(model, profile, shapes) as device:
        device.new_call()
        wall, host = _real_perf_counter(), host_clock()
        start = clock(model.device)  # the clock `profile` moves, when it is emulated
        out = model.generate(**kwargs)
        seconds = clock(model.device) - start
        wall, host = _real_perf_counter() - wall, host_clock() - host
    return seconds, wall, host, device.forwards, out


def priced(
    wall_seconds: float,
    host_seconds: float,
    forwards: list[Forward],
    profile: CostProfile,
    shapes: set[tuple[int, int]] | None = None,
) -> float:
    """What a call that took `wall_seconds` (`host_seconds` on the host clock) and ran `forwards`
    would have taken under `profile`, for calls whose decisions never read the clock. `shapes` as
    for `emulate` (per-call profiles start from none)."""
    if not profile.emulated:
        return wall_seconds
    if shapes is None or profile.oneoff_scope == "call":
        shapes = set()
    rng = Jitter(0)
    return host_seconds + sum(_cost(profile, f, shapes, rng) - f.host_seconds for f in forwards)


__all__ = [
    "PROFILES",
    "REAL",
    "CostProfile",
    "Emulation",
    "Forward",
    "Jitter",
    "emulate",
    "host_clock",
    "priced",
]
