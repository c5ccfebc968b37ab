"""Tiny block drafts in each published layout, written the way their authors' code writes them.

- `write_zlab`: z-lab DFlash (`dflash/model.py`): a Qwen3Config with `dflash_config`, `auto_map`
  naming the authors' modeling file, `model.safetensors` with `fc`, `hidden_norm`, `layers.*`, `norm`.
- `write_dspark`: DeepSpec (`deepspec/modeling/dspark/qwen3`): top-level DSpark fields, the target's
  embedding and LM head copied in, Markov and confidence heads.
- `write_muse_glimmer`: transformers' own `MuseGlimmerAssistantModel.save_pretrained`.

Weights are random with a large spread, so that drafts depend on their context (a draft with
small weights proposes the same token everywhere, which no comparison could tell apart).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPREAD = 0.5


def _shape(target, layers: int) -> dict:
    c = target.config
    return dict(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_bias=False,
        max_position_embeddings=512,
        num_target_layers=c.num_hidden_layers,
    )


def _weights(s: dict, seed: int, reads: int) -> dict[str, torch.Tensor]:
    """Random tensors under the z-lab / DeepSpec names (the Qwen3 layer's)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = SPREAD) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1 + rand(n, scale=0.1)

    h, d = s["hidden_size"], s["head_dim"]
    q, kv, inter = s["num_attention_heads"] * d, s["num_key_value_heads"] * d, s["intermediate_size"]
    w = {
        "fc.weight": rand(h, reads * h, scale=SPREAD / reads),
        "hidden_norm.weight": norm(h),
        "norm.weight": norm(h),
    }
    for i in range(s["num_hidden_layers"]):
        p = f"layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
    return w


def write_zlab(
    folder: Path,
    target,
    *,
    layers: int = 2,
    block_size: int = 4,
    target_layer_ids: tuple[int, ...] = (0, 1),
    mask_token_id: int = 3,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    settings: dict | None = None,
    seed: int = 0,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    s = _shape(target, layers)
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        **s,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id},
        "layer_types": layer_types or ["full_attention"] * layers,
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
        "tie_word_embeddings": False,
    }
    config["dflash_config"].update(settings or {})
    (folder / "config.json").write_text(json.dumps(config))
    # The authors' modeling file ships beside the weights; loading must neither fetch nor run it.
    (folder / "dflash.py").write_text("raise SystemExit('the draft repo ran its own code')\n")
    save_file(_weights(s, seed, len(target_layer_ids)), str(folder / "model.safetensors"))
    return folder


def write_dspark(
    folder: Path,
    target,
    *,
    layers: int = 2,
    block_size: int = 4,
    target_layer_ids: tuple[int, ...] = (-1, 1),
    markov: str | None = "vanilla",
    rank: int = 6,
    confidence: bool = True,
    confidence_with_markov: bool = True,
    seed: int = 1,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    s = _shape(target, layers)
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        **s,
        "layer_types": ["full_attention"] * layers,
        "block_size": block_size,
        "mask_token_id": 3,
        "target_layer_ids": list(target_layer_ids),
        "num_anchors": 512,
        "markov_rank": rank if markov else 0,
        "enable_confidence_head": confidence,
        "tie_word_embeddings": False,
    }
    if markov:
        config["markov_head_type"] = markov
    if confidence:
        config["confidence_head_with_markov"] = confidence_with_markov and bool(markov)
    (folder / "config.json").write_text(json.dumps(config))
    w = _weights(s, seed, len(target_layer_ids))
    g = torch.Generator().manual_seed(seed + 100)
    h, v = s["hidden_size"], s["vocab_size"]
    w["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    w["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    if markov:
        w["markov_head.markov_w1.weight"] = torch.randn(v, rank, generator=g)
        w["markov_head.markov_w2.weight"] = torch.randn(v, rank, generator=g)
        if markov == "gated":
            w["markov_head.gate_proj.weight"] = torch.randn(rank, h + rank, generator=g) * 0.3
            w["markov_head.gate_proj.bias"] = torch.randn(rank, generator=g) * 0.3
    if confidence:
        width = h + (rank if config.get("confidence_head_with_markov") else 0)
        w["confidence_head.proj.weight"] = torch.randn(1, width, generator=g) * 0.3
        w["confidence_head.proj.bias"] = torch.tensor([1.0])
    save_file(w, str(folder / "model.safetensors"))
    return folder


def write_muse_glimmer(
    folder: Path, target, *, layers: int = 2, block_size: int = 4, window: int = 16, seed=2
):
    """A MuseGlimmer assistant saved by transformers itself (random weights, spread out)."""
    from transformers import MuseGlimmerAssistantConfig
    from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantModel

    s = _shape(target, layers)
    config = MuseGlimmerAssistantConfig(
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        head_dim=s["head_dim"],
        target_layer_ids=[0, target.config.num_hidden_layers - 1],
        block_size=block_size,
        mask_token_id=3,
        sliding_window=window,
        vocab_size=s["vocab_size"],
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, SPREAD)
    model.save_pretrained(folder)
    return model


def random_block_draft(target, target_layer_ids=(0,), seed: int = 3, **config):
    """A block draft of our own format for `target` with spread-out random weights (no file)."""
    from hf_specdec.heads.dflash import BlockDraftConfig
    from hf_specdec.heads.io import build_head

    head = build_head(BlockDraftConfig.for_target(target, list(target_layer_ids), **config), target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * SPREAD)
    return head.eval()
