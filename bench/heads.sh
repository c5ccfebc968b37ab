#!/usr/bin/env bash
# Train an EAGLE and a Medusa head for SmolLM2-135M-Instruct on this machine, then measure them.
#
# Training text: SmolLM2's own greedy answers (192 new tokens) to the 462 Spec-Bench prompts of the
# `specbench-train` suite, i.e. every Spec-Bench prompt except the 18 of `specbench-quick`, which the
# measurement then uses (categories qa, mt_bench [its first prompt is MT-bench writing],
# math_reasoning, translation: the open prompts; batch 1, greedy, 128 new tokens).
# Heads are written to $HEADS (default ~/.cache/hf-specdec/heads); an interrupted training resumes
# when the script is run again. EAGLE_MINUTES / MEDUSA_MINUTES set the training time.
set -euo pipefail
cd "$(dirname "$0")/.."
HEADS=${HEADS:-$HOME/.cache/hf-specdec/heads}
hf-specdec train-draft --method eagle --out "$HEADS/smollm2-135m-eagle" --minutes "${EAGLE_MINUTES:-30}"
# Same prompts and settings: the medusa run reuses the answers the eagle run generated.
mkdir -p "$HEADS/smollm2-135m-medusa/data"
cp -n "$HEADS/smollm2-135m-eagle/data/sequences.pt" "$HEADS/smollm2-135m-medusa/data/" || true
hf-specdec train-draft --method medusa --out "$HEADS/smollm2-135m-medusa" --minutes "${MEDUSA_MINUTES:-15}"
hf-specdec bench --suite specbench-quick --categories qa,mt_bench,math_reasoning,translation \
    --methods eagle,medusa,ngram --head eagle="$HEADS/smollm2-135m-eagle" \
    --head medusa="$HEADS/smollm2-135m-medusa" --max-new-tokens 128 --no-transformers \
    --out bench_out/heads --markdown bench_out/heads/heads.md "$@"
