"""Seeded sampling with `speculative=` against plain `generate` with the same seed: how many outputs
are the very same tokens.

    python benchmarks/micro/seeded_sampling.py [--prompts 8] [--max-new-tokens 64] [--temperature 0.7]
        [--dtypes bfloat16,float32] [--method ngram]

SmolLM2-135M-Instruct (the offline demo model), Spec-Bench prompts (every 40th of the first turns,
`$HF_SPECDEC_DATA`), a chat prompt each, batch 1; for each prompt `torch.manual_seed(i)` before
plain sampling and again before speculative sampling. Drafts chosen without draws (`ngram`,
`suffix`, trees) are verified with plain sampling's own draw at each position (docs/lossless.md),
so the outputs agree except where the verify forward's rounding moves a draw across p (bf16
most). Prints, per dtype, each prompt's first differing new token, and the count identical.
"""

from __future__ import annotations

import argparse
import json

import torch

import hf_specdec
from hf_specdec.bench.suites import data_dir
from hf_specdec.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--method", default="ngram")
    args = parser.parse_args()
    lines = (data_dir() / "specbench" / "question.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["turns"][0] for line in lines][::40][: args.prompts]
    for dtype in args.dtypes.split(","):
        model, tokenizer = load_model(hf_specdec.demo_model_path(), dtype=getattr(torch, dtype))
        identical = 0
        for i, prompt in enumerate(prompts):
            messages = [{"role": "user", "content": prompt}]
            inputs = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            settings = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature)
            torch.manual_seed(i)
            plain = model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1] :]
            torch.manual_seed(i)
            ours = model.generate(**inputs, **settings, speculative=args.method)[
                0, inputs["input_ids"].shape[1] :
            ]
            n = min(len(plain), len(ours))
            differ = (plain[:n] != ours[:n]).nonzero()
            same = torch.equal(plain, ours)
            identical += same
            where = (
                "identical" if same else f"first differs at new token {int(differ[0]) if len(differ) else n}"
            )
            print(f"{dtype} prompt {i}: {where}", flush=True)
        print(f"{dtype}: {identical} of {len(prompts)} identical to plain's seeded sample", flush=True)


if __name__ == "__main__":
    main()
