#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: train an EAGLE head for SmolLM2-135M-Instruct in minutes (the CPU
# takes an hour for a head trained on 8x less text, benchmarks/reports/heads.sh), then measure trees against chains
# where verification is nearly free: ngram and eagle, chain and tree, bf16, batch 1.
#   benchmarks/gpu/gpu_heads.sh [OUT_DIR]     (default: bench_out/gpu_heads; $OUT/gpu_heads on the device tool)
# Training text: the target's greedy answer and 3 answers sampled from it for each of the 462
# `specbench-train` prompts (384 new tokens); the benchmark reads `specbench-quick`, which those leave
# out. The head is written to $HEAD (default ~/.cache/hf-specdec/heads/smollm2-135m-eagle-gpu);
# measure it on a CPU afterwards with `hf-specdec bench --methods eagle,eagle+tree --head eagle=$HEAD`.
# EAGLE_MINUTES sets the training time; TRAIN_ARGS / BENCH_ARGS replace the data and bench options
# (a CPU smoke test: TRAIN_ARGS="--data few.jsonl --max-new-tokens 8" EAGLE_MINUTES=0.1 DEVICE=cpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:-bench_out}/gpu_heads}"
head="${HEAD:-$HOME/.cache/hf-specdec/heads/smollm2-135m-eagle-gpu}"
device="${DEVICE:-cuda}"
mkdir -p "$out"
cli() { "${PYTHON:-python3}" -m hf_specdec.cli "$@"; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

# shellcheck disable=SC2086  # the *_ARGS are lists of options
cli train-draft --method eagle --device "$device" --dtype bfloat16 --out "$head" \
    --minutes "${EAGLE_MINUTES:-3.5}" ${TRAIN_ARGS:---suite specbench-train --max-new-tokens 384 --answers-per-prompt 4} \
    2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$" | tee "$out/train.log"
cp "$head/training.json" "$head/training.png" "$out/" 2>/dev/null || true

# shellcheck disable=SC2086
cli bench --device "$device" --dtype bfloat16 --methods ngram,ngram+tree,eagle,eagle+tree \
    --head eagle="$head" ${BENCH_ARGS:---suite specbench-quick --limit 2 --max-new-tokens 128} \
    --no-transformers --out "$out/bench" --markdown "$out/gpu_heads.md" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
