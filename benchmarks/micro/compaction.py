"""How wide a batch's dynamic cache grows, and what compacting it (`RaggedKV.compact`) costs.

    python benchmarks/micro/compaction.py        # tiny fp32 llama, 1,000 tokens (about 10 min on 2 cores)
    python benchmarks/micro/compaction.py --model smollm2 --max-new-tokens 300 --repeats 1

A batch of 4 left-padded prompts decodes `--max-new-tokens` greedily (no EOS) with a fixed draft length
and a draft that agrees with the target now and then (the target's weights plus Gaussian noise,
`--noise` times each tensor's std), so the rows keep different numbers of drafts each step and leave
holes. Each `--bounds` value is a `kv.HOLES_BOUND` ("inf": never compact within a call, the cache
before compaction); the settings alternate within each repeat, after one plain `generate` whose
output each must equal up to rounding ties (`hf_specdec.lossless.check_greedy`). Per setting: the
target cache's widest (columns, and that over plain's at the end: the prompt's width plus the
tokens but the last), its compactions, and the call's time (median of repeats).

`--model tiny`: a random 2-layer llama (hidden 64), fp32, as the probe that measured the growth;
`--model smollm2`: SmolLM2-135M (`hf_specdec.demo_model_path()`) in `--dtype` (bf16 by default), its
noisy copy the draft.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_specdec
from hf_specdec.core import kv as kv_module
from hf_specdec.core.timing import clock
from hf_specdec.loading import describe_runtime, load_model, runtime_line
from hf_specdec.lossless import MISMATCH, check_greedy


def tiny_llama() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def noisy(model: torch.nn.Module, scale: float, seed: int = 3) -> torch.nn.Module:
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            noise = torch.randn(p.shape, generator=g).to(p.dtype)
            p.add_(noise * scale * p.float().std().clamp(min=1e-3).to(p.dtype))
    return draft


def prompts(lengths: list[int], vocab: int, seed: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        attention_mask[b, width - n :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class Widths:
    """The target cache's width after each step's roll-back, and its compactions (the call's last
    included: `finished_cache`)."""

    def __init__(self) -> None:
        self.widest, self.compactions = 0, 0
        roll_back, finished_cache = kv_module.RaggedKV.roll_back, kv_module.RaggedKV.finished_cache

        def rolled_back(kv, *args, **kwargs):
            roll_back(kv, *args, **kwargs)
            self.widest = max(self.widest, kv.width)

        def finished(kv):
            cache = finished_cache(kv)
            self.compactions = kv.compactions
            return cache

        kv_module.RaggedKV.roll_back, kv_module.RaggedKV.finished_cache = rolled_back, finished

    def reset(self) -> None:
        self.widest, self.compactions = 0, 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--dtype", default="bfloat16", help="SmolLM2's dtype")
    parser.add_argument("--max-new-tokens", type=int, default=1000)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--noise", type=float, default=0.2)
    parser.add_argument("--bounds", default="inf,0.25,0.125")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    if args.model == "tiny":
        target = tiny_llama()
    else:
        target, _ = load_model(hf_specdec.demo_model_path(), dtype=args.dtype)
    print(f"# {runtime_line(describe_runtime(target))}")
    draft = noisy(target, args.noise)
    vocab = target.config.vocab_size
    inputs = prompts([7, 1, 3, 12] if args.model == "tiny" else [40, 25, 33, 48], vocab)
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    speculative = {"method": "draft_model", "draft": draft, "num_draft_tokens": args.num_draft_tokens}
    settings = [float(bound) for bound in args.bounds.split(",")]
    widths = Widths()
    with torch.no_grad():
        plain = target.generate(**inputs, **options)
        target.generate(**inputs, **{**options, "max_new_tokens": 16}, speculative=speculative)  # warm-up
        plain_columns = plain.shape[1] - 1
        times: dict[float, list[float]] = {s: [] for s in settings}
        seen: dict[float, tuple[int, int, float]] = {}
        for _ in range(args.repeats):
            for setting in settings:
                kv_module.HOLES_BOUND = setting
                widths.reset()
                start = clock(target.device)
                out = target.generate(
                    **inputs, **options, speculative=speculative, return_dict_in_generate=True
                )
                times[setting].append(clock(target.device) - start)
                ids, mask = inputs["input_ids"], inputs["attention_mask"]
                rows = check_greedy(target, ids, plain, out.sequences, mask)
                if any(row.kind == MISMATCH for row in rows):  # bf16 rows may part at rounding ties
                    raise SystemExit(f"bound {setting}: an output differs from plain generate's: {rows}")
                seen[setting] = (widths.widest, widths.compactions, out.speculative_stats.acceptance_rate)
    print(
        f"# batch 4, {args.max_new_tokens} new tokens, k={args.num_draft_tokens}, draft noise {args.noise}; "
        f"plain's cache at the end: {plain_columns} columns"
    )
    print("| HOLES_BOUND | widest columns | / plain's | compactions | acceptance | seconds |")
    print("|---|---|---|---|---|---|")
    for setting in settings:
        widest, compactions, acceptance = seen[setting]
        print(
            f"| {setting} | {widest} | {widest / plain_columns:.2f} | {compactions} | "
            f"{acceptance:.2f} | {statistics.median(times[setting]):.2f} |"
        )


if __name__ == "__main__":
    main()
