"""What logits processors that tell rows apart by their index cost a batch, against plain `generate`.

    python benchmarks/micro/row_indexed.py [--batch-sizes 1,8,64] [--vocab 4096] [--new-tokens 32]
        [--repeats 3]

Verifying rows apart, each row and draft position is processed alone. transformers' processors
that index rows (`prefix_allowed_tokens_fn`, the encoder repetition penalty and n-gram ban) are
narrowed to the row, so a step costs one row's work per position; a user's own processor (here a
bias per row, `[B, V]`) is a black box that may read any row, so it is shown a batch of B copies
of the row per position. A tiny random Llama (2 layers, hidden 32) keeps the forwards cheap,
prompts repeat themselves so `ngram` (k=4) drafts, greedy; seconds per call, the median of
`--repeats`, plain and speculative interleaved, with whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import hf_specdec  # noqa: F401  (adds speculative= to generate)
from hf_specdec.core.timing import clock


class BiasPerRow(LogitsProcessor):
    """A user's processor with one bias row per row of the batch."""

    def __init__(self, batch: int, vocab: int) -> None:
        self.bias = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores + self.bias


def tiny_model(vocab: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.4,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def timed(model: LlamaForCausalLM, kwargs: dict) -> tuple[float, torch.Tensor]:
    started = clock(model.device)
    out = model.generate(**kwargs)
    return clock(model.device) - started, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = tiny_model(args.vocab)
    speculative = dict(method="ngram", num_draft_tokens=4, options=dict(min_ngram=1))
    print("processor | batch | plain s | ngram s | ratio | identical")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        phrase = torch.randint(1, args.vocab, (batch, 6), generator=torch.Generator().manual_seed(batch))
        input_ids = phrase.repeat(1, 2)
        processors = {
            "prefix_allowed_tokens_fn": dict(
                prefix_allowed_tokens_fn=lambda b, sent: list(range(b, args.vocab, 2))
            ),
            "user bias per row": dict(logits_processor=LogitsProcessorList([BiasPerRow(batch, args.vocab)])),
        }
        for name, processor in processors.items():
            common = dict(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=args.new_tokens,
                do_sample=False,
                **processor,
            )
            plain, spec, same = [], [], True
            for _ in range(args.repeats):
                seconds, expected = timed(model, common)
                plain.append(seconds)
                seconds, out = timed(model, {**common, "speculative": speculative})
                spec.append(seconds)
                same &= torch.equal(out, expected)
            p, s = statistics.median(plain), statistics.median(spec)
            print(f"{name} | {batch} | {p:.2f} | {s:.2f} | {s / p:.1f}x | {same}", flush=True)


if __name__ == "__main__":
    main()
