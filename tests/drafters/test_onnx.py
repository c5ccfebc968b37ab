"""The ONNX Runtime drafter, on tiny random Llamas exported once per session (`onnx_dirs`)."""

from __future__ import annotations

import shutil
import sys
import warnings

import pytest
import torch

from hf_specdec.ort import session

from ..conftest import assert_greedy_match, random_batch, tiny_llama

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


@pytest.mark.parametrize("damage", ["truncated", "empty", "random"])
def test_a_damaged_model_file_is_named_with_what_to_do(target, onnx_dirs, tmp_path, damage):
    """A truncated, empty or overwritten model.onnx raised ONNX Runtime's own error (`InvalidProtobuf`:
    "Protobuf parsing failed"), which names no remedy and is no ValueError, so the CLI showed a traceback."""
    import shutil

    folder = tmp_path / damage
    shutil.copytree(onnx_dirs["weak"], folder)
    whole = (folder / "model.onnx").read_bytes()
    damaged = {"truncated": whole[: len(whole) // 2], "empty": b"", "random": bytes(range(256)) * 8}
    (folder / "model.onnx").write_bytes(damaged[damage])
    with pytest.raises(
        ValueError,
        match=r"model.onnx is not a model ONNX Runtime can load .*damaged.*Export the draft again "
        r"\(`hf-specdec export-onnx MODEL ",
    ):
        target.generate(
            input_ids=torch.tensor([[7, 8, 9]]),
            max_new_tokens=4,
            speculative=dict(method="onnx", draft=str(folder)),
        )


def test_vocabulary_mismatch_is_refused(target, onnx_vocab8_draft):
    ids, mask = random_batch(1, 1)
    with pytest.raises(ValueError, match=r"vocabulary has 8 entries but the target's has 64"):
        target.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            speculative=dict(method="onnx", draft=str(onnx_vocab8_draft)),
        )


def test_missing_onnxruntime_names_the_install_command(target, onnx_dirs, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now raises ImportError
    monkeypatch.setattr(session, "_LOADED", {})
    with pytest.raises(ImportError, match=r"need `onnxruntime`: pip install 'hf-specdec\[onnx\]'"):
        target.generate(
            input_ids=torch.tensor([[7, 8, 9]]),
            max_new_tokens=4,
            speculative=dict(method="onnx", draft=str(onnx_dirs["weak"])),
        )


def test_the_target_folders_tokenizer_is_compared_with_the_exports(tmp_path):
    """As `draft_model` does, an ONNX draft is checked token by token against the tokenizer of the
    folder the target was loaded from, without `generate(tokenizer=...)`: no warning that only the
    vocabulary sizes were compared, and an export of another tokenizer of the same size refused."""
    from transformers import AutoModelForCausalLM

    from hf_specdec.ort import export_onnx

    from ..helpers.tokenizers import byte_level_bpe, metaspace_bpe

    tokenizer = byte_level_bpe(300)
    tiny_llama(0, vocab_size=300).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval()
    export_onnx(target, tmp_path / "same", tokenizer=tokenizer, progress=False)
    export_onnx(target, tmp_path / "other", tokenizer=metaspace_bpe(300), progress=False)
    ids = torch.tensor([tokenizer("the fox and the rabbit walked to the river. the fox").input_ids])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.generate(ids, max_new_tokens=4, speculative=dict(method="onnx", draft=str(tmp_path / "same")))
    assert not [w for w in caught if "judged by vocabulary size" in str(w.message)]
    with pytest.raises(ValueError, match="cannot draft for this target"):
        target.generate(ids, max_new_tokens=4, speculative=dict(method="onnx", draft=str(tmp_path / "other")))


def test_an_exports_tokenizer_that_does_not_load_is_named_unless_replaced(target, onnx_dirs, tmp_path):
    """Tokenizer files beside an export that do not load (a truncated tokenizer.json) were read as
    none: the pair was judged by vocabulary size alone. Refused, naming the error; a draft_tokenizer=
    given in its place is used without reading them."""
    from tests.hub_server import tiny_tokenizer

    folder = tmp_path / "export"
    shutil.copytree(onnx_dirs["weak"], folder)
    tokenizer = tiny_tokenizer("A")
    tokenizer.save_pretrained(folder)
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text()[:100])
    ids = torch.tensor([[7, 8, 9]])
    with pytest.raises(
        ValueError, match=r"has tokenizer files that do not load \(JSONDecodeError.*draft_tokenizer="
    ):
        target.generate(ids, max_new_tokens=2, speculative=dict(method="onnx", draft=str(folder)))
    spec = dict(method="onnx", draft=str(folder), draft_tokenizer=tokenizer)
    target.generate(ids, max_new_tokens=2, speculative=spec)
