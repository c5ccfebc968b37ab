#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (a session lent one): the issue-12 GPU check in one JSON, in at
# most ~8 minutes: bf16 tie-aware identity and a sampling smoke test on CUDA, then speedups at batch 1
# and 8 for ngram (chain and tree), draft_model (the model as its own draft), onnx on the CUDA
# provider and quantized. See benchmarks/gpu/gpu_check.py.
#   benchmarks/gpu/gpu_check.sh [OUT_JSON]        (default: gpu_check.json; $OUT/gpu_check.json on the device tool)
# Then issue 23's compiled rows (gpu_compiled.json beside it), in the time left of ~9.5 minutes.
# Not run here (a 10-minute command holds no more): an EAGLE head compiled beside the compiled
# target, CUDA graphs, as a second command: python benchmarks/micro/eagle_compiled.py --device cuda
# Then, with time left, the serving checks of issue 15 (benchmarks/engines/vllm_check.sh, benchmarks/engines/sglang_flags.py).
# Installs what it needs first (torch's CUDA build is expected to be there already; onnxruntime-gpu
# replaces the CPU onnxruntime for the onnx rows).
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
pip install -q -e . 2>/dev/null || true
pip install -q onnx onnxscript "onnxruntime-gpu>=1.22" 2>/dev/null || echo "onnxruntime-gpu not installed: onnx rows will report it"
out="${1:-${OUT:-.}/gpu_check.json}"
timeout 480 python benchmarks/gpu/gpu_check.py --device cuda --dtype bfloat16 --out "$out"
# Issue 23's GPU rows (eager / compiled plain and ngram, CUDA graphs), in their own JSON beside it;
# GPU_CHECK_COMPILED=0 skips them.
# Bounded so that the whole script stays under the device tool's 10 minutes a command.
if [ "${GPU_CHECK_COMPILED:-1}" = 1 ]; then
    left=$((570 - SECONDS))
    if [ "$left" -gt 120 ]; then
        timeout "$left" python benchmarks/gpu/gpu_check.py --device cuda --dtype bfloat16 --sections compiled \
            --budget $((left - 30)) --out "$(dirname "$out")/gpu_compiled.json" \
            || echo "compiled rows: failed or out of time ($(dirname "$out")/gpu_compiled.json if it got that far)"
    else
        echo "compiled rows skipped: ${left}s left; run: python benchmarks/gpu/gpu_check.py --sections compiled"
    fi
fi

# Issue 15's serving checks, after the main JSON and only with time left (the device tool allows
# 10 minutes a command; GPU_CHECK_SERVING=0 skips them): a real vLLM serving our exports
# (benchmarks/engines/vllm_check.sh installs vllm into its own venv; where that fails, e.g. no network, its JSON
# says so) and every SGLang flag we write against the sglang wheel (benchmarks/engines/sglang_flags.py).
if [ "${GPU_CHECK_SERVING:-1}" = 1 ]; then
    dir="$(dirname "$out")"
    left=$((540 - SECONDS))
    if [ "$left" -gt 180 ]; then
        VLLM_CHECK_TRAIN_SECONDS=30 timeout "$left" benchmarks/engines/vllm_check.sh "$dir/vllm_check.json" \
            || echo "vllm_check: failed or out of time (above; $dir/vllm_check.json if it got that far)"
    else
        echo "vllm_check skipped: ${left}s of the 9-minute budget left"
    fi
    timeout 90 python benchmarks/engines/sglang_flags.py --out "$dir/sglang_flags.json" \
        || echo "sglang_flags: failed (no network to download the wheel?); tests/serving/test_engines.py checks the list"
fi
