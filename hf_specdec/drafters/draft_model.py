"""A separate, smaller PyTorch causal LM drafts autoregressively (drafting itself is
`decoder.DecoderDrafter`'s). A draft of another tokenizer drafts through a translation of its tokens
into the target's, chosen from the two tokenizers (`vocabulary.choose_translation`): over the tokens
both vocabularies share (token-level intersection, in `DecoderDrafter`), or through text
(`text_aligned.TextAlignedDrafter`, greedy only)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..config import COMPILED, GREEDY_CHAINS_AND_TREES, TRANSLATED, TREES, read_when
from ..core.checks import check_causal_checkpoint
from ..core.devices import check_placed, execution_device
from ..core.fields import check_fields
from ..hub.config_check import NO_PICKLES, checkpoint_problem
from ..hub.download import HubFileError, download_model, refetch_advice
from ..hub.tokenizer_check import compare_tokenizers_once, spelling, token_spellings
from ..hub.tokenizer_files import saved_tokenizer
from ..store.manifest import checkpoint_stamp
from .base import Drafter, options_to_config
from .decoder import DecoderDrafter, TorchDecoder
from .kind import clear_kinds, draft_method
from .registry import register_drafter
from .text_aligned import TextAlignedDrafter
from .vocabulary import SHARED, TRANSLATIONS, Translation, choose_translation, clear_translations

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


@dataclass
class DraftModelConfig:
    """Settings of the `draft_model` drafter.

    Args:
        min_confidence: stop a greedy chain draft early once the draft's own probability of its
            next token falls below this (llama.cpp's `--draft-p-min`), and leave out tree nodes
            whose path is less probable; 0 always drafts the full length. A sampled chain does
            not read it.
        tokenizer_verified: the pair's tokenizers are known to agree (set by automatic draft
            selection, which compared them), so no vocabulary-size check is needed.
        tree_top_k: with `SpeculativeConfig(tree=...)`, the children drafted per expanded node and
            the nodes expanded per level (EAGLE-2's top-k). Chains do not read it.
        compile_with_target: where the target decodes on a compiled static cache (`compile_config`),
            compile the draft's forwards alike (`Drafter.compile_forwards`); False
            keeps them eager (a draft dynamo cannot trace as one graph, or to spare its compiles).
            An eager target does not read it.
        translation: for a draft whose tokenizer differs from the target's, how its drafts become
            the target's tokens: "auto" chooses from the two tokenizers (`choose_translation`),
            "intersection" drafts over the tokens both vocabularies share (token-level intersection,
            TLI: exact for sampling too), "text" re-tokenizes the draft's text (universal assisted
            decoding, UAD: greedy only). Needs both tokenizers; not read where they agree.
    """

    min_confidence: float = read_when(GREEDY_CHAINS_AND_TREES, 0.0)
    tokenizer_verified: bool = False
    tree_top_k: int = read_when(TREES, 4)
    compile_with_target: bool = read_when(COMPILED, True)
    translation: str = read_when(TRANSLATED, "auto")

    def __post_init__(self) -> None:
        check_fields(
            self,
            ranges={"min_confidence": (0, 1), "tree_top_k": (1, None)},
            choices={"translation": TRANSLATIONS},
        )


# Loaded drafts by (what was loaded, dtype, device, trust_remote_code): loading takes seconds, a
# generate call should not. `clear_loaded()` (called by `hf_specdec.clear_cache()`) frees it.
_LOADED: dict[tuple[tuple, torch.dtype, str, bool], tuple[Any, Any]] = {}


def load_draft(
    name: str, target: PreTrainedModel, *, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, Any]:
    """Load a draft model and its tokenizer with the target's dtype and device (cached).

    `name` is a local folder, or a Hub repo id whose config, safetensors weights and tokenizer files
    are downloaded from the commit its `main` is at (`hub.download_model`: never pickled weights).
    The folder's own code runs only with `trust_remote_code=True`: without it a folder that needs
    it is refused with a ValueError that says so (`config_check.checkpoint_problem`), never asked about.
    """
    device = execution_device(target)  # not `target.device`: `meta` when device_map offloads its weights
    local = Path(name).expanduser().is_dir()
    key = (_loaded_as(name, local), target.dtype, str(device), trust_remote_code)
    loaded = _LOADED.get(key)
    if loaded is None:
        folder = Path(name).expanduser() if local else download_model(str(name))
        problem = checkpoint_problem(folder, trust_remote_code=trust_remote_code, from_hub=not local)
        if problem == NO_PICKLES:  # what a pickle holds is not read: it may be a head, published so
            problem += (
                ". If it is a draft head the authors published pickled (EAGLE's are), pass "
                f"speculative=dict(method='eagle', draft={str(name)!r}): a head's weights are read with "
                "torch.load(weights_only=True)"
            )
        if problem:
            raise ValueError(f"The draft {name} cannot be used: {problem}.")
        check_causal_checkpoint(folder, f"The draft {name}", trust_remote_code=trust_remote_code)
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=target.dtype, trust_remote_code=trust_remote_code, output_loading_info=True
        )
        # transformers fills weights the checkpoint lacks with random values and only logs it: such
        # a draft's tokens are noise, which verification rejects, so every call would run slower
        # than plain decoding without a word. (Tied weights, stored once, are not missing.)
        missing = sorted(info["missing_keys"])
        if missing:
            raise ValueError(
                f"The draft {name} cannot be used: its checkpoint lacks {len(missing)} of its weights "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), which transformers "
                "would fill with random values: pass a complete checkpoint, or load it yourself and "
                "pass the model."
            )
        model = model.to(device).eval()
        remedy = (
            f"{refetch_advice(folder, 'save or download it again')}, or load the draft and its tokenizer "
            "yourself and pass draft=<model>, draft_tokenizer=<tokenizer>"
        )
        tokenizer = saved_tokenizer(
            folder, f"The draft {name}", trust_remote_code=trust_remote_code, remedy=remedy
        )
        loaded = (model, tokenizer)
        _LOADED.clear()  # keep one draft in memory, not every one ever used
        _LOADED[key] = loaded  # returned as it is: another thread may clear the dict meanwhile
    return loaded


def _loaded_as(name: str, local: bool) -> tuple:
    """What a draft named `name` is loaded from: a folder by its absolute path and its weights files
    as they are now (a relative name read from another working directory, or a draft saved again
    into the same folder, is another draft); a Hub repo id by the id."""
    if not local:
        return (str(name),)
    folder = Path(name).expanduser().resolve()
    return (str(folder), checkpoint_stamp(folder))


def clear_loaded() -> None:
    """Forget the draft `load_draft` keeps loaded, the tokenizers read from targets' folders, the
    translations chosen between tokenizers and what Hub repos given as drafts were told to be."""
    _LOADED.clear()
    _load_tokenizer.cache_clear()
    clear_translations()
    clear_kinds()


def check_compatible(
    target: PreTrainedModel,
    target_tokenizer: Any,
    draft: PreTrainedModel,
    draft_tokenizer: Any,
    draft_folder: str | None = None,
) -> None:
    """Refuse a draft whose token ids mean something else; warn when that cannot be checked.
    `draft_folder`: where a draft named by folder or repo was loaded from, which reads its tokenizer
    from there and refuses `draft_tokenizer=`."""
    give_draft_tokenizer = (
        f"its tokenizer saved in {draft_folder}, or the draft loaded, with draft_tokenizer="
        if draft_folder is not None
        else "`draft_tokenizer=` in the SpeculativeConfig"
    )
    if target_tokenizer is not None and draft_tokenizer is not None:
        check = compare_tokenizers_once(target_tokenizer, draft_tokenizer)
        if not check.compatible:
            raise ValueError(
                f"The draft model cannot draft for this target: its {check.explain()}. Use a draft "
                "from the same model family, the PyTorch draft with method='draft_model' (which "
                "drafts across tokenizers), or method='ngram'."
            )
        return
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        missing = [
            what
            for what, given in [
                ("the target's (`tokenizer=` to generate())", target_tokenizer),
                (f"the draft's ({give_draft_tokenizer})", draft_tokenizer),
            ]
            if given is None
        ]
        raise ValueError(
            f"The draft's vocabulary has {draft_vocab} entries but the target's has {target_vocab}, and "
            f"the tokenizers cannot be compared without {' and '.join(missing)}. Pass "
            f"{'them' if len(missing) > 1 else 'it'} so the vocabularies can be "
            "compared token by token (a draft of another tokenizer then drafts through a translation "
            "of its tokens)."
        )
    warnings.warn(
        f"Draft compatibility was judged by vocabulary size only. Give the draft's tokenizer "
        f"({give_draft_tokenizer}) and the target's (`generate(tokenizer=...)`) to check "
        "that token ids mean the same strings; a mismatch does not break correctness, only speed.",
        stacklevel=4,
    )


@register_drafter
class DraftModelDrafter(DecoderDrafter):
    """Drafts with a small PyTorch model (a folder, a Hub id or a loaded model)."""

    name: ClassVar[str] = "draft_model"
    supports_sampling: ClassVar[bool] = True
    supports_tree: ClassVar[bool] = True  # top-k branching by cumulative draft probability
    takes_trust_remote_code: ClassVar[bool] = True  # a draft named by folder or repo
    options_class: ClassVar[type] = DraftModelConfig

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        if config.draft is None:
            raise ValueError(
                "method='draft_model' needs a draft: "
                "SpeculativeConfig(method='draft_model', draft='repo/or/path') or draft=<a loaded model>."
            )
        _check_is_draft_model(config.draft)
        draft_folder = None
        if isinstance(config.draft, (str, Path)):
            draft_folder = str(config.draft)
            if config.draft_tokenizer is not None:
                raise ValueError(
                    f"The draft {str(config.draft)!r} is loaded with its own tokenizer, and draft_tokenizer= "
                    "would go unused: drop it, or pass the draft loaded (draft=<model>) with it."
                )
            draft, draft_tokenizer = _load_named_draft(
                str(config.draft), target, trust_remote_code=config.trust_remote_code
            )
        else:
            draft, draft_tokenizer = _unwrapped_peft(config.draft), config.draft_tokenizer
            # Run where it is, as transformers' assisted generation runs an assistant model: tokens
            # go to its device and its logits come back (`DecoderDrafter`). Only one that is no causal
            # LM, or has no weights, is refused.
            _check_causal_lm(draft)
            check_placed(draft, None, f"The draft {type(draft).__name__}", "")
        if draft is target:
            warnings.warn(
                "The draft is the target itself: every draft is accepted but nothing is gained.", stacklevel=4
            )
        options = options_to_config(cls.options_class, config.options)
        if tokenizer is None and draft_tokenizer is not None and not options.tokenizer_verified:
            tokenizer = local_tokenizer(target)
        translation = (
            SHARED
            if options.tokenizer_verified
            else _translation(target, tokenizer, draft, draft_tokenizer, options.translation, draft_folder)
        )
        decoder = TorchDecoder(draft, compile_with_target=options.compile_with_target)
        device = execution_device(target)
        if translation.vocabulary is None:  # through text
            return TextAlignedDrafter(
                decoder, options.min_confidence, device, tokenizer, draft_tokenizer, translation.statement
            )
        drafter = cls(decoder, options.min_confidence, device, options.tree_top_k, translation.vocabulary)
        drafter.translation = translation.statement
        return drafter


def _check_is_draft_model(draft: Any) -> None:
    """Refuse a draft that `kind.draft_method` tells is of another method, naming it."""
    own = draft_method(draft)
    if own is None:
        return
    name = str(draft) if isinstance(draft, (str, Path)) else type(draft).__name__
    what = (
        "an official assistant, which drafts from the target's own KV cache and hidden state"
        if own == "assistant"
        else f"a {own} draft, which reads the target's hidden states"
    )
    raise ValueError(
        f"The draft {name} is not a draft model but {what}: use speculative=dict(method={own!r}, "
        "draft=...), or method='auto', which runs a draft by what it is."
    )


def _unwrapped_peft(draft: Any) -> Any:
    """A PEFT model given as the draft, as the transformers model it wraps: LoRA and its kin live in
    that model's layers, and PEFT's wrapper only routes to it (it is no transformers model: its class
    has none of what a draft's cache is checked by). Prompt learning's virtual tokens are added by the
    wrapper's own input preparation instead, which a draft's forwards never go through: refused."""
    if not type(draft).__module__.startswith("peft.") or not hasattr(type(draft), "get_base_model"):
        return draft
    peft_config = draft.active_peft_config
    if peft_config.is_prompt_learning:
        raise ValueError(
            f"The draft is a PEFT {peft_config.peft_type.value} model, whose virtual tokens PEFT adds in its "
            "own generate, which a draft's forwards do not go through: pass another draft, or its base model "
            "(draft=<peft model>.get_base_model()) to draft without them."
        )
    return draft.get_base_model()


def _check_causal_lm(draft: nn.Module) -> None:
    """A loaded draft model must be a causal LM, which scores next tokens (a base model without its
    LM head, as `AutoModel` loads one, or another module would fail deep inside)."""
    can_generate = getattr(draft, "can_generate", None)
    if callable(can_generate) and can_generate():
        return
    raise ValueError(
        f"The draft {type(draft).__name__} is no causal LM: it has no language-model head to score next "
        "tokens with (a base model, as AutoModel loads one, or another module). Load the draft with "
        "AutoModelForCausalLM, or pass its folder or Hub repo id."
    )


def _translation(
    target: PreTrainedModel,
    tokenizer: Any,
    draft: PreTrainedModel,
    draft_tokenizer: Any,
    requested: str,
    draft_folder: str | None,
) -> Translation:
    """How the draft's tokens become the target's: as they are where the tokenizers agree, else as
    `choose_translation` says. Without both tokenizers only the vocabulary sizes can be compared
    (`check_compatible`): a draft of another size is refused, one of the same size taken as sharing
    the target's tokenizer, with a warning."""
    if tokenizer is None or draft_tokenizer is None:
        check_compatible(target, tokenizer, draft, draft_tokenizer, draft_folder)
        return SHARED
    draft_vocab = draft.config.get_text_config().vocab_size
    for role, given, vocab in [
        ("the target's (tokenizer=)", tokenizer, target.config.get_text_config().vocab_size),
        ("the draft's (draft_tokenizer=)", draft_tokenizer, draft_vocab),
    ]:
        if 2 * len(given) < vocab:  # padded vocabularies differ by a few percent, not by half
            warnings.warn(
                f"The tokenizer given as {role} has {len(given)} tokens, and its model embeds {vocab}: "
                "is it that model's own? Another model's tokenizer would make its ids mean other tokens "
                "to it (the output stays the target's; drafts would rarely be accepted).",
                stacklevel=5,
            )
    if _embeds_too_few(draft_tokenizer, draft_vocab):  # the draft would be fed ids it cannot embed
        raise ValueError(
            f"draft_tokenizer= has {len(draft_tokenizer)} tokens but the draft model's vocabulary "
            f"has only {draft_vocab} ids: pass the draft's own tokenizer, or resize the draft's embeddings "
            f"(draft.resize_token_embeddings({len(draft_tokenizer)})) if tokens were added to it."
        )
    if compare_tokenizers_once(tokenizer, draft_tokenizer).compatible:
        return SHARED
    return choose_translation(
        tokenizer,
        draft_tokenizer,
        requested,
        target.config.get_text_config().vocab_size,
        draft_vocab,
        execution_device(target),
    )


def _embeds_too_few(tokenizer: Any, vocab_size: int) -> bool:
    """Whether a token of text has an id past a model's `vocab_size` embeddings. Special tokens
    past it do not count: the draft reads text without them (`vocabulary.encode`), and a tokenizer
    may list more than its model embeds (Gemma 3's, shared by its sizes, has `<image_soft_token>` at
    id 262144, past the 262144 ids of the text-only models)."""
    if len(tokenizer) <= vocab_size:
        return False
    spellings = token_spellings(tokenizer)  # None for special tokens
    return any(spelling(spellings, i) is not None for i in range(vocab_size, len(tokenizer)))


def _load_named_draft(
    name: str, target: PreTrainedModel, *, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, Any]:
    """`load_draft`, saying when a name that is no local folder was also no repo the Hub gave us:
    a relative path that does not exist reads as a repo id, and transformers blames the network."""
    try:
        return load_draft(name, target, trust_remote_code=trust_remote_code)
    except (OSError, HubFileError) as err:
        if Path(name).expanduser().exists():
            raise
        message = (
            f"draft={name!r} is not a local folder (there is no {Path(name).expanduser().resolve()}), and "
            f"loading it as a Hub repo id failed: {err}\nCheck the path (a relative one starts from "
            f"{Path.cwd()}), or the repo id and your connection to the Hub."
        )
        if isinstance(err, HubFileError):
            raise HubFileError(message, lasting=err.lasting) from err
        raise OSError(message) from err


def local_tokenizer(model: PreTrainedModel) -> Any:
    """The target's tokenizer, read without downloading anything: from the local folder it was
    loaded from, or from the Hub cache for a model loaded by repo id; None where there is none."""
    name = getattr(model, "name_or_path", "") or ""
    folder = Path(name)
    if not name or not folder.is_dir():
        # A repo id: what the Hub cache holds of it (files of another commit are not looked for).
        return _load_tokenizer(name, ()) if name.count("/") == 1 and not folder.exists() else None
    files = [folder / f for f in ("tokenizer.json", "tokenizer_config.json") if (folder / f).exists()]
    if not files:
        return None
    # Loading takes ~150 ms and happens on every generate call: keep it while the files are unchanged.
    return _load_tokenizer(str(folder.resolve()), tuple(f.stat().st_mtime_ns for f in files))


@functools.lru_cache(maxsize=4)
def _load_tokenizer(name: str, mtimes: tuple[int, ...]) -> Any:
    try:  # the target's own tokenizer, but one the user did not ask for: no code of its runs
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError):
        return None
