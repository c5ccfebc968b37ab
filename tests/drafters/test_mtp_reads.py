"""What a target's own MTP layers cost the calls after the first: their checkpoint is read once per
model (the layers, or why they do not load), and again only once its files changed or
`clear_cache()` forgot it. Counted on the files themselves (`mtp.count_reads`: every opening of
a file in the checkpoint's folder, every weight read out of one), in checkpoints of one file and of
several shards with their index."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_specdec import clear_cache
from hf_specdec.drafters.mtp import RememberedFailure
from hf_specdec.selection.method import DRAFT_FREE_AUTO

from ..conftest import assert_greedy_match
from ..helpers import mtp


def load(folder):
    return mtp.model_class("glm4_moe").from_pretrained(folder).eval()


def speculate(target, **speculative):
    """`target` run speculatively on one prompt; with the warnings it gave that pass its own MTP
    layers over."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(
            **mtp.prompts(1),
            max_new_tokens=4,
            do_sample=False,
            speculative=speculative or True,
            return_dict_in_generate=True,
        )
    return out, [str(w.message) for w in caught if "Choosing another draft" in str(w.message)]


@pytest.mark.parametrize("shards", [1, 3], ids=["one-file", "three-shards"])
def test_a_second_call_reads_nothing_of_the_checkpoint(tmp_path, monkeypatch, shards):
    folder = mtp.checkpoint(tmp_path, "glm4_moe", shards=shards)
    assert (len(list(folder.glob("*.safetensors"))) > 1) == (shards > 1)
    target = load(folder)
    reads = mtp.count_reads(monkeypatch, folder)
    first, _ = speculate(target)
    assert first.speculative_stats.method == "mtp"
    assert any(what == "weight" for what, _ in reads)  # the layers, read to draft with
    reads.clear()
    second, _ = speculate(target)
    assert second.speculative_stats.method == "mtp" and not reads
    assert second.speculative_stats.selection == first.speculative_stats.selection
    speculate(target, method="mtp")
    assert not reads
    plain = target.generate(**mtp.prompts(1), max_new_tokens=4, do_sample=False)
    assert_greedy_match(target, plain, second.sequences, mtp.prompts(1)["attention_mask"])


def test_a_checkpoint_changed_since_is_read_again(tmp_path):
    """The layers loaded; then the checkpoint's MTP layer is rewritten misshapen: the next call reads
    it again and passes it over, saying why."""
    folder = mtp.checkpoint(tmp_path, "glm4_moe")
    target = load(folder)
    assert speculate(target)[0].speculative_stats.method == "mtp"
    mtp.damage(folder, "misshapen")
    out, said = speculate(target)
    assert out.speculative_stats.method == DRAFT_FREE_AUTO and len(said) == 1


def test_layers_that_do_not_load_are_not_read_again(tmp_path, monkeypatch):
    """Said once and read once per model and checkpoint: a later call passes them over reading nothing
    and warning nothing (its selection still says why), method='mtp' raises the same reason; after
    `clear_cache()`, or once the checkpoint changed (here: repaired), they are read again."""
    folder = mtp.checkpoint(tmp_path, "glm4_moe")
    good = (folder / "model.safetensors").read_bytes()
    mtp.damage(folder, "misshapen")
    target = load(folder)
    reads = mtp.count_reads(monkeypatch, folder)
    out, said = speculate(target)
    assert out.speculative_stats.method == DRAFT_FREE_AUTO and len(said) == 1 and reads
    reads.clear()
    out, said = speculate(target)
    assert (out.speculative_stats.method, said, reads) == (DRAFT_FREE_AUTO, [], {})
    assert "own MTP layers are not used" in out.speculative_stats.selection
    with pytest.raises(RememberedFailure, match=r"eh_proj.*MISMATCH.*earlier call.*clear_cache\(\)"):
        speculate(target, method="mtp")
    assert not reads

    clear_cache()
    assert len(speculate(target)[1]) == 1 and reads
    (folder / "model.safetensors").write_bytes(good)
    out, said = speculate(target)
    assert out.speculative_stats.method == "mtp" and said == []


def test_running_out_of_memory_is_not_remembered_as_layers_that_do_not_load(tmp_path, monkeypatch):
    """The device's state is no property of the checkpoint: an out-of-memory error while reading the
    layers is raised as it is, and the next call reads them again (and loads them)."""
    from transformers.modeling_layers import MtpModel

    from hf_specdec.drafters.mtp import layers_for

    target = load(mtp.checkpoint(tmp_path, "glm4_moe"))
    real = MtpModel.from_pretrained.__func__

    def out_of_memory(cls, *args, **kwargs):
        monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(real))  # once
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(out_of_memory))
    with pytest.raises(torch.OutOfMemoryError):
        layers_for(target)
    assert layers_for(target) is not None


def test_a_config_mended_in_place_is_read_again(tmp_path):
    """The MTP layer count the config declares is part of what a failure depended on: a config
    that promised more layers than the checkpoint holds, mended in place, loads its layers."""
    target = load(mtp.checkpoint(tmp_path, "glm4_moe"))
    config = target.config.get_text_config()
    declared, config.num_mtp_layers = config.num_mtp_layers, config.num_mtp_layers + 1
    out, said = speculate(target)
    assert out.speculative_stats.method == DRAFT_FREE_AUTO and len(said) == 1
    config.num_mtp_layers = declared
    assert speculate(target)[0].speculative_stats.method == "mtp"
