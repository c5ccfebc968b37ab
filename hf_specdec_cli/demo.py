"""`hf-specdec demo`: plain generate against speculative=True on the offline SmolLM2 model."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .options import add_runtime_options, one_of, positive_int

if TYPE_CHECKING:
    from hf_specdec import SpeculativeStats

# Prompts written for the demo: two whose answers copy from their input (where lookup drafting
# shines) and one open question (where it must not cost anything). SmolLM2-135M does copy these two
# (a prompt asking it to rewrite a Python function got a 37-token answer that was not the function).
DEMO_PROMPTS = [
    "Summarize the following text in two sentences, reusing its wording.\n\n"
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
    "The council members agreed that the bicycle lanes on Main Street will be built next spring, "
    "and that the parking spaces on Main Street will be moved to Oak Avenue. "
    "Residents who live on Main Street said they were happy with the plan for the bicycle lanes.",
    "Correct any mistakes in this email and return the full email.\n\n"
    "Hi Sam,\n\nThanks for sending the report on Monday. I read the report and I think the numbers "
    "in the second table are correct. Please send the final version of the report to the whole team "
    "by Friday, and add the numbers from the second table to the summary.\n\nBest,\nAlex",
    "What are three good habits for staying healthy?",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="compare plain and speculative generation on SmolLM2-135M",
        description="Generate greedily for a few built-in prompts with plain generate and with "
        "speculative=--method, interleaved, on the offline SmolLM2-135M-Instruct (or --model), and "
        "print tokens/s, speedup, acceptance, and whether each output is identical to plain's, "
        "differs at a rounding tie, or mismatches (exit status 1).",
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt (default: 128)"
    )
    parser.add_argument(
        "--method",
        default="auto",
        type=one_of("hf_specdec.drafters:DRAFTERS", "auto"),
        help="speculative method (default: auto)",
    )
    parser.add_argument(
        "--model", default=None, help="a model folder or repo id (default: the offline demo model)"
    )
    add_runtime_options(parser)
    parser.add_argument(
        "--draft",
        default=None,
        help="the draft --method drafts with: a draft model folder or repo id (draft_model; auto, the "
        "default, runs a draft by what it is), a trained head or block draft (eagle, medusa, dflash, "
        "dspark), an official assistant, or an export-onnx folder (onnx)",
    )
    parser.add_argument(
        "--draft-dtype",
        default=None,
        type=one_of("hf_specdec.loading:DTYPE_CHOICES"),
        help="load a draft model in this dtype (default: the target's; e.g. a bfloat16 copy of an fp32 "
        "target)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import hf_specdec  # the package: importing it adds `speculative=` to generate()
    from hf_specdec.bench.machine import OtherProcesses, busy_note
    from hf_specdec.core.timing import clock
    from hf_specdec.drafters.kind import draft_method
    from hf_specdec.loading import describe_runtime, load_model, runtime_line
    from hf_specdec.lossless import MISMATCH, bound_formula, check_greedy, count_kinds

    # A draft model is loaded here, in --draft-dtype, with its tokenizer; any other draft (a head, an
    # assistant, an ONNX export) goes to --method as it is, which loads it.
    loads_draft = (
        bool(args.draft) and args.method in ("auto", "draft_model") and draft_method(args.draft) is None
    )
    if args.draft_dtype and not loads_draft:
        raise ValueError("--draft-dtype loads a draft model: pass --draft with one, or drop --draft-dtype.")
    path = args.model or hf_specdec.demo_model_path()
    print(f"Loading {path}")
    model, tokenizer = load_model(path, dtype=args.dtype, device=args.device)
    print(f"Running in {runtime_line(describe_runtime(model))}")
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, tokenizer=tokenizer)
    speculative = hf_specdec.SpeculativeConfig(method=args.method, draft=args.draft)
    if loads_draft:
        draft, draft_tokenizer = load_model(
            args.draft, dtype=args.draft_dtype or model.dtype, device=model.device
        )
        speculative = hf_specdec.SpeculativeConfig(
            method="draft_model", draft=draft, draft_tokenizer=draft_tokenizer
        )

    # Both ways warmed up, so that neither timed run pays a first call's costs, and a method that
    # refuses its arguments (a draft missing, or one it takes none of) says so before the prompts.
    warm = _encode(tokenizer, model, "Hello!")
    model.generate(**warm, max_new_tokens=4, do_sample=False)
    model.generate(**warm, max_new_tokens=4, do_sample=False, speculative=speculative)

    plain_tokens = spec_tokens = 0
    plain_seconds = spec_seconds = 0.0
    stats = hf_specdec.SpeculativeStats()
    checks = []
    others = OtherProcesses()
    for i, prompt in enumerate(DEMO_PROMPTS, 1):
        inputs = _encode(tokenizer, model, prompt)
        print(f"\nPrompt {i}/{len(DEMO_PROMPTS)}: {prompt.splitlines()[0][:70]}", flush=True)
        # plain, speculative, speculative, plain: drift in machine load cancels out of the ratio.
        t_plain = t_spec = 0.0
        for n, order in enumerate(("plain", "speculative", "speculative", "plain"), 1):
            # On a slow machine a run takes tens of seconds: say which one (on stderr, then erased).
            print(f"  running {order} generate ({n}/4) ...", end="\r", file=sys.stderr, flush=True)
            start = clock(model.device)
            if order == "plain":
                plain = model.generate(**inputs, **settings)
                t_plain += clock(model.device) - start
            else:
                spec = model.generate(
                    **inputs, **settings, speculative=speculative, return_dict_in_generate=True
                )
                t_spec += clock(model.device) - start
        print(" " * 40, end="\r", file=sys.stderr, flush=True)
        new_plain = plain.shape[1] - inputs["input_ids"].shape[1]
        new_spec = spec.sequences.shape[1] - inputs["input_ids"].shape[1]
        check = check_greedy(model, inputs["input_ids"], plain, spec.sequences, inputs["attention_mask"])[0]
        checks.append(check)
        plain_tokens, plain_seconds = plain_tokens + 2 * new_plain, plain_seconds + t_plain
        spec_tokens, spec_seconds = spec_tokens + 2 * new_spec, spec_seconds + t_spec
        stats.merge(spec.speculative_stats)
        s, rate_plain, rate_spec = spec.speculative_stats, 2 * new_plain / t_plain, 2 * new_spec / t_spec
        # Rates, not times: where the outputs part at a tie, they may differ in length.
        print(
            f"  plain       {rate_plain:6.1f} tokens/s\n"
            f"  speculative {rate_spec:6.1f} tokens/s  ({s.method}, "
            f"{rate_spec / rate_plain:.2f}x, {_acceptance(s)})\n"
            f"  vs plain greedy: {check.describe() if check.kind != MISMATCH else check.describe().upper()}"
        )
    plain_rate, spec_rate = plain_tokens / plain_seconds, spec_tokens / spec_seconds
    counts, dtype = count_kinds(checks), str(model.dtype).removeprefix("torch.")
    print(
        f"\nOverall: plain {plain_rate:.1f} tokens/s, speculative {spec_rate:.1f} tokens/s, "
        f"speedup {spec_rate / plain_rate:.2f}x\n"
        f"Method {stats.method}: {_overall_acceptance(stats)}, "
        f"{stats.speculative_steps} speculative and {stats.plain_steps} plain steps\n"
        f"Outputs vs plain greedy generate in {dtype}: {counts['identical']} identical, "
        f"{counts['tie']} first differing at a rounding tie (top two within {bound_formula(model.dtype)}), "
        f"{counts['mismatch']} mismatches\n"
        "(acceptance: the share of drafted tokens the model accepted; τ: the tokens one speculative "
        "step adds, its accepted drafts plus the model's own next token, where plain decoding adds 1)"
    )
    if note := busy_note(others.share()):
        print(note)
    return 1 if counts["mismatch"] else 0


def _acceptance(stats: SpeculativeStats) -> str:
    """Acceptance and τ, or that nothing was drafted (τ, tokens per speculative step, has none then)."""
    if not stats.speculative_steps:
        return "no draft verified: plain decoding throughout"
    return f"acceptance {stats.acceptance_rate:.0%}, τ {stats.mean_accepted_length_speculative:.2f}"


def _overall_acceptance(stats: SpeculativeStats) -> str:
    """`_acceptance`'s figures for the whole run, with the mean accepted length over every step."""
    if not stats.speculative_steps:
        return "no draft verified: plain decoding throughout"
    return (
        f"acceptance rate {stats.acceptance_rate:.0%}, mean accepted length {stats.mean_accepted_length:.2f} "
        f"per step, τ {stats.mean_accepted_length_speculative:.2f} per speculative step"
    )


def _encode(tokenizer, model, prompt: str):
    from hf_specdec.loading import encode_prompts, pad_token_id, use_chat_template

    return encode_prompts(
        tokenizer, [prompt], use_chat_template(tokenizer), pad_token_id(tokenizer, model), model.device
    )
