"""One GPU check for a session lent a GPU (issue 12): writes one JSON, finishes in minutes.

    python benchmarks/gpu/gpu_check.py --out gpu_check.json  # on the GPU machine (gpu_check.sh)
    python benchmarks/gpu/gpu_check.py --device cpu --quick  # this script's own smoke test, on a CPU

SmolLM2-135M-Instruct (the offline demo model, built from PyPI on first use) in bf16 on the device:

1. lossless: greedy plain `generate` vs every method that runs offline (ngram and draft_model with
   the model as its own draft, chains and trees, onnx on the CUDA provider, quantized) on the
   built-in suite's prompts, batch 1 and a left-padded batch of 8: each row classified identical /
   tie / mismatch by `hf_specdec.lossless.check_greedy` (mismatches must be 0);
2. sampling smoke: the same methods with do_sample=True run to completion on the device;
3. speed: plain vs each method at batch 1 and batch 8 (grounded prompts), interleaved, medians,
   with every clock read synchronizing the device;
4. policy ("why plain?"): ngram with `num_draft_tokens="auto"` on each grounded prompt at batch 1,
   with what the policy saw and chose (`SpeculativeStats`: tokens asked for, widths verified and
   their seconds per step), next to a sweep of fixed draft lengths, so one run shows whether `auto`
   stays near the best fixed k and, where it does not, which timings made it decode plainly;
5. compiled (issue 23, `--sections compiled`): plain and ngram, eager (dynamic cache) and on
   transformers' fast path (static cache, decode step compiled with its default `CompileConfig`:
   inductor, "reduce-overhead", CUDA graphs on a GPU), each grounded prompt at batch 1,
   interleaved, after every verify width was compiled; tokens/s per row, the two speedups, the
   compile seconds and the graphs compiled while timing (0 expected).

Each section is timed and bounded (`--budget` seconds in all); what did not run says why.
`--sections` picks some (default: the first four).
"""

from __future__ import annotations

import argparse
import json
import statistics
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import CompileConfig

import hf_specdec
from hf_specdec.bench.runner import compile_widths, fast_path
from hf_specdec.bench.suites import load_suite
from hf_specdec.core.timing import clock
from hf_specdec.loading import describe_runtime, encode_prompts, load_model, pad_token_id
from hf_specdec.lossless import check_greedy, count_kinds

GROUNDED = ("summarization", "rag")


def methods(model, device: torch.device, onnx_folder: str | None) -> dict[str, Any]:
    """The methods to check; onnx needs an exported folder (made by `main` when onnxruntime is there)."""
    found = {
        "ngram": {"method": "ngram"},
        "ngram tree": {"method": "ngram", "tree": True},
        "draft_model (itself)": {"method": "draft_model", "draft": model, "num_draft_tokens": 4},
        "draft_model (itself) tree": {"method": "draft_model", "draft": model, "tree": True},
        "quantized": {"method": "quantized"},
    }
    if onnx_folder is not None:
        provider = "cuda" if device.type == "cuda" else "cpu"
        found["onnx"] = {"method": "onnx", "draft": onnx_folder, "options": {"provider": provider}}
    return found


def batch_of(tokenizer, model, prompts, size: int, device) -> dict[str, torch.Tensor]:
    chosen = (prompts * size)[:size]
    return encode_prompts(tokenizer, chosen, True, pad_token_id(tokenizer, model), device)


def timed(model, inputs, **kwargs) -> tuple[float, Any]:
    start = clock(inputs["input_ids"].device)
    out = model.generate(**inputs, **kwargs)
    return clock(inputs["input_ids"].device) - start, out


def lossless(model, tokenizer, prompts, cases, device, new_tokens: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for size in (1, 8):
        inputs = batch_of(tokenizer, model, prompts, size, device)
        plain = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        for name, spec in cases.items():
            try:
                out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, speculative=spec)
                rows = check_greedy(model, inputs["input_ids"], plain, out, inputs["attention_mask"])
                report[f"{name}, batch {size}"] = count_kinds(rows)
            except Exception as err:  # report and go on: one method must not hide the others
                report[f"{name}, batch {size}"] = {"error": f"{type(err).__name__}: {err}"}
    return report


def sampling(model, tokenizer, prompts, cases, device, new_tokens: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    inputs = batch_of(tokenizer, model, prompts, 4, device)
    for name, spec in cases.items():
        try:
            torch.manual_seed(0)
            out = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=True,
                temperature=0.8,
                top_p=0.95,
                speculative=spec,
                return_dict_in_generate=True,
            )
            stats = out.speculative_stats
            report[name] = {"ran": True, "drafted": stats.drafted, "accepted": stats.accepted}
        except Exception as err:
            report[name] = {"ran": False, "error": f"{type(err).__name__}: {err}"}
    return report


def speed(model, tokenizer, prompts, cases, device, new_tokens: int, repeats: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    grounded = [p for p in prompts if p.category in GROUNDED] or prompts
    for size in (1, 8):
        inputs = batch_of(tokenizer, model, grounded, size, device)
        settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        timed(model, inputs, **settings)  # warm-up
        for name, spec in cases.items():
            try:
                plain_s, spec_s = [], []
                for _ in range(repeats):  # interleaved: drift in load cancels out of the ratio
                    plain_s.append(timed(model, inputs, **settings)[0])
                    spec_s.append(timed(model, inputs, **settings, speculative=spec)[0])
                ratio = statistics.median(plain_s) / statistics.median(spec_s)
                report[f"{name}, batch {size}"] = {
                    "speedup": round(ratio, 3),
                    "plain_s": statistics.median(plain_s),
                    "speculative_s": statistics.median(spec_s),
                }
            except Exception as err:
                report[f"{name}, batch {size}"] = {"error": f"{type(err).__name__}: {err}"}
    return report


FIXED_KS = (2, 4, 8, 12, 16)


def compiled(
    model, tokenizer, prompts, device, new_tokens: int, repeats: int, backend: str, checkpoint
) -> dict[str, Any]:
    """`checkpoint(report)` after each prompt: what ran survives a timeout."""
    config = CompileConfig(backend=backend)  # transformers' default but for the backend
    # Each prompt's static cache has its own length, a new shape for plain's graph and our five
    # widths: past dynamo's default 8 graphs per function it would run them eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    fast = fast_path(static_cache=False, compile=config)
    rows = {
        "plain eager": {},
        "plain compiled": fast,
        "ngram eager": {"speculative": "ngram"},
        "ngram compiled": {**fast, "speculative": "ngram"},
    }
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    report: dict[str, Any] = {}
    for prompt in [p for p in prompts if p.category in GROUNDED] or prompts[:2]:
        inputs = batch_of(tokenizer, model, [prompt], 1, device)
        started = clock(device)
        for extra in rows.values():  # warm-up: plain's graph and ours at the widths it reaches
            timed(model, inputs, **settings, **extra)
        compile_widths(model, inputs, {**settings, **fast})
        warm_up_s = clock(device) - started
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        seconds: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(repeats):  # interleaved: drift in load cancels out of the ratios
            for name, extra in rows.items():
                seconds[name].append(timed(model, inputs, **settings, **extra)[0])
        median = {name: statistics.median(s) for name, s in seconds.items()}
        report[f"{prompt.category} {prompt.id}"] = {
            "tokens_per_s": {name: round(new_tokens / s, 2) for name, s in median.items()},
            "ngram_over_plain_eager": round(median["plain eager"] / median["ngram eager"], 3),
            "ngram_over_plain_compiled": round(median["plain compiled"] / median["ngram compiled"], 3),
            "plain_compiled_over_eager": round(median["plain eager"] / median["plain compiled"], 3),
            "warm_up_and_compile_s": round(warm_up_s, 1),
            "graphs_compiled_while_timing": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        }
        checkpoint(report)
    return report


def policy_trace(model, tokenizer, prompts, device, new_tokens: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    for prompt in [p for p in prompts if p.category in GROUNDED] or prompts[:2]:
        inputs = batch_of(tokenizer, model, [prompt], 1, device)
        timed(model, inputs, **settings)  # warm-up
        plain_s = timed(model, inputs, **settings)[0]
        seconds, out = timed(
            model, inputs, **settings, speculative={"method": "ngram"}, return_dict_in_generate=True
        )
        stats = out.speculative_stats
        widths = {}
        for width, verify_s in zip(stats.verified_widths, stats.verify_times):
            if verify_s is not None:
                widths.setdefault(width, []).append(verify_s)
        sweep = {}
        for k in FIXED_KS:
            spec = {"method": "ngram", "num_draft_tokens": k}
            sweep[f"k{k}"] = round(plain_s / timed(model, inputs, **settings, speculative=spec)[0], 3)
        report[f"{prompt.category} {prompt.id}"] = {
            "auto_speedup": round(plain_s / seconds, 3),
            "fixed_k_speedup": sweep,
            "speculative_steps": stats.speculative_steps,
            "steps": stats.steps,
            "tokens_per_forward": round(stats.mean_accepted_length, 2),
            "draft_lengths_asked": stats.draft_lengths,
            "verified_widths": stats.verified_widths,
            "verify_ms_by_width": {w: [round(1e3 * t, 3) for t in ts] for w, ts in sorted(widths.items())},
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="a few tokens and one repeat: a smoke test")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all sections together")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument(
        "--sections", default="lossless,sampling,speed,policy", help="comma-separated (also: compiled)"
    )
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend of `compiled` (eager: a smoke test)"
    )
    args = parser.parse_args()
    chosen = args.sections.split(",")
    started = clock("cpu")
    device = torch.device(args.device)
    new_tokens, repeats = (8, 1) if args.quick else (96, 3)
    model, tokenizer = load_model(None, dtype=args.dtype, device=device)
    prompts = load_suite("builtin")
    report: dict[str, Any] = {"runtime": describe_runtime(model), "sections": {}}

    onnx_folder = None
    if any(name in chosen for name in ("lossless", "sampling", "speed")):  # the sections with onnx rows
        try:
            from hf_specdec.ort import export_onnx
            from hf_specdec.store.paths import cache_dir

            onnx_dtype = "fp16" if device.type == "cuda" else "fp32"
            folder = cache_dir() / "onnx" / f"SmolLM2-135M-Instruct-{onnx_dtype}"
            if not (folder / "model.onnx").exists():
                export_onnx(hf_specdec.demo_model_path(), folder, dtype=onnx_dtype)
            onnx_folder = str(folder)
        except Exception as err:
            report["onnx_export"] = f"{type(err).__name__}: {err}"
    cases = methods(model, device, onnx_folder)

    sections = [
        ("lossless", lambda: lossless(model, tokenizer, prompts, cases, device, new_tokens)),
        ("sampling", lambda: sampling(model, tokenizer, prompts, cases, device, new_tokens)),
        ("speed", lambda: speed(model, tokenizer, prompts, cases, device, new_tokens, repeats)),
        ("policy", lambda: policy_trace(model, tokenizer, prompts, device, new_tokens)),
        (
            "compiled",
            lambda: compiled(
                model, tokenizer, prompts, device, new_tokens, repeats, args.backend, partial("compiled")
            ),
        ),
    ]

    def partial(section: str):
        def save(results: dict[str, Any]) -> None:
            report["sections"][section] = {**results, "partial": True}
            Path(args.out).write_text(json.dumps(report, indent=2))

        return save

    unknown = set(chosen) - {name for name, _ in sections}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    for name, run in [(name, run) for name, run in sections if name in chosen]:
        if clock("cpu") - started > args.budget:
            report["sections"][name] = {"skipped": f"past the {args.budget:.0f} s budget"}
            continue
        section_start = clock("cpu")
        try:
            report["sections"][name] = run()
        except Exception:
            report["sections"][name] = {"error": traceback.format_exc(limit=3)}
        report["sections"][name + "_seconds"] = round(clock("cpu") - section_start, 1)
        Path(args.out).write_text(json.dumps(report, indent=2))  # what ran survives a later failure
    report["seconds"] = round(clock("cpu") - started, 1)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
