"""`load_head` given a module: one of our heads is checked against the target; any other module (a
model's own MTP layers, an assistant, a whole model) is refused by what it is, before it is run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.io import save_head

from ..conftest import tiny_llama
from ..helpers import assistant, mtp
from ..helpers.heads import copied_layer_eagle


@pytest.mark.parametrize("method", ["eagle", "medusa", "dflash"])
def test_a_module_that_is_no_head_of_ours_is_refused(method):
    target, layers = mtp.target_and_layers(num_hidden_layers=2, first_k_dense_replace=2)
    for draft in (layers, assistant.pair()[1], tiny_llama(1, vocab_size=mtp.VOCAB)):
        kind = type(draft).__name__
        with pytest.raises(ValueError, match=rf"{kind} is not a {method} head.*method='auto'"):
            target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method=method, draft=draft))


def test_a_head_given_keeps_its_training_mode(tmp_path):
    """A head passed in (one mid-training, say) is not switched to eval for good; one loaded is in eval."""
    target = tiny_llama(0)
    head = copied_layer_eagle(target).train()
    assert load_head(head, target, method="eagle") is head
    assert all(m.training for m in head.modules())
    save_head(head, tmp_path)
    assert not any(m.training for m in load_head(str(tmp_path), target, method="eagle").modules())


def _fetched_beside(beside: Callable[[Path], dict[str, bytes]], tmp_path, monkeypatch) -> tuple[set, set]:
    """An EAGLE head pushed to a local Hub with the files `beside(its folder)` names, loaded by repo
    id: (the files fetched, the head's own files)."""
    from ..helpers.hub import local_hub

    target = tiny_llama(0)
    folder = save_head(copied_layer_eagle(target), tmp_path / "out")
    hub = local_hub(tmp_path, monkeypatch)
    try:
        hub.add("someone/eagle-head", folder)
        hub.push("someone/eagle-head", beside(folder))
        load_head("someone/eagle-head", target, method="eagle")
        return {name for _, name in hub.resolved("someone/eagle-head")}, {p.name for p in folder.iterdir()}
    finally:
        hub.stop()


def test_a_hub_repo_of_a_whole_train_draft_folder_downloads_the_head_alone(tmp_path, monkeypatch):
    """`train-draft --out DIR` writes the head beside its training data and checkpoint (`data/`,
    `checkpoint/`); with DIR pushed to the Hub as it is, `draft="user/head"` downloaded them all, the
    target's features of every training token (gigabytes for a large target), unread."""

    def training(folder: Path) -> dict[str, bytes]:
        copies = {f"checkpoint/{path.name}": path.read_bytes() for path in folder.iterdir()}
        return copies | {"data/features.pt": b"0" * 64, "checkpoint/trainer_state.pt": b"0" * 64}

    fetched, head_files = _fetched_beside(training, tmp_path, monkeypatch)
    assert fetched == head_files


def test_a_hub_repo_of_a_trainers_output_downloads_the_head_alone(tmp_path, monkeypatch):
    """A head pushed with its trainer's output beside it (HF Trainer writes `optimizer.pt`, twice the
    head's size, `scheduler.pt` and `training_args.bin` at the top level): every top-level `.pt` and
    `.bin` was downloaded, unread. Only the pickled weights a layout reads are fetched."""
    trainer = dict.fromkeys(["optimizer.pt", "scheduler.pt", "training_args.bin", "rng_state.pt"], b"0" * 64)
    fetched, head_files = _fetched_beside(lambda folder: trainer, tmp_path, monkeypatch)
    assert fetched == head_files
