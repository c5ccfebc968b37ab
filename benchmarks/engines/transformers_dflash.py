"""Our DFlash drafting against transformers' own (`speculation_type="dflash"` with a MuseGlimmer
assistant, `DFlashTokenCandidateGenerator`), on the same assistant and target, batch 1, greedy.

    python benchmarks/engines/transformers_dflash.py --draft DIR [--model M] [--dtype float32]
        [--suite specbench-quick] [--categories qa,mt_bench,translation,math_reasoning] [--limit 2]
        [--max-new-tokens 96] [--rounds 3]
    python benchmarks/engines/transformers_dflash.py --tiny    # a random tiny Llama and assistant

`--draft` is a block draft of ours (`hf-specdec train-draft --method dflash`): it is written as a
MuseGlimmer assistant (full-attention layers, the target's whole vocabulary scored: the layout
transformers runs), and both sides draft with that same assistant, so their drafts are the same
(tests/drafters/test_dflash.py checks them step by step). Rows per prompt, interleaved in rotated
order, `--rounds` times: plain, transformers (its whole block verified every step), ours with the
same fixed block, ours with the adaptive policy. On one thread (every operation on the calling
thread), so the thread's CPU time (`time.thread_time`) is the work each loop did, which other
processes on a shared machine do not inflate as they do the wall clock. Reported: CPU time per
generated token (median over prompts of the best round) against transformers', tokens per target
forward, and how many outputs equal plain greedy (in fp32, the default here, all should).
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

from hf_specdec.bench.result import tokens_per_verify_forward
from hf_specdec.bench.runner import _new_tokens, _select_prompts
from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.layouts import check_dflash_layout
from hf_specdec.loading import (
    describe_runtime,
    encode_prompts,
    eos_token_ids,
    load_model,
    pad_token_id,
    use_chat_template,
)


def as_muse_glimmer(draft: Any, target: Any) -> MuseGlimmerAssistantModel:
    """Our block draft as a MuseGlimmer assistant: same tensors (`fc`, `hidden_norm` as `encoder.*`),
    full-attention layers; its draft vocabulary is dropped (the assistant scores every token)."""
    c = draft.config
    try:  # what z-lab's layout cannot hold, MuseGlimmer's (the same tensors) cannot either
        check_dflash_layout(draft)
    except ValueError as err:
        raise SystemExit(f"Not comparable with transformers' MuseGlimmer assistant: {err}") from err
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


def _run(target: Any, inputs: dict, new: int, extra: dict) -> tuple[float, int, Any]:
    """(CPU seconds of this thread, target forwards, output) of one greedy generate."""
    forwards = []
    hook = target.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with torch.no_grad():
            start = time.thread_time()
            out = target.generate(**inputs, max_new_tokens=new, do_sample=False, **extra)
            seconds = time.thread_time() - start
    finally:
        hook.remove()
    return seconds, len(forwards), out


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
    per_token: dict[str, list[float]] = defaultdict(list)
    per_forward: dict[str, list[float]] = defaultdict(list)
    identical: dict[str, int] = defaultdict(int)
    for row in rows:  # warm-up: allocations, lazy imports, loading
        target.generate(prompts[0], max_new_tokens=8, do_sample=False, **rows[row])
    for i, input_ids in enumerate(prompts):
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        names = list(rows)
        best: dict[str, float] = defaultdict(lambda: float("inf"))
        outputs = {}
        for _ in range(args.rounds):
            for row in names[i % len(names) :] + names[: i % len(names)]:  # interleaved
                seconds, forwards, out = _run(target, inputs, args.max_new_tokens, rows[row])
                tokens = sum(len(t) for t in _new_tokens(out, inputs, eos))
                best[row] = min(best[row], seconds / tokens)
                per_forward[row].append(tokens_per_verify_forward(tokens, forwards))
                outputs.setdefault(row, out)
        for row in names:
            per_token[row].append(best[row])
            identical[row] += bool(torch.equal(outputs[row], outputs["plain"]))
        print(f"[{i + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
    runtime = describe_runtime(target)
    base = statistics.median(per_token["transformers"])
    lines = [
        f"{runtime}; {torch.get_num_threads()} thread(s); block {block}; {len(prompts)} prompts, batch 1, "
        f"greedy, {args.max_new_tokens} new tokens, best of {args.rounds} rounds",
        "",
        "| row | CPU ms/token | vs transformers | tokens per target forward | equal to plain |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        ms = statistics.median(per_token[row])
        forward, same = statistics.mean(per_forward[row]), f"{identical[row]}/{len(prompts)}"
        lines.append(f"| {row} | {1000 * ms:.1f} | {ms / base:.2f}x | {forward:.2f} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default=None, help="a block draft of ours (train-draft --method dflash)")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama target and assistant")
    parser.add_argument("--model", default=None, help="default: the offline SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32", help="float32 (default): outputs equal plain's")
    parser.add_argument("--rounds", type=int, default=3)
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
    torch.set_num_threads(1)  # every operation on this thread, whose CPU time is what is measured
    print(measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
