"""`hf-specdec select TARGET`: which draft (or draft-free method) speculative decoding would use."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_specdec.selection.select import DraftChoice


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "select",
        help="choose a draft model for a target",
        description="Choose a draft model (or a draft-free method) for a target model, and say why.",
    )
    parser.add_argument("target", metavar="TARGET", help="a Hub repo id or a local model folder")
    parser.add_argument("--json", action="store_true", help="print the decision as JSON")
    parser.add_argument("--token", default=None, help="Hugging Face token for gated or private repos")
    parser.add_argument("--revision", default=None, help="the target's branch, tag or commit")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="consider drafts that need custom code (auto_map)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_specdec.selection.choice import auto_method
    from hf_specdec.selection.select import DraftSelectionError, select_draft

    try:
        choice = select_draft(
            args.target, token=args.token, revision=args.revision, trust_remote_code=args.trust_remote_code
        )
    except DraftSelectionError as err:  # the Hub would not let the target be examined
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # input refused: 2, as argparse's own errors
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:  # `method` as the choice is cached and exported; `auto_method`, what generate runs
        print(json.dumps({**choice.to_dict(), "auto_method": auto_method(choice.method)}, indent=2))
    else:
        print(_describe(choice))
    return 0


def _describe(choice: DraftChoice) -> str:
    from hf_specdec.selection.choice import auto_method

    runs = auto_method(choice.method)
    lines = [
        f"method:    {runs}"
        + (
            f" (draft-free: {choice.method} plus the corpus of earlier calls)"
            if runs != choice.method
            else ""
        ),
        f"draft:     {choice.draft or '-'}",
        *(
            [f"revision:  {choice.revision} (the commit checked; the draft is loaded from it)"]
            if choice.revision
            else []
        ),
        f"reason:    {choice.reason}",
        f"source:    {choice.source}",
    ]
    if choice.size_ratio:
        lines.append(f"size:      1/{1 / choice.size_ratio:.1f} of the target")
    if choice.tokenizer_check:
        lines.append(f"tokenizer: {choice.tokenizer_check}")
    if choice.translation:
        lines.append(f"drafts:    across tokenizers ({choice.translation}: over the tokens both share)")
    lines += [f"rejected:  {item}" for item in choice.rejected]
    for head in choice.heads:  # published heads for this target, from the registry
        layout = f"{head['layout']} layout; " if head.get("layout") else ""
        source = head.get("source") or "-"
        lines.append(f"head:      {head['method']} {head['head']} ({layout}source: {source})")
    if choice.heads:
        lines.append("           (use a head with speculative=dict(method=METHOD, draft=REPO))")
    return "\n".join(lines)
