"""Where targets and drafts come from: Hub repo ids or local folders, the model an ONNX export was made
from, the published heads the registry knows; loading the target and comparing vocabularies."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..core.checks import check_causal_checkpoint, check_causal_folder
from ..heads.mtp import declared_mtp_fields
from ..hub.download import refetch_advice
from ..hub.tokenizer_check import compare_tokenizers
from ..hub.tokenizer_files import saved_tokenizer
from ..loading import adapter_base, is_missing_path
from ..selection.select import assistant_lookup
from .base import ServingExportError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_target(model: str) -> None:
    """Refuse a target the engine could not load: a local path that does not exist, a PEFT adapter
    (which transformers loads onto its base; the engines load a model checkpoint), or a folder
    holding no causal LM (a Hub repo's config is read where the target is loaded, `load_target`)."""
    if is_missing_path(model):
        raise ValueError(
            f"{model!r} is neither a local folder nor a Hub repo id (owner/name): the engine would not "
            "find it. Pass the folder or repo id the engine should load."
        )
    base = adapter_base(model)
    if base is not None:
        raise ServingExportError(
            f"{model} is a PEFT adapter of {base}, which vLLM and SGLang do not load as a model: they serve "
            f"an adapter on its base (vLLM: --enable-lora --lora-modules NAME={model}; SGLang: --enable-lora "
            "--lora-paths NAME=...). Export a checkpoint with the adapter merged into it (PeftModel's "
            "merge_and_unload(), then save_pretrained with the tokenizer) and pass that folder, or export "
            f"{base} and add those flags to its command."
        )
    check_causal_folder(model)


def load_target(model: str) -> Any:
    # The checkpoint's dtype, as vLLM serves it; a model needing its repo's code is refused, not run.
    check_causal_checkpoint(model, model)
    return AutoModelForCausalLM.from_pretrained(model, trust_remote_code=False).eval()


def _config(name: str) -> Any:
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"Cannot read the config of {name} to compare it with the target's: {err}") from None


def check_vocab(model: str, draft: str) -> None:
    """Refuse a draft the engines cannot serve as a draft model of `model`."""
    draft_config = _config(str(draft))
    declared = declared_mtp_fields(draft_config)
    if declared:
        # vLLM (`SpeculativeConfig.hf_config_override`, 0.33 and 0.34) and SGLang 0.5.23
        # (`ModelConfig._config_draft_model`) turn a draft checkpoint of an architecture with MTP
        # layers into those layers: vLLM 0.33 then serves method mtp, 0.34 runs them as a draft model.
        raise ServingExportError(
            f"{draft} declares MTP layers ({', '.join(declared)}): vLLM and SGLang load a draft of its "
            "architecture as those MTP layers, not as a draft model, so it cannot be served as "
            "draft_model (generate runs it as one). Use a draft of an architecture without MTP layers "
            "and with the target's tokenizer, the target's own MTP layers (--method mtp) if it has "
            "them, or --method ngram."
        )
    target_vocab = int(_config(model).get_text_config().vocab_size)
    draft_vocab = int(draft_config.get_text_config().vocab_size)
    if target_vocab != draft_vocab:
        raise ServingExportError(
            f"vLLM's draft_model (and SGLang's STANDALONE) need the draft's vocab_size to equal the "
            f"target's, but {draft} has {draft_vocab} and {model} has {target_vocab} (padded sizes count, "
            "even with a shared tokenizer). Use a draft with the same vocab_size, or --method ngram."
        )
    # Equal sizes are not one tokenizer: the engines feed the draft the target's ids and verify the
    # draft's ids as the target's, so a draft of another tokenizer would draft nonsense (our
    # generate translates between the two; neither engine's draft_model does).
    target_tokenizer, draft_tokenizer = _tokenizer(model), _tokenizer(str(draft))
    if target_tokenizer is None or draft_tokenizer is None:
        return  # a folder without one: the engine runs the draft on the target's tokenizer
    check = compare_tokenizers(target_tokenizer, draft_tokenizer)
    if not check.compatible:
        raise ServingExportError(
            f"vLLM's draft_model (and SGLang's STANDALONE) read the draft's token ids as the target's, "
            f"but {draft}'s tokenizer is not {model}'s ({check.explain()}). speculative='draft_model' "
            "drafts across tokenizers in generate; to serve, use a draft with the target's tokenizer, "
            "or --method ngram."
        )


def _tokenizer(name: str) -> Any:
    """The tokenizer saved with a model, or None where there is none; a folder's files that do not
    load are refused (read as none, the check below would pass a draft of another tokenizer)."""
    if Path(name).is_dir():
        try:
            remedy = f"{refetch_advice(Path(name), 'save or download it again')}, or export --method ngram"
            return saved_tokenizer(Path(name), name, trust_remote_code=False, remedy=remedy)
        except ValueError as err:
            raise ServingExportError(str(err)) from None
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except (OSError, ValueError):  # a Hub repo without one
        return None


def onnx_source(folder: Path) -> str | None:
    """The PyTorch model an exported ONNX folder came from: the folder itself when it also holds
    safetensors weights, else its config's `_name_or_path` when that names one; None if unknown."""
    if any(folder.glob("*.safetensors")):
        return str(folder)
    config = folder / "config.json"
    origin = json.loads(config.read_text()).get("_name_or_path", "") if config.is_file() else ""
    if origin and (Path(origin).is_dir() or (_REPO_ID.match(origin) and not Path(origin).exists())):
        return origin
    return None


def hub_origin(model: str) -> str | None:
    """The Hub repo id `model` is, or that its local folder's config.json names; None if neither."""
    if _REPO_ID.match(model) and not Path(model).exists():
        return model
    config = Path(model) / "config.json"
    origin = json.loads(config.read_text()).get("_name_or_path", "") if config.is_file() else ""
    return origin if _REPO_ID.match(origin or "") and not Path(origin).exists() else None


def registry_assistant(model: str) -> str | None:
    """The official assistant the registry lists for `model` (its Hub origin), if any."""
    origin = hub_origin(model)
    choice = assistant_lookup(origin) if origin is not None else None
    return None if choice is None else choice.draft
