#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (a session lent one): the issue-12 GPU check in one JSON, in at
# most ~8 minutes: bf16 tie-aware identity and a sampling smoke test on CUDA, then speedups at batch 1
# and 8 for ngram (chain and tree), draft_model (the model as its own draft), onnx on the CUDA
# provider and quantized. See bench/gpu_check.py.
#   bench/gpu_check.sh [OUT_JSON]        (default: gpu_check.json; $OUT/gpu_check.json on the device tool)
# Installs what it needs first (torch's CUDA build is expected to be there already; onnxruntime-gpu
# replaces the CPU onnxruntime for the onnx rows).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
pip install -q -e . 2>/dev/null || true
pip install -q onnx onnxscript "onnxruntime-gpu>=1.22" 2>/dev/null || echo "onnxruntime-gpu not installed: onnx rows will report it"
out="${1:-${OUT:-.}/gpu_check.json}"
timeout 480 python bench/gpu_check.py --device cuda --dtype bfloat16 --out "$out"
