"""Block drafts published in their authors' layouts, read into `BlockDraft` without running their code.

- DFlash (github.com/z-lab/dflash, `dflash/model.py`; e.g. the Hub repo `z-lab/Qwen3-8B-DFlash-b16`):
  `config.json` is a Qwen3Config with `architectures: ["DFlashDraftModel"]`, `block_size` (top level
  or in `dflash_config`), `dflash_config: {target_layer_ids, mask_token_id}` and optionally
  `output_multiplier`, `final_logit_softcapping`, `input_embedding_scale`, `causal`; its `auto_map`
  names the authors' modeling file, which is never downloaded nor run. `model.safetensors` holds
  `fc`, `hidden_norm`, `layers.{i}.*` (Qwen3 layers with q/k norms) and `norm`. A sliding-window
  layer attends to keys fewer than `sliding_window` positions back and is causal unless
  `is_causal` (or `dflash_config.causal`) says otherwise, as in the reference and vLLM.
- DSpark (github.com/deepseek-ai/DeepSpec, `deepspec/modeling/dspark/qwen3/modeling.py`; e.g.
  `deepseek-ai/dspark_qwen3_8b_block7`): `architectures: ["Qwen3DSparkModel"]`, top-level
  `block_size`, `mask_token_id`, `target_layer_ids`, `markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov`; the weights add `markov_head.*`,
  `confidence_head.proj.*` and copies of the target's `embed_tokens` and `lm_head`, which are skipped
  (the target's own are used). Output i predicts the token after position i. DeepSpec's DFlash
  drafts (`deepseek-ai/dflash_qwen3_8b_block7`) are this layout with `markov_rank` 0 and no confidence head.
- MuseGlimmer assistant (transformers 5.25, `models/muse_glimmer_assistant`): `model_type`
  `muse_glimmer_assistant`, top-level `block_size`, `mask_token_id`, `target_layer_ids`;
  `encoder.fc` and `encoder.output_norm_enc` are `fc` and `hidden_norm`; its sliding-window layers
  attend both ways to keys within `sliding_window` positions.

Refused by name: DFlash 2 (`DFlash2DraftModel`: candidate selector and dynamic convolutions), Gemma-4
DSpark drafts (`Gemma4DSparkModel`), DSpark's `rnn` Markov head, and any `dflash_config` setting not
listed above. Weights are read from safetensors only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ..hub.download import SAFETENSORS_INDEX, ShardIndexError, refetch_advice, weights_files
from .dflash import MARKOV_HEADS, BlockDraftConfig
from .io import build_head, check_head_matches, head_config, load_state
from .published import read_config, read_json_object, read_layer_shape, shape_errors

DFLASH = "DFlashDraftModel"
DSPARK = "Qwen3DSparkModel"
MUSE_GLIMMER = "MuseGlimmerAssistantModel"
# Architectures named in a block draft's config that we know and do not run, and why.
REFUSED = {
    "DFlash2DraftModel": "DFlash 2 drafts (a candidate selector and dynamic convolutions on DFlash's layers)",
    "Gemma4DSparkModel": "Gemma-4 DSpark drafts (Gemma 4 layers)",
}
# `dflash_config` settings read here; any other is refused by name rather than ignored.
DFLASH_SETTINGS = {
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
    "causal",
}
LAYOUTS = "DFlash (z-lab), DSpark and DFlash (DeepSpec), MuseGlimmer assistant (transformers)"


def is_block_draft(raw: Any) -> bool:
    """Whether a parsed config.json describes a block draft (DFlash, DSpark or a MuseGlimmer assistant)."""
    if not isinstance(raw, dict):
        return False
    names = set(raw.get("architectures") or [])
    known = {DFLASH, DSPARK, MUSE_GLIMMER, *REFUSED}
    return bool(names & known) or "dflash_config" in raw or raw.get("model_type") == "muse_glimmer_assistant"


def is_block_draft_folder(folder: Path) -> bool:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        return is_block_draft(json.loads(path.read_text()))
    except (ValueError, OSError):
        return False  # the layout loaders say what is wrong with it


def has_dspark_heads(folder: Path) -> bool:
    """Whether the block draft in `folder` has DSpark's Markov or confidence head (DeepSpec's layout)."""
    return raw_has_dspark_heads(read_json_object(Path(folder) / "config.json"))


def raw_has_dspark_heads(raw: dict[str, Any]) -> bool:
    return bool(raw.get("markov_rank") or raw.get("enable_confidence_head"))


def loaded_config(module: Any) -> dict[str, Any] | None:
    """The parsed config of a block draft loaded by transformers (a `MuseGlimmerAssistantModel`, or
    an authors' class run with `trust_remote_code`), as its config.json holds it; None for any other
    module."""
    to_dict = getattr(getattr(module, "config", None), "to_dict", None)
    raw = to_dict() if callable(to_dict) else None
    return raw if is_block_draft(raw) else None


def load_block_draft(folder: Path, target: Any) -> nn.Module:
    """The block draft in `folder` (any layout above) as a `BlockDraft` for `target`."""
    folder = Path(folder)
    return _block_draft(read_config(folder), None, folder, target)


def loaded_block_draft(module: nn.Module, target: Any) -> nn.Module:
    """A block draft loaded by transformers (`loaded_config` says which) as a `BlockDraft` for
    `target`: its config and weights read as they would be from its folder (copied: the module is
    left as it is). Messages name it as `<its class>/config.json`."""
    raw = loaded_config(module)
    if raw is None:
        raise ValueError(f"{type(module).__name__} is no block draft (its config is none of {LAYOUTS}).")
    state = {name: tensor.detach() for name, tensor in module.state_dict().items()}
    return _block_draft(raw, state, Path(type(module).__name__), target)


def _block_draft(raw: dict[str, Any], state: dict[str, torch.Tensor] | None, folder: Path, target: Any):
    """The block draft of config `raw` and weights `state` (None: read from `folder`'s safetensors)."""
    names = set(raw.get("architectures") or [])
    for name, what in REFUSED.items():
        if name in names:
            raise ValueError(
                f"{folder / 'config.json'} is a {name}: {what}, which hf-specdec does not run. Supported "
                f"block drafts: {LAYOUTS}."
            )
    if raw.get("model_type") == "muse_glimmer_assistant" or MUSE_GLIMMER in names:
        renames = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
        fields = _muse_glimmer(raw, folder)
    elif DSPARK in names:
        fields, renames = _dspark(raw, folder), {}
    else:
        fields, renames = _dflash(raw, folder), {}
    if not fields["vocab_size"]:  # MuseGlimmer's config does not record it: the target's, as in transformers
        fields["vocab_size"] = target.config.get_text_config().vocab_size
    config = head_config(BlockDraftConfig, fields, folder / "config.json")
    check_head_matches(config, target, str(folder))
    state = _read_safetensors(folder) if state is None else state
    head = build_head(config, target)
    ours = {"draft_vocab": head.draft_vocab}
    for name, tensor in state.items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            continue  # DeepSpec's copies of the target's own, which the draft borrows instead
        for old, new in renames.items():
            name = new + name.removeprefix(old) if name.startswith(old) else name
        ours[name] = tensor
    load_state(head, ours, folder)
    return head


# --- the layouts -------------------------------------------------------------------------------


def _shape(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The Qwen3-like layer shape every layout shares: EAGLE's, with the draft's layer count."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{folder / 'config.json'}: hidden_act {raw['hidden_act']!r}; hf-specdec runs block drafts "
            "with silu MLPs."
        )
    target_hidden = raw.get("target_hidden_size")
    if target_hidden not in (None, raw.get("hidden_size")):
        raise ValueError(
            f"{folder / 'config.json'}: a draft of hidden size {raw.get('hidden_size')} for a target of "
            f"hidden size {target_hidden} (target_hidden_size); hf-specdec runs drafts of the target's "
            "hidden size."
        )
    what = "a block draft"
    # A MuseGlimmer config records no vocab_size: 0 here, the target's once the loader has it.
    shape = read_layer_shape({"vocab_size": 0, **raw}, folder, what)
    with shape_errors(folder, what):
        return dict(
            **shape,
            num_hidden_layers=int(raw["num_hidden_layers"]),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 0),
            attention_bias=bool(raw.get("attention_bias", False)),
            target_num_layers=int(raw.get("num_target_layers") or 0),
        )


def _required(raw: dict[str, Any], name: str, folder: Path, *sections: dict[str, Any]) -> Any:
    for section in (*sections, raw):
        if section.get(name) is not None:
            return section[name]
    raise ValueError(
        f"{folder / 'config.json'} does not give {name}: not a block draft config hf-specdec reads."
    )


def _dflash(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    settings = raw.get("dflash_config") or {}
    unknown = sorted(set(settings) - DFLASH_SETTINGS)
    if unknown:
        raise ValueError(
            f"{folder / 'config.json'}: dflash_config sets {', '.join(unknown)}, which hf-specdec does not "
            f"run (it reads {', '.join(sorted(DFLASH_SETTINGS))}). Supported block drafts: {LAYOUTS}."
        )
    shape = _shape(raw, folder)
    types = raw.get("layer_types") or ["full_attention"] * shape["num_hidden_layers"]
    forced = raw.get("is_causal", settings.get("causal"))
    sliding = [kind == "sliding_attention" for kind in types]
    window = int(raw.get("sliding_window") or 0)
    if any(sliding) and window < 1:
        raise ValueError(f"{folder / 'config.json'}: sliding-window layers without a sliding_window.")
    return dict(
        **shape,
        block_size=int(_required(raw, "block_size", folder, settings)),
        mask_token_id=int(_required(raw, "mask_token_id", folder, settings)),
        target_layer_ids=[int(i) for i in _required(raw, "target_layer_ids", folder, settings)],
        # The reference attends to keys fewer than `sliding_window` positions back.
        layer_windows=[window - 1 if s else 0 for s in sliding],
        causal_layers=[bool(forced) if forced is not None else s for s in sliding],
        input_embedding_scale=float(settings.get("input_embedding_scale", 1.0)),
        output_multiplier=float(settings.get("output_multiplier", 1.0)),
        final_logit_softcapping=float(settings.get("final_logit_softcapping") or 0.0),
        layout="DFlash (z-lab)",
    )


def _dspark(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    shape = _shape(raw, folder)
    if any(kind != "full_attention" for kind in raw.get("layer_types") or []):
        raise ValueError(
            f"{folder / 'config.json'}: a DSpark draft with sliding-window layers, which DeepSpec's Qwen3 "
            "drafts do not have and hf-specdec does not run."
        )
    rank = int(raw.get("markov_rank") or 0)
    kind = str(raw.get("markov_head_type") or "vanilla").lower()
    if rank and kind not in MARKOV_HEADS:
        raise ValueError(
            f"{folder / 'config.json'}: DSpark's {kind!r} Markov head is not supported; hf-specdec runs "
            f"{' and '.join(MARKOV_HEADS)} Markov heads."
        )
    confidence = bool(raw.get("enable_confidence_head", False))
    return dict(
        **shape,
        block_size=int(_required(raw, "block_size", folder)),
        mask_token_id=int(_required(raw, "mask_token_id", folder)),
        target_layer_ids=[int(i) for i in _required(raw, "target_layer_ids", folder)],
        drafts_from_anchor=True,
        markov_rank=rank,
        markov_head_type=kind if rank else "vanilla",
        confidence_head=confidence,
        confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov", False)),
        layout="DSpark (DeepSpec)" if rank or confidence else "DFlash (DeepSpec)",
    )


def _muse_glimmer(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    shape = _shape(raw, folder)
    types = raw.get("layer_types") or ["sliding_attention"] * shape["num_hidden_layers"]
    window = int(raw.get("sliding_window") or 0)
    return dict(
        **shape,
        block_size=int(_required(raw, "block_size", folder)),
        mask_token_id=int(_required(raw, "mask_token_id", folder)),
        target_layer_ids=[int(i) for i in _required(raw, "target_layer_ids", folder)],
        # Bidirectional windows, `|query - key| <= sliding_window` (transformers' masking_utils).
        layer_windows=[window if kind == "sliding_attention" else 0 for kind in types],
        layout="MuseGlimmer assistant (transformers)",
    )


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """The draft's tensors from `model.safetensors` or the shards its index names; pickles never."""
    found = sorted(path.name for path in folder.iterdir() if path.is_file())
    try:
        files = weights_files(found, lambda: read_json_object(folder / SAFETENSORS_INDEX))
    except ShardIndexError:
        raise ValueError(
            f"{folder / SAFETENSORS_INDEX} does not name safetensors shards in its folder."
        ) from None
    if not files:
        raise ValueError(
            f"The block draft in {folder} has no safetensors weights (it holds {', '.join(found)}): block "
            "drafts are read from model.safetensors only, never from pickles (pytorch_model.bin), whose "
            "loading can run code. Convert it with safetensors, or download a safetensors copy."
        )
    names = [folder / name for name in files]
    state: dict[str, torch.Tensor] = {}
    for path in names:
        if not path.is_file():
            raise ValueError(f"Block draft weights {path} are missing: the checkpoint is incomplete.")
        try:
            state.update(load_file(str(path)))
        except Exception as err:  # safetensors raises several kinds for a damaged file
            raise ValueError(
                f"Block draft weights {path} cannot be read ({type(err).__name__}: {err}): the checkpoint is "
                f"corrupt; {refetch_advice(path, 'download it again')}."
            ) from None
    if not state:
        raise ValueError(f"The block draft weights in {folder} hold no tensors.")
    return state


__all__ = [
    "LAYOUTS",
    "has_dspark_heads",
    "is_block_draft",
    "is_block_draft_folder",
    "load_block_draft",
]
