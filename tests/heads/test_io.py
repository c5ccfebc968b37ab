"""Writing a head to a folder (`save_head`) and what loading checks in it before the head runs."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file as real_save_file

from hf_specdec.heads import io
from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.io import WEIGHTS_NAME, check_saved_head, save_head

from ..conftest import random_batch, tiny_llama
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


@pytest.mark.parametrize(
    "last_id, problem",
    [
        (70, r"maps 1 of its 60 tokens to ids outside this target's vocabulary of 64 \(0\.\.63\): 70"),
        (-1, r"maps 1 of its 60 tokens to ids outside this target's vocabulary of 64 \(0\.\.63\): -1"),
        (4, r"gives 1 of its 60 tokens an id another one already has"),
    ],
)
def test_a_saved_draft_vocabulary_outside_the_targets_is_refused_at_load(tmp_path, last_id, problem):
    """A head whose draft ids (`draft_vocab`) are not distinct ids of the target's vocabulary is
    refused when it is loaded, naming the file and what to do: one out of range failed the first
    draft step with `IndexError: index 70 is out of bounds for dimension 0 with size 64`."""
    target = tiny_llama(30, layers=1)
    head = copied_layer_eagle(target, torch.arange(4, 64))
    head.draft_vocab[-1] = last_id
    folder = save_head(head, tmp_path / "head")
    message = rf"Head weights {re.escape(str(folder / WEIGHTS_NAME))}: the draft vocabulary \(draft_vocab\) "
    ids, mask = random_batch(seed=1, batch=1)
    with pytest.raises(ValueError, match=message + problem + r"\..*hf-specdec train-draft --target"):
        target.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            speculative=dict(method="eagle", draft=str(folder)),
        )


def test_a_head_of_another_target_is_refused_naming_this_one_where_it_has_no_path(tmp_path):
    """A target built in memory has an empty `name_or_path`: the message named it as "()"."""
    head = copied_layer_eagle(tiny_llama(30, layers=1), torch.arange(4, 64))
    folder = save_head(head, tmp_path / "head")
    other = tiny_llama(30, vocab_size=80, layers=1)
    assert not other.name_or_path
    ids, mask = random_batch(seed=1, batch=1)
    with pytest.raises(ValueError, match=r"but this target \(LlamaForCausalLM\) has 80\."):
        other.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=2,
            speculative=dict(method="eagle", draft=str(folder)),
        )
