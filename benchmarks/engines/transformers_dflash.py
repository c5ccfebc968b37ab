"""Our DFlash drafting against transformers' own (`speculation_type="dflash"` with a MuseGlimmer
assistant, `DFlashTokenCandidateGenerator`), on the same assistant and target, batch 1, greedy.

    python benchmarks/engines/transformers_dflash.py --draft DIR [--model M] [--profiles real,flat]
        [--suite specbench-quick] [--categories qa,mt_bench,translation,math_reasoning] [--limit 2]
        [--max-new-tokens 96]
    python benchmarks/engines/transformers_dflash.py --tiny    # a random tiny Llama and assistant

`--draft` is a block draft of ours (`hf-specdec train-draft --method dflash`): it is written as a
MuseGlimmer assistant (full-attention layers, the target's whole vocabulary scored: the layout
transformers runs), and both sides draft with that same assistant, so their drafts are the same
(tests/drafters/test_dflash.py checks them step by step). Rows per prompt, in rotated order: plain,
transformers (its whole block verified every step), ours with the same fixed block, ours with the
adaptive policy. Reported: time per generated token (median over prompts) on each profile's clock
(`real`: this machine's wall clock; `flat`: an emulated GPU at batch 1, host work at CPU time), and
whether every output equals plain greedy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import MuseGlimmerAssistantConfig
from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantModel

from hf_specdec.bench.regimes import PROFILES, emulate
from hf_specdec.bench.runner import _new_tokens, _select_prompts
from hf_specdec.core.timing import clock
from hf_specdec.heads.checkpoint import load_head
from hf_specdec.loading import (
    describe_runtime,
    encode_prompts,
    eos_token_ids,
    load_model,
    pad_token_id,
    use_chat_template,
)

_wall = time.perf_counter


def as_muse_glimmer(draft: Any, target: Any) -> MuseGlimmerAssistantModel:
    """Our block draft as a MuseGlimmer assistant: same tensors (`fc`, `hidden_norm` as `encoder.*`),
    full-attention layers; its draft vocabulary is dropped (the assistant scores every token)."""
    c = draft.config
    if c.drafts_from_anchor or c.markov_rank or any(c.layer_windows) or any(c.causal_layers):
        raise SystemExit(f"{c.layout} drafts do not fit transformers' MuseGlimmer assistant.")
    text = target.config.get_text_config()
    config = MuseGlimmerAssistantConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        max_position_embeddings=c.max_position_embeddings or 8192,
        layer_types=["full_attention"] * c.num_hidden_layers,
        target_layer_ids=list(c.target_layer_ids),
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
        vocab_size=text.vocab_size,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    )
    model = MuseGlimmerAssistantModel(config)
    renames = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
    state = {}
    for name, tensor in draft.state_dict().items():
        if name == "draft_vocab":
            continue
        for old, new in renames.items():
            name = new + name.removeprefix(old) if name.startswith(old) else name
        state[name] = tensor
    model.load_state_dict(state)
    return model.to(dtype=target.dtype).eval()


def tiny_pair() -> tuple[Any, Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    assistant = MuseGlimmerAssistantModel(
        MuseGlimmerAssistantConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            target_layer_ids=[0, 3],
            block_size=8,
            mask_token_id=1,
            layer_types=["full_attention"] * 2,
            vocab_size=256,
            pad_token_id=0,
            eos_token_id=None,
        )  # fmt: skip
    ).eval()
    return target, assistant, None


def measure(args: argparse.Namespace) -> str:
    if args.tiny:
        target, assistant, tokenizer = tiny_pair()
        prompts = [
            torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 17, 33)
        ]
    else:
        target, tokenizer = load_model(args.model, dtype=args.dtype)
        assistant = as_muse_glimmer(load_head(args.draft, target, method="dflash"), target)
        chosen = _select_prompts(args.suite, None, None, args.limit, args.categories.split(","))
        chat, pad = use_chat_template(tokenizer, None), pad_token_id(tokenizer, target)
        prompts = [encode_prompts(tokenizer, [p], chat, pad, target.device)["input_ids"] for p in chosen]
    folder = Path(args.out)
    assistant.save_pretrained(folder)  # what our loader reads: the very same assistant
    block = assistant.config.block_size
    eos = eos_token_ids(target) if tokenizer is not None else set()
    rows = {
        "plain": {},
        "transformers": {"assistant_model": assistant, "speculation_type": "dflash"},
        "ours-fixed": {
            "speculative": {"method": "dflash", "draft": str(folder), "num_draft_tokens": block - 1}
        },
        "ours-auto": {"speculative": {"method": "dflash", "draft": str(folder)}},
    }
    per_token: dict[tuple[str, str], list[float]] = defaultdict(list)
    identical: dict[str, int] = defaultdict(int)
    for row in rows:  # warm-up: allocations, lazy imports, loading
        target.generate(prompts[0], max_new_tokens=8, do_sample=False, **rows[row])
    for i, input_ids in enumerate(prompts):
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        names = list(rows)
        outputs = {}
        for row in names[i % len(names) :] + names[: i % len(names)]:
            for profile in [PROFILES[p] for p in args.profiles.split(",")]:
                profile = profile.with_step(args.step_ms / 1000) if profile.emulated else profile
                with emulate(target, profile):
                    start = clock(target.device)
                    out = target.generate(
                        **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **rows[row]
                    )
                    seconds = clock(target.device) - start
                tokens = sum(len(t) for t in _new_tokens(out, inputs, eos))
                per_token[(profile.name, row)].append(seconds / tokens)
                outputs.setdefault(row, out)
        for row in names:
            identical[row] += bool(torch.equal(outputs[row], outputs["plain"]))
        print(f"[{i + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
    runtime = describe_runtime(target)
    lines = [
        f"{runtime}; block {block}; {len(prompts)} prompts, batch 1, greedy, "
        f"{args.max_new_tokens} new tokens",
        "",
    ]
    lines += [
        "| row | " + " | ".join(f"{p} ms/token" for p in args.profiles.split(",")) + " | equal to plain |"
    ]
    lines += ["|---|" + "---:|" * (len(args.profiles.split(",")) + 1)]
    for row in rows:
        cells = [f"{1000 * statistics.median(per_token[(p, row)]):.1f}" for p in args.profiles.split(",")]
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {identical[row]}/{len(prompts)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default=None, help="a block draft of ours (train-draft --method dflash)")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama target and assistant")
    parser.add_argument("--model", default=None, help="default: the offline SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--profiles", default="real,flat")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--suite", default="specbench-quick")
    parser.add_argument("--categories", default="qa,mt_bench,translation,math_reasoning")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--out", default="bench_out/muse_glimmer_assistant", help="where the assistant is written"
    )
    args = parser.parse_args()
    if not args.tiny and args.draft is None:
        parser.error("pass --draft DIR (a block draft of ours) or --tiny")
    print(measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
