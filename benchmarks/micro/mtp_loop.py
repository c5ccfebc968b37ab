"""The loop's own cost with a model's own draft heads, against transformers' generators on the same heads.

    python benchmarks/micro/mtp_loop.py [--prompts 6] [--new 48] [--rounds 3]

On the tiny checkpoints the tests build (`tests/helpers/mtp.py`, `tests/helpers/assistant.py`: random
weights made to agree with their target part of the time), in fp32 on one CPU thread, batch
1, greedy: each prompt runs plain `generate`, transformers' own generator (`use_mtp=True`, or
`assistant_model=`) and ours at the same draft length (one token per MTP layer; the assistant's
`num_assistant_tokens`), interleaved prompt by prompt, `--rounds` times. Printed per model: CPU
seconds per generated token (median over prompts of the best round) relative to transformers', and
tokens per target forward (`tokens_per_verify_forward`, the forwards counted with a forward hook),
which equal drafts make equal. The models
are tiny, so the time is mostly each loop's own overhead per step: what this measures. With one
thread every operation runs on the calling thread, so its CPU time (`time.thread_time`) is the
work done, which other processes sharing the machine do not inflate as they do the wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers.modeling_layers import MtpModel

import hf_specdec  # noqa: F401  (adds speculative= to generate)
from hf_specdec.bench.result import tokens_per_verify_forward
from tests.helpers import assistant, mtp


def _models(folder: Path) -> dict[str, tuple]:
    """name -> (target, transformers' generate kwargs, ours, draft length)."""
    models = {}
    for layout in mtp.LAYOUTS:
        target = mtp.model_class(layout).from_pretrained(mtp.checkpoint(folder / layout, layout, agree=0.002))
        models[f"{layout} ({mtp.LAYOUTS[layout]} layers, 1 MTP layer)"] = (
            target.eval(),
            dict(use_mtp=True),
            dict(method="mtp", num_draft_tokens=1),
        )
    target, helper = assistant.pair()
    helper.generation_config.num_assistant_tokens = 3
    models["gemma4 text (4 layers) + assistant (2 layers)"] = (
        target,
        dict(assistant_model=helper),
        dict(method="assistant", draft=helper, num_draft_tokens=3),
    )
    return models


def _run(target, inputs: dict, new: int, extra: dict) -> tuple[float, int, int]:
    """(CPU seconds, new tokens, target forwards) of one greedy generate."""
    forwards = []
    hook = target.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with torch.no_grad():
            start = time.thread_time()
            out = target.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, **extra)
            seconds = time.thread_time() - start
    finally:
        hook.remove()
    return seconds, out.shape[1] - inputs["input_ids"].shape[1], len(forwards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # every operation on this thread, whose CPU time is what is measured
    with tempfile.TemporaryDirectory() as tmp:
        models = _models(Path(tmp))
        for name, (target, theirs, ours) in models.items():
            if "use_mtp" in theirs:  # transformers reads the same layers out of the same checkpoint
                layers = MtpModel.from_pretrained(target)
                ours = {**ours, "draft": layers}
            rows = {"plain": {}, "transformers": theirs, "ours": {"speculative": ours}}
            per_token = {row: [] for row in rows}
            per_forward = {row: [] for row in rows}
            gained: dict[str, float] = {}
            for p in range(args.prompts):
                inputs = {k: v[:1] for k, v in mtp.prompts(1, seed=p).items()}
                best = {row: float("inf") for row in rows}
                for _ in range(args.rounds):
                    for row, extra in rows.items():  # interleaved: the machine's drift hits all rows alike
                        seconds, tokens, forwards = _run(target, inputs, args.new, extra)
                        best[row] = min(best[row], seconds / tokens)
                        gained[row] = tokens_per_verify_forward(tokens, forwards)  # greedy: every round alike
                for row in rows:
                    per_token[row].append(best[row])
                    per_forward[row].append(gained[row])
            base = statistics.median(per_token["transformers"])
            print(f"\n{name}: {args.prompts} prompts x {args.new} new tokens, fp32, 1 thread")
            print(f"{'':14}{'CPU ms/token':>13}{'vs transformers':>18}{'tokens/forward':>17}")
            for row in rows:
                ms = 1000 * statistics.median(per_token[row])
                ratio = statistics.median(per_token[row]) / base
                print(f"{row:14}{ms:13.2f}{ratio:17.2f}x{statistics.mean(per_forward[row]):17.2f}")


if __name__ == "__main__":
    main()
