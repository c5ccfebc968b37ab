"""`hf-specdec bench`: time speculative methods against plain generate and transformers' own drafting."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .options import add_runtime_options, one_of


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark speculative methods against plain generate",
        description="Time plain generate, our speculative methods and transformers' prompt lookup / "
        "assisted generation on a prompt suite, interleaved prompt by prompt; write markdown, JSON "
        "and PNG plots.",
    )
    parser.add_argument("--model", default=None, help="model folder or repo id (default: the demo model)")
    parser.add_argument(
        "--draft",
        default=None,
        help="draft model for draft_model and transformers_assisted, or an export-onnx folder for onnx",
    )
    add_runtime_options(parser)
    parser.add_argument(
        "--head",
        action="append",
        default=[],
        metavar="METHOD=FOLDER",
        help="a trained head or block draft for eagle, medusa, mtp or dflash (repeatable), "
        "e.g. --head eagle=my-eagle-head",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods (default: auto, what speculative=True does, drafting with --draft "
        "when given, plus the methods of --head); a method followed by +tree (e.g. ngram+tree) drafts trees",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--suite",
        default="builtin",
        type=one_of("hf_specdec.bench.suites:SUITES", "builtin"),
        help="prompt suite: specbench, specbench-quick, mtbench, humaneval ... (default: builtin)",
    )
    source.add_argument("--prompts", type=Path, default=None, help="a JSONL file with a 'prompt' per line")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="benchmark data (default: $HF_SPECDEC_DATA, else shared/data beside the checkout)",
    )
    parser.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each row N times per prompt, interleaved, and keep the median (default 1)",
    )
    parser.add_argument("--categories", default=None, help="comma-separated categories to keep")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes (default: 1)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)"
    )
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--static-cache",
        action="store_true",
        help="every row on transformers' static cache (cache_implementation='static'; compiled by "
        "default on a GPU, as transformers does)",
    )
    cache.add_argument(
        "--compile",
        action="store_true",
        help="every row on the static cache with the decode step compiled, on a CPU too (transformers' "
        "fast path; the verify widths are compiled before timing)",
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="sample (do_sample=True) instead of greedy; each prompt seeded alike for every row, and "
        "rows that took plain's draws checked against plain's sample",
    )
    parser.add_argument("--num-draft-tokens", default="auto", help='an integer, or "auto" (default)')
    template = parser.add_mutually_exclusive_group()
    template.add_argument(
        "--chat-template",
        dest="chat_template",
        action="store_true",
        default=None,
        help="wrap each prompt (code completions aside) as a user message in the tokenizer's chat "
        "template (default: when the tokenizer has one); refused for a tokenizer without one",
    )
    template.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="feed each prompt as plain text, without the chat template",
    )
    parser.add_argument(
        "--no-transformers", action="store_true", help="skip transformers' prompt lookup / assisted rows"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench_out"), help="output folder (default: bench_out)"
    )
    parser.add_argument("--markdown", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument("--note", action="append", default=[], help="a line of text for the report's header")
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_specdec.bench import run_bench, save, to_markdown
    from hf_specdec.bench.report import failed_rows

    try:
        _check_outputs(args.out, args.markdown)  # before the run, not after it: its figures would be lost
        result = run_bench(
            args.model,
            dtype=args.dtype,
            device=args.device,
            draft=args.draft,
            heads=_heads(args.head),
            methods=_names(args.methods, "--methods", "method", "auto,ngram"),
            suite=args.suite,
            prompts=args.prompts,
            data_dir=args.data_dir,
            limit=args.limit,
            repeats=args.repeats,
            static_cache=args.static_cache,
            compile=args.compile,
            categories=_names(args.categories, "--categories", "category", "qa,rag"),
            batch_sizes=[_positive_int(b, "--batch-sizes") for b in _split(args.batch_sizes)],
            max_new_tokens=args.max_new_tokens,
            sample=args.sample,
            chat_template=args.chat_template,
            num_draft_tokens=_draft_tokens(args.num_draft_tokens),
            transformers_baselines=not args.no_transformers,
            progress=not args.quiet,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result.settings["command"] = "hf-specdec bench " + shlex.join(sys.argv[2:]) if _is_cli() else None
    result.settings["notes"] = args.note
    written = save(result, args.out, plots=not args.no_plots)
    markdown = to_markdown(result)
    if args.markdown:
        args.markdown.write_text(markdown)
        written.append(args.markdown)
    print(markdown)
    print("Wrote " + ", ".join(map(str, written)), file=sys.stderr)
    if result.interrupted:
        print("Interrupted: the files hold the results measured so far.", file=sys.stderr)
        return 130
    failed = failed_rows(result.measurements)
    if failed:  # the report holds the others' figures; a script must still learn that these measured nothing
        print(f"{len(failed)} row(s) failed on every prompt:", *failed, sep="\n- ", file=sys.stderr)
        return 1
    return 0


def _check_outputs(out: Path, markdown: Path | None) -> None:
    """The output folder can be made and the markdown file's folder exists, both taking files."""
    from hf_specdec.store.paths import cannot_write_in

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder for the results.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot make that folder ({err.strerror}).") from None
    if problem := cannot_write_in(out):
        raise ValueError(f"--out {out}: cannot write files in that folder ({problem}); pass another.")
    if markdown is not None and (markdown.is_dir() or not markdown.parent.is_dir()):
        raise ValueError(f"--markdown {markdown}: pass a file in a folder that exists.")
    if markdown is not None and (problem := cannot_write_in(markdown.parent)):
        raise ValueError(f"--markdown {markdown}: cannot write files in its folder ({problem}).")


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _names(text: str | None, option: str, what: str, example: str) -> list[str] | None:
    """The comma-separated names of an option, None where it is not given; given, it must name some
    (else the default would run in place of what was asked for)."""
    if text is None:
        return None
    if names := _split(text):
        return names
    raise ValueError(f"{option} names no {what}: pass some, e.g. {option} {example}, or leave {option} out.")


def _heads(values: list[str]) -> dict[str, str]:
    from hf_specdec.heads import TRAINED_METHODS

    heads = {}
    for value in values:
        method, sep, folder = value.partition("=")
        if not sep or method not in TRAINED_METHODS or not folder:
            raise ValueError(
                f"--head takes METHOD=FOLDER with METHOD {', '.join(TRAINED_METHODS)}, got {value!r}."
            )
        if method in heads:  # else the first would be dropped without a word
            raise ValueError(
                f"--head {method}= is given twice ({heads[method]}, {folder}): benchmark one per run."
            )
        heads[method] = folder
    return heads


def _positive_int(text: str, option: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{option} takes positive integers, got {text!r}.")
    return int(text)


def _draft_tokens(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text, "--num-draft-tokens")


def _is_cli() -> bool:
    return len(sys.argv) > 1 and sys.argv[1] == "bench"
