"""One decoding step of SmolLM2-135M-Instruct (fp32, 256 tokens of past) in PyTorch eager and in ONNX Runtime,
interleaved, with the machine's streaming read time for the same bytes as the floor either can reach.

    python benchmarks/micro/ort_decode.py --threads 2 exported=OUT/model.onnx [optimized=OTHER/model.onnx ...]

`OUT` comes from `hf-specdec export-onnx <demo model folder> OUT`. A decoding step reads every weight once
(540 MB in fp32), so on a CPU it is bound by memory bandwidth; the floor printed is the time to sum a
540 MB tensor with the same threads.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import hf_specdec
from hf_specdec.core.timing import clock

PAST, STEPS, ROUNDS = 256, 24, 3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("models", nargs="+", help="NAME=path/to/model.onnx")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(hf_specdec.demo_model_path(), dtype=torch.float32).eval()
    sessions = {name: _session(path, args.threads) for name, path in (m.split("=", 1) for m in args.models)}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for round_ in range(ROUNDS):
        row = {"torch": _torch_step(model)}
        row.update({name: _ort_step(s, model.config.num_hidden_layers) for name, s in sessions.items()})
        row["read floor"] = _read_floor(weights)
        times = ", ".join(f"{k} {v:.1f} ms ({row['torch'] / v:.2f}x)" for k, v in row.items())
        print(f"round {round_}: {times}", flush=True)


def _session(path: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


@torch.no_grad()
def _torch_step(model) -> float:
    cache = DynamicCache(config=model.config)
    model(torch.randint(10, 40000, (1, PAST), generator=torch.Generator().manual_seed(0)), cache=cache)
    token, times = torch.tensor([[123]]), []
    for _ in range(STEPS):
        start = clock(model.device)
        model(token, cache=cache, logits_to_keep=1)
        times.append(clock(model.device) - start)
    return statistics.median(times) * 1000


def _ort_step(session, layers: int) -> float:
    names = {i.name for i in session.get_inputs()}
    kv_heads, head_dim = session.get_inputs()[-1].shape[1], session.get_inputs()[-1].shape[3]

    def run(ids, past, start):
        feed = {
            "input_ids": ids,
            "position_ids": np.arange(start, start + ids.shape[1], dtype=np.int64)[None],
        }
        if "attention_mask" in names:
            feed["attention_mask"] = np.ones((1, start + ids.shape[1]), dtype=np.int64)
        for i in range(layers):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[i]
        out = session.run(None, feed)
        return [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(layers)]

    empty = np.zeros((1, kv_heads, 0, head_dim), np.float32)
    past = run(
        np.random.default_rng(0).integers(10, 40000, (1, PAST)).astype(np.int64), [(empty, empty)] * layers, 0
    )
    times = []
    for i in range(STEPS):
        start = clock("cpu")  # the session runs on the CPU provider
        past = run(np.array([[123]], dtype=np.int64), past, PAST + i)
        times.append(clock("cpu") - start)
    return statistics.median(times) * 1000


def _read_floor(nbytes: int) -> float:
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    data.sum()
    times = []
    for _ in range(5):
        start = clock(data.device)
        data.sum()
        times.append(clock(data.device) - start)
    return statistics.median(times) * 1000


if __name__ == "__main__":
    main()
