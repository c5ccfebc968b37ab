"""`SpeculativeConfig`: what the user asks for with `generate(..., speculative=...)`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from torch import nn

DraftLength = int | Literal["auto"] | Any

# The methods of `policy.DraftLengthPolicy`, every one of which the loop calls each step.
POLICY_METHODS = ("draft_length", "trim", "update", "expect_draft_cost")


@dataclass
class SpeculativeConfig:
    """How to speculate.

    Args:
        method: a drafter name (`"ngram"`, `"draft_model"`, ...) or `"auto"`, which uses the draft
            model given in `draft` when there is one and otherwise chooses for the target.
        draft: for `method="draft_model"`: a local folder, a Hub repo id, or a loaded model;
            for `method="onnx"`: a folder exported with `hf-specdec export-onnx`.
        draft_tokenizer: the draft's tokenizer when `draft` is a loaded model; lets the
            compatibility check compare vocabularies instead of sizes.
        num_draft_tokens: tokens drafted per step: an integer for a fixed length, `"auto"` to
            choose it each step from measured acceptance and costs (state kept for the call), or
            a policy object such as `AdaptiveDraftLength()` that keeps what it learns across calls
            (any object with the `DraftLengthPolicy` methods `draft_length`, `trim` and `update`).
        options: settings of the chosen drafter (see its config class, e.g. `NgramConfig`).
        tree: `True` to let the drafter propose a tree of candidate continuations, verified in one
            forward (`num_draft_tokens` then counts its nodes); an integer also caps the nodes;
            `False` (default) drafts one chain; `"auto"` a tree where the drafter grows trees
            and a chain where it does not (no error), the tree's size chosen by the draft-length
            policy from measured costs and acceptance. Drafters that grow trees: `ngram` (a trie of
            matches), `draft_model`, `onnx`, `quantized` and `eagle` (EAGLE-2: top-k
            branching by cumulative draft probability) and `medusa` (the cartesian product of each
            head's top-k, pruned by probability).
        trust_remote_code: let a draft (named in `draft`, or chosen by `method="auto"`) run the
            Python code its repo ships (`auto_map` in its config), as `from_pretrained(...,
            trust_remote_code=True)` would. Off by default: such a draft is refused when named, and
            skipped by the automatic choice, never asked about. A loaded model given as `draft` is
            used as it is.
    """

    method: str = "auto"
    draft: Any = None
    draft_tokenizer: Any = None
    num_draft_tokens: DraftLength = "auto"
    options: dict[str, Any] = field(default_factory=dict)
    tree: bool | int | str = False
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.trust_remote_code, bool):
            raise TypeError(f"`trust_remote_code` must be True or False, got {self.trust_remote_code!r}.")
        if self.tree != "auto" and (
            not isinstance(self.tree, (bool, int)) or (type(self.tree) is int and self.tree < 1)
        ):
            raise ValueError(
                f"`tree` must be True, False, 'auto' or a positive number of nodes, got {self.tree!r}."
            )
        if not isinstance(self.method, str):
            raise TypeError(f"`method` must be a string, got {type(self.method).__name__}.")
        _check_num_draft_tokens(self.num_draft_tokens)
        if not isinstance(self.options, dict):
            raise TypeError(
                f"`options` must be a dict of the drafter's settings, e.g. options={{'max_ngram': 4}} for "
                f"method='ngram' (or leave it out), got {self.options!r}."
            )
        if isinstance(self.draft, (str, os.PathLike)):
            _check_draft_location(str(self.draft))
        elif self.draft is not None:
            _check_draft_object(self.draft)

    @classmethod
    def from_user(cls, value: Any) -> SpeculativeConfig | None:
        """Normalise what `speculative=` accepts: True/False/None, a method name, a dict, a config."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(
                    f"Unknown key(s) {unknown} in the `speculative` dict; valid keys are {sorted(known)}."
                )
            return cls(**value)
        raise TypeError(
            "`speculative` must be True, False, None, a method name, a dict or a SpeculativeConfig; "
            f"got {type(value).__name__}."
        )


def _check_num_draft_tokens(n: Any) -> None:
    """A positive integer, "auto", or an object with every method of the policy protocol."""
    if n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        return
    missing = [name for name in POLICY_METHODS if not callable(getattr(n, name, None))]
    if len(missing) == len(POLICY_METHODS):
        raise ValueError(
            f'`num_draft_tokens` must be a positive integer, "auto" or a policy object, got {n!r}.'
        )
    if missing:
        raise TypeError(
            f"The draft-length policy {type(n).__name__} lacks {missing}: a policy object needs "
            "draft_length, trim, update and expect_draft_cost (subclass hf_specdec."
            "DraftLengthPolicy to inherit its no-op expect_draft_cost; FixedDraftLength is the simplest one)."
        )


def _check_draft_object(draft: Any) -> None:
    """A draft given as an object must be a loaded model (or, for eagle/medusa, a head module) that
    continues text as the target does: decoder-only."""
    if not isinstance(draft, nn.Module):
        raise TypeError(
            "`draft` must be a local folder, a Hub repo id, or a loaded model (for method='eagle' or "
            f"'medusa': a head folder, repo id or module); got {draft!r} ({type(draft).__name__})."
        )
    if getattr(getattr(draft, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"The draft {type(draft).__name__} is an encoder-decoder model; a draft must be a decoder-only "
            "causal LM that shares the target's tokenizer (one AutoModelForCausalLM loads), or use "
            "method='ngram'."
        )


def _check_draft_location(draft: str) -> None:
    """A draft named by a string must be a folder that exists or could be a Hub repo id; otherwise
    the Hub client would answer for a mistyped path with its repo id rules."""
    if Path(draft).expanduser().exists():
        return
    try:
        validate_repo_id(draft)
    except HFValidationError:
        raise FileNotFoundError(
            f"draft={draft!r} is not a folder that exists, nor a Hub repo id ('name' or 'namespace/name'). "
            "Check the path, or pass a loaded model."
        ) from None
