"""N-gram matching rules replayed on the target's own greedy answers: tokens per target forward.

    python benchmarks/micro/ngram_rules.py [--suite specbench-train] [--limit 4] [--max-new-tokens 128] \
        [--ks 4,10,16] [--trees]

Generates each prompt's plain greedy answer once (SmolLM2-135M, the checkpoint's dtype; cached in
`bench_out/ngram_rules/`), then replays drafting at a fixed k against it: a step proposes up to k
tokens from the text so far, the target keeps the longest prefix its own answer agrees with plus
one token of its own, exactly as greedy verification would (rounding ties aside). So a rule's
tokens per forward are counted, not timed, and deterministic. Rules:

- `ours`: the shipped `ngram` drafter (longest suffix down to one token, continuation voted among
  its latest occurrences);
- `most_recent`: the longest suffix's most recent occurrence (what `ngram` did before the vote);
- `prompt_lookup`: transformers' `PromptLookupCandidateGenerator` rule (suffixes of 2 then 1
  tokens, the earliest occurrence with a continuation);
- `hindsight`: a bound, not a drafter: the continuation among every occurrence of every suffix
  size that the answer keeps longest, chosen knowing the answer;
- with `--trees`, `ours`' tries of k nodes (`tree=True`; a trie's paths are prefixes of such
  continuations, so `hindsight` bounds them too).

It also prints how often `ours`' proposals held, by the size of the match they came from: the
first token of a draft, and a later one once the tokens before it held (the odds the shipped
drafter reports as its confidences, `ngram.FIRST_TOKEN_ODDS` / `LATER_TOKEN_ODDS`).

The default suite is kept apart from Spec-Bench quick, which the benchmarks measure.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from hf_specdec.bench.result import tokens_per_verify_forward
from hf_specdec.bench.runner import _select_prompts
from hf_specdec.core.draft import DraftRequest
from hf_specdec.drafters.ngram import NgramConfig, NgramDrafter, NgramIndex
from hf_specdec.loading import encode_prompts, load_model, native_bf16, pad_token_id, use_chat_template

Propose = Callable[[list[int], int], list[int]]


def count_forwards(prompt: list[int], answer: list[int], propose: Propose, k: int) -> int:
    """Target forwards, the prefill's included, to generate `answer` drafting with `propose`."""
    done, count = 1, 1  # the prefill's forward gives the first token
    while done < len(answer):
        draft = propose(prompt + answer[:done], min(k, len(answer) - done - 1))
        accepted = 0
        while accepted < len(draft) and draft[accepted] == answer[done + accepted]:
            accepted += 1
        done, count = done + accepted + 1, count + 1
    return count


def replay(prompt: list[int], answer: list[int], propose: Propose, k: int) -> float:
    """Tokens per target forward when drafting with `propose` against the target's `answer`."""
    return tokens_per_verify_forward(len(answer), count_forwards(prompt, answer, propose, k))


def _request(context: list[int], k: int, tree: bool = False) -> DraftRequest:
    """A greedy request for up to k draft tokens (tree nodes) after one row's `context`."""
    ids = torch.tensor([context])
    return DraftRequest(ids, torch.ones_like(ids), [len(context)], [k], False, None, [0], tree=tree)


def tree_path(tokens: list[int], parents: list[int], n: int, answer: list[int], at: int) -> list[int]:
    """The accepted path through a tree's first n nodes: children that carry the answer's next token."""
    node, path = -1, []
    while at + len(path) < len(answer):
        want = answer[at + len(path)]
        child = next((i for i in range(n) if parents[i] == node and tokens[i] == want), None)
        if child is None:
            break
        node = child
        path.append(node)
    return path


def trie(prompt: list[int], answer: list[int]) -> Propose:
    """The shipped `ngram` drafter's tries of k nodes, each given as the path through it that the
    target's `answer` follows (what tree verification keeps), so `replay` counts them as chains."""
    drafter = NgramDrafter(NgramConfig())

    def propose(context: list[int], k: int) -> list[int]:
        draft = drafter.propose(_request(context, k, tree=True))
        n, tokens = draft.lengths[0], draft.tokens[0].tolist()
        if not n:
            return []
        path = tree_path(tokens, draft.parents[0].tolist(), n, answer, len(context) - len(prompt))
        return [tokens[node] for node in path]

    return propose


def ours(**options) -> Propose:
    drafter = NgramDrafter(NgramConfig(**options))

    def propose(context: list[int], k: int) -> list[int]:
        draft = drafter.propose(_request(context, k))
        return draft.tokens[0, : draft.lengths[0]].tolist()

    return propose


def most_recent(context: list[int], k: int, sizes: range = range(4, 0, -1)) -> list[int]:
    for n in sizes:
        suffix = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):  # occurrences with a continuation, latest first
            if context[i : i + n] == suffix:
                return context[i + n : i + n + k]
    return []


def prompt_lookup(context: list[int], k: int, max_ngram: int = 2) -> list[int]:
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        suffix = context[-n:]
        for i in range(len(context) - n + 1):  # earliest first; the suffix itself has no continuation
            if context[i : i + n] == suffix and i + n < len(context):
                return context[i + n : i + n + k]
    return []


def hindsight(prompt: list[int], answer: list[int], sizes: range = range(1, 5)) -> Propose:
    """Not a drafter, a bound: the continuation, among every occurrence of every suffix of 1 to 4
    tokens, that the target's answer keeps longest, chosen knowing that answer. No rule that drafts
    one chain from n-gram matches of the text can do better."""

    def propose(context: list[int], k: int) -> list[int]:
        done, best, kept = len(context) - len(prompt), [], -1
        for n in sizes:
            suffix = context[-n:]
            for i in range(len(context) - n):  # occurrences with a continuation
                if context[i : i + n] != suffix:
                    continue
                continuation = context[i + n : i + n + k]
                hits = 0
                while hits < len(continuation) and continuation[hits] == answer[done + hits]:
                    hits += 1
                if hits > kept:
                    best, kept = continuation[: max(hits, 1)], hits
        return best

    return propose


def match_odds(rows: list[dict], max_ngram: int = 4) -> tuple[dict[tuple, list[int]], dict[tuple, list[int]]]:
    """Per (match size, agreement): [held, proposed] for a draft's first token, and for its later
    tokens (each counted only while the tokens before it held), drafting `ours`' voted
    continuation of up to 16 tokens at every position of each answer. Agreement is how the
    suffix's occurrences backed the token (`ngram.ONE`, `ALL`, `SPLIT`)."""
    first: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    later: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        index, answer = NgramIndex(range(1, max_ngram + 1), 16), r["answer"]
        index.extend(r["prompt"])
        for at in range(len(answer)):
            chain, size, agreement = index.lookup(16)
            for j, (token, agreed) in enumerate(zip(chain[: len(answer) - at], agreement)):
                counts = (first if j == 0 else later)[(size, agreed)]
                counts[1] += 1
                counts[0] += token == answer[at + j]
                if token != answer[at + j]:
                    break
            index.extend([answer[at]])
    return first, later


# Rule name -> a maker given the prompt and the target's answer (only `hindsight` reads it).
RULES: dict[str, Callable[[list[int], list[int]], Propose]] = {
    "ours": lambda prompt, answer: ours(),
    "most_recent": lambda prompt, answer: most_recent,
    "prompt_lookup": lambda prompt, answer: prompt_lookup,
    "hindsight": hindsight,
}


def add_answer_arguments(parser: argparse.ArgumentParser, suite: str, limit: int) -> None:
    """The options that say which cached greedy answers a script replays (`answers`)."""
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--suite", default=suite)
    parser.add_argument("--limit", type=int, default=limit)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="bench_out/ngram_rules", help="where the greedy answers are cached")


def answers(args: argparse.Namespace) -> list[dict]:
    # Answers differ by model and dtype; "auto" is bf16 on a CPU with native bf16, else fp32.
    dtype = args.dtype if args.dtype != "auto" else f"auto-{'native' if native_bf16() else 'no'}-bf16"
    model = f"{Path(args.model).name}-" if args.model else ""
    cache = Path(args.out) / f"{model}{args.suite}-{args.limit}-{args.max_new_tokens}-{dtype}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    chat, pad = use_chat_template(tokenizer, None), pad_token_id(tokenizer, model)
    rows = []
    for prompt in _select_prompts(args.suite, None, None, args.limit, None):
        inputs = encode_prompts(tokenizer, [prompt], chat, pad, model.device)
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
        ids = inputs["input_ids"][0].tolist()
        rows.append(
            {
                "id": prompt.id,
                "category": prompt.category,
                "prompt": ids,
                "answer": out[0, len(ids) :].tolist(),
            }
        )
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(rows))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_answer_arguments(parser, "specbench-train", 4)
    parser.add_argument("--ks", default="4,10,16")
    parser.add_argument("--trees", action="store_true", help="also the shipped drafter's tries of k nodes")
    args = parser.parse_args()
    rows = answers(args)
    categories = list(dict.fromkeys(r["category"] for r in rows))
    for k in (int(k) for k in args.ks.split(",")):
        print(f"\nk = {k}: tokens per target forward (mean over each category's prompts)\n")
        print("| rule | " + " | ".join(categories) + " | mean |")
        print("|---|" + "---:|" * (len(categories) + 1))
        rules: dict[str, Callable[[dict], float]] = {
            name: lambda r, make=make, k=k: replay(
                r["prompt"], r["answer"], make(r["prompt"], r["answer"]), k
            )
            for name, make in RULES.items()
        }
        if args.trees:
            rules[f"ours, trie of {k} nodes"] = lambda r, k=k: replay(
                r["prompt"], r["answer"], trie(r["prompt"], r["answer"]), k
            )
        for name, rule in rules.items():
            per = defaultdict(list)
            for r in rows:
                per[r["category"]].append(rule(r))
            means = [sum(per[c]) / len(per[c]) for c in categories]
            print(
                f"| {name} | " + " | ".join(f"{m:.2f}" for m in means) + f" | {sum(means) / len(means):.2f} |"
            )
    first, later = match_odds(rows)
    print(
        "\nHow often `ours`' proposals held, by the size of the match and how its occurrences "
        "backed the token (held / proposed):\n"
    )
    print("| match size | agreement | first token | later tokens |")
    print("|---:|---|---:|---:|")
    for size, agreed in sorted(set(first) | set(later)):
        (a, n), (b, m) = first[(size, agreed)], later[(size, agreed)]
        print(f"| {size} | {agreed} | {a / max(n, 1):.2f} ({a} / {n}) | {b / max(m, 1):.2f} ({b} / {m}) |")


if __name__ == "__main__":
    main()
