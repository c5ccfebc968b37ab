#!/usr/bin/env bash
# Train a DFlash block draft and an EAGLE head for SmolLM2-135M-Instruct for the same minutes on this
# machine, then measure them against n-grams per Spec-Bench category (BENCHMARKS_HEADS.md, "Block
# drafts").
#
# Training text: SmolLM2's greedy answers (128 new tokens) to every other prompt of `specbench-train`
# (231 of its 462: a 2-core machine shared by other jobs generated them in 31 min), written once and
# shared by both runs. Each run trains 25 minutes, then is resumed to 50 and 90 (the budget each
# measurement below names); the DFlash draft trains on batches of 1024 tokens after its first 25
# minutes (four times the optimizer steps a minute: 75 steps of 4096 tokens had taught it next to
# nothing). Runs go to $RUNS (default ~/.cache/hf-specdec/block-drafts); an interrupted run resumes.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-$HOME/.cache/hf-specdec/block-drafts}
mkdir -p "$RUNS"
python - "$RUNS/train_prompts.jsonl" <<'EOF'
import json, sys
from hf_specdec.bench.suites import load_suite
with open(sys.argv[1], "w") as f:
    for p in load_suite("specbench-train")[::2]:
        f.write(json.dumps({"prompt": p.text, "category": p.category, "id": p.id}) + "\n")
EOF
train() {  # METHOD MINUTES [extra flags]
    OMP_NUM_THREADS=1 hf-specdec train-draft --method "$1" --data "$RUNS/train_prompts.jsonl" \
        --max-new-tokens 128 --out "$RUNS/$1" --minutes "$2" "${@:3}"
}
for minutes in 25 50 90; do
    dflash_batch=$([ "$minutes" = 25 ] && echo 4096 || echo 1024)
    train eagle "$minutes"
    train dflash "$minutes" --block-size 8 --draft-layers 2 --batch-tokens "$dflash_batch"
    mkdir -p "$RUNS/at-$minutes"
    cp -r "$RUNS/eagle" "$RUNS/at-$minutes/eagle" && rm -rf "$RUNS/at-$minutes/eagle/data"
    cp -r "$RUNS/dflash" "$RUNS/at-$minutes/dflash" && rm -rf "$RUNS/at-$minutes/dflash/data"
done
# The emulated `flat` profile (virtual clock: fine on a busy machine). For the real clock, run it
# again with --profiles real,flat under `flock /work/.timing.lock` and note `uptime`'s load.
python benchmarks/reports/block_drafts.py --head eagle="$RUNS/at-90/eagle" --head dflash="$RUNS/at-90/dflash" \
    --methods eagle,dflash,dflash:7,ngram --profiles flat --threads 1 \
    --out bench_out/block_drafts.json --markdown bench_out/block_drafts.md
