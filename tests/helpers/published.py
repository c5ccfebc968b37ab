"""Draft heads written in their authors' layouts (SafeAILab/EAGLE's EAGLE-1/2 and EAGLE-3,
FasterDecoding/Medusa's), with random weights for tiny Llama targets: what `heads.published` reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def shape_of(target) -> dict:
    text = target.config.get_text_config()
    return dict(
        hidden=text.hidden_size,
        heads=text.num_attention_heads,
        kv=text.num_key_value_heads,
        head_dim=text.hidden_size // text.num_attention_heads,
        inter=text.intermediate_size,
        vocab=text.vocab_size,
    )


def _llama_config(s: dict, **extra) -> dict:
    """A reference head's config.json: LlamaConfig fields of a one-layer model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"],
        "num_hidden_layers": 1,
        "vocab_size": s["vocab"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 500.0,  # not the 10000 default: a config value that is ignored would show
        **extra,
    }


def _rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape) * scale


def save_state(state: dict, path: Path) -> None:
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)


def _attention(s: dict, prefix: str, width: int) -> dict:
    q, kv = s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(q, width),
        f"{prefix}.self_attn.k_proj.weight": _rand(kv, width),
        f"{prefix}.self_attn.v_proj.weight": _rand(kv, width),
        f"{prefix}.self_attn.o_proj.weight": _rand(s["hidden"], q),
        f"{prefix}.post_attention_layernorm.weight": 1 + _rand(s["hidden"], scale=0.1),
        f"{prefix}.mlp.gate_proj.weight": _rand(s["inter"], s["hidden"]),
        f"{prefix}.mlp.up_proj.weight": _rand(s["inter"], s["hidden"]),
        f"{prefix}.mlp.down_proj.weight": _rand(s["hidden"], s["inter"]),
    }


def write_eagle1(
    folder: Path,
    target,
    *,
    weights: str = "pytorch_model.bin",
    bias: bool = True,
    hidden: int | None = None,
    qkv_bias: bool = False,
    extra: dict | None = None,
) -> Path:
    """SafeAILab/EAGLE `cnets1.Model` as saved: fc over cat(embedding, feature), layers.0 (no input norm);
    `qkv_bias` as the reference's Qwen heads (`qkv_bias` in its config)."""
    torch.manual_seed(1)
    s = shape_of(target)
    if hidden is not None:
        s = {**s, "hidden": hidden, "head_dim": hidden // s["heads"]}
    h = s["hidden"]
    state = {"fc.weight": _rand(h, 2 * h), **_attention(s, "layers.0", h)}
    if bias:
        state["fc.bias"] = _rand(h)
    if qkv_bias:
        q, kv = s["heads"] * s["head_dim"], s["kv"] * s["head_dim"]
        for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            state[f"layers.0.self_attn.{name}.bias"] = _rand(width)
    state["embed_tokens.weight"] = _rand(s["vocab"], h)  # saved by the reference, unused by us
    folder.mkdir(parents=True, exist_ok=True)
    config = _llama_config(s, bias=bias, **({"qkv_bias": True} if qkv_bias else {}))
    (folder / "config.json").write_text(json.dumps({**config, **(extra or {})}))
    save_state(state, folder / weights)
    return folder


def write_eagle3(folder: Path, target, *, draft_vocab: int = 40, extra: dict | None = None) -> Path:
    """SafeAILab/EAGLE `cnets.Model` (EAGLE-3) as saved: fc over 3 layers, midlayer, norm, lm_head, d2t."""
    torch.manual_seed(2)
    s = shape_of(target)
    h = s["hidden"]
    kept = torch.randperm(s["vocab"])[:draft_vocab].sort().values  # target ids of the draft vocabulary
    state = {
        "fc.weight": _rand(h, 3 * h, scale=0.1),
        **_attention(s, "midlayer", 2 * h),
        "midlayer.hidden_norm.weight": 1 + _rand(h, scale=0.1),
        "midlayer.input_layernorm.weight": 1 + _rand(h, scale=0.1),
        "norm.weight": 1 + _rand(h, scale=0.1),
        "lm_head.weight": _rand(draft_vocab, h),
        "d2t": kept - torch.arange(draft_vocab),
        "t2d": torch.zeros(s["vocab"], dtype=torch.bool).index_fill_(0, kept, True),
    }
    state["midlayer.self_attn.o_proj.weight"] = _rand(h, s["heads"] * s["head_dim"])
    folder.mkdir(parents=True, exist_ok=True)
    config = _llama_config(s, draft_vocab_size=draft_vocab, architectures=["LlamaForCausalLMEagle3"])
    (folder / "config.json").write_text(json.dumps({**config, **(extra or {})}))
    save_state(state, folder / "model.safetensors")
    return folder


def write_medusa(
    folder: Path,
    target,
    *,
    weights: str = "medusa_lm_head.safetensors",
    heads: int = 3,
    layers: int = 1,
    hidden: int | None = None,
) -> Path:
    """FasterDecoding/Medusa `medusa_head` as saved: {i}.{j}.linear.* blocks, {i}.{layers}.weight LM head."""
    torch.manual_seed(3)
    s = shape_of(target)
    h = hidden or s["hidden"]
    # each head's LM head starts as the target's (as the reference initialises it), then drifts
    lm_head = target.lm_head.weight.detach().float() if hidden is None else _rand(s["vocab"], h)
    state = {}
    for i in range(heads):
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"] = _rand(h, h, scale=0.1)
            state[f"{i}.{j}.linear.bias"] = _rand(h, scale=0.1)
        state[f"{i}.{layers}.weight"] = lm_head + _rand(s["vocab"], h, scale=0.05)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
    (folder / "config.json").write_text(json.dumps(config))
    save_state(state, folder / weights)
    return folder
