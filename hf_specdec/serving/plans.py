"""One serving plan per method, or a refusal that says what to export instead.

`PLANS` and `REFUSALS` are keyed by drafter name (`hf_specdec.DRAFTERS`): every registered drafter is
in exactly one of them (tests/serving/test_plans.py), so a new drafter needs a decision here. A plan
is engine-neutral (`ServingPlan`); `engines.py` renders it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..drafters.base import options_to_config
from ..drafters.draft_model import DraftModelConfig
from ..drafters.head_drafter import HeadDrafterConfig
from ..drafters.mtp import own_layers
from ..drafters.ngram import NgramConfig
from ..drafters.registry import DRAFTERS
from ..drafters.suffix import SuffixConfig
from ..drafters.tree import ChainTreeConfig
from ..heads.checkpoint import CONFIG_NAME, load_head
from ..heads.eagle3 import Eagle3Head
from ..heads.layouts import check_layout
from ..heads.mtp import load_mtp_layers, local_model, mtp_layer_count
from ..selection.select import registry_head
from .base import (
    SGLANG_VERSION,
    VLLM_MEDUSA_LAST,
    VLLM_VERSION,
    Options,
    ServingExportError,
    ServingPlan,
    Source,
    not_carried,
)
from .block import plan_block, plan_dspark
from .sources import check_vocab, hub_origin, load_target, onnx_source, registry_assistant

Planner = Callable[[str, Source, Source, Options], ServingPlan]  # (model, draft, head, options)

# Methods no engine has an equivalent of, and what to export instead.
REFUSALS: dict[str, str] = {
    "quantized": (
        "method 'quantized' drafts with an int8 copy of the target itself, which neither vLLM nor SGLang "
        "offers (their drafts are separate, smaller models or trained heads). Export --method ngram, "
        "--method draft_model --draft <a small model with the target's tokenizer>, or an EAGLE-3 head "
        "(--head DIR) instead."
    ),
    "medusa": (
        f"Medusa heads cannot be served by vLLM {VLLM_VERSION} (method 'medusa' was removed in 0.33; vLLM "
        f"{VLLM_MEDUSA_LAST} and earlier still had it) nor by SGLang {SGLANG_VERSION} (no Medusa). Pin "
        f"vllm<=0.32 to serve it, or export --method ngram, --method draft_model or an EAGLE-3 head."
    ),
}


def plan_for(method: str, model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    """The plan that serves `method`; `ServingExportError` when no engine has an equivalent."""
    if method in REFUSALS:
        raise ServingExportError(REFUSALS[method])
    drafter = DRAFTERS.get(method)
    given = next((flag for flag, path in (("--draft", draft), ("--head", head)) if path is not None), None)
    if drafter is not None and not drafter.takes_draft and given is not None:
        raise ValueError(
            f"method {method!r} drafts without a draft of yours, and {given} {draft or head} would go "
            f"unused: drop {given}, or export --method draft_model (a draft model) or --method eagle (a "
            "head) to serve it (with no --method, the method is chosen for the draft given)."
        )
    planner = PLANS.get(method)
    if planner is not None:
        return planner(model, draft, head, options)
    if method in DRAFTERS:  # registered after hf-specdec's own drafters, e.g. by the user
        raise ServingExportError(
            f"The drafter {method!r} has no serving plan: vLLM and SGLang run only their own speculative "
            f"methods, and none is known to draft as it does. Export --method {' / '.join(sorted(PLANS))} "
            "instead."
        )
    raise ValueError(f"Unknown method {method!r}; valid methods: {', '.join(sorted({*PLANS, *REFUSALS}))}.")


def plan_ngram(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    config = options_to_config(NgramConfig, options)
    return ServingPlan(
        "ngram",
        {"vllm": "ngram", "sglang": "NGRAM"},
        measure={"method": "ngram", "options": options},
        ngram=(config.min_ngram, config.max_ngram),
        caveats=not_carried(options, carried=("min_ngram", "max_ngram")),
    )


def plan_suffix(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    """vLLM's `suffix` is SuffixDecoding on the GPU (0.34: its own kernels, a ring of earlier responses
    bounded in tokens); SGLang has no equivalent and serves its own prompt lookup (NGRAM) instead."""
    config = options_to_config(SuffixConfig, options)
    vllm = [
        f"vLLM {VLLM_VERSION} runs suffix decoding on the GPU with no extra package; earlier releases "
        "needed arctic-inference and refuse suffix_decoding_corpus_tokens: serve this config with vLLM "
        f"{VLLM_VERSION} or later.",
        "vLLM keeps earlier responses (not prompts) in a corpus of suffix_decoding_corpus_tokens tokens "
        f"(our max_corpus_tokens, {config.max_corpus_tokens}), where ours keeps prompts and outputs; it "
        "drafts from them wherever their match is longer than the request's own, no replay deciding "
        "whether they pay, and in chains only.",
        "vLLM drafts num_speculative_tokens tokens at every step, whatever the match's length: our "
        "length rule and probability floor (max_spec_factor, max_spec_offset, min_token_prob) have no "
        "equivalent there.",
    ]
    if config.recency_half_life is not None:
        vllm.append("vLLM scores continuations by frequency alone: recency_half_life is not carried over.")
    sglang = [
        "SGLang 0.5.23 has no suffix decoding: NGRAM, its prompt lookup, is served instead (its own n-gram "
        "trie and defaults); nothing of our corpus of earlier calls is carried over."
    ]
    return ServingPlan(
        "suffix",
        {"vllm": "suffix", "sglang": "NGRAM"},
        measure={"method": "suffix", "options": options},
        ngram=(config.min_ngram, config.max_ngram),
        # The rest have caveats of their own above (vLLM's) or in the rendering of `ngram` (SGLang's).
        caveats=not_carried(options, carried=_SUFFIX_CARRIED),
        engine_options={
            # 0.34's keys: it ignores suffix_decoding_max_spec_factor and _min_token_prob (0.33's
            # length rule), and 0.33 refuses suffix_decoding_corpus_tokens.
            "vllm": {"suffix_decoding_corpus_tokens": config.max_corpus_tokens}
        },
        engine_caveats={"vllm": vllm, "sglang": sglang},
    )


_SUFFIX_CARRIED = (
    "max_corpus_tokens",
    "min_ngram",
    "max_ngram",
    "max_spec_factor",
    "min_token_prob",
    "max_spec_offset",
    "recency_half_life",
)


def plan_draft_model(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    if draft is None:
        raise ValueError("method 'draft_model' needs --draft: the draft model's folder or Hub repo id.")

    options_to_config(DraftModelConfig, options)  # unknown options are named now, not at measuring time
    check_vocab(model, draft)
    return ServingPlan(
        "draft_model",
        {"vllm": "draft_model", "sglang": "STANDALONE"},
        draft=str(draft),
        measure={"method": "draft_model", "draft": str(draft), "options": options},
        caveats=not_carried(options),
    )


def plan_onnx(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    """An exported ONNX draft: the engines run PyTorch weights, so serve the model it came from."""
    if draft is None:
        raise ValueError("method 'onnx' needs --draft: the folder written by `hf-specdec export-onnx`.")
    source = onnx_source(Path(draft))
    if source is None:
        raise ServingExportError(
            f"vLLM and SGLang cannot run the ONNX draft {draft}, and the folder does not record which model "
            "it was exported from. Export the model you exported instead: "
            "`hf-specdec export-serving TARGET --method draft_model --draft <that model>`."
        )

    shared = {key: value for key, value in options.items() if key in DraftModelConfig.__dataclass_fields__}
    plan = plan_draft_model(model, source, head, shared)
    plan.method = "onnx"
    plan.caveats += not_carried(options, carried=shared)
    plan.caveats.append(
        f"The ONNX draft {draft} is served as the model it was exported from ({source}), run by the "
        "engine's own kernels: it drafts as an fp32 export does (an int8 export drafts a little "
        "differently), with the engine's timing, not ONNX Runtime's."
    )
    return plan


def plan_eagle(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    source = head or draft
    if source is None:
        raise ValueError("method 'eagle' needs --head: the draft head's folder.")
    known = registry_head(str(source))
    if known is not None:  # a published head on the Hub, in its authors' layout: engines read it as is
        if known["method"] == "medusa":
            raise ServingExportError(REFUSALS["medusa"])
        return _plan_registry_head(model, known, options)
    if not Path(str(source)).is_dir():
        raise ValueError(
            f"Draft head {source!r} is neither a local folder nor a head the registry knows; download it "
            "and pass its folder."
        )
    return _plan_local_head(model, Path(str(source)), options)


def _plan_registry_head(model: str, known: dict[str, Any], options: Options) -> ServingPlan:
    """A published head on the Hub, in its authors' layout: the engines read it as it is."""
    targets = [t.lower() for t in known["targets"]]
    origin = hub_origin(model)
    if origin is not None and origin.lower() not in targets:
        raise ServingExportError(
            f"The head {known['head']} was trained for {', '.join(known['targets'])}, not for {origin}: a "
            "head only drafts for the model it was trained on. `hf-specdec select TARGET` lists the heads "
            "known for a target."
        )
    options_to_config(HeadDrafterConfig, options)  # unknown options are named now
    three = known.get("layout") == "EAGLE-3"
    plan = ServingPlan(
        "eagle",
        {"vllm": "eagle3" if three else "eagle", "sglang": "EAGLE3" if three else "EAGLE"},
        draft=known["head"],
        measure={"method": "eagle", "draft": known["head"], "options": options},
        caveats=not_carried(options),
    )
    if origin is None:
        plan.caveats.append(
            f"{model} does not say which Hub model it is, so whether {known['head']} was trained for it "
            f"(it was for {', '.join(known['targets'])}) could not be checked."
        )
    return plan


def _plan_local_head(model: str, folder: Path, options: Options) -> ServingPlan:
    target = load_target(model)
    loaded = load_head(str(folder), target)
    measure = {"method": loaded.config.method, "draft": loaded, "options": options}
    if loaded.config.method == "medusa":
        raise ServingExportError(REFUSALS["medusa"])
    if isinstance(loaded, Eagle3Head):
        return ServingPlan(
            "eagle",
            {"vllm": "eagle3", "sglang": "EAGLE3"},
            head=loaded,
            measure=measure,
            target=target,
            caveats=not_carried(options),
        )
    if not (folder / CONFIG_NAME).is_file():  # a published EAGLE-1/2 folder: the engines read it as is
        return ServingPlan(
            "eagle",
            {"vllm": "eagle", "sglang": "EAGLE"},
            draft=str(folder),
            measure=measure,
            target=target,
            caveats=not_carried(options),
        )

    try:
        check_layout(loaded, "speculators and original EAGLE-3")
    except ValueError as err:  # our EAGLE-1-style heads: no engine layout drafts as they do
        raise ServingExportError(str(err)) from None
    raise AssertionError(f"{type(loaded).__name__} passed the EAGLE-3 layout check")


def plan_mtp(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    """The target's own MTP layers: both engines load them out of the target's checkpoint, with no
    draft of their own (vLLM `method="mtp"`; SGLang's EAGLE worker on the NextN layers, as its
    DeepSeek-V3 recipe launches it: `--speculative-algorithm EAGLE` and no draft path)."""
    if draft is not None or head is not None:
        raise ServingExportError(
            "vLLM and SGLang draft method 'mtp' with the MTP layers of the target's own checkpoint only: "
            "an MTP head trained for a target that ships none (--draft / --head) has no engine "
            "equivalent. Export the target's own layers (drop --draft / --head), --method ngram, or "
            "an EAGLE-3 head."
        )
    options_to_config(ChainTreeConfig, options)
    caveats = not_carried(options)
    here = local_model(model)
    if own_layers(model) is None:
        if here is not None and mtp_layer_count(here) == 0:  # its config is here and declares none
            try:
                load_mtp_layers(here)  # refuses it, saying why, as method='mtp' in generate does
            except ValueError as err:
                raise ServingExportError(str(err)) from None
        caveats.append(
            f"Whether {model}'s checkpoint holds MTP layers could not be checked here (its files are not "
            "in this folder or the local Hub cache); the engines refuse to start when it has none."
        )
    caveats.append(
        "Past the checkpoint's MTP layers vLLM cycles through them (draft step i runs layer i mod n) "
        "where we reapply the last; with one layer (DeepSeek-V3, GLM-4.5) both reapply it. SGLang "
        "loads the MTP layers of the architectures it has them for (the target is its draft path); "
        "for others it fails to start."
    )
    return ServingPlan(
        "mtp",
        {"vllm": "mtp", "sglang": "EAGLE"},
        measure={"method": "mtp", "options": options},
        caveats=caveats,
        mtp_layers=mtp_layer_count(here) if here is not None else None,
    )


def plan_assistant(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    """An official assistant (Gemma 4's `*-assistant`): vLLM serves it as `method="mtp"` with the
    assistant as its model, SGLang as FROZEN_KV_MTP (what it promotes NEXTN / EAGLE to for a Gemma 4
    assistant draft)."""
    draft = draft or registry_assistant(model)
    if draft is None:
        raise ValueError(
            f"method 'assistant' needs --draft: the assistant's folder or Hub repo id (the registry knows "
            f"none for {model})."
        )
    options_to_config(ChainTreeConfig, options)
    caveats = not_carried(options)
    caveats.append(
        "Both engines read the assistant's config to wire its layers to the target's KV cache "
        "(model_type gemma4_assistant); a release without Gemma 4 MTP treats it as a plain draft "
        "model and fails to start. SGLang drafts it with top-k 1 only (chains)."
    )
    return ServingPlan(
        "assistant",
        {"vllm": "mtp", "sglang": "FROZEN_KV_MTP"},
        draft=str(draft),
        measure={"method": "assistant", "draft": str(draft), "options": options},
        caveats=caveats,
    )


PLANS: dict[str, Planner] = {
    "ngram": plan_ngram,
    "suffix": plan_suffix,
    "draft_model": plan_draft_model,
    "eagle": plan_eagle,
    "onnx": plan_onnx,
    "mtp": plan_mtp,
    "assistant": plan_assistant,
    "dflash": plan_block,
    "dspark": plan_dspark,
}
