#!/usr/bin/env bash
# Drafts trained here for SmolLM2-135M-Instruct, side by side: an EAGLE head, an MTP layer in
# DeepSeek-V3's design (train-draft --method mtp) and a DFlash block draft, each trained on the same
# text for the same minutes, then measured against n-grams per Spec-Bench category
# (benchmarks/reports/trained_drafts.py; figures in BENCHMARKS_HEADS.md, "Trained drafts").
#
# Training text: SmolLM2's greedy answers (128 new tokens) to 150 prompts of `specbench-train` (25
# per category, spread evenly; `specbench-quick`, which the measurement uses, is never among them),
# generated once by the EAGLE run and copied to the others (with the EAGLE run's features for the
# MTP run, which reads the same layer). MINUTES (default 25) of training each; the DFlash draft on
# batches of 1024 tokens (4096-token batches gave it a quarter of the optimizer steps and taught it
# next to nothing in 25 minutes). Runs go to $RUNS (default ~/.cache/hf-specdec/trained-drafts); an
# interrupted run resumes when the script runs again. PROFILES (default flat,real) are passed on.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-$HOME/.cache/hf-specdec/trained-drafts}
MINUTES=${MINUTES:-25}
PROFILES=${PROFILES:-flat,real}
mkdir -p "$RUNS"
python - "$RUNS/prompts.jsonl" <<'PY'
import json, sys
from hf_specdec.bench.suites import load_suite, take_per_category
with open(sys.argv[1], "w") as f:
    for p in take_per_category(load_suite("specbench-train"), 25):
        f.write(json.dumps({"prompt": p.text, "category": p.category, "id": p.id}) + "\n")
PY
train() {  # METHOD [extra flags]
    hf-specdec train-draft --method "$1" --data "$RUNS/prompts.jsonl" --max-new-tokens 128 \
        --out "$RUNS/$1" --minutes "$MINUTES" "${@:2}"
}
train eagle
for method in mtp dflash; do  # the EAGLE run's answers (and, for MTP, its features)
    mkdir -p "$RUNS/$method/data"
    files=sequences.pt && [ "$method" = mtp ] && files="sequences.pt features.pt"
    for f in $files; do cp -n "$RUNS/eagle/data/$f" "$RUNS/$method/data/" || true; done
done
train mtp
train dflash --block-size 8 --draft-layers 2 --batch-tokens 1024
python benchmarks/reports/trained_drafts.py \
    --head eagle="$RUNS/eagle" --head mtp="$RUNS/mtp" --head dflash="$RUNS/dflash" \
    --methods eagle,mtp,dflash,dflash:7,ngram --profiles "$PROFILES" \
    --out bench_out/trained_drafts.json --markdown bench_out/trained_drafts.md "$@"
