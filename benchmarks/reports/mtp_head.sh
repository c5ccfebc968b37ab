#!/usr/bin/env bash
# An MTP head (DeepSeek-V3's design) and an EAGLE head for SmolLM2-135M-Instruct, trained on the same
# text for the same number of steps, then measured side by side (benchmarks/reports/mtp_head.py).
#
# Training text: SmolLM2's greedy answers (128 new tokens) to 150 Spec-Bench prompts of the
# `specbench-train` suite (25 per category, spread evenly; the 18 of `specbench-quick`, which the
# measurement uses, are never among them). STEPS (default 300) optimizer steps each; the MTP run
# reuses the answers and the target's features the EAGLE run computed. Heads go to $HEADS
# (default ~/.cache/hf-specdec/heads); an interrupted run resumes when the script runs again.
set -euo pipefail
cd "$(dirname "$0")/../.."
HEADS=${HEADS:-$HOME/.cache/hf-specdec/heads}
STEPS=${STEPS:-300}
mkdir -p "$HEADS"
python - "$HEADS/specbench-train-150.jsonl" <<'PY'
import json, sys
from hf_specdec.bench.suites import load_suite, take_per_category
with open(sys.argv[1], "w") as f:
    for p in take_per_category(load_suite("specbench-train"), 25):
        f.write(json.dumps({"prompt": p.text, "category": p.category, "id": p.id}) + "\n")
PY
for method in eagle mtp; do
    if [ "$method" = mtp ]; then  # the same answers and features as the EAGLE run
        mkdir -p "$HEADS/smollm2-135m-mtp/data"
        cp -n "$HEADS/smollm2-135m-eagle-150/data/"{sequences,features}.pt "$HEADS/smollm2-135m-mtp/data/" || true
    fi
    out="$HEADS/smollm2-135m-$method"
    [ "$method" = eagle ] && out="$HEADS/smollm2-135m-eagle-150"
    hf-specdec train-draft --method "$method" --out "$out" --data "$HEADS/specbench-train-150.jsonl" \
        --max-new-tokens 128 --minutes 120 --max-steps "$STEPS"
done
python benchmarks/reports/mtp_head.py --eagle "$HEADS/smollm2-135m-eagle-150" --mtp "$HEADS/smollm2-135m-mtp" "$@"
