"""Seeded sampling with `speculative=` against plain `generate` with the same seed: how many outputs
are the very same tokens.

    python benchmarks/micro/seeded_sampling.py [--prompts 8] [--max-new-tokens 64] [--temperature 0.7]
        [--dtypes bfloat16,float32] [--method ngram]

SmolLM2-135M-Instruct (the offline demo model), Spec-Bench prompts (every 40th of the first turns,
`$HF_SPECDEC_DATA`), a chat prompt each, batch 1; for each prompt `torch.manual_seed(i)` before
plain sampling and again before speculative sampling. Drafts chosen without draws (`ngram`,
`suffix`, trees) are verified with plain sampling's own draw at each position (docs/lossless.md),
so the outputs agree except where the verify forward's rounding moves a draw across p (bf16
most). Prints, per dtype, each prompt's first differing new token and how `check_sampled` reads it
(a rounding tie of plain's draw, or a mismatch), and the counts.
"""

from __future__ import annotations

import argparse
import json

import torch

import hf_specdec
from hf_specdec.bench.suites import data_dir
from hf_specdec.loading import eos_token_ids, load_model
from hf_specdec.lossless import IDENTICAL, check_sampled, count_kinds


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
        checks = []
        for i, prompt in enumerate(prompts):
            messages = [{"role": "user", "content": prompt}]
            inputs = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            settings = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature)
            torch.manual_seed(i)
            plain = model.generate(
                **inputs, **settings, output_scores=True, output_logits=True, return_dict_in_generate=True
            )
            torch.manual_seed(i)
            ours = model.generate(**inputs, **settings, speculative=args.method)
            prompt_length = inputs["input_ids"].shape[1]
            (check,) = check_sampled(
                plain.sequences,
                plain.scores,
                ours,
                prompt_length,
                i,
                model.dtype,
                eos_token_ids=eos_token_ids(model),
                temperature=args.temperature,
                plain_logits=plain.logits,
            )
            checks.append(check)
            print(f"{dtype} prompt {i}: {check.describe()}", flush=True)
        counts = count_kinds(checks)
        print(
            f"{dtype}: {counts[IDENTICAL]} of {len(prompts)} identical to plain's seeded sample; "
            f"first differing at a rounding tie of its draw: {counts['tie']}; "
            f"mismatches: {counts['mismatch']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
