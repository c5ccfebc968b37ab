"""Published heads (EAGLE-1/2, EAGLE-3, Medusa layouts): converted, checked, and lossless in `generate`.

Checkpoints are written here in each reference layout with random weights for tiny random Llama
targets. The EAGLE-1 and EAGLE-3 conversions are also compared with the reference formulas
written out from the raw tensors, so a key-mapping mistake cannot pass.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.eagle import EagleHead, EagleHeadConfig
from hf_specdec.heads.eagle3 import Eagle3Head
from hf_specdec.heads.io import build_head, save_head
from hf_specdec.heads.medusa import MedusaHead
from hf_specdec.selection.select import DraftChoice, known_heads, select_draft
from hf_specdec.store.manifest import MANIFEST_NAME

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.hub import local_hub
from ..helpers.published import save_state, shape_of, write_eagle1, write_eagle3, write_medusa


@pytest.fixture(scope="module")
def target8():
    """An 8-layer target: EAGLE-3 reads the inputs of its layers 2, 4 and 5."""
    return tiny_llama(0, layers=8)


# --- the reference formulas, from the raw tensors ---------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, heads, T, d] rotated to positions 0..T-1 as the reference does (rotate_half)."""
    d, length = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(length).float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * emb.cos() + half * emb.sin()


def _reference_attention(x: torch.Tensor, w: dict, p: str, s: dict, theta: float) -> torch.Tensor:
    b, t, _ = x.shape

    def heads(y: torch.Tensor, n: int) -> torch.Tensor:
        return y.view(b, t, n, s["head_dim"]).transpose(1, 2)

    def proj(name: str) -> torch.Tensor:
        return x @ w[f"{p}.self_attn.{name}.weight"].T + w.get(f"{p}.self_attn.{name}.bias", 0)

    q = _rope(heads(proj("q_proj"), s["heads"]), theta)
    k = _rope(heads(proj("k_proj"), s["kv"]), theta)
    v = heads(proj("v_proj"), s["kv"])
    k = k.repeat_interleave(s["heads"] // s["kv"], dim=1)
    v = v.repeat_interleave(s["heads"] // s["kv"], dim=1)
    scores = q @ k.transpose(2, 3) / math.sqrt(s["head_dim"])
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
    return out @ w[f"{p}.self_attn.o_proj.weight"].T


def _reference_mlp(x: torch.Tensor, w: dict, p: str) -> torch.Tensor:
    gate = x @ w[f"{p}.mlp.gate_proj.weight"].T
    return (torch.nn.functional.silu(gate) * (x @ w[f"{p}.mlp.up_proj.weight"].T)) @ w[
        f"{p}.mlp.down_proj.weight"
    ].T


def reference_eagle1(w: dict, s: dict, embed: torch.Tensor, lm_head: torch.Tensor, ids, feats):
    """cnets1.Model.forward + the target's LM head: fc(cat(embeds, hidden)), a layer without input norm."""
    x = torch.cat([embed[ids], feats], dim=-1) @ w["fc.weight"].T + w.get("fc.bias", 0)
    x = x + _reference_attention(x, w, "layers.0", s, 500.0)
    x = x + _reference_mlp(_rms(x, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0")
    return x @ lm_head.T, x


def reference_eagle3(w: dict, s: dict, embed: torch.Tensor, ids, raw_feats):
    """cnets.Model.forward (EAGLE-3) and its scoring: lm_head(norm(out)) over the draft vocabulary."""
    hidden = raw_feats @ w["fc.weight"].T
    normed = torch.cat(
        [
            _rms(embed[ids], w["midlayer.input_layernorm.weight"]),
            _rms(hidden, w["midlayer.hidden_norm.weight"]),
        ],
        dim=-1,
    )
    x = hidden + _reference_attention(normed, w, "midlayer", s, 500.0)
    x = x + _reference_mlp(_rms(x, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer")
    return _rms(x, w["norm.weight"]) @ w["lm_head.weight"].T, x


def _raw(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


# --- conversion is exact ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "bias", "qkv_bias"),
    [
        ("pytorch_model.bin", True, False),
        ("model.safetensors", False, False),
        ("model.safetensors", True, True),
    ],
    ids=["bin", "st-nobias", "st-qkv-bias"],
)
def test_eagle1_matches_reference_formula(tmp_path, target, weights, bias, qkv_bias):
    folder = write_eagle1(tmp_path / "eagle1", target, weights=weights, bias=bias, qkv_bias=qkv_bias)
    head = load_head(folder, target, method="eagle")
    assert isinstance(head, EagleHead) and head.layer.input_layernorm is None
    assert (head.fc.bias is not None) == bias
    assert head.config.attention_bias == qkv_bias == (head.layer.self_attn.k_proj.bias is not None)
    assert head.config.rope_parameters["rope_theta"] == 500.0

    w, s = _raw(folder / weights), shape_of(target)
    ids = torch.randint(0, s["vocab"], (2, 7))
    feats = torch.randn(2, 7, s["hidden"])
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    expected_logits, expected_hidden = reference_eagle1(w, s, embed, lm_head, ids, feats)
    with torch.no_grad():
        out = head(ids, feats, cache=None)
        # the same through a KV cache, 4 positions then 3
        cache = DynamicCache()
        first = head(ids[:, :4], feats[:, :4], cache=cache)
        rest = head(ids[:, 4:], feats[:, 4:], cache=cache)
    torch.testing.assert_close(out.logits, expected_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden_states, expected_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        torch.cat([first.logits, rest.logits], 1), expected_logits, atol=1e-4, rtol=1e-4
    )


def test_eagle3_matches_reference_formula(tmp_path, target8):
    folder = write_eagle3(tmp_path / "eagle3", target8)
    head = load_head(folder, target8, method="eagle")
    assert isinstance(head, Eagle3Head)
    assert head.feature_layers == (2, 4, 5)  # inputs of layers 2, L//2, L-3 of an 8-layer target
    assert head.config.method == "eagle" and head.config.draft_vocab_size == 40
    assert (head.config.variant, head.config.feature_layers) == ("eagle3", [2, 4, 5])

    w, s = _raw(folder / "model.safetensors"), shape_of(target8)
    torch.testing.assert_close(head.draft_vocab, torch.arange(40) + w["d2t"])  # target id = i + d2t[i]
    assert bool(w["t2d"][head.draft_vocab].all())
    ids = torch.randint(0, s["vocab"], (2, 6))
    raw = torch.randn(2, 6, 3 * s["hidden"])
    embed = target8.model.embed_tokens.weight.detach()
    expected_logits, expected_hidden = reference_eagle3(w, s, embed, ids, raw)
    with torch.no_grad():
        cache = DynamicCache()
        first = head(ids[:, :4], head.project_features(raw[:, :4]), cache=cache)
        rest = head(ids[:, 4:], head.project_features(raw[:, 4:]), cache=cache)
    torch.testing.assert_close(
        torch.cat([first.logits, rest.logits], 1), expected_logits, atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        torch.cat([first.hidden_states, rest.hidden_states], 1), expected_hidden, atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("weights", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_medusa_matches_reference_formula(tmp_path, target, weights):
    folder = write_medusa(tmp_path / "medusa", target, weights=weights, heads=3, layers=2)
    head = load_head(folder, target, method="medusa")
    assert isinstance(head, MedusaHead) and head.lm_heads is not None
    assert (head.config.num_heads, head.config.num_layers) == (3, 2)
    w = _raw(folder / weights)
    feats = torch.randn(5, shape_of(target)["hidden"])
    with torch.no_grad():
        logits = head(feats)  # [5, heads, V]
    for i in range(3):  # medusa_head[i] = Sequential(ResBlock x layers, Linear(H, V))
        x = feats
        for j in range(2):
            x = x + torch.nn.functional.silu(x @ w[f"{i}.{j}.linear.weight"].T + w[f"{i}.{j}.linear.bias"])
        torch.testing.assert_close(logits[:, i], x @ w[f"{i}.2.weight"].T, atol=1e-4, rtol=1e-4)


def test_converted_heads_take_the_targets_dtype(tmp_path):
    target = tiny_llama(0).to(torch.bfloat16)
    for folder, method in [
        (write_eagle1(tmp_path / "e1", target), "eagle"),
        (write_medusa(tmp_path / "m", target), "medusa"),
    ]:
        head = load_head(folder, target, method=method)
        assert {p.dtype for p in head.parameters()} == {torch.bfloat16}, folder.name
    target8 = tiny_llama(0, layers=8).to(torch.bfloat16)
    head = load_head(write_eagle3(tmp_path / "e3", target8), target8)
    assert {p.dtype for p in head.parameters()} == {torch.bfloat16}


# --- through our own format -----------------------------------------------------------------------


def _forward(head, target, seed: int = 6):
    """The head's outputs on random inputs, in one call and through a KV cache (4 positions, then 3)."""
    text = target.config.get_text_config()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, text.vocab_size, (2, 7), generator=gen)
    raw = torch.randn(2, 7, len(head.feature_layers) * text.hidden_size, generator=gen)
    with torch.no_grad():
        feats = head.project_features(raw)
        whole = head(ids, feats, cache=None)
        cache = DynamicCache()
        first = head(ids[:, :4], feats[:, :4], cache=cache)
        rest = head(ids[:, 4:], feats[:, 4:], cache=cache)
    return [
        whole.logits,
        whole.hidden_states,
        torch.cat([first.logits, rest.logits], 1),
        torch.cat([first.hidden_states, rest.hidden_states], 1),
    ]


@pytest.mark.parametrize("layout", ["eagle1-qkv-bias", "eagle3"])
def test_converted_head_round_trips_through_our_format(tmp_path, target, target8, layout):
    if layout == "eagle3":
        model, folder = target8, write_eagle3(tmp_path / "published", target8)
    else:
        model, folder = target, write_eagle1(tmp_path / "published", target, qkv_bias=True)
    head = load_head(folder, model, method="eagle")
    saved = save_head(head, tmp_path / "ours")
    written = json.loads((saved / "head_config.json").read_text())
    if layout == "eagle3":
        assert (written["variant"], written["feature_layers"]) == ("eagle3", [2, 4, 5])
    else:
        assert (written["variant"], written["attention_bias"]) == ("eagle", True)
    assert written["max_position_embeddings"] == 512  # the target's

    again = load_head(saved, model, method="eagle")
    assert type(again) is type(head) and again.config == head.config
    assert repr(again) == repr(head)  # the same modules, of the same shapes
    assert again.feature_layers == head.feature_layers
    theirs, ours = head.state_dict(), again.state_dict()
    assert theirs.keys() == ours.keys()
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name
    for expected, got in zip(_forward(head, model), _forward(again, model), strict=True):
        assert torch.equal(expected, got)


def test_saved_eagle3_head_refuses_a_target_too_shallow_for_its_layers(tmp_path, target, target8):
    saved = save_head(load_head(write_eagle3(tmp_path / "published", target8), target8), tmp_path / "ours")
    with pytest.raises(ValueError, match=r"reads target layers \[2, 4, 5\].*2-layer target"):
        load_head(saved, target)  # same hidden and vocabulary sizes, but 2 layers


def test_head_saved_before_the_new_config_fields_still_loads(tmp_path, target):
    """head_config.json without attention_bias, max_position_embeddings, variant, feature_layers."""
    head = build_head(EagleHeadConfig.for_target(target, input_norm=True), target)
    saved = save_head(head, tmp_path / "old")
    (saved / MANIFEST_NAME).unlink()  # versions of that time wrote no manifest
    path = saved / "head_config.json"
    config = json.loads(path.read_text())
    for key in ("attention_bias", "max_position_embeddings", "variant", "feature_layers"):
        del config[key]
    path.write_text(json.dumps(config))
    again = load_head(saved, target, method="eagle")
    assert isinstance(again, EagleHead) and again.config == head.config
    for expected, got in zip(_forward(head, target), _forward(again, target), strict=True):
        assert torch.equal(expected, got)

    path.write_text(json.dumps({**config, "variant": "eagle9"}))
    with pytest.raises(ValueError, match=r"unknown EAGLE head variant 'eagle9'"):
        load_head(saved, target)


def test_llama3_rope_heads_take_the_targets_context_length(tmp_path, monkeypatch):
    """llama3 rope scaling wants max_position_embeddings above its original_max_position_embeddings:
    a head's rotary built with LlamaConfig's default (2048) would warn about it."""
    import transformers.modeling_rope_utils as rope_utils

    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_parameters=dict(rope),
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    warned: list[str] = []
    monkeypatch.setattr(rope_utils.logger, "warning", lambda msg, *a, **k: warned.append(str(msg)))

    ours = build_head(EagleHeadConfig.for_target(target), target)
    assert ours.config.max_position_embeddings == 131072
    saved = load_head(save_head(ours, tmp_path / "ours"), target)
    assert saved.config.max_position_embeddings == 131072
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    folder = write_eagle1(tmp_path / "published", target, extra={"rope_scaling": scaling})
    published = load_head(folder, target)
    assert published.config.rope_parameters["rope_type"] == "llama3"
    assert published.config.max_position_embeddings == 131072
    assert not warned, warned


# --- lossless in generate ---------------------------------------------------------------------------

LAYOUTS = {
    "eagle1-bin": (lambda f, t: write_eagle1(f, t), "eagle"),
    "eagle1-safetensors-nobias": (
        lambda f, t: write_eagle1(f, t, weights="model.safetensors", bias=False),
        "eagle",
    ),
    "eagle3": (lambda f, t: write_eagle3(f, t), "eagle"),
    "medusa-safetensors": (lambda f, t: write_medusa(f, t), "medusa"),
    "medusa-pt": (lambda f, t: write_medusa(f, t, weights="medusa_lm_head.pt", heads=4), "medusa"),
}


@pytest.mark.parametrize("batch", [1, 2], ids=["b1", "b2-left-padded"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_generate_with_published_head_equals_plain_greedy(tmp_path, target, target8, layout, batch):
    write, method = LAYOUTS[layout]
    model = target8 if layout == "eagle3" else target
    folder = write(tmp_path / layout, model)
    if batch == 1:
        input_ids, attention_mask = torch.tensor([[1, 17, 42, 9, 33]]), None
    else:
        input_ids, attention_mask = random_batch(seed=4, batch=2, min_len=3, max_len=9)
        assert not bool(attention_mask.all())  # really left-padded
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16)
    plain = model.generate(**kwargs)
    out = model.generate(
        **kwargs,
        speculative=dict(method=method, draft=str(folder), num_draft_tokens=3),
        return_dict_in_generate=True,
    )
    assert_greedy_match(model, plain, out.sequences, attention_mask)
    stats = out.speculative_stats
    assert stats.drafted > 0 and 0 <= stats.accepted <= stats.drafted


def test_exact_eagle1_head_is_accepted_in_full(tmp_path):
    """A target whose one layer adds nothing is a bigram model: its feature for x_{t+1} is
    norm(E[x_{t+1}]). An EAGLE-1 head whose fc keeps the embedding and whose attention and MLP add
    nothing predicts E[x_{t+1}], which the target's LM head ranks as the target does."""
    target = tiny_llama(0, layers=1, eos_token_id=None)
    with torch.no_grad():
        target.model.layers[0].self_attn.o_proj.weight.zero_()
        target.model.layers[0].mlp.down_proj.weight.zero_()
    folder = write_eagle1(tmp_path / "exact", target, weights="model.safetensors")
    state = _raw(folder / "model.safetensors")
    h = shape_of(target)["hidden"]
    state["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)  # cat(embedding, feature)
    state["fc.bias"] = torch.zeros(h)
    state["layers.0.self_attn.o_proj.weight"].zero_()
    state["layers.0.mlp.down_proj.weight"].zero_()
    save_state(state, folder / "model.safetensors")
    input_ids, attention_mask = random_batch(seed=5, batch=2, min_len=3, max_len=9)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20)
    plain = target.generate(**kwargs)
    out = target.generate(
        **kwargs,
        speculative=dict(method="eagle", draft=str(folder), num_draft_tokens=3),
        return_dict_in_generate=True,
    )
    assert_greedy_match(target, plain, out.sequences, attention_mask)
    assert out.speculative_stats.drafted > 0
    assert out.speculative_stats.accepted == out.speculative_stats.drafted


# --- bad input --------------------------------------------------------------------------------------


def test_unknown_folder_names_its_files_and_the_supported_layouts(tmp_path, target):
    (tmp_path / "README.md").write_text("a head")
    (tmp_path / "weights.npz").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError) as err:
        load_head(tmp_path, target)
    message = str(err.value)
    assert "README.md" in message and "weights.npz" in message
    for layout in ("head_config.json", "EAGLE-1/2", "EAGLE-3", "Medusa", "medusa_lm_head.safetensors"):
        assert layout in message


def test_eagle_weights_of_another_kind_are_refused(tmp_path, target):
    folder = write_eagle1(tmp_path / "odd", target)
    torch.save({"blocks.0.weight": torch.zeros(2)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"neither an EAGLE-1/2 layer .*blocks\.0\.weight"):
        load_head(folder, target)
    torch.save({"layers.0.mlp.up_proj.weight": torch.zeros(2)}, folder / "pytorch_model.bin")  # no fc
    with pytest.raises(ValueError, match=r"neither an EAGLE-1/2 layer \(fc\.\*, layers\.0\.\*\)"):
        load_head(folder, target)


@pytest.mark.parametrize("layout", ["eagle1", "medusa"])
def test_head_for_another_hidden_size_is_refused(tmp_path, target, layout):
    write = write_eagle1 if layout == "eagle1" else write_medusa
    folder = write(tmp_path / layout, target, hidden=16)
    with pytest.raises(ValueError, match=r"hidden size 16.*has 32"):
        load_head(folder, target)


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors", "medusa_lm_head.safetensors"])
def test_truncated_weights_are_called_corrupt(tmp_path, target, weights):
    if weights.startswith("medusa"):
        folder = write_medusa(tmp_path / "h", target, weights=weights)
    else:
        folder = write_eagle1(tmp_path / "h", target, weights=weights)
    path = folder / weights
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt"):
        load_head(folder, target)


def test_wrong_method_is_refused(tmp_path, target):
    folder = write_medusa(tmp_path / "m", target)
    with pytest.raises(ValueError, match=r"is a medusa head, not a eagle head"):
        load_head(folder, target, method="eagle")


def test_eagle3_needs_three_distinct_target_layers(tmp_path, target, target8):
    folder = write_eagle3(tmp_path / "e3", target)  # 2 layers: 2, 1, -1 are not three inputs
    with pytest.raises(ValueError, match="three distinct target layers"):
        load_head(folder, target)
    # the config may name them (vLLM's key), then any target depth works
    folder = write_eagle3(tmp_path / "e3b", target, extra={"eagle_aux_hidden_state_layer_ids": [2, 0, 1]})
    assert load_head(folder, target).feature_layers == (0, 1, 2)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda w: w["d2t"].__setitem__(-1, w["d2t"][-1] + 100),
            r"the draft vocabulary \(d2t: draft index i is target token i \+ d2t\[i\]\) maps 1 of its "
            r"40 tokens to ids outside this target's vocabulary of 64",
        ),
        (lambda w: w.__setitem__("t2d", w["t2d"][:48]), r"t2d has shape \(48,\), not one flag per target"),
        (
            lambda w: w["t2d"].__setitem__(int(torch.arange(64)[~w["t2d"]][0]), True),
            r"t2d marks 41 target tokens, not the 40 ids d2t maps to",
        ),
    ],
)
def test_eagle3_draft_vocabulary_maps_outside_the_target_are_refused(tmp_path, target8, edit, message):
    """d2t (draft index -> target id) must land in the target's vocabulary and t2d (a flag per target
    token) must mark the same ids: an engine reads one or the other."""
    folder = write_eagle3(tmp_path / "eagle3", target8)
    weights = _raw(folder / "model.safetensors")
    edit(weights)
    save_state(weights, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=rf"Head weights .*model\.safetensors: {message}.*download the head again"
    ):
        load_head(folder, target8)


def test_incomplete_medusa_weights_name_the_missing_heads(tmp_path, target):
    folder = write_medusa(tmp_path / "m", target, heads=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 3}))
    with pytest.raises(ValueError, match=r"missing: blocks\.2\.0\.linear\.bias"):
        load_head(folder, target)


# --- from the Hub -----------------------------------------------------------------------------------


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local Hub; HF_ENDPOINT and HF_HUB_CACHE point at it (read when a head is downloaded)."""
    server = local_hub(tmp_path, monkeypatch)
    yield server
    server.stop()


def test_eagle1_head_from_a_hub_repo(tmp_path, target, hub):
    repo = "yuhuili/EAGLE-Tiny-Test"
    served = hub.add(repo, write_eagle1(tmp_path / "repo", target))
    hostile = ["../../escaped.json", "/tmp/escaped.json", "a\\..\\escaped.json"]  # never fetched
    served.files.update(dict.fromkeys(hostile, b"{}"))

    head = load_head(repo, target, method="eagle")
    assert isinstance(head, EagleHead) and head.fc.bias is not None
    fetched = hub.resolved(repo)
    assert "pytorch_model.bin" in {name for _, name in fetched}
    assert {revision for revision, _ in fetched} == {served.sha}  # one commit, the one listed
    assert not {name for _, name in fetched} & set(hostile)
    assert ("GET", f"/api/models/{repo}") in hub.requests
    assert (tmp_path / "hf-cache" / "models--yuhuili--EAGLE-Tiny-Test").is_dir()  # HF_HUB_CACHE, read now

    input_ids = torch.tensor([[1, 17, 42, 9, 33]])
    plain = target.generate(input_ids=input_ids, do_sample=False, max_new_tokens=12)
    spec = target.generate(
        input_ids=input_ids,
        do_sample=False,
        max_new_tokens=12,
        speculative=dict(method="eagle", draft=repo, num_draft_tokens=3),
    )
    assert_greedy_match(target, plain, spec)


def test_missing_gated_and_private_hub_heads_say_what_to_do(tmp_path, target, hub):
    folder = write_eagle1(tmp_path / "repo", target)
    hub.add("yuhuili/Gated-Head", folder, gated=True)
    hub.add("yuhuili/Private-Head", folder, private=True)
    with pytest.raises(ValueError, match=r"yuhuili/No-Such-Head was not found on the Hub.*private"):
        load_head("yuhuili/No-Such-Head", target)
    with pytest.raises(ValueError, match=r"yuhuili/Gated-Head is gated.*licence.*token"):
        load_head("yuhuili/Gated-Head", target)
    with pytest.raises(ValueError, match=r"yuhuili/Private-Head was not found.*private.*token"):
        load_head("yuhuili/Private-Head", target)


def test_uncached_hub_head_offline_says_so(tmp_path, target, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError, match=r"yuhuili/EAGLE-Tiny-Test is not in the local Hub cache.*offline"):
        load_head("yuhuili/EAGLE-Tiny-Test", target)


# --- draft selection: the registry's published heads (offline) -----------------------------------


def test_select_draft_reports_published_heads_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "specdec"))

    llama = select_draft("meta-llama/Llama-3.1-8B-Instruct")
    assert (llama.method, llama.draft) == ("draft_model", "meta-llama/Llama-3.2-1B-Instruct")  # unchanged
    assert [(h["method"], h["head"], h["layout"]) for h in llama.heads] == [
        ("eagle", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "EAGLE-3")
    ]
    vicuna = select_draft("lmsys/vicuna-7b-v1.3")  # no draft model listed: heads beside a draft-free method
    assert (vicuna.method, vicuna.source) == ("ngram", "offline")
    assert {h["method"]: h["head"] for h in vicuna.heads} == {
        "eagle": "yuhuili/EAGLE-Vicuna-7B-v1.3",
        "medusa": "FasterDecoding/medusa-vicuna-7b-v1.3",
    }
    assert DraftChoice.from_dict(json.loads(json.dumps(vicuna.to_dict()))) == vicuna
    assert [h["head"] for h in known_heads("LMSYS/Vicuna-7B-v1.3", method="medusa")] == [
        "FasterDecoding/medusa-vicuna-7b-v1.3"
    ]
    assert [h["head"] for h in select_draft("Qwen/Qwen3-8B").heads] == [
        "deepseek-ai/dspark_qwen3_8b_block7",
        "z-lab/Qwen3-8B-DFlash-b16",
        "deepseek-ai/dflash_qwen3_8b_block7",
    ]
    assert select_draft("Qwen/Qwen3-32B").heads == []


def test_registry_heads_are_sourced_and_of_a_known_layout():
    from hf_specdec.selection.select import _REPO_ID, _registry_data

    entries = _registry_data()["head"]
    assert entries
    for entry in entries:
        assert entry["source"] and len(entry["targets"]) == 1, entry  # a head fits one target
        methods = {"Medusa": {"medusa"}, "DFlash": {"dflash"}, "DSpark": {"dspark", "dflash"}}
        assert entry["layout"] in {"EAGLE-1/2", "EAGLE-3", *methods}, entry
        assert entry["method"] in methods.get(entry["layout"], {"eagle"}), entry
        assert (entry["method"] in ("dflash", "dspark")) == (int(entry.get("drafts", 0)) > 0), entry
        assert _REPO_ID.match(entry["head"]) and _REPO_ID.match(entry["targets"][0]), entry
