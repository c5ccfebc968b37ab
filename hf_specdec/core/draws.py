"""The random numbers plain `generate` samples each token with, drawn by position.

Plain sampling picks token t of every row as `torch.multinomial(p_t, 1)`: `argmax(p_t / E_t)` with
E_t ~ Exp(1) of shape [batch, vocab], the t-th such draw from the device's default generator
(Gumbel-max; PyTorch's one-sample path). A draft chosen without draws (n-gram, suffix, any tree)
needs no other randomness to be verified: the target's token at each fed position is that argmax,
the draft holds while it matches (each token accepted with probability p_t(x), as rejection sampling
of a certain draft accepts it), and the first mismatch is the target's own token. Taken by position,
not by step, the draws are the ones plain takes whatever the draft lengths: a seeded call samples
what plain samples (rounding near-ties of p aside) and leaves the generator where plain leaves it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from transformers import initialization as transformers_init

# Draws kept at once, at most so many positions and bytes (each position is batch x vocab floats:
# 39 MB at batch 64 and 152k ids); one let go is drawn again from its generator state when a row that
# fell behind needs it.
KEPT_POSITIONS, KEPT_BYTES = 32, 256 * 2**20


def default_generator(device: torch.device) -> torch.Generator | None:
    """The generator `torch.multinomial` draws from on `device` (None where not known here)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
    return None


class PlainDraws:
    """E_t for each position t of a call's rows, as plain decoding of this `batch` would draw them
    from the device's default generator, which is left where plain leaves it (`finish`, which the
    loop calls whether the call ends or raises)."""

    def __init__(self, batch: int, prompt_width: int, default: torch.Generator) -> None:
        self.batch, self.prompt_width, self.default = batch, prompt_width, default
        self.generator = torch.Generator(device=default.device)
        self.generator.set_state(default.get_state())
        # states[t]: the generator's before E_t was drawn (None once every row is past t).
        self.states: list[torch.Tensor | None] = []
        self.released = 0  # states[:released] are all None: let go of by an earlier step
        self.noise: dict[int, torch.Tensor] = {}  # t -> E_t [batch, vocab], positions in flight
        self.vocab = 0
        # A draft model sampling its drafts draws from the default generator: not these numbers.
        digest = hashlib.blake2b(default.get_state().cpu().numpy().tobytes(), digest_size=8).digest()
        default.manual_seed(int.from_bytes(digest, "little") >> 1)

    def picks(self, rows: list[int], positions: list[list[int]], probs: torch.Tensor) -> torch.Tensor:
        """The token plain sampling picks from `probs` [B, n, V] of row `rows[b]` at the step
        `positions[b][j]` (tokens generated before it), [B, n]."""
        self.vocab = probs.shape[-1]
        slowest = min(ts[0] for ts in positions)  # no row needs a position before its next token again
        for t in [t for t in self.noise if t < slowest]:
            del self.noise[t]
        # Only the positions passed since the last step: all of them again would cost every step
        # as much as the tokens generated so far.
        end = min(slowest, len(self.states))
        if end > self.released:
            self.states[self.released : end] = [None] * (end - self.released)
            self.released = end
        noise = torch.empty_like(probs)
        by_position: dict[int, list[tuple[int, int]]] = {}
        for b, ts in enumerate(positions):
            for j, t in enumerate(ts):
                by_position.setdefault(t, []).append((b, j))
        for t, places in sorted(by_position.items()):
            bs, js = zip(*places)
            noise[list(bs), list(js)] = self._noise(t)[[rows[b] for b in bs]]  # one copy a position
        return (probs / noise).argmax(dim=-1)

    def step(self, lengths: list[int]) -> list[int]:
        """Each row's next position: tokens generated so far, from its sequence's `lengths`."""
        return [n - self.prompt_width for n in lengths]

    def finish(self, generated: int) -> None:
        """The call generated `generated` positions (its longest row's): leave the default generator
        after as many draws, where plain decoding leaves it."""
        while len(self.states) < generated:
            self._noise(len(self.states))
        state = self.states[generated] if generated < len(self.states) else self.generator.get_state()
        self.default.set_state(state)

    def _noise(self, t: int) -> torch.Tensor:
        if t not in self.noise:
            while len(self.states) <= t:  # in order, as plain draws them
                self.states.append(self.generator.get_state())
                self._keep(len(self.states) - 1, self._draw(self.generator))
            if t not in self.noise:  # let go earlier: the same numbers again from its state
                again = torch.Generator(device=self.generator.device)
                again.set_state(self.states[t])
                self._keep(t, self._draw(again))
        return self.noise[t]

    def _keep(self, t: int, drawn: torch.Tensor) -> None:
        """Keep E_t, letting the earliest kept go past `KEPT_POSITIONS` or `KEPT_BYTES`."""
        kept = max(1, min(KEPT_POSITIONS, KEPT_BYTES // drawn.nbytes))
        while len(self.noise) >= kept:
            del self.noise[min(self.noise)]
        self.noise[t] = drawn

    def _draw(self, generator: torch.Generator) -> torch.Tensor:
        return plain_draw(generator, self.batch, self.vocab)


def plain_draw(generator: torch.Generator, batch: int, vocab: int) -> torch.Tensor:
    """E_t [batch, vocab], the next of plain sampling's draws from `generator`: `torch.multinomial`
    over fp32 probabilities takes argmax(p / E) with E ~ Exp(1) of this shape."""
    return torch.empty(batch, vocab, device=generator.device, dtype=torch.float32).exponential_(
        generator=generator
    )


# `torch.nn.init`'s functions that dispatch to torch function modes themselves.
_INIT_DRAWS = ("uniform_", "normal_", "kaiming_uniform_")
# What draws from a default generator unless given `generator=`. A torch function mode sees no call
# made inside one it intercepts: `torch.nn.init`'s that dispatch to modes themselves are listed too,
# and transformers' guarded copies of them, which transformers puts in `torch.nn.init`'s place while
# it initialises a model's weights (`guard_torch_init_functions`): torch's then dispatch as those.
_DRAWS = frozenset(
    [
        *(getattr(torch.nn.init, name) for name in _INIT_DRAWS),
        *(getattr(transformers_init, name) for name in _INIT_DRAWS),
        *(getattr(torch.Tensor, name) for name in ("uniform_", "normal_", "bernoulli_", "random_")),
        *(getattr(torch.Tensor, name) for name in ("exponential_", "geometric_", "log_normal_", "cauchy_")),
        torch.Tensor.bernoulli,
        torch.Tensor.multinomial,
        *(getattr(torch, name) for name in ("rand", "randn", "randint", "randperm", "normal", "poisson")),
        *(
            getattr(torch, name)
            for name in ("rand_like", "randn_like", "randint_like", "bernoulli", "multinomial")
        ),
    ]
)


class PrivateDraws(TorchFunctionMode):
    """While on, this thread's draws from torch's default generators (CPU, CUDA) come from private
    copies of them, made as the first draw on each device needs one: the defaults are read, never
    moved. Building a drafter can initialise modules before their weights load; a seeded sample, on
    this thread or any other, must not see it. Saving and restoring the defaults around the build
    (`torch.random.fork_rng`) would rewind what another thread drew from them meanwhile, and
    replace a seed it set. Torch function modes are per thread: other threads draw as before."""

    def __init__(self) -> None:
        super().__init__()
        self.generators: dict[torch.Generator, torch.Generator] = {}  # a default's private copy

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _DRAWS and kwargs.get("generator") is None:
            generator = self._private(_drawn_on(args, kwargs))
            if generator is not None:
                kwargs["generator"] = generator
        return func(*args, **kwargs)

    def _private(self, device: torch.device) -> torch.Generator | None:
        """This device's private generator, starting where its default stands (None: a device whose
        default is not known here, drawn on as before)."""
        default = default_generator(device)
        if default is None:
            return None
        if default not in self.generators:  # keyed by the default: "cuda" and "cuda:0" share it
            self.generators[default] = torch.Generator(device=default.device)
            self.generators[default].set_state(default.get_state())
        return self.generators[default]


def _drawn_on(args: tuple, kwargs: dict) -> torch.device:
    """The device a random function fills: its `device=`, else its first tensor's (`torch.nn.init`
    passes it by name, as `tensor=`), else the default."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    tensor = next((arg for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor)), None)
    return tensor.device if tensor is not None else torch.get_default_device()
