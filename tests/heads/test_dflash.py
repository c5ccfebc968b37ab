"""Block drafts read from their published layouts compute what their authors' code computes.

z-lab's DFlash is checked against a reference written from `dflash/model.py` (its attention and
masks, its sliding-window rule), DSpark's heads against DeepSpec's formulas (`markov_head.py`,
`AcceptRatePredictor`), and the MuseGlimmer assistant against transformers' own
`DFlashTokenCandidateGenerator` (tests/drafters/test_dflash.py). Refusals name what is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_specdec.drafters.dflash import BlockContext
from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.dflash import BlockDraft, BlockDraftConfig, attention_masks
from hf_specdec.heads.io import build_head, save_head

from ..conftest import tiny_llama
from ..helpers.architectures import tiny
from ..helpers.block_drafts import random_block_draft, write_dspark, write_muse_glimmer, write_zlab
from .test_published import hub  # noqa: F401 (the local Hub fixture)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


# --- the reference: z-lab's DFlash forward, written out from the raw tensors ---------------------


def _rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta=10000.0):
    """x [heads, T, d] rotated to `positions` [T] (rotate_half, as Qwen3 does)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions.float()[:, None] * inv_freq] * 2, dim=-1)
    return x * emb.cos() + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * emb.sin()


def reference_block(w, config: dict, features, block_embeds, causal=(), windows=()):
    """`DFlashDraftModel.forward` for one row: the context of n tokens (positions 0..n-1), the block at
    n..n+S-1; z-lab's `_attention_mask` rules per layer (causal: keys up to the query; a window of W:
    q - k < W, and k - q < W when not causal). Returns the block's normed outputs [S, H]."""
    n, size = features.shape[0], block_embeds.shape[0]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = block_embeds
    q_pos, k_pos = torch.arange(n, n + size), torch.arange(n + size)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, h])

        def split(y, count):
            return y.view(y.shape[0], count, d).transpose(0, 1)

        q = _rope(
            _rms(split(h @ w[p + "self_attn.q_proj.weight"].T, heads), w[p + "self_attn.q_norm.weight"]),
            q_pos,
        )
        k = _rope(
            _rms(split(kv_in @ w[p + "self_attn.k_proj.weight"].T, kv), w[p + "self_attn.k_norm.weight"]),
            k_pos,
        )
        v = split(kv_in @ w[p + "self_attn.v_proj.weight"].T, kv)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        visible = torch.ones(size, n + size, dtype=torch.bool)
        is_causal = causal[i] if causal else False
        window = windows[i] if windows else None
        if is_causal:
            visible &= k_pos[None] <= q_pos[:, None]
        if window:
            visible &= q_pos[:, None] - k_pos[None] < window
            if not is_causal:
                visible &= k_pos[None] - q_pos[:, None] < window
        scores = (q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(~visible, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(size, -1)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        m = _rms(x, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"])


def ours_block(head: BlockDraft, features, anchor: int):
    """Our draft over the same row: the context taken in, then one block forward."""
    n = features.shape[0]
    context = BlockContext(len(head.layers), 1, features.device)
    positions = torch.arange(n)[None]
    context.append(
        head.context_keys(features[None], positions), positions, torch.ones(1, n, dtype=torch.bool)
    )
    block_at = torch.arange(n, n + head.config.block_size)[None]
    keys_at = torch.cat([context.positions, block_at], dim=1)
    real = torch.cat([context.valid, torch.ones_like(block_at, dtype=torch.bool)], dim=1)
    masks = attention_masks(head.config, block_at, keys_at, real, n)
    embeds = head.embed_block(torch.tensor([anchor]))
    return head.run_block(embeds, block_at, context.layers(), masks)[0], embeds[0]


def _features(target, n=9, seed=3, layers=(0, 1)):
    ids = torch.randint(6, 64, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0] for i in layers], dim=-1), ids


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        # z-lab's sliding layers: causal, and keys fewer than `sliding_window` positions back
        dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
        dict(
            layer_types=["sliding_attention", "sliding_attention"],
            sliding_window=3,
            settings={"causal": False},
        ),
    ],
    ids=["full", "sliding-causal", "sliding-bidirectional"],
)
def test_zlab_dflash_matches_the_reference_formula(tmp_path, target, variant):
    folder = write_zlab(tmp_path / "draft", target, **variant)
    head = load_head(folder, target, method="dflash").float()
    raw = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    features, ids = _features(target)
    ours, embeds = ours_block(head, features, anchor=int(ids[0, -1]))
    types = raw["layer_types"]
    forced = raw["dflash_config"].get("causal")
    causal = [(t == "sliding_attention") if forced is None else forced for t in types]
    windows = [raw["sliding_window"] if t == "sliding_attention" else None for t in types]
    expected = reference_block(w, raw, features, embeds, causal, windows)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert head.config.drafts_per_block == raw["block_size"] - 1 and not head.config.drafts_from_anchor


def test_block_embedding_is_the_targets_raw_rows_times_the_scale(tmp_path, target):
    folder = write_zlab(
        tmp_path / "draft", target, settings={"input_embedding_scale": 2.5, "mask_token_id": 7}
    )
    head = load_head(folder, target, method="dflash")
    embeds = head.embed_block(torch.tensor([11, 12]))
    weight = target.get_input_embeddings().weight
    torch.testing.assert_close(embeds[1, 0], 2.5 * weight[12])
    torch.testing.assert_close(embeds[0, 1:], 2.5 * weight[7].expand(3, -1))


def test_output_multiplier_and_softcap_shape_the_logits(tmp_path, target):
    folder = write_zlab(
        tmp_path / "draft", target, settings={"output_multiplier": 0.5, "final_logit_softcapping": 3.0}
    )
    head = load_head(folder, target, method="dflash")
    hidden = torch.randn(2, 32)
    raw = hidden @ target.get_output_embeddings().weight.T
    torch.testing.assert_close(head.logits(hidden), torch.tanh(raw * 0.5 / 3.0) * 3.0)


@pytest.mark.parametrize("markov", ["vanilla", "gated"])
def test_dspark_heads_match_deepspec_formulas(tmp_path, target, markov):
    folder = write_dspark(tmp_path / "draft", target, markov=markov)
    head = load_head(folder, target, method="dflash").float()
    w = load_file(str(folder / "model.safetensors"))
    assert head.config.drafts_from_anchor and head.config.drafts_per_block == 4
    hidden, previous = torch.randn(5, 32), torch.tensor([7, 8, 9, 10, 11])
    code = w["markov_head.markov_w1.weight"][previous]
    if markov == "gated":
        gate = (
            torch.cat([hidden, code], -1) @ w["markov_head.gate_proj.weight"].T
            + w["markov_head.gate_proj.bias"]
        )
        code = code * torch.sigmoid(gate)
    torch.testing.assert_close(head.markov_bias(previous, hidden), code @ w["markov_head.markov_w2.weight"].T)
    features = torch.cat([hidden, w["markov_head.markov_w1.weight"][previous]], -1)
    logit = features @ w["confidence_head.proj.weight"].T + w["confidence_head.proj.bias"]
    torch.testing.assert_close(head.confidence(hidden, previous), torch.sigmoid(logit[:, 0]))


def test_dspark_reads_the_embeddings_as_layer_minus_one(tmp_path, target):
    folder = write_dspark(tmp_path / "draft", target, target_layer_ids=(-1, 1))
    head = load_head(folder, target)
    assert head.feature_layers == (0, 2)  # output_hidden_states indices: the embeddings, layer 1's output


def test_muse_glimmer_layout_is_read_with_its_bidirectional_windows(tmp_path, target):
    model = write_muse_glimmer(tmp_path / "draft", target, window=5)
    head = load_head(tmp_path / "draft", target, method="dflash")
    assert head.config.layer_windows == [5, 5] and head.config.causal_layers == []
    torch.testing.assert_close(head.fc.weight, model.encoder.fc.weight)
    torch.testing.assert_close(head.hidden_norm.weight, model.encoder.output_norm_enc.weight)


def test_our_format_round_trips(tmp_path, target):
    config = BlockDraftConfig.for_target(
        target, [0, 1], num_hidden_layers=2, block_size=5, draft_vocab_size=40
    )
    head = build_head(config, target)
    head.set_draft_vocab(torch.arange(3, 43))
    save_head(head, tmp_path / "ours")
    loaded = load_head(tmp_path / "ours", target, method="dflash")
    assert loaded.config == head.config
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


# --- refusals -----------------------------------------------------------------------------------


def _edit_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(architectures=["DFlash2DraftModel"]),
            r"DFlash2DraftModel: DFlash 2 drafts \(a candidate selector",
        ),
        (dict(architectures=["Gemma4DSparkModel"]), r"Gemma-4 DSpark drafts"),
        (
            dict(dflash_config={"target_layer_ids": [0, 1], "mask_token_id": 3, "selector_top_k": 16}),
            r"dflash_config sets selector_top_k, which hf-specdec does not run",
        ),
        (dict(hidden_act="gelu"), r"hidden_act 'gelu'"),
        (dict(target_hidden_size=64), r"target_hidden_size"),
        (
            dict(dflash_config={"target_layer_ids": [0, 5], "mask_token_id": 3}),
            r"reads target layers \[0, 5\].*2 layers",
        ),
        (dict(dflash_config={"target_layer_ids": [0, 1]}), r"does not give mask_token_id"),
    ],
    ids=["dflash2", "gemma4-dspark", "unknown-setting", "activation", "target-hidden", "layers", "no-mask"],
)
def test_what_is_not_understood_is_refused_by_name(tmp_path, target, changes, message):
    folder = write_zlab(tmp_path / "draft", target)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        load_head(folder, target, method="dflash")


def test_rnn_markov_head_is_refused_by_name(tmp_path, target):
    folder = write_dspark(tmp_path / "draft", target)
    _edit_config(folder, markov_head_type="rnn")
    with pytest.raises(ValueError, match=r"DSpark's 'rnn' Markov head is not supported"):
        load_head(folder, target)


def test_pickled_weights_are_never_read(tmp_path, target):
    folder = write_zlab(tmp_path / "draft", target)
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no safetensors weights.*never from pickles"):
        load_head(folder, target, method="dflash")


def test_a_draft_for_another_target_is_refused(tmp_path, target):
    folder = write_zlab(tmp_path / "draft", tiny_llama(0, vocab_size=80))
    with pytest.raises(ValueError, match=r"vocabulary size 80.*has 64"):
        load_head(folder, target)


def _draft_for_four_layers(kind, folder):
    """A block draft reading layer 3 of a 4-layer model (the fixture's sizes) that does not record
    the model's layer count (as MuseGlimmer configs and older saves do not), given as `kind`."""
    four = tiny_llama(0, layers=4)
    if kind == "module":
        head = random_block_draft(four, (0, 3))
        head.config.target_num_layers = 0
        return head
    if kind == "ours":
        config = dataclasses.replace(BlockDraftConfig.for_target(four, [0, 3]), target_num_layers=0)
        return save_head(build_head(config, four), folder)
    if kind == "muse-glimmer":
        write_muse_glimmer(folder, four)  # reads layers 0 and L - 1
        return folder
    write = write_zlab if kind == "z-lab" else write_dspark
    write(folder, four, target_layer_ids=(0, 3))
    _edit_config(folder, num_target_layers=None)
    return folder


@pytest.mark.parametrize("kind", ["z-lab", "dspark", "muse-glimmer", "ours", "module"])
def test_every_loader_refuses_a_draft_reading_layers_the_target_lacks(tmp_path, target, kind):
    draft = _draft_for_four_layers(kind, tmp_path / "draft")
    refused = r"reads target layers \[0, 3\], but this target has 2 layers"
    with pytest.raises(ValueError, match=refused) as err:
        load_head(draft, target, method="dflash")
    if isinstance(draft, torch.nn.Module):  # named by its class, not by its whole module listing
        assert "The block draft BlockDraft reads" in str(err.value) and "\n" not in str(err.value)


def test_unexpected_tensors_are_named(tmp_path, target):
    folder = write_zlab(tmp_path / "draft", target)
    state = load_file(str(folder / "model.safetensors"))
    state["layers.0.attention_conv.base_kernel"] = torch.zeros(2)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected: layers\.0\.attention_conv\.base_kernel"):
        load_head(folder, target)


# --- from the Hub: nothing of the repo's runs ------------------------------------------------------


def test_a_published_dflash_repo_loads_without_its_code_and_pickles_are_refused(tmp_path, target, hub):  # noqa: F811
    """z-lab's repos carry their modeling file (named by `auto_map`): it is neither fetched nor run
    (ours would exit the test). A repo whose weights are only a pickle is refused, never unpickled."""
    repo = "z-lab/Tiny-DFlash-Test"
    served = hub.add(repo, write_zlab(tmp_path / "repo", target))
    hostile = ["../../escaped.json", "/tmp/escaped.json"]
    served.files.update(dict.fromkeys(hostile, b"{}"))
    head = load_head(repo, target, method="dflash")
    assert isinstance(head, BlockDraft) and head.config.layout == "DFlash (z-lab)"
    fetched = {name for _, name in hub.resolved(repo)}
    assert "model.safetensors" in fetched and not fetched & {"dflash.py", *hostile}

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((tmp_path / "repo" / "config.json").read_bytes())
    torch.save(load_file(str(tmp_path / "repo" / "model.safetensors")), pickled / "pytorch_model.bin")
    hub.add("evil/Pickled-DFlash", pickled)
    with pytest.raises(ValueError, match=r"never from pickles"):
        load_head("evil/Pickled-DFlash", target, method="dflash")


@pytest.mark.parametrize("name", ["gpt2", "falcon"])
def test_heads_for_targets_whose_configs_name_their_mlp_width_otherwise(name):
    """GPT-2 (`n_inner`, None: 4x the hidden size) and Falcon (`ffn_hidden_size`) name no
    `intermediate_size`: a fresh head (what train-draft trains) was an AttributeError."""
    from hf_specdec.heads.eagle import EagleHeadConfig

    target = tiny(name, 0, eos_token_id=None)
    text = target.config
    width = getattr(text, "n_inner", None) or getattr(text, "ffn_hidden_size", None) or 4 * text.hidden_size
    assert EagleHeadConfig.for_target(target).intermediate_size == width
    draft = random_block_draft(target, (0, text.num_hidden_layers - 1))
    assert draft.config.intermediate_size == width
    input_ids = torch.tensor([[7, 8, 9, 10, 7, 8]])
    kwargs = dict(input_ids=input_ids, do_sample=False, max_new_tokens=8)
    spec = target.generate(**kwargs, speculative=dict(method="dflash", draft=draft, num_draft_tokens=3))
    assert torch.equal(spec, target.generate(**kwargs))
