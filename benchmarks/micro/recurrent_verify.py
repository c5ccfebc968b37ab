"""What a verify forward of k tokens costs on a model with linear-attention layers (see `kv.RaggedKV`).

    python benchmarks/micro/recurrent_verify.py [--context 512] [--widths 1,2,4,8,16] [--dtype bfloat16]

A random model with SmolLM2-135M's width and vocabulary (hidden 576, 24 layers, vocabulary 49152)
in Qwen3.5's layer pattern (three gated delta-net layers to one full-attention layer), over a cache
filled with `--context` tokens; each forward of `width` tokens is timed, then undone, interleaved,
median of `--repeats`:

- hybrid, recording (what `speculative=` runs): the cache records the recurrent state after every
  token fed (`activate_past_recording`), so that a rejection can be rolled back; transformers then
  feeds those tokens through the one-token recurrence, one after another. Undone by `crop`;
- hybrid, not recording (what a verify would cost if states needed no rollback: the chunked
  kernel over all tokens at once); undone by restoring a copy of the cache, untimed;
- the same shape with full attention on every layer, undone by `crop`, for scale.

Each row's cost is also given over its one-token forward: speculation pays only where a forward of
k + 1 tokens costs much less than k + 1 one-token forwards.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from hf_specdec.core.kv import EVERY_TOKEN
from hf_specdec.core.timing import clock


def model(hybrid: bool, dtype: torch.dtype) -> Qwen3_5ForCausalLM:
    layers = 24
    linear = [hybrid and (i + 1) % 4 != 0 for i in range(layers)]
    types = ["linear_attention" if is_linear else "full_attention" for is_linear in linear]
    config = Qwen3_5TextConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        layer_types=types, max_position_embeddings=8192, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).to(dtype).eval()


def filled(m: Qwen3_5ForCausalLM, context: int, recording: bool) -> DynamicCache:
    cache = DynamicCache(config=m.config)
    prompt = torch.randint(10, 49000, (1, context), generator=torch.Generator().manual_seed(context))
    with torch.no_grad():
        m(input_ids=prompt, cache=cache, use_cache=True)
    if recording:
        cache.activate_past_recording(recurrent_states_to_keep=EVERY_TOKEN)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--widths", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    hybrid, attention = model(True, dtype), model(False, dtype)
    rows = {
        "hybrid, recording (speculative=)": (hybrid, True),
        "hybrid, not recording": (hybrid, False),
        "full attention, same shape": (attention, False),
    }
    caches = {name: filled(m, args.context, recording) for name, (m, recording) in rows.items()}
    widths = [int(w) for w in args.widths.split(",")]
    times: dict[tuple[str, int], list[float]] = {(name, w): [] for name in rows for w in widths}
    tokens = torch.randint(10, 49000, (1, max(widths)), generator=torch.Generator().manual_seed(1))
    for repeat in range(args.repeats + 1):  # the first round warms up
        for width in widths:
            for name, (m, recording) in rows.items():
                cache = caches[name]
                kept = None if recording or name.startswith("full") else copy.deepcopy(cache)
                if recording:
                    cache.crop(0)  # what RaggedKV commits before each verify
                start = clock(m.device)
                with torch.no_grad():
                    m(input_ids=tokens[:, :width], cache=cache, use_cache=True, logits_to_keep=width)
                seconds = clock(m.device) - start
                if kept is None:
                    cache.crop(-width)
                else:
                    caches[name] = kept
                if repeat:
                    times[name, width].append(seconds * 1e3)
    threads = torch.get_num_threads()
    print(f"# context {args.context}, {args.dtype}, {threads} torch threads, median of {args.repeats}")
    print("| width | " + " | ".join(rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for width in widths:
        cells = []
        for name in rows:
            ms, one = statistics.median(times[name, width]), statistics.median(times[name, 1])
            cells.append(f"{ms:.1f} ms ({ms / one:.2f}x its 1)")
        print(f"| {width} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
