"""An EAGLE head's per-token forwards compiled beside a compiled target (issue 23), against the same
head left eager.

    python benchmarks/micro/eagle_compiled.py [--ks 4,8] [--new-tokens 128] [--repeats 3] [--dtype auto]
    python benchmarks/micro/eagle_compiled.py --device cuda   # a GPU: CUDA graphs ("reduce-overhead")
    python benchmarks/micro/eagle_compiled.py --batch-size 4  # the prompt 4 times: a batch's forwards

SmolLM2-135M (the offline demo model) in its checkpoint's dtype (bf16; `--dtype float32` on a CPU
without native bf16) on transformers' compiled static-cache path (`cache_implementation="static"`,
its default `CompileConfig`: inductor, on CPU with `_compile_all_devices`), with an EAGLE head of
SmolLM2's shape, randomly initialised, scoring a draft vocabulary of `--draft-vocab` tokens
(`train-draft`'s default 8192). A head's forward costs what a trained head's of that shape costs;
its drafts are mostly rejected, which the milliseconds per draft token do not depend on (no trained
head for SmolLM2 ships offline). Rows per fixed k: the head compiled with the target
(`compile_with_target=True`, the default) and eager (False). Figures: draft milliseconds per
drafted token (`speculative_stats.draft_seconds / drafted`: the catch-up over the target's newly
cached tokens and the chained tokens), milliseconds per generated token, the first call's seconds
(every compile, the target's and the head's), outputs against plain static greedy. Medians of
`--repeats` runs, rows interleaved within each. At a batch size over 1, a draft token is one of any
row, and ms / token is per position of the batch (one token of each row).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import CompileConfig

import hf_specdec  # noqa: F401  (wires speculative= into generate)
from hf_specdec import SpeculativeConfig
from hf_specdec.core.policy import FixedDraftLength
from hf_specdec.core.timing import clock
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import build_head
from hf_specdec.loading import describe_runtime, encode_prompts, load_model, pad_token_id, runtime_line
from hf_specdec.lossless import check_greedy

PROMPT = "Explain in a few paragraphs how a hash map works and when to use one."


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--ks", default="4,8", help="fixed draft lengths")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head scores (0: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default=None, help="default: the CPU")
    parser.add_argument("--batch-size", type=int, default=1, help="the prompt repeated, one row each")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None, dtype=args.dtype, device=args.device)
    prompts = [PROMPT] * args.batch_size
    prompt = encode_prompts(tokenizer, prompts, True, pad_token_id(tokenizer, model), model.device)
    input_ids = prompt["input_ids"]
    torch.manual_seed(0)
    head = build_head(EagleHeadConfig.for_target(model, draft_vocab_size=args.draft_vocab), model).eval()
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # transformers compiles on CPU only when told so
    common = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        cache_implementation="static",
        compile_config=compile_config,
    )

    def spec(k: int, compiled: bool) -> SpeculativeConfig:
        options = {"compile_with_target": compiled}
        return SpeculativeConfig(method="eagle", draft=head, policy=FixedDraftLength(k), options=options)

    rows = {"plain, compiled": {}}
    for k in map(int, args.ks.split(",")):
        for compiled in (True, False):
            rows[f"eagle k={k}, head {'compiled' if compiled else 'eager'}"] = {"k": k, "compiled": compiled}

    def run(row: dict) -> tuple[float, object]:
        extra = {} if not row else {"speculative": spec(row["k"], row["compiled"])}
        start = clock(model.device)
        with torch.no_grad():
            out = model.generate(input_ids, **common, **extra, return_dict_in_generate=True)
        return clock(model.device) - start, out

    first, outputs = {}, {}
    for name, row in rows.items():  # first calls: every compile (the head's at each width here)
        first[name], outputs[name] = run(row)
    seconds = {name: [] for name in rows}
    draft_ms = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, row in rows.items():
            elapsed, out = run(row)
            seconds[name].append(elapsed)
            stats = getattr(out, "speculative_stats", None)
            if stats is not None and stats.drafted:
                draft_ms[name].append(stats.draft_seconds / stats.drafted * 1e3)
    plain = outputs["plain, compiled"].sequences
    print(f"# EAGLE head compiled vs eager beside a compiled target: {runtime_line(describe_runtime(model))}")
    print(
        f"# batch {args.batch_size}, {args.new_tokens} greedy tokens, "
        f"draft vocabulary {args.draft_vocab or 'all'}, median of {args.repeats}, {args.threads} thread(s)\n"
    )
    columns = ["row", "draft ms / draft token", "ms / token", "ms / token vs plain", "τ", "first call s"]
    print("| " + " | ".join([*columns, "output vs plain"]) + " |")
    print("|---|---:|---:|---:|---:|---:|---|")
    plain_ms = statistics.median(seconds["plain, compiled"]) / args.new_tokens * 1e3
    for name in rows:
        ms = statistics.median(seconds[name]) / args.new_tokens * 1e3
        stats = getattr(outputs[name], "speculative_stats", None)
        tau = f"{stats.mean_accepted_length:.2f}" if stats is not None else ""
        draft = f"{statistics.median(draft_ms[name]):.2f}" if draft_ms[name] else ""
        rows = check_greedy(model, input_ids, plain, outputs[name].sequences)
        same = ", ".join(sorted({row.kind for row in rows}))
        print(f"| {name} | {draft} | {ms:.1f} | {ms / plain_ms:.2f}x | {tau} | {first[name]:.0f} | {same} |")


if __name__ == "__main__":
    main()
