"""The project-side half of `benchmarks/engines/vllm_check.sh`: what `export-serving` writes, run by a
real vLLM.

    python benchmarks/engines/vllm_check.py prepare --work DIR  # exports, a small EAGLE-3 head, our outputs
    $VENV/bin/python benchmarks/engines/vllm_engine.py DIR  # vLLM: plain and each exported config
    python benchmarks/engines/vllm_check.py report --work DIR --out vllm_check.json

`prepare` (this environment): SmolLM2-135M-Instruct (the demo model, `hf_specdec.demo_model`) in bf16;
4 prompts (one per category of Spec-Bench quick when the shared data is there, else the built-in
suite), chat-templated here and handed to vLLM as token ids so both see the same tokens. A small
EAGLE-3 head is built with our head API and trained for `--train-seconds` on the target's own greedy
answers to Spec-Bench-train prompts (else all built-in ones, the evaluated among them): first draft
step only, so acceptance after the first position stays low; it only has to be real enough that
accepted drafts show the layout was read correctly. `hf-specdec export-serving` (our CLI, called
in-process) then writes the vLLM configs: ngram, draft_model with the model as its own draft, and
the head (speculators layout); the SGLang export of the same head gives the original EAGLE-3
layout, run through vLLM's long form too, and a copy of the speculators head naming the local
target as its verifier runs in the short form, `LLM(model=<head>)`. Our own greedy `generate` runs
plain and with each method at the same fixed draft length.

`report`: vLLM's speculative output must equal vLLM's plain output token for token, and vLLM's
counters must show accepted drafts; agreement of vLLM with our `generate` is reported (identical /
tie / mismatch by `hf_specdec.lossless.check_greedy`, our bf16 target's scores) but not required:
two implementations' bf16 kernels may part at near-ties. Exit status 1 when a requirement fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers

import hf_specdec
from hf_specdec.bench.suites import builtin_suite_path, load_prompt_file, load_suite, take_per_category
from hf_specdec.cli import main as cli
from hf_specdec.core.timing import clock
from hf_specdec.demo_model import demo_model_path
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.eagle3 import default_feature_layers
from hf_specdec.heads.io import build_head, save_head
from hf_specdec.loading import load_model, pad_token_id, prompt_token_ids, use_chat_template
from hf_specdec.lossless import check_greedy
from hf_specdec.train.data import build_sequences
from hf_specdec.train.features import Example, cached_target_features

DTYPE = "bfloat16"
MAX_MODEL_LEN = 1024
# Draft lengths exported (fixed, so our run and vLLM's draft the same number of tokens; `auto`
# would measure them with our adaptive policy, and an untrained-looking head may not draft at all).
DRAFT_TOKENS = {"ngram": 4, "draft_model": 3, "eagle3": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["prepare", "report"])
    parser.add_argument(
        "--work", required=True, type=Path, help="folder shared with benchmarks/engines/vllm_engine.py"
    )
    parser.add_argument("--out", type=Path, default=None, help="report: the JSON to write")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--train-seconds", type=float, default=120.0, help="EAGLE-3 head training time")
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.work, args.prompts, args.max_new_tokens, args.train_seconds)
        return 0
    return report(args.work, args.out or args.work / "vllm_check.json")


# --- prepare ------------------------------------------------------------------------------------


def prepare(work: Path, count: int, new_tokens: int, train_seconds: float) -> None:
    work.mkdir(parents=True, exist_ok=True)
    folder = str(demo_model_path())
    model, tokenizer = load_model(folder, dtype=DTYPE)
    chat = use_chat_template(tokenizer)
    prompts, source = eval_prompts(tokenizer, chat, count, new_tokens)
    prompt_ids = [prompt_token_ids(tokenizer, p, chat) for p in prompts]

    head_dir, training = train_eagle3_head(model, tokenizer, work, train_seconds, prompts)
    exports = export_all(folder, head_dir, work / "export")
    runs = [{"name": "plain", "ours": "plain", "speculative_config": None}]
    runs += [
        {"name": n, "ours": n, "speculative_config": e["speculative_config"]} for n, e in exports.items()
    ]
    # The original EAGLE-3 layout (what the SGLang export writes) through vLLM's long form as well.
    original = json.loads((work / "export" / "eagle3-sglang" / "serving.json").read_text())["draft"]
    long_form = exports["eagle3"]["speculative_config"]
    runs.append(
        {
            "name": "eagle3-original-layout",
            "ours": "eagle3",
            "speculative_config": {**long_form, "model": original},
        }
    )
    # The speculators short form (`vllm serve HEAD`): vLLM serves the config's verifier. Ours names
    # the Hub id the local folder came from (unreachable offline), so a copy names the folder.
    runs.append(
        {
            "name": "eagle3-short-form",
            "ours": "eagle3",
            "speculative_config": None,
            "llm_model": str(short_form_copy(work, exports["eagle3"]["draft"], folder)),
        }
    )
    plan = {
        "model": folder,
        "dtype": DTYPE,
        "max_model_len": MAX_MODEL_LEN,
        "max_new_tokens": new_tokens,
        "prompt_source": source,
        "prompts": [f"{p.category}/{p.id}" for p in prompts],
        "prompt_ids": prompt_ids,
        "runs": runs,
    }
    (work / "plan.json").write_text(json.dumps(plan, indent=2))

    ours = our_outputs(model, tokenizer, prompt_ids, head_dir, new_tokens)
    ours["training"] = training
    (work / "ours.json").write_text(json.dumps(ours, indent=2))
    print(f"Prepared {work}: {len(runs)} vLLM runs over {len(prompts)} prompts ({source}).")


def short_form_copy(work: Path, head: str, verifier: str) -> Path:
    """The exported speculators head with `verifier.name_or_path` set to the local target folder."""
    copy = work / "head-short-form"
    shutil.copytree(head, copy, dirs_exist_ok=True)
    config = json.loads((copy / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = verifier
    (copy / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return copy


def eval_prompts(tokenizer: Any, chat: bool, count: int, new_tokens: int) -> tuple[list[Any], str]:
    """One prompt per category, short enough for `MAX_MODEL_LEN` with the new tokens."""
    try:
        prompts, source = load_suite("specbench-quick"), "specbench-quick"
    except (OSError, ValueError):  # no shared data next to the checkout: the project runs without it
        prompts, source = load_prompt_file(builtin_suite_path()), "builtin"
    fits = [
        p
        for p in take_per_category(prompts, 1)
        if len(prompt_token_ids(tokenizer, p, chat)) + new_tokens <= MAX_MODEL_LEN
    ]
    return fits[:count], source


def train_prompts(held_out: list[Any]) -> tuple[list[Any], int, bool]:
    """Prompts to train the head on, how many new tokens to generate for each, and whether they
    include the evaluated ones: Spec-Bench's training split (never evaluated on), else all built-in
    prompts with longer answers (the others alone hold too few tokens for the trainer's minimum; the
    acceptance measured is then optimistic, which does not matter for what this check asserts)."""
    try:
        return take_per_category(load_suite("specbench-train"), 6), 96, False
    except (OSError, ValueError):
        seen = {p.id for p in held_out}
        prompts = load_prompt_file(builtin_suite_path())
        return prompts, 192, any(p.id in seen for p in prompts)


def export_all(model: str, head_dir: Path, out: Path) -> dict[str, dict[str, Any]]:
    """`hf-specdec export-serving` for each method, as a user runs it; returns the vLLM results."""
    cases = {
        "ngram": ["--method", "ngram"],
        "draft_model": ["--method", "draft_model", "--draft", model],
        "eagle3": ["--method", "eagle", "--head", str(head_dir)],
    }
    results = {}
    for name, extra in cases.items():
        k = ["--num-draft-tokens", str(DRAFT_TOKENS[name])]
        for engine in ("vllm", "sglang"):
            target = out / f"{name}-{engine}"
            code = cli(["export-serving", model, "--engine", engine, *extra, *k, "--out", str(target)])
            if code != 0:
                raise SystemExit(f"export-serving failed for {name} on {engine}")
        results[name] = json.loads((out / f"{name}-vllm" / "serving.json").read_text())
    return results


def train_eagle3_head(
    model: Any, tokenizer: Any, work: Path, seconds: float, held_out: list[Any]
) -> tuple[Path, dict[str, Any]]:
    """A small EAGLE-3 head for `model`, trained briefly on the target's own answers (first draft
    step only: the head reads the target's features f_t and token x_{t+1} and predicts x_{t+2}).

    `train-draft` trains EAGLE-1-style heads, which no engine layout holds, so the head is built
    with our head API and trained here; its tensors are those `export-serving` converts."""
    folder = work / "head-eagle3"
    if (folder / "training.json").is_file():  # reused: a rerun of the check need not train again
        return folder, json.loads((folder / "training.json").read_text())
    torch.manual_seed(0)
    layers = default_feature_layers(model.config.num_hidden_layers)
    prompts, new_tokens, overlap = train_prompts(held_out)
    sequences = build_sequences(model, tokenizer, prompts, work / "sequences.pt", max_new_tokens=new_tokens)
    examples = cached_target_features(model, sequences, layers, work / "features.pt")
    # the last 128 positions (the answers: drafting's text; features keep the whole context): cheap steps
    examples = [Example(e.ids[-128:], e.features[-128:], e.labels[-128:], 0) for e in examples]
    vocab = model.config.vocab_size
    counts = torch.bincount(
        torch.cat([e.labels for e in examples] + [e.ids for e in examples]), minlength=vocab
    )
    draft_vocab = torch.sort(torch.argsort(counts, descending=True, stable=True)[:4096]).values
    config = EagleHeadConfig.for_target(
        model, variant="eagle3", feature_layers=list(layers), draft_vocab_size=len(draft_vocab)
    )
    head = build_head(config, model).float()
    head.draft_vocab.copy_(draft_vocab)
    _warm_start(head, model)
    device = head.fc.weight.device  # the target's: the training clock synchronizes it
    to_draft = torch.full((vocab,), -100, dtype=torch.long, device=device)
    to_draft[draft_vocab] = torch.arange(len(draft_vocab), device=device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=2e-3)
    rng = random.Random(0)
    steps, losses, spent = 0, [], 0.0
    while spent < seconds:
        batch = rng.sample(examples, min(4, len(examples)))
        started = clock(device)
        loss = _first_step_loss(head, batch, to_draft)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        spent += clock(device) - started
        steps += 1
        losses.append(loss.item())
    save_head(head.to(model.dtype), folder)
    training = {
        "feature_layers": list(layers),
        "draft_vocab_size": len(draft_vocab),
        "prompts": len(prompts),
        "answer_tokens": new_tokens,
        "includes_evaluated_prompts": overlap,
        "sequences": len(sequences),
        "tokens": sum(len(s.ids) for s in sequences),
        "steps": steps,
        "seconds": round(spent, 1),
        "loss_first_10": round(sum(losses[:10]) / len(losses[:10]), 3),
        "loss_last_10": round(sum(losses[-10:]) / len(losses[-10:]), 3),
    }
    (folder / "training.json").write_text(json.dumps(training, indent=2))
    return folder, training


@torch.no_grad()
def _warm_start(head: Any, model: Any) -> None:
    """Start from the target's own view: the feature is the deepest layer read (fc picks it out),
    attention and MLP add nothing yet, and the final norm and LM head are the target's (draft
    vocabulary rows). Training then only has to learn the step to the next token, which a couple of
    minutes on a CPU can begin to do; from random weights they cannot."""
    hidden = head.config.hidden_size
    head.fc.weight.zero_()
    head.fc.weight[:, -hidden:] = torch.eye(hidden)
    head.midlayer.self_attn.o_proj.weight.zero_()
    head.midlayer.mlp.down_proj.weight.zero_()
    head.norm.weight.copy_(model.model.norm.weight.float())
    head.lm_head.weight.copy_(model.get_output_embeddings().weight[head.draft_vocab].float())


def _first_step_loss(head: Any, batch: list[Any], to_draft: torch.Tensor) -> torch.Tensor:
    width = max(len(e.ids) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.zeros(len(batch), width, dtype=torch.long)
    raw = torch.zeros(len(batch), width, batch[0].features.shape[-1])
    valid = torch.zeros(len(batch), width, dtype=torch.long)
    for b, e in enumerate(batch):  # right-padded: positions count from 0 in every row
        n = len(e.ids)
        ids[b, :n], labels[b, :n], raw[b, :n], valid[b, :n] = e.ids, e.labels, e.features.float(), 1
    device = head.fc.weight.device
    ids, labels, raw, valid = (x.to(device) for x in (ids, labels, raw, valid))
    # position t reads (f_t, x_{t+1}) and predicts the target's choice after x_{t+1}: labels[t + 1]
    out = head(ids[:, 1:], head.project_features(raw[:, :-1]), attention_mask=valid[:, 1:], use_cache=False)
    targets = to_draft[labels[:, 1:]].masked_fill(valid[:, 1:] == 0, -100)
    return F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def our_outputs(
    model: Any, tokenizer: Any, prompt_ids: list[list[int]], head_dir: Path, new_tokens: int
) -> dict[str, Any]:
    """Our greedy `generate`, batch 1, plain and with each method at the exported draft length."""
    methods = {
        "plain": None,
        "ngram": {"method": "ngram", "num_draft_tokens": DRAFT_TOKENS["ngram"]},
        "draft_model": {
            "method": "draft_model",
            "draft": model,
            "num_draft_tokens": DRAFT_TOKENS["draft_model"],
        },
        "eagle3": {"method": "eagle", "draft": str(head_dir), "num_draft_tokens": DRAFT_TOKENS["eagle3"]},
    }
    pad = pad_token_id(tokenizer, model)
    runs: dict[str, Any] = {}
    for name, speculative in methods.items():
        tokens, accepted, drafted, seconds = [], 0, 0, 0.0
        for ids in prompt_ids:
            inputs = {
                "input_ids": torch.tensor([ids], device=model.device),
                "attention_mask": torch.ones(1, len(ids), dtype=torch.long, device=model.device),
            }
            started = clock(model.device)
            out = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
                speculative=speculative,
                return_dict_in_generate=True,
            )
            seconds += clock(model.device) - started
            tokens.append(out.sequences[0, len(ids) :].tolist())
            stats = getattr(out, "speculative_stats", None)
            if stats is not None:
                accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        runs[name] = {
            "token_ids": tokens,
            "seconds": round(seconds, 2),
            "accepted": accepted,
            "drafted": drafted,
        }
    return {"runs": runs}


# --- report -------------------------------------------------------------------------------------


def report(work: Path, out: Path) -> int:
    plan = json.loads((work / "plan.json").read_text())
    ours = json.loads((work / "ours.json").read_text())
    engine = json.loads((work / "vllm.json").read_text())
    model, tokenizer = load_model(plan["model"], dtype=DTYPE)
    runs = {r["name"]: r for r in engine["runs"]}
    planned = {r["name"]: r for r in plan["runs"]}
    plain = runs.get("plain", {})
    rows, failures = [], []
    if "error" in plain:
        failures.append(f"plain vLLM failed: {plain['error']}")
    for name, run in runs.items():
        row: dict[str, Any] = {"run": name, "speculative_config": run.get("speculative_config")}
        if run.get("llm_model") != plan["model"]:  # the short form: LLM(model=<the head>)
            row["llm_model"] = run.get("llm_model")
        if "error" in run:
            row["error"] = run["error"]
            failures.append(f"{name}: {run['error']}")
            rows.append(row)
            continue
        row.update(engine_seconds=run["engine_seconds"], generate_seconds=run["generate_seconds"])
        row["new_tokens"] = run["new_tokens"]
        spec = run.get("spec_decode") or {}
        row["spec_decode"] = spec
        mine = ours["runs"].get(planned.get(name, {}).get("ours", ""))
        if mine is not None:
            row["ours"] = {key: mine[key] for key in ("seconds", "accepted", "drafted")}
            row["vs_ours"] = _agreement(
                model, plan["prompt_ids"], mine["token_ids"], run["token_ids"], "ours/vLLM"
            )
        if name != "plain":
            same = "token_ids" in plain and run["token_ids"] == plain["token_ids"]
            row["equals_vllm_plain"] = same
            if not same:
                failures.append(f"{name}: vLLM's speculative output differs from its plain output")
                if "token_ids" in plain:  # which kind of difference, judged by our target's scores
                    row["vs_vllm_plain"] = _agreement(
                        model, plan["prompt_ids"], plain["token_ids"], run["token_ids"], "plain/speculative"
                    )
            if not spec.get("num_accepted_tokens"):
                failures.append(f"{name}: vLLM accepted no drafted tokens ({spec or 'no counters'})")
        rows.append(row)
    result = {
        "check": "benchmarks/engines/vllm_check.sh (issue 15)",
        "passed": not failures,
        "failures": failures,
        "versions": {
            "engine": engine["versions"],
            "project": {
                "hf-specdec": hf_specdec.__version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
        },
        "settings": {key: plan[key] for key in ("model", "dtype", "max_model_len", "max_new_tokens")}
        | {"prompts": plan["prompts"], "prompt_source": plan["prompt_source"], "greedy": "temperature 0"},
        "eagle3_head_training": ours.get("training"),
        "runs": rows,
        "texts": {name: run.get("texts") for name, run in runs.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}; wrote {out}")
    for failure in failures:
        print(f"  - {failure}")
    return 0 if result["passed"] else 1


def _agreement(
    model: Any, prompt_ids: list[list[int]], reference: list[list[int]], other: list[list[int]], names: str
) -> list[str]:
    """identical / tie / mismatch per prompt, `other` against `reference` (`names`: "ours/vLLM"), by
    our target's scores."""
    first, second = names.split("/")
    kinds = []
    for ids, ref, got in zip(prompt_ids, reference, other):
        prompt = torch.tensor([ids])
        (check,) = check_greedy(model, prompt, torch.tensor([ids + ref]), torch.tensor([ids + got]))
        if check.kind == "identical" or check.top_two is None or check.tie_at is not None:
            kinds.append(check.describe())
            continue
        kinds.append(  # check_greedy's words are plain / speculative: here they are reference / other
            f"{check.kind} at generated token {check.position}: {first} {check.plain_token}, {second} "
            f"{check.speculative_token}, the further {check.gap:.3g} below the best score (rounding bound "
            f"{check.bound:.3g})"
        )
    return kinds


def table(result: dict[str, Any]) -> str:
    engine = result["versions"]["engine"]
    lines = [
        f"vLLM {engine.get('vllm', '?')} (torch {engine.get('torch', '?')}, transformers "
        f"{engine.get('transformers', '?')}); SmolLM2-135M-Instruct {result['settings']['dtype']}, "
        f"{len(result['settings']['prompts'])} prompts x {result['settings']['max_new_tokens']} new tokens",
        "",
        "| run | = vLLM plain | accepted / drafted tokens (vLLM) | per position | ours: accepted / drafted "
        "| = ours (tie-aware) | engine start s | generate s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["runs"]:
        if "error" in row:
            lines.append(f"| {row['run']} | error: {row['error'][:80]} | | | | | | |")
            continue
        spec = row["spec_decode"]
        counts = f"{spec.get('num_accepted_tokens', 0)} / {spec.get('num_draft_tokens', 0)}" if spec else "-"
        per_pos = ", ".join(str(v) for v in spec.get("num_accepted_tokens_per_pos", [])) or "-"
        mine = row.get("ours")
        our_counts = f"{mine['accepted']} / {mine['drafted']}" if mine and mine["drafted"] else "-"
        kinds = row.get("vs_ours") or []
        agree = f"{sum(k == 'identical' for k in kinds)} identical" if kinds else "-"
        ties = sum(k.startswith("tie") for k in kinds)
        agree += f", {ties} tie" if ties else ""
        agree += f", {len(kinds) - ties - sum(k == 'identical' for k in kinds)} mismatch" if kinds else ""
        equal = {True: "yes", False: "NO"}.get(row.get("equals_vllm_plain"), "-")
        lines.append(
            f"| {row['run']} | {equal} | {counts} | {per_pos} | {our_counts} | {agree} "
            f"| {row['engine_seconds']} | {row['generate_seconds']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    started = clock("cpu")
    code = main()
    print(f"({clock('cpu') - started:.0f} s)", file=sys.stderr)
    sys.exit(code)
