"""The IO-bound KV cache of an ONNX decoder against `RaggedKV`, and logits kept per position."""

from __future__ import annotations

import torch

from hf_specdec.core.kv import RaggedKV
from hf_specdec.ort import kv as ort_kv_module
from hf_specdec.ort.export import _export
from hf_specdec.ort.kv import OrtKV
from hf_specdec.ort.session import OnnxDecoder


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
    # Rows copied and reordered, batch size unchanged, as tree drafts do (a row per node).
    for kv in (ort_kv, torch_kv):
        kv.select_rows(torch.tensor([1, 1]))
    both(torch.randint(6, 64, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.bool))
    for kv in (ort_kv, torch_kv):
        kv.select_rows(torch.tensor([1, 0, 0]))
    both(torch.randint(6, 64, (3, 2), generator=g), torch.ones(3, 2, dtype=torch.bool))
    # The same tokens a row; RaggedKV compacts its holes away (`HOLES_BOUND`), the ONNX cache keeps them.
    assert torch.equal(ort_kv.lengths, torch_kv.lengths)
    assert torch_kv.compactions > 0 and torch_kv.width < ort_kv.width


def test_a_long_forward_runs_in_chunks_with_the_same_logits(onnx_dirs, weak_draft, monkeypatch):
    """One session run over a whole prompt materializes its [heads, new, past + new] attention scores
    and mask, quadratic in the prompt's length: a 4000-token prompt's int8 draft prefill took 7.7x
    the target's own and GBs of memory. A long forward is fed in chunks, to the same logits."""
    monkeypatch.setattr(ort_kv_module, "PREFILL_CHUNK", 64)
    fed: list[int] = []
    bind = OrtKV._bind

    def recording(self, name, tensor, output):
        if name == "input_ids":
            fed.append(tensor.shape[1])
        return bind(self, name, tensor, output)

    monkeypatch.setattr(OrtKV, "_bind", recording)
    ort_kv = OrtKV(OnnxDecoder.load(onnx_dirs["weak"]), 2)
    torch_kv = RaggedKV(weak_draft, None, 2, torch.device("cpu"))
    tokens = torch.randint(6, 64, (2, 200), generator=torch.Generator().manual_seed(4))
    valid = torch.ones(2, 200, dtype=torch.bool)
    valid[0, :90] = False  # a left-padded row: chunks of only holes too
    for step, step_valid in ((tokens, valid), (tokens[:, :1], valid[:, -1:])):
        got = ort_kv.forward(step, step_valid, logits_to_keep=1).logits
        with torch.no_grad():
            expected = torch_kv.forward(step, step_valid).logits[:, -1:]
        assert torch.allclose(got, expected, atol=1e-4), float((got - expected).abs().max())
    assert fed == [64, 64, 8, 64, 1]


def test_only_the_logits_asked_for_are_computed(onnx_dirs, weak_draft, tmp_path):
    """Our exports take `num_logits_to_keep`; Hub-layout graphs without it still work (all logits)."""
    plain = tmp_path / "plain"
    plain.mkdir()
    _export(weak_draft, plain / "model.onnx", tree_mask=False)  # the Hub layout, none of our inputs
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


def test_kv_buffers_grow_to_what_the_cache_holds(onnx_dirs):
    """A buffer grows to the KV it must hold (at most twice that), counted in elements: the tree
    drafts' row copies grow them often, and on a GPU an oversized buffer is real memory."""
    decoder = OnnxDecoder.load(onnx_dirs["weak"])
    kv = OrtKV(decoder, 1)
    kv.forward(torch.randint(6, 64, (1, 100)), torch.ones(1, 100, dtype=torch.bool))
    kv.select_rows(torch.tensor([0, 0, 0, 0]))
    needed = 4 * decoder.kv_heads * 100 * decoder.head_dim
    assert all(needed <= pair[kv.current].numel() <= 2 * needed for pair in kv.buffers)


def test_ort_kv_takes_tree_masks_as_ragged_kv_does(onnx_dirs, weak_draft):
    """Our exports' `tree_attention_mask`: a tree level fed after a level before it, each node
    seeing only its ancestors, gives PyTorch's logits under `RaggedKV`'s tree masks."""
    decoder = OnnxDecoder.load(onnx_dirs["weak"])
    assert decoder.has_tree_mask
    ort_kv, torch_kv = OrtKV(decoder, 2), RaggedKV(weak_draft, None, 2, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(6, 64, (2, 6), generator=g)
    prompt_valid = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6], dtype=torch.bool)  # a left-padded row
    levels = [  # (tokens, valid, visible over the tree columns so far, depths)
        (torch.randint(6, 64, (2, 2), generator=g), torch.tensor([[1, 1], [1, 0]]), [[1, 0], [0, 1]], [0, 0]),
        (
            torch.randint(6, 64, (2, 3), generator=g),
            torch.ones(2, 3),
            [[1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [0, 1, 0, 0, 1]],
            [-1, -1, -1],
        ),
    ]
    with torch.no_grad():
        torch_kv.forward(prompt, prompt_valid)
    ort_kv.forward(prompt, prompt_valid)
    for tokens, valid, visible, depths in levels:
        valid = valid.bool()
        tree = (
            torch.tensor(visible, dtype=torch.bool)[None].repeat(2, 1, 1),
            torch.tensor(depths)[None].repeat(2, 1),
        )
        with torch.no_grad():
            expected = torch_kv.forward(tokens, valid, tree=tree).logits
        got = ort_kv.forward(tokens, valid, tree=tree).logits
        assert torch.allclose(got[valid], expected[valid], atol=1e-4), float(
            (got - expected)[valid].abs().max()
        )
