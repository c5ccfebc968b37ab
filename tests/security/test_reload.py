"""Reloading our modules (what notebook autoreload does), install / uninstall / install, and two threads
generating on two models at once: every `generate` in the process keeps working, with and without
`speculative=`."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from transformers import TextGenerationPipeline
from transformers.generation.continuous_batching import ContinuousMixin
from transformers.generation.utils import GenerationMixin

import hf_specdec
import hf_specdec.integration
from hf_specdec.integration import (
    _ORIGINAL_GENERATE,
    _ORIGINAL_GENERATE_BATCH,
    _ORIGINAL_PIPELINE_FORWARD,
    _ORIGINAL_PIPELINE_POSTPROCESS,
)

from ..conftest import child_env, random_batch, tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def _outputs(target, draft) -> list[torch.Tensor]:
    """Plain, ngram and draft-model greedy outputs of one ragged batch."""
    input_ids, attention_mask = random_batch(7, 3)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    return [
        target.generate(**kwargs),
        target.generate(**kwargs, speculative="ngram"),
        target.generate(**kwargs, speculative=dict(method="draft_model", draft=draft, num_draft_tokens=3)),
    ]


@pytest.fixture
def restore_install():
    yield
    hf_specdec.install()
    assert GenerationMixin.generate.__wrapped__ is _ORIGINAL_GENERATE


@pytest.mark.parametrize("module", ["hf_specdec.integration", "hf_specdec"])
def test_reloading_keeps_every_generate_working(module, target, weak_draft, restore_install):
    before = _outputs(target, weak_draft)
    importlib.reload(sys.modules[module])
    importlib.reload(sys.modules[module])  # a second reload reads back the first one's wrapper
    assert hf_specdec.integration._ORIGINAL_GENERATE is _ORIGINAL_GENERATE
    assert hf_specdec.integration._ORIGINAL_GENERATE_BATCH is _ORIGINAL_GENERATE_BATCH
    # and the pipeline's: a wrapper read back as the original calls itself until the stack overflows
    assert hf_specdec.integration._ORIGINAL_PIPELINE_FORWARD is _ORIGINAL_PIPELINE_FORWARD
    assert hf_specdec.integration._ORIGINAL_PIPELINE_POSTPROCESS is _ORIGINAL_PIPELINE_POSTPROCESS
    after = _outputs(target, weak_draft)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    hf_specdec.integration.uninstall()
    assert GenerationMixin.generate is _ORIGINAL_GENERATE
    assert ContinuousMixin.generate_batch is _ORIGINAL_GENERATE_BATCH
    assert TextGenerationPipeline._forward is _ORIGINAL_PIPELINE_FORWARD
    assert TextGenerationPipeline.postprocess is _ORIGINAL_PIPELINE_POSTPROCESS
    assert torch.equal(target.generate(**_plain_kwargs()), before[0])


def _plain_kwargs() -> dict:
    input_ids, attention_mask = random_batch(7, 3)
    return dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)


def test_install_uninstall_install(target, weak_draft, restore_install):
    expected = _outputs(target, weak_draft)
    hf_specdec.uninstall()
    assert GenerationMixin.generate is _ORIGINAL_GENERATE
    with pytest.raises(ValueError, match="speculative"):  # transformers' own: an unknown argument
        target.generate(**_plain_kwargs(), speculative="ngram")
    assert torch.equal(target.generate(**_plain_kwargs()), expected[0])
    hf_specdec.install()
    hf_specdec.install()  # idempotent: one wrapper, not a wrapper of a wrapper
    assert GenerationMixin.generate.__wrapped__ is _ORIGINAL_GENERATE
    assert all(torch.equal(a, b) for a, b in zip(expected, _outputs(target, weak_draft)))


def _reload_in_a_fresh_process(modules: list[str]) -> subprocess.CompletedProcess:
    """Reload `modules` in a new interpreter, then generate plain, ngram and draft_model."""
    code = textwrap.dedent(
        f"""
        import importlib, sys, warnings
        import torch
        warnings.simplefilter("ignore")
        import hf_specdec
        from tests.conftest import tiny_llama
        target, draft = tiny_llama(0), tiny_llama(1)
        ids = torch.tensor([[1, 7, 8, 9, 7, 8]])
        for name in {modules!r}:
            importlib.reload(sys.modules[name])
        for speculative in (None, "ngram", dict(method="draft_model", draft=draft)):
            target.generate(ids, max_new_tokens=4, speculative=speculative)
        print("ok")
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )


def test_reloading_a_drafter_module_keeps_its_drafter_registered():
    """A drafter module reloaded registers its class again (under the same name: not a clash), and a
    reloaded registry keeps the drafters registered before."""
    done = _reload_in_a_fresh_process(
        ["hf_specdec.drafters.ngram", "hf_specdec.drafters.draft_model", "hf_specdec.drafters.registry"]
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_two_threads_generating_on_two_models(tmp_path):
    """Two targets with two drafts loaded by folder, generating at the same time, give what each gives
    alone (drafts are kept loaded per process; each call's state is its own)."""
    targets = [tiny_llama(0), tiny_llama(2)]
    drafts = []
    for seed in (1, 3):
        tiny_llama(seed).save_pretrained(tmp_path / f"draft{seed}")
        drafts.append(str(tmp_path / f"draft{seed}"))
    alone = [_outputs(t, d) for t, d in zip(targets, drafts)]
    results: dict[int, list[list[torch.Tensor]]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(4):
                results[i].append(_outputs(targets[i], drafts[i]))
        except BaseException as err:  # reported below, with its traceback
            errors.append(err)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so that interleavings actually happen
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    if errors:
        raise errors[0]
    for i in (0, 1):
        for outputs in results[i]:
            assert all(torch.equal(a, b) for a, b in zip(alone[i], outputs))
