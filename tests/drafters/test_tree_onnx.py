"""ONNX Runtime trees (`onnx`, `quantized`), grown both ways: a level per forward under our
exports' `tree_attention_mask`, and, for graphs without it (the Hub's), each node in a batch row of
its own (`decoder.BranchRows`). Lossless for greedy, and the trees the PyTorch draft grows."""

from __future__ import annotations

import shutil

import pytest
import torch

from hf_specdec.core.kv import RaggedKV
from hf_specdec.drafters.decoder import DecoderDrafter
from hf_specdec.ort.kv import OrtKV

from ..conftest import assert_greedy_match, random_batch
from ..helpers.sampling import ALPHA, SETTINGS, chi2_pvalue, exact_distribution
from ..helpers.trees import BRANCHING_PROMPT, sample_trees

CASES = [  # (drafter, draft folder, batch size, max_tree_nodes)
    ("onnx", "good", 1, None),
    ("onnx", "good", 3, 5),
    ("onnx", "weak", 1, 5),  # mostly rejected: what a tree fed goes again every step
    ("onnx", "weak", 4, None),
    ("onnx", "weak-hub", 2, None),
    ("quantized", None, 1, None),
    ("quantized", None, 3, None),
]
WAYS = ["masks", "rows"]  # rows: as for a graph without `tree_attention_mask`


def _grow_by(way: str, monkeypatch) -> None:
    if way == "rows":
        monkeypatch.setattr(OrtKV, "takes_tree_masks", False)


def _spy_drafts(monkeypatch) -> list[tuple]:
    """(draft, accepted) of every step, as the drafter observed them."""
    steps = []
    observe = DecoderDrafter.observe

    def spy(self, draft, accepted):
        steps.append((draft, accepted))
        observe(self, draft, accepted)

    monkeypatch.setattr(DecoderDrafter, "observe", spy)
    return steps


def _generate(model, batch: int, seed: int, **spec):
    input_ids, attention_mask = random_batch(seed, batch)  # left-padded when batch > 1
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
    plain = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative=dict(num_draft_tokens=6, **spec), return_dict_in_generate=True)
    return plain, out, attention_mask


def _branched(steps: list[tuple]) -> bool:
    """Some step drafted a tree with more nodes than its depth: two nodes shared a parent."""
    return any(
        len(set(draft.parents[b, :n].tolist())) < n for draft, _ in steps for b, n in enumerate(draft.lengths)
    )


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory, target_int8):
    """A cache of this module's own holding `target`'s int8 copy, so `quantized` finds it whatever
    ran before (`test_quantized` expects to be the first to build into the shared one)."""
    root = tmp_path_factory.mktemp("cache")
    shutil.copytree(target_int8, root / "onnx" / target_int8.name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_SPECDEC_CACHE", str(root))
        yield


@pytest.mark.filterwarnings("error:Building an int8 ONNX copy")  # `private_cache` holds it
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("method,name,batch,max_tree_nodes", CASES)
def test_greedy_tree_matches_plain_greedy(
    target, onnx_dirs, private_cache, method, name, batch, max_tree_nodes, way, monkeypatch
):
    _grow_by(way, monkeypatch)
    steps = _spy_drafts(monkeypatch)
    draft = {} if name is None else {"draft": str(onnx_dirs[name])}
    spec = dict(method=method, tree=True, max_tree_nodes=max_tree_nodes, **draft)
    plain, out, mask = _generate(target, batch, batch, **spec)
    assert_greedy_match(target, plain, out.sequences, mask)
    assert out.speculative_stats.method == method
    assert _branched(steps)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("batch,seed", [(1, 0), (3, 1)])
def test_onnx_grows_the_trees_the_pytorch_draft_grows(
    target, good_draft, onnx_dirs, batch, seed, way, monkeypatch
):
    """The exported draft's trees are the PyTorch draft's, node for node, grown either way (fp32 on
    both sides, where no top-k ranking is near a tie)."""
    _grow_by(way, monkeypatch)
    trees = []
    for draft in (good_draft, str(onnx_dirs["good"])):
        method = "draft_model" if isinstance(draft, torch.nn.Module) else "onnx"
        steps = _spy_drafts(monkeypatch)
        _generate(target, batch, seed, method=method, draft=draft, tree=True)
        trees.append([(d.tokens.tolist(), d.parents.tolist(), accepted) for d, accepted in steps])
    assert trees[0] == trees[1]
    assert _branched(steps)


def test_branch_rows_on_a_pytorch_cache_match_its_tree_masks(target, good_draft, monkeypatch):
    """`BranchRows` only needs a cache's rows: on a PyTorch cache it grows the trees that cache's
    own tree masks grow."""
    trees = []
    for masks in (True, False):
        monkeypatch.setattr(RaggedKV, "takes_tree_masks", masks)
        steps = _spy_drafts(monkeypatch)
        plain, out, mask = _generate(target, 3, 2, method="draft_model", draft=good_draft, tree=True)
        assert_greedy_match(target, plain, out.sequences, mask)
        trees.append([(d.tokens.tolist(), d.parents.tolist(), accepted) for d, accepted in steps])
    assert trees[0] == trees[1]


@pytest.fixture(scope="module")
def sampling_onnx(onnx_vocab8_draft):
    """The vocabulary-8 pair of the draft-model tree sampling tests, its draft cut to one layer and
    exported (`onnx_vocab8_draft`)."""
    from ..conftest import tiny_llama

    return tiny_llama(20, vocab_size=8, eos_token_id=None), onnx_vocab8_draft


@pytest.mark.parametrize("way", WAYS)
def test_tree_samples_follow_target_distribution(sampling_onnx, way, monkeypatch):
    """Sampling with ONNX trees keeps the target's distribution (exact enumeration, chi-square)."""
    _grow_by(way, monkeypatch)
    target, folder = sampling_onnx
    spec = dict(method="onnx", draft=str(folder), num_draft_tokens=4, tree=True, options=dict(tree_top_k=2))
    exact = exact_distribution(target, SETTINGS["temp"], BRANCHING_PROMPT)
    samples = sample_trees(target, SETTINGS["temp"], 42, monkeypatch, spec=spec)
    assert chi2_pvalue(samples, exact) > ALPHA
