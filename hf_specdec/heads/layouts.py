"""EAGLE-3 heads written in the layouts serving engines load: speculators (vLLM) and the original
EAGLE-3 layout (SGLang, and vLLM's long `--speculative-config` form).

Both hold the same tensors as `Eagle3Head`; only names and config differ. `heads/published.py`
reads both back. Checked against:

- the speculators 0.9.0 wheel (github.com/vllm-project/speculators): `config.py`
  (`speculators_config` with `algorithm`, `proposal_methods`, `default_proposal_method`,
  `verifier.name_or_path` / `architectures`), `proposals/greedy.py` (`proposal_type: "greedy"`,
  `speculative_tokens`), `models/eagle3/config.py` (`transformer_layer_config`, which defaults to
  a Qwen3 config, so `model_type` is written; `draft_vocab_size`; the flags `norm_before_residual`,
  `norm_before_fc`, `fc_norm`, `norm_output`, all false for our head;
  `eagle_aux_hidden_state_layer_ids`), `convert/eagle/eagle3_converter.py` (its own conversion from
  the original layout: `midlayer.*` renamed `layers.0.*`, a LlamaConfig of the target's vocabulary)
  and the first layer of `models/eagle3` (the residual is the raw feature unless
  `norm_before_residual`: ours never normalises it).
- vLLM: `transformers_utils/configs/speculators/base.py` and `algos.py` (`update_eagle3` reads the
  fields above; a missing `norm_before_residual` means true, so it is always written);
  `models/llama_eagle3.py` renames `midlayer.` to `layers.0.` when loading, and its aux layer ids
  index the input of decoder layer i, as `output_hidden_states` does (our `feature_layers`).
- the sglang 0.5.23 wheel: `models/llama_eagle3.py` (`LlamaForCausalLMEagle3` maps `midlayer` to
  `layers.0` and takes `d2t` as hot-token offsets, `hot_token_id = d2t + arange`);
  `model_executor/model_runner_components/spec_aux_hidden_state.py` reads explicit aux layer ids
  from `config.eagle_config["eagle_aux_hidden_state_layer_ids"]` only, and `models/llama.py`
  (`set_eagle3_layers_to_capture`) adds 1 to them: they name the layer whose *output* is read, one
  less than ours.

Only `Eagle3Head` maps onto these layouts. Our own EAGLE-1-style head (`EagleHead`: the target's
last layer and LM head, optionally RMS-normalised inputs) would draft differently there, so it is
refused rather than approximated.

Block drafts (`BlockDraft`, what `train-draft --method dflash` writes) are written in z-lab's DFlash
layout (`save_dflash`), which vLLM (`model_executor/models/qwen3_dflash.py`: `dflash_config`'s
`target_layer_ids` and `mask_token_id`, `block_size`, Qwen3 layers with q/k norms, `fc`,
`hidden_norm`) and SGLang (`--speculative-algorithm DFLASH`, the z-lab drafts of its docs) load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..store.manifest import write_atomically
from .dflash import BlockDraft
from .eagle3 import Eagle3Head, default_feature_layers

WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes
LAYOUT_NAMES = ("speculators", "eagle3")


def save_speculators(
    head: nn.Module,
    folder: str | Path,
    *,
    verifier: str,
    num_speculative_tokens: int,
    verifier_architectures: list[str] | None = None,
) -> Path:
    """Write an EAGLE-3 `head` in the speculators layout (what `vllm serve DIR` loads); returns `folder`.

    `verifier` is the target's Hub repo id (vLLM 0.33 refuses a local path there; with a local
    target, pass the folder and serve with the long `--speculative-config` form instead).
    """
    check_layout(head, "speculators")
    config = head.config
    layers = list(head.feature_layers)
    meta = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": _layer_config(config),
        "draft_vocab_size": len(head.draft_vocab),
        "norm_before_residual": False,  # Eagle3Layer.finish adds attention to the raw feature
        "norm_before_fc": False,  # fc reads the target's hidden states as they are ...
        "fc_norm": False,  # ... not normalised one by one either
        "norm_output": False,  # chaining feeds back the layer's pre-norm output
        "eagle_aux_hidden_state_layer_ids": layers,
    }
    state = {_speculators_name(name): tensor for name, tensor in _eagle3_state(head).items()}
    return _write(Path(folder), meta, state)


def save_eagle3(head: nn.Module, folder: str | Path) -> Path:
    """Write an EAGLE-3 `head` in the original layout (SafeAILab/EAGLE `cnets.py`, what SGLang's
    `--speculative-algorithm EAGLE3` loads); returns `folder`."""
    check_layout(head, "original EAGLE-3")
    config = head.config
    meta = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_config(config),
        "draft_vocab_size": len(head.draft_vocab),
        "_name_or_path": config.target,
    }
    layers = list(head.feature_layers)
    if config.target_num_layers and tuple(layers) != default_feature_layers(config.target_num_layers):
        # SGLang's ids name the layer whose *output* is read; ours (and vLLM's) the one whose input is.
        meta["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}
        meta["eagle_aux_hidden_state_layer_ids"] = layers
    return _write(Path(folder), meta, _eagle3_state(head))


def save_dflash(head: BlockDraft, folder: str | Path) -> Path:
    """Write a block draft in z-lab's DFlash layout (what vLLM's and SGLang's `dflash` load); returns
    `folder`. Its draft vocabulary is not kept: the engines score every token with the target's LM
    head. Drafts the layout cannot hold (DSpark's heads, a draft from the anchor, sliding windows,
    scaled embeddings or logits) are refused."""
    check_dflash_layout(head)
    config = head.config
    layer = _layer_config(config)
    meta = {
        "architectures": ["DFlashDraftModel"],
        **layer,
        "model_type": "qwen3",
        "num_hidden_layers": config.num_hidden_layers,
        "block_size": config.block_size,
        "attention_bias": config.attention_bias,
        "dflash_config": {
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
        },
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "num_target_layers": config.target_num_layers,
        "_name_or_path": config.target,
    }
    state = {
        name: tensor.detach().cpu().contiguous()
        for name, tensor in head.state_dict().items()
        if name != "draft_vocab"
    }
    return _write(Path(folder), meta, state)


def check_dflash_layout(head: BlockDraft) -> None:
    """Refuse a block draft z-lab's DFlash layout cannot hold, naming what it has beyond it."""
    config = head.config
    unheld = [
        name
        for name, value in (
            ("Markov head", config.markov_rank),
            ("confidence head", config.confidence_head),
            ("drafts from the anchor (DSpark's layout)", config.drafts_from_anchor),
            ("sliding windows", any(config.layer_windows)),
            ("causal layers", any(config.causal_layers)),
            ("input_embedding_scale", config.input_embedding_scale != 1),
            ("output_multiplier", config.output_multiplier != 1),
            ("final_logit_softcapping", config.final_logit_softcapping),
        )
        if value
    ]
    if unheld:
        raise ValueError(
            f"This block draft ({config.layout}) has {', '.join(unheld)}, which hf-specdec's DFlash export "
            "does not write: serve its published checkpoint as it is."
        )


def check_layout(head: nn.Module, layout: str) -> None:
    """Refuse a head `layout` (an EAGLE-3 layout) cannot hold faithfully, saying what to do instead."""
    if isinstance(head, Eagle3Head):
        return
    config = getattr(head, "config", None)
    method, variant = getattr(config, "method", "?"), getattr(config, "variant", "?")
    if method == "eagle" and variant == "eagle":
        raise ValueError(
            f"This is hf-specdec's EAGLE-1-style head (it reads the target's last layer and drafts with "
            f"the target's LM head{', with RMS-normalised inputs to fc' if config.input_norms else ''}); "
            f"the {layout} layouts hold EAGLE-3 heads only (three target layers, their own LM head), so "
            "an engine would draft differently with it. Serve with method ngram or draft_model, or train "
            "an EAGLE-3 head (speculators or SpecForge) for the engine."
        )
    raise ValueError(f"Only EAGLE-3 heads can be written in the {layout} layout, not a {method} head.")


def _layer_config(config: Any) -> dict[str, Any]:
    """The head's decoder layer as a LlamaConfig dict (legacy rope keys, read by every loader)."""
    rope = dict(config.rope_parameters or {})
    theta = float(rope.pop("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    layer = {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "rope_theta": theta,
        "rope_scaling": None if kind == "default" else rope,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    if config.max_position_embeddings:
        layer["max_position_embeddings"] = config.max_position_embeddings
    return layer


def _eagle3_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's tensors under the reference's names, with `d2t` (int64: target id = i + d2t[i])
    and `t2d` (bool over the target vocabulary) for its draft vocabulary."""
    vocab = head.draft_vocab.detach().cpu().long()
    if len(set(vocab.tolist())) != len(vocab):
        raise ValueError("The head's draft vocabulary repeats token ids; it cannot be written as d2t.")
    state = {
        name: tensor.detach().cpu().contiguous()
        for name, tensor in head.state_dict().items()
        if name != "draft_vocab"
    }
    state["d2t"] = vocab - torch.arange(len(vocab))
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    state["t2d"] = t2d
    return state


def _speculators_name(name: str) -> str:
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def _write(folder: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "producer": "hf-specdec"}
    write_atomically(folder / WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata=metadata))
    text = json.dumps(config, indent=2) + "\n"
    write_atomically(folder / "config.json", lambda tmp: tmp.write_text(text))
    return folder
