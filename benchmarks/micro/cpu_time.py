"""Our loop against transformers' prompt lookup on the CPU-time clock, where other processes do not count.

    python benchmarks/micro/cpu_time.py [--dtype bfloat16] [--limit 1] [--max-new-tokens 64]

On a shared machine the wall clock says more about the neighbours than about the loop. Here every
call runs on one thread and is timed by that thread's CPU time (`hf_specdec.bench.regimes.host_clock`),
and so is each target forward (`emulate(model, REAL)` records them): per row, the tokens, the target
forwards, the CPU seconds of the call and of its forwards, and the host work per step (the rest:
drafting, verifying, bookkeeping). Rows: plain `generate`, transformers' prompt lookup (its 10
tokens), ours `ngram` at a fixed k = 10 and ours `auto`, one Spec-Bench quick prompt per category by
default. The policy still reads the wall clock to decide, as in any call. CPU time still grows when
another process shares the core's caches (two vCPUs of one physical core): compare rows side by side.
"""

from __future__ import annotations

import argparse

import torch

import hf_specdec
from hf_specdec.bench.regimes import REAL, emulate, host_clock
from hf_specdec.bench.suites import data_dir, load_suite, take_per_category
from hf_specdec.demo_model import demo_model_path

ROWS = {
    "plain": {},
    "prompt lookup": {"prompt_lookup_num_tokens": 10},
    "ngram k=10": {"speculative": {"method": "ngram", "policy": hf_specdec.FixedDraftLength(10)}},
    "auto": {"speculative": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--limit", type=int, default=1, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    totals = dict.fromkeys(ROWS, 0.0)
    print("| prompt | row | tokens | forwards | CPU s | forwards' CPU s | host ms / step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for prompt in take_per_category(load_suite("specbench-quick", data_dir()), args.limit):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        inputs = tokenizer(text, return_tensors="pt")
        for name, options in ROWS.items():
            with emulate(model, REAL) as device:
                started = host_clock()
                out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **options)
                seconds = host_clock() - started
            forwards = sum(f.host_seconds for f in device.forwards)
            totals[name] += seconds
            host = (seconds - forwards) / max(len(device.forwards), 1) * 1000
            print(
                f"| {prompt.category} {prompt.id} | {name} | {out.shape[1] - inputs['input_ids'].shape[1]}"
                f" | {len(device.forwards)} | {seconds:.2f} | {forwards:.2f} | {host:.1f} |",
                flush=True,
            )
    print("\nCPU seconds in all: " + ", ".join(f"{name} {s:.1f}" for name, s in totals.items()))
    print("Over plain: " + ", ".join(f"{name} {totals['plain'] / s:.2f}x" for name, s in totals.items()))


if __name__ == "__main__":
    main()
