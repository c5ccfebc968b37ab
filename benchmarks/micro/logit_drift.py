"""How far a bf16 verify forward moves a row's scores from one-token decoding, and what that drift
follows: the largest positive logit, the largest |logit| (a negative one can be larger), or the
final hidden state's norm.

    python benchmarks/micro/logit_drift.py [--prompts 16] [--positions 40] [--widths 16] [--out drift.json]

SmolLM2-135M-Instruct (the offline demo model) in bf16, Spec-Bench prompts (every 30th first turn,
`$HF_SPECDEC_DATA`) as chat prompts. Per prompt: plain greedy decoding one token at a time with a KV
cache (the reference), then the same tokens fed again after the same prefill in chunks of w tokens
(w = 2..--widths) with a KV cache, as the speculative loop verifies them, and once in a single
forward without a cache (as `hf_specdec.lossless` recomputes plain's scores). For each scored
position and feeding: the drift of the gap between the reference's top two tokens, the largest
drift of a top-50 token's gap to the best, and that of any token's, in bf16 steps 2^(e-7) at
magnitude 2^e of (a) the largest logit, (b) the largest |logit|, and against (c) the final hidden
state's norm. Prints the largest drifts by octave of each predictor; `--out` keeps every row.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections import defaultdict

import torch

import hf_specdec
from hf_specdec.bench.suites import data_dir
from hf_specdec.loading import load_model


def steps(drift: float, magnitude: float) -> float:
    """`drift` in bf16 rounding steps at `magnitude`."""
    return drift / 2.0 ** (math.floor(math.log2(abs(magnitude))) - 7)


@torch.no_grad()
def forward(model, ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits [n, vocab] (as computed, then in float) and final hidden states [n, hidden]."""
    hidden = model.model(input_ids=ids, cache=cache, use_cache=cache is not None).last_hidden_state
    return model.lm_head(hidden)[0].float(), hidden[0].float()


def drift_rows(model, prompt: torch.Tensor, positions: int, widths: int) -> list[dict]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits, _ = forward(model, prompt, cache)
    prefilled = copy.deepcopy(cache)
    tokens = [int(logits[-1].argmax())]
    reference, hidden = [], []
    for _ in range(positions):  # plain greedy decoding: the logits after each generated token
        step_logits, step_hidden = forward(model, torch.tensor([tokens[-1:]]), cache)
        reference.append(step_logits[0])
        hidden.append(step_hidden[0])
        tokens.append(int(step_logits[0].argmax()))
    fed = torch.tensor([tokens[:positions]])  # token t is fed to score position t + 1
    feedings: dict[str, list[torch.Tensor]] = {}
    for width in range(2, widths + 1):
        cache = copy.deepcopy(prefilled)
        chunks = [forward(model, fed[:, s : s + width], cache)[0] for s in range(0, positions, width)]
        feedings[str(width)] = list(torch.cat(chunks))
    full, _ = forward(model, torch.cat([prompt, fed], dim=1), None)
    feedings["full"] = list(full[prompt.shape[1] :])
    rows = []
    for t in range(positions):
        ref = reference[t]
        top = ref.topk(50).indices
        best, second = int(top[0]), int(top[1])
        positive, absolute = float(ref.max()), float(ref.abs().max())
        recomputed = feedings["full"][t]
        for name, logits in feedings.items():
            x = logits[t]
            moved = (ref - ref[best]) - (x - x[best])  # every token's gap to the best, how it moved
            # as `check_greedy` sees a tie: the chunked feeding against the recomputation, not plain's
            against_full = (recomputed - recomputed[best]) - (x - x[best])
            rows.append(
                {
                    "width": name,
                    "position": t,
                    "max_logit": positive,
                    "max_abs_logit": absolute,
                    "min_logit": float(ref.min()),
                    "hidden_norm": float(hidden[t].norm()),
                    "top_two_gap": float(ref[best] - ref[second]),
                    "top_two_drift": abs(float(moved[second])),
                    "top50_drift": float(moved[top].abs().max()),
                    "all_drift": float(moved.abs().max()),
                    # how far two tokens' gap moved, at most, among the top 5 and the top 50
                    "top5_range": float(moved[top[:5]].max() - moved[top[:5]].min()),
                    "top50_range": float(moved[top].max() - moved[top].min()),
                    "top5_range_vs_full": float(against_full[top[:5]].max() - against_full[top[:5]].min()),
                    "argmax_moved": int(x.argmax()) != best,
                }
            )
    return rows


def octave_table(rows: list[dict], predictor: str, drift: str) -> str:
    by_octave: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        by_octave[math.floor(math.log2(abs(row[predictor])))].append(row[drift])
    lines = []
    for e in sorted(by_octave):
        values = by_octave[e]
        largest = max(values)
        lines.append(
            f"  {predictor} in [{2**e:g}, {2 ** (e + 1):g}): {len(values):5d} rows, {drift} max "
            f"{largest:.4g} = {largest / 2.0 ** (e - 7):.2f} steps"
        )
    return "\n".join(lines)


DRIFTS = ("top_two_drift", "top5_range", "top5_range_vs_full", "top50_drift", "top50_range", "all_drift")


def summary(rows: list[dict]) -> None:
    print(f"{len(rows)} rows (positions x feedings)")
    for drift in DRIFTS:
        for predictor in ("max_logit", "max_abs_logit"):
            worst = max(rows, key=lambda r: steps(r[drift], r[predictor]))
            print(
                f"{drift} in steps at {predictor}: max {steps(worst[drift], worst[predictor]):.2f} "
                f"({worst[drift]:.4g} at {worst[predictor]:.3g}, width {worst['width']})"
            )
            print(octave_table(rows, predictor, drift))
    negative = [r for r in rows if r["max_abs_logit"] > r["max_logit"]]
    apart = [r for r in negative if steps(1, r["max_logit"]) > steps(1, r["max_abs_logit"])]
    print(f"rows whose largest |logit| is negative: {len(negative)}; an octave or more above: {len(apart)}")
    for predictor in ("max_logit", "max_abs_logit", "hidden_norm"):
        ratios = sorted(r["top50_drift"] / abs(r[predictor]) for r in rows)
        print(
            f"top50 drift / {predictor}: max {ratios[-1]:.3g}, "
            f"99th pct {ratios[int(0.99 * len(ratios))]:.3g}, median {ratios[len(ratios) // 2]:.3g}"
        )
    for width in sorted({r["width"] for r in rows}, key=lambda w: (w == "full", len(w), w)):
        group = [r for r in rows if r["width"] == width]
        print(
            f"width {width:>4}: top-two drift max "
            f"{max(steps(r['top_two_drift'], r['max_abs_logit']) for r in group):.2f} steps at max |logit|, "
            f"top-5 {max(steps(r['top5_range'], r['max_abs_logit']) for r in group):.2f}; "
            f"argmax moved {sum(r['argmax_moved'] for r in group)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--positions", type=int, default=40)
    parser.add_argument("--widths", type=int, default=16)
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = (data_dir() / "specbench" / "question.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["turns"][0] for line in lines][::30][: args.prompts]
    model, tokenizer = load_model(hf_specdec.demo_model_path(), dtype=torch.bfloat16, device="cpu")
    rows = []
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        prompt_rows = drift_rows(model, ids, args.positions, args.widths)
        for row in prompt_rows:
            row["prompt"] = i
        rows += prompt_rows
        worst = max(r["top50_drift"] for r in prompt_rows)
        print(f"prompt {i}: {ids.shape[1]} tokens, largest top-50 drift {worst:.3g}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    summary(rows)


if __name__ == "__main__":
    main()
