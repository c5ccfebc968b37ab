"""What keeping the whole context in sliding-window layers costs (see `kv._WindowMasks`).

    python benchmarks/micro/sliding_window.py [--contexts 512,2048] [--window 256] [--dtype bfloat16]

A random Mistral-style model with SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV
heads, vocabulary 49152) and a sliding window on every layer decodes `--new-tokens` greedily after
a prompt of each context length, interleaved, median of `--repeats`:

- plain `generate`: transformers' window cache, each layer attends to at most `window` tokens;
- ours, never drafting (a policy that always answers 0): full cache layers and our own masks,
  i.e. only the price of rolling back, without any speculation to pay for it;
- plain `generate` on the same model without a window (every layer attends to the whole context),
  for scale.

Decode time is the call's minus a separately timed one-token call (the prefill), divided by the
tokens after the first: at long contexts the prefill's own noise dominates, so compare the rows of
one context, and prefer `--repeats 3` or more there.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import MistralConfig, MistralForCausalLM

import hf_specdec
from hf_specdec.core.policy import DraftLengthPolicy
from hf_specdec.core.timing import clock
from hf_specdec.lossless import check_greedy


class NeverDraft(DraftLengthPolicy):
    """A draft-length policy that always decodes plainly."""

    def draft_length(self, batch_size: int) -> int:
        return 0

    def trim(self, draft, batch_size, remaining=None):
        return draft

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds) -> None:
        pass


def model(window: int | None, dtype: torch.dtype) -> MistralForCausalLM:
    config = MistralConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        sliding_window=window,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return MistralForCausalLM(config).to(dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    windowed, full = model(args.window, dtype), model(None, dtype)
    never = hf_specdec.SpeculativeConfig(method="ngram", policy=NeverDraft())
    rows = {
        "plain, window cache": (windowed, {}),
        "ours, full cache + window masks, no drafts": (windowed, {"speculative": never}),
        "plain, no window (full attention)": (full, {}),
    }
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    threads = torch.get_num_threads()
    print(f"# window {args.window}, {args.dtype}, {args.new_tokens} new tokens, {threads} torch threads")
    print("| context | " + " | ".join(rows) + " | lossless |")
    print("|---" * (len(rows) + 2) + "|")
    for context in [int(c) for c in args.contexts.split(",")]:
        prompt = torch.randint(10, 49000, (1, context), generator=torch.Generator().manual_seed(context))
        times: dict[str, list[float]] = {name: [] for name in rows}
        outputs = {}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, (m, extra) in rows.items():
                prefill_start = clock(m.device)
                m.generate(prompt, max_new_tokens=1, do_sample=False, **extra)
                prefill = clock(m.device) - prefill_start
                start = clock(m.device)
                outputs[name] = m.generate(prompt, **common, **extra)
                seconds = clock(m.device) - start - prefill  # decoding only: the prefill is the same
                if repeat:
                    times[name].append(seconds / (args.new_tokens - 1) * 1e3)
        plain_out, ours_out = (outputs[name] for name in list(rows)[:2])
        check = check_greedy(windowed, prompt, plain_out, ours_out, eos_token_ids=())[0]
        cells = [f"{statistics.median(t):.1f} ms/token" for t in times.values()]
        print(f"| {context} | " + " | ".join(cells) + f" | ours vs plain: {check.describe()} |")


if __name__ == "__main__":
    main()
