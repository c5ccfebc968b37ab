"""`SpeculativeConfig`: what the user asks for with `generate(..., speculative=...)`."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from torch import nn
from transformers import PreTrainedTokenizerBase

# The methods a policy object needs (`policy.DraftLengthPolicy`'s, which has defaults for all but
# `draft_length`): one that does not subclass it needs these four, and gets the defaults of the rest.
POLICY_METHODS = ("draft_length", "trim", "update", "expect_draft_cost")
# The rest: a subclass of `DraftLengthPolicy` may override them (added after policies were written).
OPTIONAL_POLICY_METHODS = ("begin_call", "keeps_batch_shape", "observe_target")


@dataclass(frozen=True)
class Drafting:
    """How one `generate` call drafts, known once its drafter is built: what decides which settings
    it reads (`ReadWhen`)."""

    do_sample: bool
    tree: bool  # tree drafts (after tree="auto" is resolved), else chains
    compiled: bool  # the target decodes on a compiled static cache
    translated: bool  # the draft's tokens are another tokenizer's, translated to the target's
    loads_draft_code: bool  # a draft is chosen (method="auto") or loaded by name through Auto classes


@dataclass(frozen=True)
class ReadWhen:
    """When a setting is read, declared with its field (`read_when`): `reads(settings, drafting)`,
    and for the warning where a call does not read it, why and what to do."""

    reads: Callable[[Any, Drafting], bool]
    unread: str  # completes "`name`=value ...": what it is for and why this call does not read it
    remedy: str


TREES = ReadWhen(
    lambda settings, drafting: drafting.tree,
    "shapes tree drafts, and this call drafts chains",
    "pass tree=True with a drafter that grows trees (tree='auto' drafts chains where the drafter or a "
    "static cache cannot), or drop it",
)
CHAINS = ReadWhen(
    lambda settings, drafting: not drafting.tree,
    "cuts chain drafts, and this call drafts trees",
    "drop tree= or the option",
)
GREEDY_CHAINS_AND_TREES = ReadWhen(
    lambda settings, drafting: drafting.tree or not drafting.do_sample,
    "stops greedy chain drafts (and prunes trees), and this call samples chains, which draft their "
    "full length for the draft-length policy to cut",
    "drop it, or decode greedily (do_sample=False)",
)
COMPILED = ReadWhen(
    lambda settings, drafting: drafting.compiled,
    "applies where the target decodes on a compiled static cache, and this call's target decodes eagerly",
    "drop it, or compile the target's decoding (cache_implementation='static', with a compile_config "
    "where the device does not compile by default)",
)
TRANSLATED = ReadWhen(
    lambda settings, drafting: drafting.translated,
    "chooses how a draft of another tokenizer is translated, and this draft's tokens are the target's",
    "drop it",
)
CORPUS = ReadWhen(
    lambda settings, drafting: settings.max_corpus_tokens > 0,
    "tunes drafting from the corpus of earlier calls, and max_corpus_tokens=0 keeps none",
    "drop it, or give the corpus room (max_corpus_tokens > 0)",
)
DRAFT_CODE = ReadWhen(
    lambda settings, drafting: drafting.loads_draft_code,
    "lets a draft named by folder or repo (method='draft_model' or 'assistant') or chosen by "
    "method='auto' run its repo's code, and this call loads none (a loaded draft is used as it is; "
    "prompt lookup, heads, block drafts, ONNX exports and the target's own MTP layers run no repo code)",
    "drop it",
)


READ_WHEN = "read_when"  # the key of a field's metadata that holds its `ReadWhen`


def read_when(rule: ReadWhen, default: Any) -> Any:
    """A dataclass field read only where `rule` holds: a value other than its default given for a
    call that does not read it draws a warning (`SpeculativeConfig.warn_unused`)."""
    return field(default=default, metadata={READ_WHEN: rule})


@dataclass
class SpeculativeConfig:
    """How to speculate.

    Args:
        method: a drafter name (`"ngram"`, `"draft_model"`, ...) or `"auto"`, which uses the draft
            given in `draft` when there is one (a draft head, block draft, assistant or `MtpModel`
            by its own method) and otherwise chooses for the target.
        draft: for `method="draft_model"`: a local folder, a Hub repo id, or a loaded model;
            for `method="onnx"`: a folder exported with `hf-specdec export-onnx`; for
            `method="eagle"` / `"medusa"`: a trained head (loaded, folder or Hub repo); for
            `method="assistant"`: an official assistant (Gemma 4's `*-assistant`), loaded or named;
            for `method="mtp"`: None (the target's own MTP layers, read out of its checkpoint),
            transformers' `MtpModel` of them, or an MTP head we trained; for `method="dflash"` /
            `"dspark"`: a block draft (loaded, folder or Hub repo). Drafters that take none
            (`ngram`, `suffix`, `quantized`) refuse one given.
        draft_tokenizer: the draft's tokenizer when `draft` is a loaded model (for `method="onnx"`,
            it replaces the one an exported folder holds); lets the compatibility check compare
            vocabularies instead of sizes. Refused where nothing would read it: without a `draft`,
            beside a draft model named by folder or repo (loaded with its own), and for drafters in
            the target's own tokens (heads, assistants).
        num_draft_tokens: tokens drafted per step (tree nodes, with `tree`): an integer for a fixed
            length, or `"auto"` (default) to choose it each step from measured acceptance and costs
            (state kept for the call).
        options: settings of the chosen drafter (see its config class, e.g. `NgramConfig`).
        tree: `True` to let the drafter propose a tree of candidate continuations, verified in one
            forward (`num_draft_tokens` then counts its nodes); `False` (default) drafts one chain;
            `"auto"` a tree where the drafter grows trees and a chain where it does not (no error),
            the tree's size chosen by the draft-length policy from measured costs and acceptance.
            Drafters that grow trees: `ngram` and `suffix` (a trie of matches), `draft_model`,
            `onnx`, `quantized`, `eagle`, `mtp` and `assistant` (EAGLE-2: top-k branching by
            cumulative draft probability), `dflash` and `dspark` (EAGLE-2 over a block's positions)
            and `medusa` (the cartesian product of each head's top-k, pruned by probability).
        trust_remote_code: let a draft (named in `draft`, or chosen by `method="auto"`) run the
            Python code its repo ships (`auto_map` in its config), as `from_pretrained(...,
            trust_remote_code=True)` would. Off by default: such a draft is refused when named, and
            skipped by the automatic choice, never asked about. A loaded model given as `draft` is
            used as it is, and heads, block drafts, ONNX exports and the target's own MTP layers
            run no repo code: there it is not read (a warning says so).
        policy: a draft-length policy object that chooses the draft length instead (leave
            `num_draft_tokens` at "auto"), e.g. `AdaptiveDraftLength()`, which keeps what it learns
            across the calls it is passed to: any object with the `DraftLengthPolicy` methods
            `draft_length`, `trim`, `update` and `expect_draft_cost`.
        max_tree_nodes: with `tree`, the most nodes a tree may have, whatever length the policy
            asks for; None (default): no cap of its own. A call that drafts chains does not read
            it (a warning says so).

    A setting given that the call does not read (a tree setting where it drafts chains, a cut of
    greedy drafts where it samples) draws one warning that names it and what to do: each field
    declares when it is read (`read_when`), and `warn_unused` checks them all, here and in the
    drafters' options, once the drafter is built.

    Deprecated spellings, kept for one release with a `DeprecationWarning`: a policy object as
    `num_draft_tokens` (now `policy=`), and `tree=<n>` (now `tree=True, max_tree_nodes=<n>`).
    """

    method: str = "auto"
    draft: Any = None
    draft_tokenizer: Any = None
    num_draft_tokens: int | Literal["auto"] = "auto"
    options: dict[str, Any] = field(default_factory=dict)
    tree: bool | Literal["auto"] = False
    trust_remote_code: bool = read_when(DRAFT_CODE, False)
    # New fields go last: earlier ones may be given by position.
    policy: Any = None
    max_tree_nodes: int | None = read_when(TREES, None)

    def __post_init__(self) -> None:
        if not isinstance(self.trust_remote_code, bool):
            raise TypeError(f"`trust_remote_code` must be True or False, got {self.trust_remote_code!r}.")
        if not isinstance(self.method, str):
            raise TypeError(f"`method` must be a string, got {type(self.method).__name__}.")
        self._take_old_tree_spelling()
        _check_tree(self.tree, self.max_tree_nodes)
        self._take_old_policy_spelling()
        _check_draft_length(self.num_draft_tokens, self.policy)
        if not isinstance(self.options, dict):
            raise TypeError(
                f"`options` must be a dict of the drafter's settings, e.g. options={{'max_ngram': 4}} for "
                f"method='ngram' (or leave it out), got {self.options!r}."
            )
        if isinstance(self.draft, (str, os.PathLike)):
            _check_draft_location(str(self.draft))
        elif self.draft is not None:
            _check_draft_object(self.draft)
        if self.draft_tokenizer is not None:
            check_tokenizer(self.draft_tokenizer, "SpeculativeConfig(draft_tokenizer=...)")
        if self.draft is None and self.draft_tokenizer is not None:
            raise ValueError(
                "`draft_tokenizer` is the tokenizer of the draft model given as draft=, and no draft was "
                f"given (method={self.method!r}): pass draft=<your draft model> with it, or drop "
                "draft_tokenizer=."
            )

    def _take_old_tree_spelling(self) -> None:
        """`tree=<n>`, deprecated: a tree of at most n nodes."""
        if not (_is_count(self.tree) and self.tree >= 1):
            return
        if self.max_tree_nodes is not None:
            raise ValueError(
                f"tree={self.tree} and max_tree_nodes={self.max_tree_nodes} both cap the tree's nodes: "
                "pass tree=True, max_tree_nodes=<n>."
            )
        warnings.warn(
            f"SpeculativeConfig(tree={self.tree}) is deprecated and will be removed in the next release: "
            f"pass tree=True, max_tree_nodes={self.tree}.",
            DeprecationWarning,
            stacklevel=4,  # the caller of SpeculativeConfig(...), past __post_init__ and __init__
        )
        self.tree, self.max_tree_nodes = True, self.tree

    def _take_old_policy_spelling(self) -> None:
        """A policy object as `num_draft_tokens`, deprecated: it goes in `policy`."""
        n = self.num_draft_tokens
        if n == "auto" or _is_count(n) or not _policy_methods(n):
            return
        if self.policy is not None:
            raise ValueError(
                "Both `num_draft_tokens` and `policy` were given a draft-length policy: pass it once, "
                "as policy=<your policy>."
            )
        warnings.warn(
            "Passing a draft-length policy as `num_draft_tokens` is deprecated and will be removed in the "
            f"next release: pass SpeculativeConfig(policy={type(n).__name__}(...)) instead.",
            DeprecationWarning,
            stacklevel=4,  # the caller of SpeculativeConfig(...), past __post_init__ and __init__
        )
        self.policy, self.num_draft_tokens = n, "auto"

    def warn_unused(
        self, resolved: SpeculativeConfig, options_class: type | None, drafting: Drafting
    ) -> None:
        """Warn, once, about the settings given (other than their defaults) that this call does not
        read, each named with what to do, as transformers' `GenerationConfig.validate` warns about
        sampling flags under greedy decoding: the call drafts as if they were not given, which is
        harmless but not what was asked. Each field declares when it is read (`read_when`), here
        and in the drafters' options dataclasses. `resolved`: this config with "auto" made concrete
        (its options are the ones the drafter read); `options_class`: the drafter's
        (`Drafter.options_class`), None where it declares none."""
        unread = _unread(self, {f.name for f in dataclasses.fields(self)}, drafting, "")
        if options_class is not None:
            unread += _unread(options_class(**resolved.options), set(self.options), drafting, "options ")
        if unread:
            warnings.warn(
                f"speculative= settings this call (method={resolved.method!r}) does not read; it drafts "
                "as if they were not given:\n" + "\n".join(unread),
                stacklevel=2,
            )

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


def _unread(settings: Any, given: set[str], drafting: Drafting, prefix: str) -> list[str]:
    """A line per field of `settings` named in `given`, set to other than its default, whose
    `ReadWhen` says this call does not read it."""
    lines = []
    for f in dataclasses.fields(settings):
        rule, value = f.metadata.get(READ_WHEN), getattr(settings, f.name)
        if rule is None or f.name not in given or value == f.default or rule.reads(settings, drafting):
            continue
        lines.append(f"- {prefix}{f.name}={value!r} {rule.unread}: {rule.remedy}.")
    return lines


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _policy_methods(value: Any) -> list[str]:
    """Which methods of the policy protocol `value` has."""
    return [name for name in POLICY_METHODS if callable(getattr(value, name, None))]


def _check_tree(tree: Any, max_tree_nodes: Any) -> None:
    if not (isinstance(tree, bool) or tree == "auto"):
        raise ValueError(
            f"`tree` must be True, False or 'auto' (cap a tree's nodes with max_tree_nodes=<n>), "
            f"got {tree!r}."
        )
    if max_tree_nodes is None:
        return
    if not _is_count(max_tree_nodes):
        raise TypeError(
            f"`max_tree_nodes` must be a positive integer or None, got {max_tree_nodes!r} "
            f"({type(max_tree_nodes).__name__})."
        )
    if max_tree_nodes < 1:
        raise ValueError(f"`max_tree_nodes` must be a positive integer or None, got {max_tree_nodes}.")


def _check_draft_length(n: Any, policy: Any) -> None:
    """`num_draft_tokens` a positive integer or "auto"; `policy` None or an object with every method
    of the policy protocol, and then the one that chooses the length."""
    if not (n == "auto" or (_is_count(n) and n >= 1)):
        raise ValueError(
            f'`num_draft_tokens` must be a positive integer or "auto" (a draft-length policy object goes '
            f"in policy=), got {n!r}."
        )
    if policy is None:
        return
    if n != "auto":
        raise ValueError(
            f"num_draft_tokens={n} and policy={type(policy).__name__}(...) both choose the draft length: "
            "pass one of them (FixedDraftLength(k) is the policy of a fixed length)."
        )
    missing = [name for name in POLICY_METHODS if name not in _policy_methods(policy)]
    if len(missing) == len(POLICY_METHODS):
        raise TypeError(
            f"`policy` must be a draft-length policy object such as hf_specdec.AdaptiveDraftLength(), got "
            f"{policy!r} ({type(policy).__name__}); a fixed draft length goes in num_draft_tokens=<k>."
        )
    if missing:
        raise TypeError(
            f"The draft-length policy {type(policy).__name__} lacks {missing}: a policy object needs "
            "draft_length, trim, update and expect_draft_cost (subclass hf_specdec.DraftLengthPolicy "
            "to inherit defaults for all but draft_length; FixedDraftLength is the simplest one)."
        )


def check_tokenizer(tokenizer: Any, argument: str) -> None:
    """A tokenizer argument must be a loaded tokenizer: a path or repo id would fail deep inside, or
    go unread where the draft's vocabulary happens to be the target's size."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(
            f"{argument} must be a loaded tokenizer, e.g. AutoTokenizer.from_pretrained(...), got "
            f"{tokenizer!r} ({type(tokenizer).__name__})."
        )


def _check_draft_object(draft: Any) -> None:
    """A draft given as an object must be a loaded model (or, for eagle/medusa, a head module) that
    continues text as the target does: decoder-only."""
    if not isinstance(draft, nn.Module):
        raise TypeError(
            "`draft` must be a local folder, a Hub repo id, or a loaded model (for method='eagle' or "
            f"'medusa': a head folder, repo id or module); got {draft!r} ({type(draft).__name__})."
        )
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(draft, OptimizedModule):
        # It forwards attribute reads but not its class, which the drafters read (what cache the
        # model keeps, its forward's signature).
        raise ValueError(
            f"The draft is wrapped by torch.compile (OptimizedModule of {type(draft._orig_mod).__name__}): "
            "pass the model itself (draft=compiled._orig_mod), compiled in place with draft.compile() "
            "if you want it compiled. On a compiled static cache (cache_implementation='static', compiled "
            "as generate compiles it) a draft model's forwards are compiled alike."
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
