"""`hf-specdec demo`: plain generate against speculative=True on the offline SmolLM2 model."""

from __future__ import annotations

import argparse
import time

# Prompts written for the demo: two that copy from their input (where lookup drafting shines)
# and one open question (where it must not cost anything).
DEMO_PROMPTS = [
    "Summarize the following text in two sentences, reusing its wording.\n\n"
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
    "The council members agreed that the bicycle lanes on Main Street will be built next spring, "
    "and that the parking spaces on Main Street will be moved to Oak Avenue. "
    "Residents who live on Main Street said they were happy with the plan for the bicycle lanes.",
    "Here is a Python function:\n\n"
    "def total_price(items):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        total = total + item.price * item.quantity\n"
    "    return total\n\n"
    "Rewrite the function with a docstring and type hints, keeping the same logic.",
    "What are three good habits for staying healthy?",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="compare plain and speculative generation on SmolLM2-135M")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--method", default="auto", help="speculative method (default: auto)")
    parser.add_argument(
        "--model", default=None, help="a model folder or repo id (default: the offline demo model)"
    )
    parser.add_argument("--draft", default=None, help="a draft model folder (implies method draft_model)")
    parser.add_argument(
        "--draft-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="load the draft in this dtype (e.g. a bfloat16 copy of the target as its own draft)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_specdec
    from hf_specdec.bench.suites import encode_prompt

    path = args.model or hf_specdec.demo_model_path()
    print(f"Loading {path}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, tokenizer=tokenizer)
    speculative = hf_specdec.SpeculativeConfig(method=args.method)
    if args.draft:
        dtype = getattr(torch, args.draft_dtype) if args.draft_dtype else model.dtype
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).eval()
        draft_tokenizer = AutoTokenizer.from_pretrained(args.draft)
        speculative = hf_specdec.SpeculativeConfig(
            method="draft_model", draft=draft, draft_tokenizer=draft_tokenizer
        )

    warm = encode_prompt(tokenizer, "Hello!")
    model.generate(**warm, max_new_tokens=4, do_sample=False)

    plain_tokens = spec_tokens = 0
    plain_seconds = spec_seconds = 0.0
    stats = hf_specdec.SpeculativeStats()
    all_identical = True
    for i, prompt in enumerate(DEMO_PROMPTS, 1):
        inputs = encode_prompt(tokenizer, prompt)
        # plain, speculative, speculative, plain: drift in machine load cancels out of the ratio.
        t_plain = t_spec = 0.0
        for order in ("plain", "spec", "spec", "plain"):
            start = time.perf_counter()
            if order == "plain":
                plain = model.generate(**inputs, **settings)
                t_plain += time.perf_counter() - start
            else:
                spec = model.generate(
                    **inputs, **settings, speculative=speculative, return_dict_in_generate=True
                )
                t_spec += time.perf_counter() - start
        new_plain = plain.shape[1] - inputs["input_ids"].shape[1]
        new_spec = spec.sequences.shape[1] - inputs["input_ids"].shape[1]
        identical = torch.equal(plain, spec.sequences)
        all_identical &= identical
        plain_tokens, plain_seconds = plain_tokens + 2 * new_plain, plain_seconds + t_plain
        spec_tokens, spec_seconds = spec_tokens + 2 * new_spec, spec_seconds + t_spec
        stats.merge(spec.speculative_stats)
        s = spec.speculative_stats
        print(
            f"\nPrompt {i}: {prompt.splitlines()[0][:70]}\n"
            f"  plain       {2 * new_plain / t_plain:6.1f} tokens/s\n"
            f"  speculative {2 * new_spec / t_spec:6.1f} tokens/s  ({s.method}, "
            f"{t_plain / t_spec:.2f}x, acceptance {s.acceptance_rate:.0%}, "
            f"τ {s.mean_accepted_length:.2f}, identical: {'yes' if identical else 'NO'})"
        )
    plain_rate, spec_rate = plain_tokens / plain_seconds, spec_tokens / spec_seconds
    print(
        f"\nOverall: plain {plain_rate:.1f} tokens/s, speculative {spec_rate:.1f} tokens/s, "
        f"speedup {spec_rate / plain_rate:.2f}x\n"
        f"Method {stats.method}: acceptance rate {stats.acceptance_rate:.0%}, mean accepted length "
        f"{stats.mean_accepted_length:.2f}, "
        f"{stats.speculative_steps} speculative and {stats.plain_steps} plain steps\n"
        f"Outputs identical to plain greedy generate: {'yes' if all_identical else 'NO'}"
    )
    return 0 if all_identical else 1
