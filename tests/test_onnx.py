"""The ONNX Runtime drafter and the exporter, on tiny random Llamas exported once per session."""

from __future__ import annotations

import shutil
import sys
import warnings

import pytest
import torch

from hf_specdec import cli
from hf_specdec.drafters.onnx import OnnxDecoder, OrtKV
from hf_specdec.kv import RaggedKV
from hf_specdec.onnx import export_onnx, export_onnx_report

from .conftest import assert_greedy_match, random_batch, tiny_llama


@pytest.fixture(scope="session")
def onnx_dirs(tmp_path_factory, good_draft, weak_draft):
    """Exported drafts: `good` through the CLI from a saved folder, `weak` by the API, also copied
    into the onnx-community layout (`onnx/model.onnx`, config beside the folder)."""
    root = tmp_path_factory.mktemp("onnx")
    good_draft.save_pretrained(root / "good-hf")
    assert cli.main(["export-onnx", str(root / "good-hf"), str(root / "good"), "--quiet"]) == 0
    export_onnx(weak_draft, root / "weak", progress=False)
    (root / "weak-hub" / "onnx").mkdir(parents=True)
    shutil.copy(root / "weak" / "model.onnx", root / "weak-hub" / "onnx" / "model.onnx")
    shutil.copy(root / "weak" / "config.json", root / "weak-hub" / "config.json")
    return {name: root / name for name in ("good", "good-hf", "weak", "weak-hub")}


@pytest.fixture(scope="session")
def quantized_cache(tmp_path_factory):
    """A private hf-specdec cache, so `method="quantized"` exports into it."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_SPECDEC_CACHE", str(root))
        yield root


def test_export_writes_hub_layout_and_matches_pytorch(onnx_dirs, weak_draft, tmp_path):
    folder = onnx_dirs["good"]
    assert {"model.onnx", "config.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    names = {i.name for i in OnnxDecoder.load(folder).session.get_inputs()}
    assert {"input_ids", "attention_mask", "position_ids", "past_key_values.1.value"} <= names
    report = export_onnx_report(weak_draft, tmp_path / "again", progress=False)
    assert report.max_abs_diff < report.tolerance <= 1e-2


def test_ort_kv_follows_ragged_kv_through_holes_and_row_drops(onnx_dirs, weak_draft):
    """Same feeds, truncations and row selections: the ONNX cache gives PyTorch's logits."""
    ort_kv = OrtKV(OnnxDecoder.load(onnx_dirs["weak"]), 3)
    torch_kv = RaggedKV(weak_draft, None, 3, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)

    def both(tokens, valid):
        with torch.no_grad():
            expected = torch_kv.forward(tokens, valid).logits
        got = ort_kv.forward(tokens, valid).logits
        real = valid.bool()  # a hole's own logits are meaningless (its query attends to nothing real)
        assert torch.allclose(got[real], expected[real], atol=1e-4), float((got - expected)[real].abs().max())

    both(
        torch.randint(6, 64, (3, 6), generator=g),
        torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 1, 1, 1, 1, 1]], dtype=torch.bool),
    )
    both(torch.randint(6, 64, (3, 4), generator=g), torch.ones(3, 4, dtype=torch.bool))
    for kv in (ort_kv, torch_kv):
        kv.truncate(torch.tensor([5, 8, 9]))  # holes in the middle of rows 0 and 1
    both(
        torch.randint(6, 64, (3, 3), generator=g),
        torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool),
    )
    for kv in (ort_kv, torch_kv):
        kv.select_rows(torch.tensor([2, 0]))
    both(torch.randint(6, 64, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.bool))
    assert torch.equal(ort_kv.mask, torch_kv.mask)


def test_only_the_logits_asked_for_are_computed(onnx_dirs, weak_draft, tmp_path):
    """Our exports take `num_logits_to_keep`; Hub-layout graphs without it still work (all logits)."""
    from hf_specdec.onnx import _export

    plain = tmp_path / "plain"
    plain.mkdir()
    _export(weak_draft, plain / "model.onnx")  # the graph before the input is added
    weak_draft.config.save_pretrained(plain)
    ours, theirs = OnnxDecoder.load(onnx_dirs["weak"]), OnnxDecoder.load(plain)
    assert ours.has_logits_to_keep and not theirs.has_logits_to_keep
    tokens = torch.randint(6, 64, (2, 5), generator=torch.Generator().manual_seed(3))
    valid = torch.tensor([[0, 1, 1, 1, 1], [1] * 5], dtype=torch.bool)
    every = OrtKV(ours, 2).forward(tokens, valid).logits
    last = OrtKV(ours, 2).forward(tokens, valid, logits_to_keep=1).logits
    reference = OrtKV(theirs, 2).forward(tokens, valid, logits_to_keep=1).logits
    assert every.shape == (2, 5, 64) and last.shape == reference.shape == (2, 1, 64)
    assert torch.equal(last, every[:, -1:])
    assert torch.allclose(last, reference, atol=1e-5)


GREEDY_CASES = [  # (draft folder, batch size, draft length)
    ("good", 1, 4),
    ("good", 3, "auto"),
    ("weak", 1, 3),  # mostly rejected: exercises rollback
    ("weak", 4, 5),
    ("weak-hub", 2, 4),
    ("good-hf", 1, 4),  # a PyTorch folder, for comparison: must agree with the ONNX one
]


@pytest.mark.parametrize("name,batch,k", GREEDY_CASES)
def test_greedy_identical_to_plain_generate(target, onnx_dirs, name, batch, k):
    ids, mask = random_batch(batch, batch)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    plain = target.generate(**kwargs)
    method = "draft_model" if name.endswith("-hf") else "onnx"
    spec = target.generate(
        **kwargs,
        speculative=dict(method=method, draft=str(onnx_dirs[name]), num_draft_tokens=k),
        return_dict_in_generate=True,
    )
    assert_greedy_match(target, plain, spec.sequences, mask)
    assert spec.speculative_stats.method == method


def test_onnx_drafts_what_the_pytorch_draft_drafts(target, good_draft, onnx_dirs):
    ids, mask = random_batch(7, 3)
    stats = []
    for draft in (good_draft, str(onnx_dirs["good"])):
        out = target.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=24,
            do_sample=False,
            speculative=dict(method="draft_model", draft=draft, num_draft_tokens=4),
            return_dict_in_generate=True,
        )
        s = out.speculative_stats
        stats.append((s.target_forwards, s.acceptance_rate))
    assert stats[0] == stats[1]  # an ONNX folder routes to the ONNX drafter and drafts the same
    assert stats[1][1] > 0.3


def test_stops_at_eos_like_plain_generate(target, onnx_dirs):
    ids, mask = random_batch(3, 2)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    eos = int(plain[0, ids.shape[1] + 6])  # a token row 0 emits mid-way becomes its EOS
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    plain = target.generate(**kwargs, pad_token_id=0)
    spec = target.generate(
        **kwargs, pad_token_id=0, speculative=dict(method="onnx", draft=str(onnx_dirs["good"]))
    )
    assert (plain[0, ids.shape[1] + 7 :] == 0).all()  # row 0 stopped at its EOS, row 1 went on
    assert_greedy_match(target, plain, spec, mask)


def test_sampling_runs_and_returns_draft_distributions(target, onnx_dirs):
    ids, mask = random_batch(5, 2)
    torch.manual_seed(0)
    out = target.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=True,
        temperature=0.8,
        top_k=20,
        speculative=dict(method="onnx", draft=str(onnx_dirs["good"]), num_draft_tokens=4),
        return_dict_in_generate=True,
    )
    new = out.sequences[:, ids.shape[1] :]
    assert new.shape[1] > 0 and int(new.max()) < 64
    assert out.speculative_stats.acceptance_rate > 0.2


def test_quantized_self_drafting(target, quantized_cache):
    ids, mask = random_batch(2, 2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    plain = target.generate(**kwargs)
    with pytest.warns(UserWarning, match="Building an int8 ONNX copy"):
        spec = target.generate(
            **kwargs, speculative=dict(method="quantized", num_draft_tokens=4), return_dict_in_generate=True
        )
    assert_greedy_match(target, plain, spec.sequences, mask)
    assert spec.speculative_stats.acceptance_rate > 0.6  # int8 in blocks of 32 still mostly agrees
    folders = list((quantized_cache / "onnx").iterdir())
    assert [f.name for f in folders] == ["LlamaForCausalLM-int8"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # cached: no rebuild the second time
        target.generate(**kwargs, speculative="quantized")


def test_cuda_request_without_gpu_falls_back_to_cpu(target, onnx_dirs):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    ids, mask = random_batch(1, 1)
    speculative = dict(method="onnx", draft=str(onnx_dirs["weak"]), options=dict(provider="cuda"))
    with pytest.warns(UserWarning, match="CUDAExecutionProvider was requested but is unavailable"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, speculative=speculative)


def _no_past_model(folder):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)],
        "no_past",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq"])],
    )
    folder.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "model.onnx")
    return folder


def test_bad_folders_say_what_is_wrong(target, tmp_path):
    ids, mask = random_batch(1, 1)

    def generate(folder, method="onnx"):
        target.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            speculative=dict(method=method, draft=str(folder)),
        )

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No ONNX decoder in .*model.onnx or onnx/model.onnx"):
        generate(tmp_path / "empty")
    with pytest.raises(
        ValueError, match=r"Missing inputs: attention_mask, past_key_values.0.key.*outputs: present"
    ):
        generate(_no_past_model(tmp_path / "no_past"))
    with pytest.raises(ValueError, match=r"needs draft= a folder exported with"):
        target.generate(input_ids=ids, max_new_tokens=4, speculative="onnx")


def test_vocabulary_mismatch_is_refused(target, tmp_path):
    export_onnx(tiny_llama(3, vocab_size=48), tmp_path / "small", progress=False)
    ids, mask = random_batch(1, 1)
    with pytest.raises(ValueError, match=r"vocabulary has 48 entries but the target's has 64"):
        target.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            speculative=dict(method="onnx", draft=str(tmp_path / "small")),
        )


def test_missing_onnxruntime_names_the_install_command(target, onnx_dirs, monkeypatch):
    from hf_specdec.drafters import onnx as onnx_drafter

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now raises ImportError
    monkeypatch.setattr(onnx_drafter, "_LOADED", {})
    with pytest.raises(ImportError, match=r"need `onnxruntime`: pip install 'hf-specdec\[onnx\]'"):
        target.generate(
            input_ids=torch.tensor([[7, 8, 9]]),
            max_new_tokens=4,
            speculative=dict(method="onnx", draft=str(onnx_dirs["weak"])),
        )
