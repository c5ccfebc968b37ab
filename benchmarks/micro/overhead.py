"""The speculative loop's own cost per step, on a model whose forward costs ~1 ms.

    python benchmarks/micro/overhead.py [--new-tokens 200] [--repeats 5] [--threads 1] [--device cpu]
    python benchmarks/micro/overhead.py --compiled [--repeats 5] # issue 23: a compiled static cache
    python benchmarks/micro/overhead.py --compiled --model demo # the same on SmolLM2, its own dtype

A tiny Llama (2 layers, hidden 64, vocabulary 49152 as SmolLM2's) makes the model almost
free, so what remains is each loop's overhead: the per-step work a GPU user pays on top of an
8B target's ~10 ms step. Its weights are random except that the layers' output projections are
zero and its LM head is its embedding shifted by one id: every layer still computes, but greedy
decoding counts up (token t is followed by t + 1), so a generated n-gram never recurs and "no
match" is exact (tau 1.00), where a random model's output soon repeats itself and lets the n-gram
drafter match. Rows, greedy, medians of `--repeats` runs interleaved row by row:

- plain `generate`;
- no match: transformers' prompt lookup and our `ngram` on a prompt whose n-grams never recur
  (both decode plainly almost every step: their per-step overhead over plain);
- perfect draft (the model as its own draft, k=4, every draft accepted): transformers' assisted
  generation and our `draft_model`.

The budget (issue 12): with no match our ms/token <= 1.05x plain's; with a perfect draft our
ms/token <= transformers' assisted generation's.

`--compiled` (issue 23) measures transformers' fast path instead: `generate(cache_implementation=
"static")` with its decode step compiled by inductor (transformers' default `CompileConfig`, on CPU
only with `_compile_all_devices`), plain against ours with the same arguments plus `speculative=`:
no match (`ngram`); the perfect draft (the model as its own draft, k=3, 4 and 7: verify widths 4,
5 padded to 8, and 8; the draft's own forwards compiled alike, and at k=4 also left eager); and a
free perfect draft (`CountingDrafter`: the known answer, no forward), the loop's and the verify
forward's cost alone.
The targets: no match <= 1.05x compiled plain's ms/token, the perfect draft <= 0.5x. Also the
compile cost: each padded width's first call, cold (a fresh TORCHINDUCTOR_CACHE_DIR, unless one
is given) and warm (a second process over the same folder).

`--compiled --model demo [--dtype float32]` runs that on SmolLM2-135M (the offline demo model) in
its checkpoint's dtype (bf16; fp32 on a CPU without native bf16) or the one given, a chat prompt,
where a verify forward's cost is the real model's: plain static eager and compiled, our `ngram`
compiled, and a free perfect draft (`ReplayDrafter`: plain static greedy's own answer, no forward)
at k = 4 (width 5, padded to 8), 7 and 15. In bf16 a compiled graph rounds differently from eager:
where the output leaves the replayed answer at a rounding tie, the rest of its drafts are rejected
(see the τ column). The model as its own draft is left out there: each of its eager draft forwards
costs a whole step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

if "--compiled" in sys.argv:  # a fresh inductor cache (cold compiles), set before torch is imported
    import static_cache_probe  # noqa: F401

import torch  # noqa: E402
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec.core.static_kv import COMPILED_WIDTHS  # noqa: E402
from hf_specdec.core.timing import clock  # noqa: E402
from hf_specdec.drafters import Draft, Drafter, DraftRequest, register_drafter  # noqa: E402
from hf_specdec.loading import (  # noqa: E402
    describe_runtime,
    encode_prompts,
    load_model,
    pad_token_id,
    runtime_line,
)
from hf_specdec.lossless import check_greedy  # noqa: E402

DEMO_PROMPT = "Explain in a few paragraphs how a hash map works and when to use one."


def tiny_llama(device: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # the layers run but leave the residual stream alone
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # After the final norm the hidden state is token t's embedding, scaled: the LM head row
        # most aligned with it is row t + 1's, so greedy decoding counts up; scaled so that the
        # model is sure of it too (a draft's confidence shapes its trees).
        model.lm_head.weight.copy_(torch.roll(model.model.embed_tokens.weight, 1, dims=0) * 50)
    return model.to(device)


def rows(model):
    perfect = hf_specdec.SpeculativeConfig(method="draft_model", draft=model, num_draft_tokens=4)
    perfect_tree = hf_specdec.SpeculativeConfig(
        method="draft_model", draft=model, num_draft_tokens=4, tree=True, max_tree_nodes=8
    )
    return {
        "plain": {},
        "transformers prompt lookup, no match": {"prompt_lookup_num_tokens": 10},
        "ours ngram, no match": {"speculative": "ngram"},
        "transformers assisted, perfect draft k=4": {
            "assistant_model": model,
            "num_assistant_tokens": 4,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        },
        "ours draft_model, perfect draft k=4": {"speculative": perfect},
        # The tree path's own cost (4D mask, cache-tail reorder, host-side walk): the same perfect
        # draft as a tree of at most 8 nodes.
        "ours draft_model tree, perfect draft": {"speculative": perfect_tree},
    }


@register_drafter
class CountingDrafter(Drafter):
    """The counting model's own continuation (t + 1, t + 2, ...) without a forward: a perfect draft
    that costs nothing, so its row is the loop's and the verify forward's cost alone."""

    name = "counting"

    @classmethod
    def from_config(cls, config, target, tokenizer):
        return cls()

    def propose(self, request: DraftRequest) -> Draft:
        k = max(request.max_tokens, default=0)
        last = torch.tensor([int(request.tokens[b, n - 1]) for b, n in enumerate(request.lengths)])
        tokens = last[:, None] + torch.arange(1, k + 1)  # [B, k]
        return Draft(tokens.to(request.tokens.device), list(request.max_tokens))


@register_drafter
class ReplayDrafter(Drafter):
    """A known answer's next tokens without a forward (`answer`: a row's whole sequence, prompt
    first): for a real model, a perfect draft that costs nothing, as `CountingDrafter` is for the
    counting one. Where the output left the answer (a rounding tie), its drafts are rejected."""

    name = "replay"
    answer: list[int] = []

    @classmethod
    def from_config(cls, config, target, tokenizer):
        return cls()

    def propose(self, request: DraftRequest) -> Draft:
        k = max(request.max_tokens, default=0)
        rows = []
        for n in request.lengths:
            following = self.answer[n : n + k]
            rows.append(following + [0] * (k - len(following)))
        lengths = [min(len(self.answer) - n, m) for n, m in zip(request.lengths, request.max_tokens)]
        return Draft(torch.tensor(rows, device=request.tokens.device), [max(0, n) for n in lengths])


def compiled_rows(model, demo: bool = False) -> dict[str, dict]:
    """Issue 23's rows: plain static-cache generate, eager and compiled, and ours with the same
    arguments plus `speculative=`."""
    config = CompileConfig()  # transformers' default: inductor, mode "reduce-overhead", dynamic=None
    config._compile_all_devices = True  # transformers compiles on CPU only when told so
    static = {"cache_implementation": "static"}
    compiled = {**static, "compile_config": config}
    if demo:

        def replay(k: int) -> dict:
            return {"speculative": hf_specdec.SpeculativeConfig(method="replay", num_draft_tokens=k)}

        return {
            "plain static, eager": static,
            "plain static, compiled": compiled,
            "ours ngram, compiled": {**compiled, "speculative": "ngram"},
            "ours replay, free perfect draft k=4, compiled": {**compiled, **replay(4)},
            "ours replay, free perfect draft k=7, compiled": {**compiled, **replay(7)},
            "ours replay, free perfect draft k=15, compiled": {**compiled, **replay(15)},
        }

    def perfect(k: int, compile_draft: bool = True) -> dict:  # the model as its own draft
        config = hf_specdec.SpeculativeConfig(
            method="draft_model",
            draft=model,
            num_draft_tokens=k,
            options={"compile_with_target": compile_draft},
        )
        return {"speculative": config}

    counting = hf_specdec.SpeculativeConfig(method="counting", num_draft_tokens=4)
    return {
        "plain static, eager": static,
        "plain static, compiled": compiled,
        "ours ngram, no match, compiled": {**compiled, "speculative": "ngram"},
        "ours draft_model, perfect draft k=3, compiled": {**compiled, **perfect(3)},
        "ours draft_model, perfect draft k=4, compiled": {**compiled, **perfect(4)},
        "ours draft_model, perfect draft k=4, compiled, draft eager": {**compiled, **perfect(4, False)},
        "ours draft_model, perfect draft k=7, compiled": {**compiled, **perfect(7)},
        "ours counting, free perfect draft k=4, compiled": {**compiled, "speculative": counting},
    }


class StepClock:
    """A streamer that notes the clock at each `put`: plain generate's seconds per step (its first
    put is the prompt, its second the prefill's token)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(clock(self.device))

    def end(self) -> None:
        pass


def first_calls(model, prompt: torch.Tensor, cases: dict[str, dict], common: dict) -> dict[str, dict]:
    """Each row's first call, in order: its seconds, its output, and per compiled graph (plain's or
    ours, by padded width) the seconds of the first forward that ran it, which compiles it where no
    earlier row did (`new`)."""
    seen: set[tuple[str, int]] = set()
    report = {}
    for name, extra in cases.items():
        ours = "speculative" in extra
        streamer = None if ours else StepClock(prompt.device)
        start = clock(prompt.device)
        out = model.generate(prompt, **common, **extra, streamer=streamer, return_dict_in_generate=True)
        seconds = clock(prompt.device) - start
        stats = getattr(out, "speculative_stats", None)
        widths: dict[int, float] = {}
        if ours:
            for width, verify in zip(stats.verified_widths, stats.verify_times):
                padded = next(w for w in COMPILED_WIDTHS if w >= width)
                if verify is not None:
                    widths.setdefault(padded, verify)
        elif "compile_config" in extra:
            widths[1] = streamer.times[2] - streamer.times[1]  # the first decode step
        graphs = []
        for width, first in sorted(widths.items()):
            key = ("ours" if ours else "plain", width)
            graphs.append({"width": width, "seconds": first, "new": key not in seen})
            seen.add(key)
        report[name] = {
            "seconds": seconds,
            "graphs": graphs,
            "sequences": out.sequences.tolist(),
            "tau": None if stats is None else stats.mean_accepted_length,
        }
    return report


def warm_first_calls(args) -> dict[str, dict]:
    """`first_calls` in a new process over the same inductor cache folder: the warm compiles."""
    command = [sys.executable, __file__, "--compiled", "--first-calls-only", "--threads", str(args.threads)]
    command += ["--new-tokens", str(args.new_tokens), "--device", args.device, "--model", args.model]
    command += ["--dtype", args.dtype]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=os.environ.copy())
    return json.loads(done.stdout.strip().splitlines()[-1])


def _same(model, prompt: torch.Tensor, sequences: list, reference: list) -> str:
    """ "True" where the output is plain static greedy's; else where it first differs: at a rounding
    tie of the target's top two scores (bf16 rounds differently in a compiled graph), or not."""
    if sequences == reference:
        return "True"
    ours, plain = torch.tensor(sequences, device=prompt.device), torch.tensor(reference, device=prompt.device)
    return check_greedy(model, prompt, plain, ours)[0].kind


def main_compiled(args, model, prompt: torch.Tensor) -> None:
    demo = args.model == "demo"
    cases = compiled_rows(model, demo)
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if demo:  # the answer the free perfect draft replays: plain static greedy's, eager
        answer = model.generate(prompt, **common, cache_implementation="static")
        ReplayDrafter.answer = answer[0].tolist()
    cold = first_calls(model, prompt, cases, common)
    if args.first_calls_only:
        figures = {name: {k: v for k, v in row.items() if k != "sequences"} for name, row in cold.items()}
        print(json.dumps(figures))
        return
    reference = cold["plain static, eager"]["sequences"]
    counted = torch.tensor(reference[0][prompt.shape[1] - 1 :]).diff()
    if not demo and not bool((counted == 1).all()):
        raise SystemExit("The tiny model did not count up: the no-match rows would not measure a miss.")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # rows interleaved; each row's ratio to plain taken within a round
        for name, extra in cases.items():
            start = clock(prompt.device)
            model.generate(prompt, **common, **extra)
            times[name].append((clock(prompt.device) - start) / args.new_tokens * 1e3)
    recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    warm = warm_first_calls(args)
    plain = times["plain static, compiled"]
    runtime = describe_runtime(model)
    print(f"# Loop overhead on a compiled static cache, {runtime_line(runtime)}")
    print(
        f"# torch {torch.__version__}, {args.new_tokens} new tokens, greedy, median of {args.repeats} "
        "rounds (vs compiled plain: the median of each round's ratio), "
        f"{args.threads} thread(s), inductor compile_threads {torch._inductor.config.compile_threads}, "
        f"graphs compiled during the timed calls: {recompiled}\n"
    )
    print("| row | ms/token | vs compiled plain | tokens per target forward | output = plain static ", end="")
    print("| first call s, cold | warm |")
    print("|---|---|---|---|---|---|---|")
    report = {"runtime": runtime, "new_tokens": args.new_tokens, "rows": {}, "recompiled": recompiled}
    for name in cases:
        ms = statistics.median(times[name])
        ratio = statistics.median(t / p for t, p in zip(times[name], plain))
        same = _same(model, prompt, cold[name]["sequences"], reference)
        tau = "" if cold[name]["tau"] is None else f"{cold[name]['tau']:.2f}"
        print(
            f"| {name} | {ms:.3f} | {ratio:.2f}x | {tau} | {same} | "
            f"{cold[name]['seconds']:.1f} | {warm[name]['seconds']:.1f} |"
        )
        report["rows"][name] = {
            "ms_per_token": ms,
            "vs_compiled_plain": ratio,
            "samples": times[name],
            "tau": cold[name]["tau"],
            "same": same,
            "first_call_seconds": {"cold": cold[name]["seconds"], "warm": warm[name]["seconds"]},
            "graphs": {"cold": cold[name]["graphs"], "warm": warm[name]["graphs"]},
        }
    print("\nEach compiled graph's first forward (seconds; its compile), by the row that ran it first:\n")
    print("| graph | padded width | cold s | warm s | first run by |")
    print("|---|---|---|---|---|")
    for name in cases:
        kind = "ours" if "speculative" in cases[name] else "plain"
        warm_graphs = {g["width"]: g["seconds"] for g in warm[name]["graphs"]}
        for graph in cold[name]["graphs"]:
            if graph["new"]:
                width = graph["width"]
                print(f"| {kind} | {width} | {graph['seconds']:.1f} | {warm_graphs[width]:.1f} | {name} |")
    print(f"\n(inductor cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--compiled", action="store_true", help="issue 23's rows: a compiled static cache")
    parser.add_argument("--first-calls-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--model", default="tiny", choices=["tiny", "demo"], help="demo: SmolLM2-135M (with --compiled)"
    )
    parser.add_argument("--dtype", default="auto", help="with --model demo (default: its checkpoint's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "demo":
        if not args.compiled:
            parser.error("--model demo goes with --compiled")
        model, tokenizer = load_model(None, dtype=args.dtype, device=args.device)  # the demo model
        prompt = encode_prompts(tokenizer, [DEMO_PROMPT], True, pad_token_id(tokenizer, model), model.device)
        main_compiled(args, model, prompt["input_ids"])
        return
    model = tiny_llama(args.device)
    # Distinct token ids below 20010, then 30000: the model continues 30001, 30002, ... so no
    # n-gram of the prompt or of the output ever recurs.
    ids = torch.randperm(20000, generator=torch.Generator().manual_seed(0))[:63].add(10)
    prompt = torch.cat([ids, torch.tensor([30000])])[None].to(args.device)
    if args.compiled:
        main_compiled(args, model, prompt)
        return
    cases = rows(model)
    times: dict[str, list[float]] = {name: [] for name in cases}
    taus: dict[str, float | None] = {}
    outputs: dict[str, torch.Tensor] = {}
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    for name, extra in cases.items():  # warm-up, and the outputs to compare
        out = model.generate(prompt, **common, **extra, return_dict_in_generate=True)
        outputs[name] = out.sequences
        stats = getattr(out, "speculative_stats", None)
        taus[name] = None if stats is None else stats.mean_accepted_length
    counted = outputs["plain"][0, prompt.shape[1] - 1 :].diff()
    if not bool((counted == 1).all()):  # the premise of the no-match rows
        raise SystemExit("The tiny model did not count up: the no-match rows would not measure a miss.")
    for _ in range(args.repeats):
        for name, extra in cases.items():
            start = clock(prompt.device)
            model.generate(prompt, **common, **extra)
            times[name].append((clock(prompt.device) - start) / args.new_tokens * 1e3)
    plain = statistics.median(times["plain"])
    runtime = describe_runtime(model)
    print(f"# Loop overhead, {runtime_line(runtime)}")
    print(f"# {args.new_tokens} new tokens, greedy, median of {args.repeats}, {args.threads} thread(s)\n")
    print("| row | ms/token | vs plain | tokens per target forward | output = plain |")
    print("|---|---|---|---|---|")
    report = {"runtime": runtime, "new_tokens": args.new_tokens, "rows": {}}
    for name in cases:
        ms = statistics.median(times[name])
        same = bool(torch.equal(outputs[name], outputs["plain"]))
        tau = "" if taus[name] is None else f"{taus[name]:.2f}"
        print(f"| {name} | {ms:.2f} | {ms / plain:.2f}x | {tau} | {same} |")
        report["rows"][name] = {"ms_per_token": ms, "samples": times[name], "tau": taus[name], "same": same}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
