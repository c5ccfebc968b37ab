"""Exporting block drafts: vLLM's `dflash` / `dspark` methods and SGLang's DFLASH / DSPARK, whole
blocks as the draft length; ours written in z-lab's DFlash layout, which our loader reads back to
the same drafts; a published draft for another target refused."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.io import save_head
from hf_specdec.serving import ServingExportError, export_serving

from ..conftest import tiny_llama
from ..helpers.block_drafts import random_block_draft, write_dspark
from .test_engines import SGLANG_FLAGS, _sglang_flags_module

PUBLISHED = {
    "dspark": ("Qwen/Qwen3-8B", "deepseek-ai/dspark_qwen3_8b_block7", 7),
    "dflash": ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", 15),
}


@pytest.mark.parametrize("method", list(PUBLISHED))
def test_published_block_drafts_are_served_whole(method):
    target, draft, drafts = PUBLISHED[method]
    vllm = export_serving(target, "vllm", draft=draft)
    assert vllm["speculative_config"] == {"method": method, "model": draft, "num_speculative_tokens": drafts}
    sglang = export_serving(target, "sglang", draft=draft)
    command = " ".join(sglang["command"])
    if method == "dspark":
        assert (
            "--speculative-algorithm DSPARK" in command
            and f"--speculative-dspark-block-size {drafts}" in command
        )
    else:
        assert (
            "--speculative-algorithm DFLASH" in command
            and f"--speculative-num-draft-tokens {drafts + 1}" in command
        )
    assert "--speculative-num-steps" not in command
    accepted = json.loads(SGLANG_FLAGS.read_text())
    assert _sglang_flags_module().check_command(sglang["command"], accepted) == []


def test_no_method_exports_the_block_draft_speculative_true_picks():
    result = export_serving("Qwen/Qwen3-8B", "vllm")
    assert (result["method"], result["draft"]) == ("dspark", "deepseek-ai/dspark_qwen3_8b_block7")


def test_a_published_block_draft_for_another_target_is_refused():
    with pytest.raises(ServingExportError, match=r"trained for Qwen/Qwen3-8B, not for Qwen/Qwen3-4B"):
        export_serving("Qwen/Qwen3-4B", "vllm", draft="z-lab/Qwen3-8B-DFlash-b16")


def test_ours_is_written_in_zlab_layout_and_reads_back_the_same(models, tmp_path):
    target = tiny_llama(0)
    draft = random_block_draft(target, (0, 1), block_size=5)
    save_head(draft, tmp_path / "ours")
    result = export_serving(
        str(models / "target"), "vllm", draft=str(tmp_path / "ours"), out=tmp_path / "out"
    )
    assert result["speculative_config"]["method"] == "dflash" and result["num_draft_tokens"] == 4
    written = tmp_path / "out" / "draft-head"
    config = json.loads((written / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"][
        "target_layer_ids"
    ] == [0, 1]
    reread = load_head(written, target, method="dflash")
    assert reread.config.layout == "DFlash (z-lab)"
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, reread.state_dict()[name]), name


def test_a_dspark_folder_is_served_as_it_is(models, tmp_path):
    folder = write_dspark(tmp_path / "dspark", tiny_llama(0))
    result = export_serving(str(models / "target"), "sglang", draft=str(folder))
    assert result["method"] == "dspark" and result["draft"] == str(folder) and result["num_draft_tokens"] == 4
