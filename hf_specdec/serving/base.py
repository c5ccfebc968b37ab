"""What the serving modules share: the engine versions we write for, the engine-neutral plan, and the
error a refusal raises."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

VLLM_VERSION = "0.34.0"
SGLANG_VERSION = "0.5.23"
VLLM_MEDUSA_LAST = "0.32"  # the last vLLM release with method="medusa"
ENGINES = {"vllm": VLLM_VERSION, "sglang": SGLANG_VERSION}
Source = str | None  # a folder or Hub repo id, when given
Options = dict[str, Any]  # SpeculativeConfig.options


class ServingExportError(ValueError):
    """What `speculative=` would run cannot be served by that engine; the message says what to use."""


@dataclass
class ServingPlan:
    """What to serve, before an engine is chosen.

    Attributes:
        method: our method name (`SpeculativeConfig.method`).
        engine_method: the engine's name for it, per engine ("vllm" -> "ngram", "sglang" -> "NGRAM").
        draft: the draft model or head the engine loads (a local folder or a Hub repo id), if any.
        head: an EAGLE-3 head module to write into the engine's layout (our own format, converted).
        measure: the `speculative=` dict whose adaptive run measures the draft length.
        target: the target, when the plan had to load it (a head is checked against it).
        ngram: (min, max) n-gram sizes, for prompt lookup.
        block: a block draft's drafts per block: the engines draft whole blocks (a shorter one is
            another draft, as its positions attend to each other), so it is the length they serve.
        caveats: what differs between our run and the engine's.
        engine_options: per engine, further keys of its speculative config (vLLM's
            `suffix_decoding_*`).
        engine_caveats: per engine, caveats that concern that engine alone.
        mtp_layers: the target's own MTP layers, where the plan drafts with them and could count them.
    """

    method: str
    engine_method: dict[str, str]
    draft: str | None = None
    head: Any = None
    measure: dict[str, Any] = field(default_factory=dict)
    target: Any = None
    ngram: tuple[int, int] | None = None
    block: int | None = None
    caveats: list[str] = field(default_factory=list)
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    engine_caveats: dict[str, list[str]] = field(default_factory=dict)
    mtp_layers: int | None = None


def not_carried(options: Options, carried: Collection[str] = ()) -> list[str]:
    """A caveat naming the drafter options, other than those a plan `carried` over, that the engines
    have no equivalent of, if any."""
    dropped = {key: value for key, value in options.items() if key not in carried}
    if not dropped:
        return []
    names = ", ".join(f"{key}={value!r}" for key, value in sorted(dropped.items()))
    return [f"Options {names} have no equivalent in vLLM or SGLang and are not carried over."]
