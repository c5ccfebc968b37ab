"""`hf-specdec train-draft`: train an EAGLE, Medusa or MTP head or a DFlash block draft for a target
by self-distillation."""

from __future__ import annotations

import argparse

from .options import add_runtime_options, one_of


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-draft",
        help="train an EAGLE, Medusa or MTP draft head or a DFlash block draft for a target",
        description="Generate training text with the target (its greedy answers to a suite's prompts, or a "
        "corpus), then train a head on the target's own hidden states for a fixed time. Interrupt it and run "
        "the same command again to resume.",
    )
    parser.add_argument("--target", default=None, help="model folder or Hub id (default: the demo model)")
    add_runtime_options(parser)
    parser.add_argument(
        "--method",
        default="eagle",
        type=one_of("hf_specdec.heads:TRAINED_METHODS", "eagle"),
        help="eagle (default), medusa, mtp or dflash",
    )
    parser.add_argument("--out", required=True, help="folder for the head, its log and checkpoints")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--suite", default=None, help="prompt suite (default: specbench-train)")
    source.add_argument("--data", default=None, help="prompts (.jsonl) or a text corpus (.txt)")
    parser.add_argument("--minutes", type=float, default=30.0, help="training time (default 30)")
    parser.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many steps if sooner (default 0: no cap)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=192, help="answer length generated per prompt")
    parser.add_argument(
        "--answers-per-prompt",
        type=int,
        default=1,
        help="answers generated per prompt: the first greedy, the rest sampled from the target (default 1)",
    )
    parser.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head scores (0: all)")
    parser.add_argument("--heads", type=int, default=4, help="Medusa heads (default 4)")
    parser.add_argument("--unrolled-steps", type=int, default=3, help="EAGLE chained steps trained at once")
    parser.add_argument(
        "--block-size", type=int, default=8, help="DFlash: block positions, the anchor included (default 8)"
    )
    parser.add_argument("--draft-layers", type=int, default=2, help="DFlash: transformer layers (default 2)")
    parser.add_argument(
        "--target-layers",
        default=[],
        type=_layers,
        help="DFlash: comma-separated target layers read (default: 5 spread from layer 1 to L - 3)",
    )
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3)")
    parser.add_argument(
        "--batch-tokens", type=int, default=4096, help="padded tokens per training step (default 4096)"
    )
    parser.add_argument(
        "--prompt-token-loss",
        action="store_true",
        help="EAGLE: token loss on prompt positions too (more labels when answers are few; "
        "see docs/methods.md)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the held-out split, the order of the data and the head's initial weights (default: 0)",
    )
    parser.set_defaults(func=run)


def _layers(text: str) -> list[int]:
    """An argparse type: comma-separated layer indices, e.g. 1,8,14."""
    try:
        return [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not comma-separated layer indices of the target, e.g. 1,8,14"
        ) from None


def run(args: argparse.Namespace) -> int:
    from hf_specdec.train import TrainConfig, train_draft

    config = TrainConfig(
        method=args.method,
        minutes=args.minutes,
        max_steps=args.max_steps,
        unrolled_steps=args.unrolled_steps,
        block_size=args.block_size,
        draft_layers=args.draft_layers,
        target_layers=args.target_layers,
        medusa_heads=args.heads,
        draft_vocab_size=args.draft_vocab,
        batch_tokens=args.batch_tokens,
        **({"learning_rate": args.lr} if args.lr is not None else {}),
        seed=args.seed,
        prompt_token_loss=args.prompt_token_loss,
    )
    try:
        log = train_draft(
            args.target,
            args.out,
            suite=args.suite,
            data=args.data,
            max_new_tokens=args.max_new_tokens,
            answers_per_prompt=args.answers_per_prompt,
            config=config,
            dtype=args.dtype,
            device=args.device,
        )
    except KeyboardInterrupt as stop:
        print(stop.args[0] if stop.args else "Interrupted.")
        return 130
    last = log["history"][-1]
    print(
        f"Wrote the {args.method} head to {args.out} ({log['steps']} steps, {log['train_seconds']} s of "
        f"training on {log['data']['tokens']} tokens). Held-out estimate: acceptance by position "
        f"{', '.join(f'{a:.0%}' for a in last['acceptance'])}, mean accepted length τ ≈ {last['tau']}."
    )
    print(
        f"Draft with it: model.generate(..., speculative=dict(method={args.method!r}, draft={args.out!r})), "
        f"or measure it: hf-specdec bench --methods {args.method} --head {args.method}={args.out}"
    )
    return 0
