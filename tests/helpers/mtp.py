"""Tiny checkpoints that carry their own MTP layers, written in the published layouts: DeepSeek-V3's
(the MTP layer stored as decoder layer 61, `num_hidden_layers`, its MoE experts one key each, its
own copies of the embedding and LM head), GLM-4.5-Air's (the same as layer 46), and Ling's hybrid
(`bailing_hybrid`: linear-attention (KDA) layers and MLA layers, the MTP layer, an MLA one, stored
after the last decoder layer). Each loads with transformers' `from_pretrained`, and its
`generate(use_mtp=True)` runs on it.

The layers' weights are random (seeded), with a large initializer range so that the distributions
are peaked: the MTP layer then agrees with its target now and then on a vocabulary of VOCAB ids.
"""

from __future__ import annotations

import io
import sys
from collections import Counter
from pathlib import Path

import safetensors
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file
from transformers import (
    BailingHybridConfig,
    BailingHybridForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
)
from transformers.modeling_layers import MtpModel

from hf_specdec.hub.download import SAFETENSORS_INDEX

VOCAB = 16
# The MTP layer's index in each layout (transformers hard-codes it per architecture, and for the
# hybrid reads it after `num_hidden_layers`). transformers 5.25's own MTP drafting and prompt lookup
# differ from plain greedy on the hybrid on most prompts (not at rounding ties): there plain decoding
# is the reference, not `use_mtp=True`.
LAYOUTS = {"deepseek_v3": 61, "glm4_moe": 46}
HYBRID_LAYOUTS = {"bailing_hybrid": 2}
INDEX = LAYOUTS | HYBRID_LAYOUTS


def config(layout: str, **overrides):
    layers = INDEX[layout]
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=layers,
        initializer_range=0.4, max_position_embeddings=256, bos_token_id=1, eos_token_id=None,
        pad_token_id=0, num_mtp_layers=1, tie_word_embeddings=False,
    )  # fmt: skip
    mla = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    if layout == "deepseek_v3":
        return DeepseekV3Config(**{**common, **mla, **overrides})
    if layout == "bailing_hybrid":  # one KDA layer, then one MLA layer; the MTP layer MLA and MoE
        hybrid = dict(head_dim=8, layer_group_size=2, num_local_experts=4, short_conv_kernel_size=2)
        made = BailingHybridConfig(**{**common, **mla, **hybrid, **overrides})
        made.mtp_layer_types, made.mtp_mlp_layer_types = ["full_attention"], ["sparse"]
        return made
    return Glm4MoeConfig(**{**common, "head_dim": 8, **overrides})


def model_class(layout: str) -> type:
    return {"deepseek_v3": DeepseekV3ForCausalLM, "bailing_hybrid": BailingHybridForCausalLM}.get(
        layout, Glm4MoeForCausalLM
    )


def target_and_layers(
    layout: str = "deepseek_v3",
    seed: int = 0,
    depths: int = 1,
    agree: float = 0.0,
    own: float = 0.0,
    **overrides,
):
    """A tiny target of `layout` in memory and `depths` MTP layers for it (transformers' `MtpModel`),
    random, or with `agree` > 0 built to agree with it (`agreeing(target, layers, agree, own)`)."""
    torch.manual_seed(seed)
    target = model_class(layout)(config(layout, num_mtp_layers=depths, **overrides)).eval()
    torch.manual_seed(seed + 1)
    layers = MtpModel(target, depths).eval()
    with torch.no_grad():
        for p in layers.parameters():
            if (
                p.dim() > 1
                and p is not target.lm_head.weight
                and p is not target.get_input_embeddings().weight
            ):
                p.normal_(0, 0.4)
    if agree:
        agreeing(target, layers, agree, own)
    return target, layers


@torch.no_grad()
def agreeing(target, layers, context: float, own_context: float = 0.0) -> None:
    """Make `layers` guess `target`'s next token well: the target's MLPs write nothing into the
    residual stream and its attention only `context` of its output (a bigram model of the embedding,
    bent by the context), and each MTP layer passes the embedding of the token it reads straight
    through its block (its MLP output zeroed, its attention's scaled by `own_context`: 0 leaves
    nothing of it), so that the shared norm and LM head score what the target would after that
    token alone."""
    for name, p in target.named_parameters():
        if name.endswith(("down_proj.weight", "down_proj")):
            p.zero_()
        elif name.endswith("o_proj.weight"):
            p.mul_(context)
    hidden = target.config.hidden_size
    for layer in layers.layers:
        layer.eh_proj.weight.zero_()
        layer.eh_proj.weight[:, :hidden] = torch.eye(hidden)  # [embedding, hidden] -> the embedding
        for name, p in layer.mtp_block.named_parameters():
            if name.endswith(("down_proj.weight", "down_proj")):
                p.zero_()
            elif name.endswith("o_proj.weight"):
                p.mul_(own_context)


def checkpoint(
    folder: Path,
    layout: str = "deepseek_v3",
    seed: int = 0,
    mtp: bool = True,
    agree: float = 0.0,
    shards: int = 1,
    **overrides,
) -> Path:
    """Write a tiny target of `layout` to `folder` with (`mtp`) or without its MTP layer in the
    published layout, in one safetensors file or in about `shards` with their index; `agree`: as
    `target_and_layers`."""
    target, layer = target_and_layers(layout, seed, 1, agree, **overrides)
    target.save_pretrained(folder)
    if not mtp:
        return folder
    weights = load_file(folder / "model.safetensors")
    weights.update(published_keys(layer.state_dict(), INDEX[layout]))
    weights[f"model.layers.{INDEX[layout]}.embed_tokens.weight"] = (
        target.get_input_embeddings().weight.detach()
    )
    weights[f"model.layers.{INDEX[layout]}.shared_head.head.weight"] = target.lm_head.weight.detach()
    weights = {k: v.contiguous() for k, v in weights.items()}
    if shards == 1:
        save_file(weights, folder / "model.safetensors", {"format": "pt"})
        return folder
    (folder / "model.safetensors").unlink()
    weights = {k: v.clone() for k, v in weights.items()}  # no two share storage (experts cut from one)
    size = sum(w.numel() * w.element_size() for w in weights.values())
    save_torch_state_dict(weights, folder, max_shard_size=size // shards + 1, metadata={"format": "pt"})
    return folder


def damage(folder: Path, how: str, layout: str = "glm4_moe") -> Path:
    """The one-file checkpoint in `folder` with its MTP layer's `eh_proj` gone (`how="missing"`) or
    cut to the wrong shape ("misshapen")."""
    weights = load_file(folder / "model.safetensors")
    eh_proj = weights.pop(f"model.layers.{INDEX[layout]}.eh_proj.weight")
    if how == "misshapen":
        weights[f"model.layers.{INDEX[layout]}.eh_proj.weight"] = eh_proj[:, :8].contiguous()
    save_file(weights, folder / "model.safetensors", {"format": "pt"})
    return folder


def count_reads(monkeypatch, folder: Path) -> Counter:
    """Count, from now on, what is read of the checkpoint's weight files in `folder` (its safetensors
    files and their index; not its config), by `(what, file name)`: `"open"` each time one is
    opened (a safetensors file, whose header that reads, or the index), `"weight"` each time a
    weight's data is read out of one. The real `safetensors.safe_open` (wrapped in every module that
    imported it) and `io.open` (what `Path.read_text` opens through) do the reading."""
    reads: Counter = Counter()
    safe_open, open_file, folder = safetensors.safe_open, io.open, folder.resolve()

    def name(path) -> str | None:
        path = Path(path).resolve() if isinstance(path, (str, Path)) else None
        weights = path is not None and path.name.endswith((".safetensors", SAFETENSORS_INDEX))
        return path.name if weights and path.parent == folder else None

    def count(what: str, file: str | None) -> None:
        if file is not None:  # in `folder`
            reads[what, file] += 1

    class Slice:
        def __init__(self, weights, file: str | None) -> None:
            self.weights, self.file = weights, file

        def __getitem__(self, index):
            count("weight", self.file)
            return self.weights[index]

        def __getattr__(self, attribute: str):
            return getattr(self.weights, attribute)

    class Counted:
        def __init__(self, path, *args, **kwargs) -> None:
            self.file = name(path)
            count("open", self.file)
            self.opened = safe_open(path, *args, **kwargs)

        def __enter__(self):
            self.opened.__enter__()
            return self

        def __exit__(self, *exc):
            return self.opened.__exit__(*exc)

        def get_slice(self, key: str) -> Slice:
            return Slice(self.opened.get_slice(key), self.file)

        def get_tensor(self, key: str) -> torch.Tensor:
            count("weight", self.file)
            return self.opened.get_tensor(key)

        def __getattr__(self, attribute: str):
            return getattr(self.opened, attribute)

    def counted_open(path, *args, **kwargs):
        count("open", name(path))
        return open_file(path, *args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "safe_open", None) is safe_open:
            monkeypatch.setattr(module, "safe_open", Counted)
    monkeypatch.setattr(io, "open", counted_open)
    return reads


def published_keys(state: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """transformers' `MtpModel` state (one layer) under the published checkpoint's names: the block's
    keys under `model.layers.{index}`, the routed experts one key per expert and projection."""
    out = {}
    prefix = f"model.layers.{index}."
    for key, value in state.items():
        if not key.startswith("layers.0."):
            continue  # the embedding and head are the target's
        name = (
            key.removeprefix("layers.0.").removeprefix("mtp_block.").replace("post_norm", "shared_head.norm")
        )
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * inner, hidden]: gate rows, then up
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[prefix + name] = value
    return out


def prompts(batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts of 7-10 tokens (ids from 2 on: 0 pads, 1 is BOS)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [10, 7, 8][:batch]
    input_ids = torch.zeros(batch, 10, dtype=torch.long)
    attention_mask = torch.zeros(batch, 10, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, 10 - n :] = torch.randint(2, VOCAB, (n,), generator=g)
        attention_mask[b, 10 - n :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}
