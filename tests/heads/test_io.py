"""Writing a head to a folder (`save_head`) and what loading checks in it before the head runs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save_file as real_save_file

from hf_specdec.heads import io
from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.io import WEIGHTS_NAME, check_saved_head, save_head

from ..conftest import tiny_llama
from ..helpers.heads import copied_layer_eagle


def test_two_saves_into_one_folder_at_once_both_finish(tmp_path, monkeypatch):
    """Each save writes its weights through a temporary file of its own before renaming it: with one
    shared temporary name, the second save overwrote the first's temporary file, and whichever
    renamed it second found it gone (FileNotFoundError)."""
    target = tiny_llama(30, layers=1)
    head = copied_layer_eagle(target, torch.arange(4, 64))
    temporaries: list[str] = []
    both_written = threading.Barrier(2, timeout=30)

    def save_file(state, path, metadata=None):
        real_save_file(state, path, metadata=metadata)
        temporaries.append(path)
        both_written.wait()  # both temporary files are written before either is renamed

    monkeypatch.setattr(io, "save_file", save_file)
    folder = tmp_path / "head"
    with ThreadPoolExecutor(2) as pool:
        saved = list(pool.map(lambda _: save_head(head, folder), range(2)))
    assert saved == [folder, folder] and len(set(temporaries)) == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["head_config.json", WEIGHTS_NAME, "hf_specdec_manifest.json"]
    )  # no temporary file left behind
    check_saved_head(folder)
    loaded = load_head(folder, target, method="eagle")
    assert torch.equal(loaded.draft_vocab.cpu(), head.draft_vocab.cpu())
