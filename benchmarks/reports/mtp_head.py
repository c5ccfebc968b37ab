"""An MTP head in DeepSeek-V3's design against the EAGLE head, trained for SmolLM2 alike, on Spec-Bench quick.

    bash benchmarks/reports/mtp_head.sh            # trains both heads, then runs this
    python benchmarks/reports/mtp_head.py --eagle DIR --mtp DIR [--profile flat] [--out bench_out/mtp_head]

Both heads come from `hf-specdec train-draft` on the same training text, for the same number of
steps (`mtp_head.sh`); their `training.json` logs are summarised first (steps, seconds, held-out τ).
Then `hf_specdec.bench.run_bench` times plain `generate`, `eagle` and `mtp` (the adaptive draft
length) on the open categories of `specbench-quick` (never in the training text), greedy, batch 1,
128 new tokens, in the checkpoint's dtype, under an emulated cost profile (`--profile`, default
`flat`: the model computes every token, so acceptance is real, while the clock follows the
profile's device; `real` is this machine's clock). The report is written to `--out`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_specdec import demo_model_path
from hf_specdec.bench import run_bench
from hf_specdec.bench.regimes import PROFILES, emulate
from hf_specdec.bench.report import save, to_markdown
from hf_specdec.loading import load_model

CATEGORIES = ("qa", "mt_bench", "math_reasoning", "translation")  # as BENCHMARKS_HEADS.md's heads run


def training_summary(folder: Path) -> str:
    log = json.loads((folder / "training.json").read_text())
    last = log["history"][-1] if log["history"] else {"tau": "-", "acceptance": []}
    acceptance = ", ".join(f"{a:.0%}" for a in last["acceptance"])
    return (
        f"{log['config']['method']} head ({folder}): {log['steps']} steps, {log['train_seconds']} s, "
        f"held-out τ ≈ {last['tau']} (acceptance by position {acceptance})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eagle", type=Path, required=True, help="the EAGLE head's folder")
    parser.add_argument("--mtp", type=Path, required=True, help="the MTP head's folder")
    parser.add_argument("--profile", default="flat", choices=sorted(PROFILES))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench_out/mtp_head"))
    args = parser.parse_args()

    notes = [training_summary(args.eagle), training_summary(args.mtp)]
    for note in notes:
        print(note)
    model, tokenizer = load_model(demo_model_path())
    profile = PROFILES[args.profile]
    with emulate(model, profile):
        result = run_bench(
            model,
            tokenizer=tokenizer,
            heads={"eagle": str(args.eagle), "mtp": str(args.mtp)},
            methods=["eagle", "mtp"],
            suite="specbench-quick",
            categories=CATEGORIES,
            max_new_tokens=args.max_new_tokens,
            transformers_baselines=False,
        )
    clock = (
        f"the emulated `{profile.name}` profile ({profile.description})"
        if profile.emulated
        else "the real clock"
    )
    result.settings["notes"] = [*notes, f"Times follow {clock}."]
    save(result, args.out, plots=False)
    print(to_markdown(result))


if __name__ == "__main__":
    main()
