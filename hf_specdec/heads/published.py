"""Heads published in their authors' own layouts, converted into our modules.

- EAGLE-1 / EAGLE-2 (github.com/SafeAILab/EAGLE, `eagle/model/cnets1.py`; e.g. the Hub repo
  `yuhuili/EAGLE-Vicuna-7B-v1.3`): `config.json` (a LlamaConfig with one layer; `bias` says
  whether `fc` has one) and `pytorch_model.bin` or `model.safetensors` holding `fc.*` over
  cat(token embedding, feature), `layers.0.*` (no input norm) and the embedding, which we ignore.
- EAGLE-3 (same repo, `eagle/model/cnets.py`; e.g. `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`): the
  same files, holding `fc` over three target layers, `midlayer.*`, `norm`, `lm_head` and `d2t`.
- speculators (github.com/vllm-project/speculators, what `vllm serve DIR` loads; written by
  `heads/layouts.py`): `config.json` with `speculators_model_type: "eagle3"`, the layer's config under
  `transformer_layer_config`, and `model.safetensors` with the EAGLE-3 tensors, `layers.0.*` for
  `midlayer.*`.
- Medusa (github.com/FasterDecoding/Medusa, `medusa/model/medusa_model.py`; e.g.
  `FasterDecoding/medusa-vicuna-7b-v1.3`): `config.json` with `medusa_num_heads`,
  `medusa_num_layers` and `medusa_lm_head.safetensors` or `.pt` holding, for head i,
  `{i}.{j}.linear.*` (residual block j) and `{i}.{num_layers}.weight` (its own LM head).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .eagle import EagleHeadConfig
from .eagle3 import default_feature_layers
from .io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    build_head,
    check_draft_vocab,
    check_head_matches,
    head_config,
    load_state,
    read_weights,
)
from .medusa import MedusaHeadConfig

EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
LAYOUTS = (
    f"hf-specdec ({CONFIG_NAME} + {WEIGHTS_NAME}); "
    "EAGLE-1/2 and EAGLE-3 (config.json + model.safetensors or pytorch_model.bin, as in "
    "SafeAILab/EAGLE); Medusa (config.json with medusa_num_heads + medusa_lm_head.safetensors or "
    "medusa_lm_head.pt, as in FasterDecoding/Medusa)"
)


# The method each layout's head drafts with.
LAYOUT_METHODS = {"medusa": "medusa", "speculators": "eagle", "eagle3": "eagle", "eagle1": "eagle"}


def published_layout(
    names: Collection[str], config: dict[str, Any] | None, tensor_names: Callable[[str], Collection[str]]
) -> str | None:
    """Which of the layouts above a checkpoint holds (a key of `LAYOUT_METHODS`), from the names of
    its files, its config.json (None: it has none) and `tensor_names(file)`, the tensors one of its
    weights files holds (asked only of an EAGLE weights file whose config says no more); None for
    none of them. What `load_published` reads a folder by, and what tells a head from a draft model
    given as `draft=`."""
    if any(name in names for name in MEDUSA_WEIGHTS):
        return "medusa"
    eagle = next((name for name in EAGLE_WEIGHTS if name in names), None)
    if eagle is None or config is None:
        return None
    if "speculators_model_type" in config:
        return "speculators"
    tensors = tensor_names(eagle)
    if "fc.weight" not in tensors:  # both fuse their inputs in `fc`; a causal LM has no such tensor
        return None
    if any(name.startswith("midlayer.") for name in tensors):
        return "eagle3"
    if any(name.startswith("layers.") for name in tensors):
        return "eagle1"
    return None


def load_published(folder: Path, target: Any) -> nn.Module:
    """The head in `folder` (an EAGLE-1/2, EAGLE-3 or Medusa layout) as our module, for `target`."""
    folder = Path(folder)
    names = {path.name for path in folder.iterdir()} if folder.is_dir() else set()
    config = read_config(folder) if "config.json" in names else None
    read = functools.cache(lambda name: read_weights(folder / name))
    layout = published_layout(names, config, read)
    medusa, eagle = _first(folder, MEDUSA_WEIGHTS), _first(folder, EAGLE_WEIGHTS)
    if layout == "medusa":
        return _medusa(folder, medusa, target)
    if layout == "speculators":
        return _speculators(folder, eagle, target)
    if layout == "eagle3":
        return _eagle3(folder, eagle, read(eagle.name), target)
    if layout == "eagle1":
        return _eagle1(folder, eagle, read(eagle.name), target)
    if eagle is not None and config is not None:
        raise ValueError(
            f"{eagle} holds neither an EAGLE-1/2 layer (fc.*, layers.0.*) nor an EAGLE-3 one (fc.*, "
            f"midlayer.*); its tensors: {some_tensors(read(eagle.name))}. Supported layouts: {LAYOUTS}."
        )
    raise ValueError(
        f"Draft head folder {folder} is not in a layout hf-specdec knows: it holds "
        f"{', '.join(sorted(names)) or 'no files'}. Supported layouts: {LAYOUTS}."
    )


# --- EAGLE-1 / EAGLE-2 ------------------------------------------------------------------------


def _eagle1(folder: Path, path: Path, state: dict[str, torch.Tensor], target: Any) -> nn.Module:
    raw = read_config(folder)
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{folder / 'config.json'}: an EAGLE head with {raw['num_hidden_layers']} layers; "
            "hf-specdec runs one-layer heads only."
        )
    config = head_config(
        EagleHeadConfig,
        dict(
            **read_layer_shape(raw, folder),
            target=str(raw.get("_name_or_path", "") or ""),
            fc_bias="fc.bias" in state,
            input_norm=False,  # the reference's layer 0 has no input norm
            # the reference's `qkv_bias` (Qwen heads)
            attention_bias="layers.0.self_attn.q_proj.bias" in state,
        ),
        folder / "config.json",
    )
    check_head_matches(config, target, str(folder))
    head = build_head(config, target)
    ours = {"draft_vocab": head.draft_vocab}
    for name, tensor in state.items():
        if name == "embed_tokens.weight":
            continue  # the target's own embedding is used
        ours[name.replace("layers.0.", "layer.", 1) if name.startswith("layers.0.") else name] = tensor
    load_state(head, ours, path)
    return head


# --- EAGLE-3 ----------------------------------------------------------------------------------


def _eagle3(
    folder: Path, path: Path, state: dict[str, torch.Tensor], target: Any, raw: dict[str, Any] | None = None
) -> nn.Module:
    raw = read_config(folder) if raw is None else raw
    text = target.config.get_text_config()
    shape = read_layer_shape(raw, folder)
    if raw.get("target_hidden_size", shape["hidden_size"]) != shape["hidden_size"]:
        raise ValueError(
            f"{folder / 'config.json'}: an EAGLE-3 head of hidden size {shape['hidden_size']} for a target "
            f"of hidden size {raw['target_hidden_size']} (with its own embedding); hf-specdec runs heads "
            "of the target's hidden size only."
        )
    d2t = state.get("d2t")
    draft_vocab_size = int(raw.get("draft_vocab_size") or shape["vocab_size"])
    if d2t is None and draft_vocab_size != shape["vocab_size"]:
        raise ValueError(f"{path} has no d2t map for its draft vocabulary of {draft_vocab_size} tokens.")
    config = head_config(
        EagleHeadConfig,
        dict(
            **shape,
            target=str(raw.get("_name_or_path", "") or ""),
            draft_vocab_size=draft_vocab_size,
            input_norm=True,
            variant="eagle3",
            feature_layers=list(_eagle3_layers(raw, text.num_hidden_layers, folder)),
        ),
        folder / "config.json",
    )
    check_head_matches(config, target, str(folder))
    head = build_head(config, target)
    vocab = torch.arange(draft_vocab_size)
    if d2t is not None:
        if d2t.shape != vocab.shape:
            raise ValueError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},).")
        vocab = vocab + d2t.long()  # draft index i is target token i + d2t[i]
    check_draft_vocab(vocab, text.vocab_size, path, "d2t: draft index i is target token i + d2t[i]")
    _check_t2d(state.get("t2d"), vocab, text.vocab_size, path)
    ours = {name: t for name, t in state.items() if name not in ("d2t", "t2d", "embed_tokens.weight")}
    ours["draft_vocab"] = vocab
    load_state(head, ours, path)
    return head


def _check_t2d(t2d: torch.Tensor | None, vocab: torch.Tensor, vocab_size: int, path: Path) -> None:
    """Refuse a `t2d` (a flag per target token: in the draft vocabulary) that disagrees with `d2t`'s
    ids `vocab`: engines read one or the other, so the head would draft different tokens in each."""
    if t2d is None:
        return
    if t2d.shape != (vocab_size,):
        problem = f"has shape {tuple(t2d.shape)}, not one flag per target token ({vocab_size},)"
    elif not torch.equal(t2d.nonzero().flatten(), vocab.sort().values):
        problem = f"marks {int(t2d.count_nonzero())} target tokens, not the {len(vocab)} ids d2t maps to"
    else:
        return
    raise ValueError(
        f"Head weights {path}: t2d {problem}. The head was written for a target with another "
        "vocabulary, or the file is corrupt: use a head made for this target, or download the head again."
    )


def _eagle3_layers(raw: dict[str, Any], num_layers: int, folder: Path) -> tuple[int, ...]:
    """Target layers the head reads: the config's (vLLM's `eagle_aux_hidden_state_layer_ids`, same
    indexing: the input of decoder layer i; SGLang's `eagle_config` ids name the layer whose output
    is read, one less), else the reference's 2, L // 2, L - 3."""
    given = raw.get("eagle_aux_hidden_state_layer_ids")
    sglang = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not given and sglang:
        given = [i + 1 for i in sglang]  # SGLang's set_eagle3_layers_to_capture adds 1 likewise
    layers = tuple(sorted(set(given))) if given else default_feature_layers(num_layers)
    if len(layers) != 3 or min(layers) < 0 or max(layers) > num_layers:
        raise ValueError(
            f"The EAGLE-3 head {folder} reads three distinct target layers, but for this "
            f"{num_layers}-layer target they would be {layers}; set eagle_aux_hidden_state_layer_ids "
            "in its config.json."
        )
    return layers


def _speculators(folder: Path, path: Path, target: Any) -> nn.Module:
    """A speculators-format EAGLE-3 head (vLLM's layout), as the original layout's config and names."""
    raw = read_config(folder)
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(
            f"{folder / 'config.json'}: a speculators {kind!r} model; hf-specdec reads speculators EAGLE-3 "
            "heads only."
        )
    # vLLM treats a missing norm_before_residual as true (speculators/algos.py): so do we.
    flags = [name for name in ("norm_before_fc", "fc_norm", "norm_output") if raw.get(name)]
    flags = (["norm_before_residual"] if raw.get("norm_before_residual", True) else []) + flags
    if flags:
        raise ValueError(
            f"{folder / 'config.json'}: this EAGLE-3 head normalises its features in ways the original "
            f"EAGLE-3 does not ({', '.join(flags)}); hf-specdec runs heads without them."
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{folder / 'config.json'} has no transformer_layer_config: not a speculators head.")
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
    flat = {
        **layer,
        "draft_vocab_size": raw.get("draft_vocab_size"),
        "eagle_aux_hidden_state_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids"),
        "_name_or_path": verifier,
    }
    state = {
        "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name: tensor
        for name, tensor in read_weights(path).items()
    }
    return _eagle3(folder, path, state, target, flat)


# --- Medusa -----------------------------------------------------------------------------------


def _medusa(folder: Path, path: Path, target: Any) -> nn.Module:
    raw = read_config(folder)
    state = read_weights(path)
    state = {name.removeprefix("medusa_head."): tensor for name, tensor in state.items()}
    num_layers = int(raw.get("medusa_num_layers", 1))
    lm_head = state.get(f"0.{num_layers}.weight")
    if lm_head is None or lm_head.dim() != 2:
        raise ValueError(
            f"{path} has no LM head for Medusa head 0 ({f'0.{num_layers}.weight'}) with "
            f"medusa_num_layers={num_layers}; its tensors: {some_tensors(state)}."
        )
    config = head_config(
        MedusaHeadConfig,
        dict(
            hidden_size=lm_head.shape[1],
            vocab_size=lm_head.shape[0],
            num_heads=int(raw.get("medusa_num_heads", 0) or _count_heads(state)),
            num_layers=num_layers,
            target=str(raw.get("base_model_name_or_path", "") or ""),
            own_lm_heads=True,
        ),
        folder / "config.json",
    )
    check_head_matches(config, target, str(folder))
    head = build_head(config, target)
    ours = {"draft_vocab": head.draft_vocab}
    for name, tensor in state.items():
        i, j, rest = (name.split(".", 2) + ["", ""])[:3]
        if j == str(num_layers) and rest == "weight":
            ours[f"lm_heads.{i}.weight"] = tensor
        else:
            ours[f"blocks.{name}"] = tensor
    load_state(head, ours, path)
    return head


def _count_heads(state: dict[str, torch.Tensor]) -> int:
    return len({name.split(".", 1)[0] for name in state})


# --- shared -----------------------------------------------------------------------------------


def _first(folder: Path, names: tuple[str, ...]) -> Path | None:
    return next((folder / name for name in names if (folder / name).is_file()), None)


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has head weights but no config.json: the checkpoint is incomplete.")
    return read_json_object(path, "a config (a JSON object)")


def read_json_object(path: Path, what: str = "a JSON object") -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object (`what`); a clear error where it does not."""
    try:
        raw = json.loads(path.read_text())
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        detail = err.msg if isinstance(err, json.JSONDecodeError) else err
        raise ValueError(f"{path} is not valid JSON ({detail}): the checkpoint is corrupt.") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds {json.dumps(raw)[:40]}, not {what}: the checkpoint is corrupt.")
    return raw


def read_layer_shape(raw: dict[str, Any], folder: Path, what: str = "an EAGLE head") -> dict[str, Any]:
    """The shape fields of EagleHeadConfig (which block drafts share) from the LlamaConfig- or
    Qwen3Config-like `config.json` of a published head (`what`, for messages)."""
    with shape_errors(folder, what):
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        return dict(
            hidden_size=hidden,
            vocab_size=int(raw["vocab_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // max(heads, 1)),  # 0 heads: the config says so
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),  # the reference's EConfig default
            rope_parameters=rope_from_config(raw, folder),
        )


@contextmanager
def shape_errors(folder: Path, what: str) -> Iterator[None]:
    """A missing field or a size that is not a number, while reading the shape of `what` from
    `folder`'s config.json, as an error naming the file."""
    try:
        yield
    except KeyError as err:
        raise ValueError(f"{folder / 'config.json'} lacks {err.args[0]!r}: not {what} config.") from None
    except (TypeError, ValueError) as err:  # int("x"), float(None)...
        raise ValueError(
            f"{folder / 'config.json'} does not describe {what}'s shape: its sizes and rms_norm_eps must "
            f"be numbers ({type(err).__name__}: {err}). Fix the file, or download the head again."
        ) from None


def rope_from_config(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    """HF `rope_parameters` for the reference's `rope_theta` (10000 when absent) and `rope_scaling`,
    or the config's own `rope_parameters` (configs saved by transformers 5, as speculators' are)."""
    theta = float(raw.get("rope_theta", 10000.0))
    given = raw.get("rope_parameters")
    if isinstance(given, dict) and given:
        return {"rope_type": "default", "rope_theta": theta, **given}
    scaling = raw.get("rope_scaling")
    if not scaling:
        return {"rope_type": "default", "rope_theta": theta}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind is None:
        raise ValueError(f"{folder / 'config.json'}: rope_scaling {scaling} names no type.")
    parameters = {k: v for k, v in scaling.items() if k != "type"}
    return {**parameters, "rope_type": kind, "rope_theta": theta}


def some_tensors(state: dict[str, torch.Tensor]) -> str:
    names = sorted(state)
    return ", ".join(names[:8]) + (f" ... ({len(names)} in all)" if len(names) > 8 else "")
