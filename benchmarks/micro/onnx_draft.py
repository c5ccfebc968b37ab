"""ONNX Runtime drafting on CPU, SmolLM2-135M-Instruct, Spec-Bench prompts, greedy, batch 1.

1. Draft cost: the same draft (SmolLM2 itself) run by PyTorch (`method="draft_model"`) and by ONNX
   Runtime (`method="onnx"`), fixed draft length, runs interleaved prompt by prompt
   (torch, onnx, onnx, torch); seconds of drafting per drafted token, medians and their ratio.
2. `method="quantized"` (int8 per-channel ONNX copy of the target drafting for it) against plain
   `generate`, interleaved (plain, quantized, quantized, plain): speedup, acceptance, and the int8
   copy's greedy agreement with the target (its argmax along the target's own output).
Every speculative output is compared with plain greedy `generate`.

    python benchmarks/micro/onnx_draft.py                  # one prompt per Spec-Bench category, 64 new tokens
    python benchmarks/micro/onnx_draft.py --limit 2 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec.bench.suites import load_suite, take_per_category
from hf_specdec.core.timing import clock
from hf_specdec.ort import export_onnx
from hf_specdec.ort.cache import quantized_copy
from hf_specdec.ort.kv import OrtKV
from hf_specdec.ort.session import OnnxDecoder
from hf_specdec.store.paths import cache_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=1, help="prompts per Spec-Bench category")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4, help="draft length for the draft-cost runs")
    parser.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime intra-op threads")
    parser.add_argument("--onnx-dir", type=Path, default=None, help="fp32 export (built if missing)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = hf_specdec.demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # same weights
    onnx_dir = args.onnx_dir or cache_dir() / "onnx" / f"{Path(path).name}-fp32"
    if not (onnx_dir / "model.onnx").exists():
        export_onnx(path, onnx_dir)
    int8_dir = quantized_copy(target, tokenizer)
    options = dict(threads=args.threads, tokenizer_verified=True)
    prompts = take_per_category(load_suite("specbench-quick"), args.limit)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, tokenizer=tokenizer)
    fixed = dict(num_draft_tokens=args.draft_tokens, options=options)
    speculative = {
        "torch": dict(
            method="draft_model",
            draft=draft,
            options=dict(tokenizer_verified=True),
            num_draft_tokens=args.draft_tokens,
        ),
        "onnx": dict(method="onnx", draft=str(onnx_dir), **fixed),
        "quantized": dict(method="quantized", options=options),
    }

    warm = _encode(tokenizer, "Hello!")
    for spec in (None, *speculative.values()):
        target.generate(**warm, max_new_tokens=8, do_sample=False, speculative=spec)

    per_token = {"torch": [], "onnx": []}
    plain_s = quant_s = 0.0
    identical = True
    agree = total = 0
    quant_stats = hf_specdec.SpeculativeStats()
    print(
        f"{'prompt':<22}{'torch ms/tok':>13}{'onnx ms/tok':>12}{'plain s':>9}{'quant s':>9}{'speedup':>9}"
        f"{'accept':>8}{'same':>6}"
    )
    for prompt in prompts:
        inputs = _encode(tokenizer, prompt.text)
        plain, t_plain = _timed(target, inputs, settings, None)
        outputs = []
        for name in ("torch", "onnx", "onnx", "torch"):
            out, _ = _timed(target, inputs, settings, speculative[name])
            s = out.speculative_stats
            per_token[name].append(1e3 * s.draft_seconds / max(s.drafted, 1))
            outputs.append(out.sequences)
        t_quant = 0.0
        for name in ("quantized", "quantized", "plain"):
            out, seconds = _timed(target, inputs, settings, None if name == "plain" else speculative[name])
            if name == "plain":
                t_plain += seconds
            else:
                t_quant += seconds
                outputs.append(out.sequences)
                quant_stats.merge(out.speculative_stats)
                stats = out.speculative_stats
        same = all(torch.equal(plain, o) for o in outputs)
        identical &= same
        plain_s, quant_s = plain_s + t_plain, quant_s + t_quant
        a, n = _greedy_agreement(int8_dir, plain, inputs["input_ids"].shape[1])
        agree, total = agree + a, total + n
        print(
            f"{prompt.category[:21]:<22}{statistics.median(per_token['torch'][-2:]):>13.1f}"
            f"{statistics.median(per_token['onnx'][-2:]):>12.1f}{t_plain / 2:>9.2f}{t_quant / 2:>9.2f}"
            f"{t_plain / t_quant:>8.2f}x{stats.acceptance_rate:>8.0%}{'yes' if same else 'NO':>6}"
        )

    torch_ms, onnx_ms = statistics.median(per_token["torch"]), statistics.median(per_token["onnx"])
    print(
        f"\nDrafting per drafted token (median over {len(per_token['onnx'])} runs, draft length "
        f"{args.draft_tokens}): PyTorch {torch_ms:.1f} ms, ONNX Runtime {onnx_ms:.1f} ms, "
        f"ratio {torch_ms / onnx_ms:.2f}x"
    )
    print(
        f"method='quantized' vs plain generate: {plain_s / quant_s:.2f}x overall "
        f"(acceptance {quant_stats.acceptance_rate:.0%}, mean accepted length "
        f"{quant_stats.mean_accepted_length:.2f} per step, "
        f"{quant_stats.mean_accepted_length_speculative:.2f} per speculative step)"
    )
    print(f"int8 copy's greedy agreement with the target: {agree / total:.1%} ({total} tokens)")
    print(f"All speculative outputs identical to plain greedy generate: {'yes' if identical else 'NO'}")


def _timed(model, inputs, settings, speculative):
    start = clock(model.device)
    if speculative is None:
        out = model.generate(**inputs, **settings)
    else:
        out = model.generate(**inputs, **settings, speculative=speculative, return_dict_in_generate=True)
    return out, clock(model.device) - start


def _greedy_agreement(folder: Path, sequence: torch.Tensor, prompt_len: int) -> tuple[int, int]:
    """How many of the target's greedy tokens the int8 model also ranks first, given the same prefix."""
    kv = OrtKV(OnnxDecoder.load(folder, threads=torch.get_num_threads()), 1)
    logits = kv.forward(sequence[:, :-1], torch.ones_like(sequence[:, :-1], dtype=torch.bool)).logits
    predicted = logits[0, prompt_len - 1 :].argmax(-1)
    return int((predicted == sequence[0, prompt_len:]).sum()), len(predicted)


def _encode(tokenizer, text: str):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


if __name__ == "__main__":
    main()
