"""The speculative loop's own cost per step, on a model whose forward costs ~1 ms.

    python benchmarks/micro/overhead.py [--new-tokens 200] [--repeats 5] [--threads 1] [--device cpu]

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
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec.core.timing import clock
from hf_specdec.loading import describe_runtime, runtime_line


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_llama(args.device)
    # Distinct token ids below 20010, then 30000: the model continues 30001, 30002, ... so no
    # n-gram of the prompt or of the output ever recurs.
    ids = torch.randperm(20000, generator=torch.Generator().manual_seed(0))[:63].add(10)
    prompt = torch.cat([ids, torch.tensor([30000])])[None].to(args.device)
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
