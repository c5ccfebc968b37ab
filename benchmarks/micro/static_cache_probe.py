"""Probe (issue 23): speculative decoding over transformers' StaticCache, eager and compiled.

    python benchmarks/micro/static_cache_probe.py # SmolLM2-135M (the offline demo model), fp32
    python benchmarks/micro/static_cache_probe.py --tiny # a random 2-layer Llama: seconds, not minutes
    python benchmarks/micro/static_cache_probe.py --no-compile # (a), (b), (d) only

(a) plain greedy `generate(cache_implementation="static")`;
(b) a speculative loop over a StaticCache with batch 1 (`hf_specdec.core.static_kv.StaticKV`):
    feed [last, draft...] at the cache's write position, accept greedily, roll back by moving the
    write position back; output compared with (a);
(c) the same with the forwards after the prompt's compiled by `torch.compile` (inductor) at padded
    widths, compile seconds per width (cold: a fresh inductor cache; warm: recompiled from it) and
    ms per forward eager vs compiled at each width;
(d) batch 2, prompts of different lengths, rows accepting different numbers: holes masked through
    the 2D attention mask, compaction when the cache (sized as `generate` sizes it) runs out;
(e) with --compiled-batch, (d) with the forwards compiled at the padded widths.

The drafts are the plain output with a wrong token put in at a scheduled place, so each step's
acceptance is known in advance (all, none, some) and any difference from (a) is the cache's doing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile

# Cold compiles: a fresh inductor cache unless one is given (then warm). Set before torch is
# imported: set later, it was not used (the compiles went to /tmp/torchinductor_$USER).
GIVEN_CACHE = "TORCHINDUCTOR_CACHE_DIR" in os.environ
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="static-probe-"))

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    StaticCache,
)

import hf_specdec  # noqa: E402
from hf_specdec.core.static_kv import StaticKV  # noqa: E402
from hf_specdec.core.timing import clock  # noqa: E402

CPU = torch.device("cpu")  # the probe runs on the CPU; clock() waits for its queued work

PROMPTS = [
    "The three primary colors are",
    "Write a short poem about the sea. The sea",
]
# Drafted tokens before the first wrong one, step by step (cycled; row b starts b places on).
SCHEDULE = [7, 0, 3, 7, 1, 7, 5, 2]


def load(tiny: bool) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, int | None]:
    """The model, left-padded prompt ids [2, P] and their mask, and the EOS id."""
    if tiny:
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.4,
            pad_token_id=0,
            eos_token_id=None,
            max_position_embeddings=512,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(6, 256, (2, 9))
        mask = torch.ones_like(ids)
        ids[1, :3], mask[1, :3] = 0, 0
        return model, ids, mask, None
    path = hf_specdec.demo_model_path(quiet=True)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return model, encoded.input_ids, encoded.attention_mask, tokenizer.eos_token_id


def plain_static(model, ids, mask, max_new: int, eos: int | None) -> list[list[int]]:
    """(a): transformers' own static-cache greedy decoding, each row cut after its EOS."""
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, cache_implementation="static"
    )
    return [_cut(row[ids.shape[1] :].tolist(), eos) for row in out]


def _cut(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def speculate(
    kv: StaticKV,
    ids: torch.Tensor,
    mask: torch.Tensor,
    reference: list[list[int]],
    max_new: int,
    k_max: int,
    eos: int | None,
    vocab: int,
) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy speculative decoding of `ids` over `kv`; returns the tokens and the accepted drafts
    per step and row. Drafts follow `reference` up to the place SCHEDULE puts a wrong token."""
    rows = ids.shape[0]
    valid = None if bool(mask.all()) else mask.bool()
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)  # generate's position ids for a left-padded prompt
    out = kv.forward(ids, valid, logits_to_keep=1, positions=positions)
    last = out.logits[:, -1].argmax(-1)
    emitted = [[t] for t in last.tolist()]
    accepted_log: list[list[int]] = []
    active = [not _finished(e, max_new, eos) for e in emitted]
    for b, is_active in enumerate(active):
        if not is_active:
            kv.retire(torch.tensor([b]))
    step = 0
    while any(active):
        remaining = min(max_new - len(emitted[b]) for b in range(rows) if active[b])
        width = kv.widest(min(k_max + 1, remaining))
        k = width - 1
        drafts = [_draft(reference[b], len(emitted[b]), k, step + b, vocab) for b in range(rows)]
        drafts = torch.tensor(drafts, dtype=torch.long).view(rows, k)
        tokens = torch.cat([last[:, None], drafts], dim=1)
        fed = torch.tensor(active)[:, None].expand(rows, width)
        before = kv.lengths.clone()
        logits = kv.forward(tokens, None if all(active) else fed).logits  # [B, width, V]
        predicted = logits.argmax(-1)  # [B, width]
        accepted = (drafts == predicted[:, :k]).long().cumprod(dim=1).sum(dim=1)
        accepted = torch.where(torch.tensor(active), accepted, 0)
        kv.truncate(before + torch.where(torch.tensor(active), 1 + accepted, 0))
        last = predicted[torch.arange(rows), accepted]
        for b in range(rows):
            if active[b]:
                emitted[b] += drafts[b, : accepted[b]].tolist() + [int(last[b])]
                emitted[b] = _cut(emitted[b][:max_new], eos)
                if _finished(emitted[b], max_new, eos):
                    active[b] = False
                    kv.retire(torch.tensor([b]))
        accepted_log.append(accepted.tolist())
        step += 1
    return emitted, accepted_log


def _finished(tokens: list[int], max_new: int, eos: int | None) -> bool:
    return len(tokens) >= max_new or (eos is not None and tokens[-1] == eos)


def _draft(reference: list[int], done: int, k: int, step: int, vocab: int) -> list[int]:
    """The next `k` reference tokens after the first `done`, wrong from SCHEDULE's place on."""
    draft = (reference[done : done + k] + [0] * k)[:k]
    wrong = SCHEDULE[step % len(SCHEDULE)]
    if wrong < k:
        draft[wrong] = (draft[wrong] + 1) % vocab
    return draft


def static_kv(model, rows: int, prompt: int, max_new: int, **options) -> StaticKV:
    """A StaticKV over a StaticCache sized as `generate` sizes it: prompt + max_new_tokens - 1."""
    cache = StaticCache(config=model.config, max_cache_len=prompt + max_new - 1)
    return StaticKV(model, cache, rows, torch.device("cpu"), **options)


def measure_widths(model, ids, widths, decode, repeats: int, capacity: int) -> tuple[dict, dict]:
    """Per width, batch 1, right after the prompt: seconds of the first forward (with `decode`
    compiled, its compile) and the median ms of the next `repeats`, each rolled back after it.
    The repeats go round the widths in turn, so a busy machine slows all widths alike."""
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    kv = StaticKV(model, cache, 1, torch.device("cpu"), decode=decode)
    kv.forward(ids, None, logits_to_keep=1)
    times: dict[int, list[float]] = {width: [] for width in widths}
    for _ in range(repeats + 1):
        for width in widths:
            tokens = ids[:, -1:].repeat(1, width)  # contiguous, as the loop feeds them
            start = clock(CPU)
            kv.forward(tokens, None)
            times[width].append(clock(CPU) - start)
            kv.truncate(kv.lengths - width)
    first = {width: t[0] for width, t in times.items()}
    ms = {width: statistics.median(t[1:]) * 1000 if repeats else float("nan") for width, t in times.items()}
    return first, ms


def report_match(name: str, got: list[list[int]], want: list[list[int]]) -> bool:
    same = got == want
    print(f"{name}: {'identical to (a)' if same else 'DIFFERS from (a)'}")
    if not same:
        for b, (g, w) in enumerate(zip(got, want)):
            at = next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
            print(f"  row {b}: first difference at token {at}: {g[at : at + 4]} vs {w[at : at + 4]}")
    return same


def machine() -> str:
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for w in f.read().split() if w in ("avx512_bf16", "amx_bf16", "avx512f")}
    except OSError:
        pass
    return (
        f"{platform.processor() or platform.machine()}, flags {sorted(flags)}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a random 2-layer Llama instead of SmolLM2")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compiled-batch", action="store_true", help="(e): (d) with the forwards compiled")
    parser.add_argument("--warm", action="store_true", help="recompile from the inductor cache (warm)")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per width")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, ids, mask, eos = load(args.tiny)
    vocab = model.config.vocab_size
    prompt = ids.shape[1]
    widths = sorted(args.widths)
    k_max = widths[-1] - 1
    print(f"model: {type(model).__name__} ({'tiny random' if args.tiny else 'SmolLM2-135M'}, fp32)")
    print(f"machine: {machine()}")
    one_ids, one_mask = ids[:1, mask[0].argmax() :], mask[:1, mask[0].argmax() :]
    one_prompt = one_ids.shape[1]

    with torch.inference_mode():
        start = clock(CPU)
        plain = plain_static(model, one_ids, one_mask, args.max_new_tokens, eos)
        seconds = clock(CPU) - start
        print(f"(a) plain static generate, batch 1: {len(plain[0])} tokens in {seconds:.2f} s")

        kv = static_kv(model, 1, one_prompt, args.max_new_tokens)
        got, log = speculate(kv, one_ids, one_mask, plain, args.max_new_tokens, k_max, eos, vocab)
        report_match(f"(b) eager speculative, batch 1, {len(log)} verify forwards", got, plain)
        print(f"    accepted per step: {[a[0] for a in log]}")

        if not args.no_compile:
            torch._inductor.config.compile_threads = 1  # a shared 2-core machine
            # Every cache here is as long as generate's, so each width compiles once for all of (c).
            capacity = one_prompt + args.max_new_tokens - 1
            _, eager_ms = measure_widths(model, one_ids, widths, model, args.repeats, capacity)
            decode = torch.compile(model.__call__, dynamic=False)
            cold, compiled_ms = measure_widths(model, one_ids, widths, decode, args.repeats, capacity)
            warm = {}
            if args.warm:
                torch._dynamo.reset()
                decode = torch.compile(model.__call__, dynamic=False)
                warm, _ = measure_widths(model, one_ids, widths, decode, 0, capacity)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            print(f"(c) inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}, graphs compiled: {graphs}")
            kind = "given cache" if GIVEN_CACHE else "cold"
            print(f"    width | compile s ({kind}) | warm | eager ms | compiled ms")
            for w in widths:
                warm_s = f"{warm[w]:4.1f}" if w in warm else "   -"
                print(f"    {w:5d} | {cold[w]:14.1f} | {warm_s} | {eager_ms[w]:16.2f} | {compiled_ms[w]:.2f}")
            kv = static_kv(model, 1, one_prompt, args.max_new_tokens, widths=(1,), decode=decode)
            got, log = speculate(kv, one_ids, one_mask, plain, args.max_new_tokens, 0, eos, vocab)
            report_match(f"(c) compiled plain loop (width 1), {len(log)} forwards", got, plain)
            kv = static_kv(model, 1, one_prompt, args.max_new_tokens, widths=tuple(widths), decode=decode)
            got, log = speculate(kv, one_ids, one_mask, plain, args.max_new_tokens, k_max, eos, vocab)
            report_match(f"(c) compiled speculative, padded widths {widths}, {len(log)} forwards", got, plain)
            print(f"    accepted per step: {[a[0] for a in log]}")
            print(f"    graphs compiled in all: {torch._dynamo.utils.counters['stats']['unique_graphs']}")

        plain2 = plain_static(model, ids, mask, args.max_new_tokens, eos)
        kv = static_kv(model, 2, prompt, args.max_new_tokens)
        got, log = speculate(kv, ids, mask, plain2, args.max_new_tokens, k_max, eos, vocab)
        report_match(f"(d) eager speculative, batch 2 (left-padded), {len(log)} verify forwards", got, plain2)
        print(f"    accepted per step (row 0, row 1): {log}")
        print(f"    cache {kv.capacity} positions, compactions: {kv.compactions}")

        if args.compiled_batch:
            torch._inductor.config.compile_threads = 1
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            decode = torch.compile(model.__call__, dynamic=False)
            kv = static_kv(model, 2, prompt, args.max_new_tokens, widths=tuple(widths), decode=decode)
            start = clock(CPU)
            got, log = speculate(kv, ids, mask, plain2, args.max_new_tokens, k_max, eos, vocab)
            seconds = clock(CPU) - start
            report_match(f"(e) compiled speculative, batch 2, {len(log)} verify forwards", got, plain2)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
            print(f"    {graphs} graphs compiled (one per width used), {seconds:.0f} s with the compiles")


if __name__ == "__main__":
    main()
