"""What one tree level costs an ONNX Runtime draft, both ways it can be fed (issue 14).

    python benchmarks/micro/ort_tree_levels.py [--threads 1] [--repeats 30] [--contexts 128,512,1024]

The int8 copy of SmolLM2-135M-Instruct (fp32; `method="quantized"`'s, built on first use) after a
context of N tokens: one chain token (1 row, 1 token); a level of 4 sibling nodes under the tree
mask our exports take (1 row, 4 tokens); the same level as 4 batch rows, each a copy of the
context's row (`BranchRows`, for graphs without the mask). Milliseconds, min / median, the three
interleaved.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hf_specdec
from hf_specdec.core.timing import clock
from hf_specdec.loading import load_model
from hf_specdec.ort.cache import quantized_copy
from hf_specdec.ort.session import OnnxDecoder


def tokens(rows: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(100, 40000, (rows, count)), torch.ones(rows, count, dtype=torch.bool)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--contexts", default="128,512,1024")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(hf_specdec.demo_model_path(quiet=True), dtype="float32", device="cpu")
    decoder = OnnxDecoder.load(quantized_copy(model, tokenizer), "cpu", args.threads)
    siblings = (torch.eye(4, dtype=torch.bool)[None], torch.zeros(1, 4, dtype=torch.long))
    for context in map(int, args.contexts.split(",")):
        kv = decoder.new_cache(1)
        kv.forward(*tokens(1, context), logits_to_keep=1)
        base = kv.lengths.clone()
        times: dict[str, list[float]] = {"chain token": [], "masked level": [], "rows level": []}
        for _ in range(args.repeats):
            start = clock("cpu")
            kv.forward(*tokens(1, 1), logits_to_keep=1)
            times["chain token"].append(clock("cpu") - start)
            kv.truncate(base)
            start = clock("cpu")
            kv.forward(*tokens(1, 4), tree=siblings)
            times["masked level"].append(clock("cpu") - start)
            kv.truncate(base)
            start = clock("cpu")
            kv.select_rows(torch.tensor([0, 0, 0, 0]))
            kv.forward(*tokens(4, 1), logits_to_keep=1)
            times["rows level"].append(clock("cpu") - start)
            kv.select_rows(torch.tensor([0]))
            kv.truncate(base)
        cells = [f"{name} {1e3 * min(t):.1f}/{1e3 * statistics.median(t):.1f}" for name, t in times.items()]
        print(f"context {context}: " + "  ".join(cells) + " ms")


if __name__ == "__main__":
    main()
