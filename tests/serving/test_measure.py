"""`serving/measure.py`: the draft length, as the median of what our adaptive policy verified, read
from bench results or measured on built-in prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_specdec.core.stats import SpeculativeStats
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import build_head, save_head
from hf_specdec.serving import ServingExportError, export_serving, median_draft_length

from ..conftest import tiny_llama


@pytest.mark.parametrize(
    "steps, drafted, expected",
    [(4, [4, 4, 2, 1], 3), (4, [4, 4, 4, 4], 4), (5, [5, 2, 1], 1), (3, [3], 1)],
)
def test_median_draft_length(steps, drafted, expected):
    assert median_draft_length(steps, drafted) == expected


def test_a_policy_that_never_drafted_gives_no_length():
    with pytest.raises(ServingExportError, match="never drafted.*--num-draft-tokens"):
        median_draft_length(0, [])


def _bench(tmp_path: Path, method: str, position_drafted: list[int], steps: int) -> Path:
    stats = {"method": method, "speculative_steps": steps, "position_drafted": position_drafted}
    rows = [{"row": "plain", "stats": None}, {"row": method, "stats": stats}, {"row": method, "stats": stats}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"settings": {}, "measurements": rows}))
    return path


def test_auto_length_from_bench_results(models, tmp_path):
    bench = _bench(tmp_path, "ngram", [10, 9, 7, 3, 1], steps=10)
    result = export_serving(
        str(models / "target"), "vllm", method="ngram", from_bench=bench, out=tmp_path / "o"
    )
    assert result["num_draft_tokens"] == 3  # 14 and 6 of 20 drafts reach lengths 3 and 4
    assert result["speculative_config"]["num_speculative_tokens"] == 3
    assert any("median draft length" in c and str(bench) in c for c in result["caveats"])
    with pytest.raises(ValueError, match="has no draft_model measurements \\(it has: ngram, plain\\)"):
        export_serving(str(models / "target"), "vllm", draft=str(models / "draft"), from_bench=bench)


def test_from_bench_reads_the_counts_bench_writes(models, tmp_path):
    """Bench writes each call's `SpeculativeStats.to_dict()`; export-serving read counts it lacked,
    and every bench file gave a length of 1 (a hand-written file in the test above hid it)."""
    stats = SpeculativeStats(method="ngram")
    for _ in range(3):  # three drafts of 6 tokens, one of 2
        stats.record_step(6, 6)
    stats.record_step(2, 0)
    path = tmp_path / "results.json"
    row = {"row": "ngram", "stats": json.loads(json.dumps(stats.to_dict()))}
    path.write_text(json.dumps({"settings": {}, "measurements": [row]}))
    result = export_serving(
        str(models / "target"), "vllm", method="ngram", from_bench=path, out=tmp_path / "o"
    )
    assert result["num_draft_tokens"] == 6
    del row["stats"]["position_drafted"]  # a file bench wrote before it kept the counts
    path.write_text(json.dumps({"settings": {}, "measurements": [row]}))
    with pytest.raises(ValueError, match="no per-position draft counts.*run `hf-specdec bench` again"):
        export_serving(str(models / "target"), "vllm", method="ngram", from_bench=path)


@pytest.mark.parametrize("method", ["draft_model", "eagle3-head"])
def test_auto_length_is_measured_with_the_adaptive_policy(tmp_path, smollm2_path, method):
    """A tiny random target with SmolLM2's tokenizer: the built-in prompts run in seconds."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    folder = tmp_path / "tiny-with-tokenizer"
    target = tiny_llama(
        0, vocab_size=len(tokenizer), layers=8 if method == "eagle3-head" else 2, eos_token_id=None
    )
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if method == "draft_model":
        # A draft that always agrees and costs less than the target, so drafting pays: both models'
        # layers add nothing to the residual stream and share embedding and LM head, so they predict
        # alike, and the target has 8 layers to run, the draft 1. (The target as its own draft would
        # cost what it saves, and the policy rightly never drafts with it.)
        target = tiny_llama(0, vocab_size=len(tokenizer), layers=8, eos_token_id=None)
        draft = tiny_llama(1, vocab_size=len(tokenizer), layers=1, eos_token_id=None)
        with torch.no_grad():
            draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            for model in (target, draft):
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
                model.lm_head.weight.copy_(target.model.embed_tokens.weight.roll(1, dims=0))
        target.save_pretrained(folder)
        draft.save_pretrained(tmp_path / "draft")
        tokenizer.save_pretrained(tmp_path / "draft")
        source = dict(draft=str(tmp_path / "draft"))
    else:  # a random head is rarely right, but the policy drafts while it explores
        config = EagleHeadConfig.for_target(
            target, variant="eagle3", feature_layers=[2, 4, 5], draft_vocab_size=64
        )
        source = dict(head=str(save_head(build_head(config, target), tmp_path / "head")))
    result = export_serving(str(folder), "vllm", out=tmp_path / "o", **source)
    assert isinstance(result["num_draft_tokens"], int) and result["num_draft_tokens"] >= 1
    assert any("adaptive policy verified on 3 built-in prompts" in c for c in result["caveats"])


def test_from_bench_counts_the_chain_rows_only(models, tmp_path):
    """The engines draft chains: a `+tree` row's drafts (its nodes) say nothing of a chain's length."""
    path = _bench(tmp_path, "ngram", [10, 9, 7, 3, 1], steps=10)
    data = json.loads(path.read_text())
    tree = {"method": "ngram", "speculative_steps": 10, "position_drafted": [10] * 8, "tree_steps": 10}
    data["measurements"].append({"row": "ngram+tree", "stats": tree})
    path.write_text(json.dumps(data))
    result = export_serving(str(models / "target"), "vllm", method="ngram", from_bench=path)
    assert result["num_draft_tokens"] == 3  # as the chain rows alone give (test above); with the tree's, 4


def test_from_bench_refuses_the_results_of_another_model(models, tmp_path):
    target = str(models / "target")
    path = _bench(tmp_path, "ngram", [10, 9, 7, 3, 1], steps=10)
    data = json.loads(path.read_text())
    for settings, message in [
        ({"model": "HuggingFaceTB/SmolLM2-360M"}, "measured HuggingFaceTB/SmolLM2-360M, not"),
        ({"model": target, "draft": str(models / "draft-vocab96")}, "drafted with .*draft-vocab96, not"),
    ]:
        path.write_text(json.dumps({**data, "settings": settings}))
        with pytest.raises(ValueError, match=message):
            export_serving(target, "vllm", draft=str(models / "draft"), from_bench=path)
    same = {"model": str(models / "target" / ".." / "target"), "draft": None}  # the same folder
    path.write_text(json.dumps({**data, "settings": same}))
    assert export_serving(target, "vllm", method="ngram", from_bench=path)["num_draft_tokens"] == 3


def test_from_bench_checks_a_heads_rows_against_the_head_that_ran_them(tmp_path):
    """bench keeps a head by its method (`settings["heads"]`), beside the --draft model: an eagle
    export of head H was refused as "drafted with D, not H" for a bench run with --draft D --head eagle=H."""
    from types import SimpleNamespace

    from hf_specdec.serving.measure import _check_bench_settings

    plan = SimpleNamespace(method="eagle", measure={"draft": "org/eagle-head"})
    settings = {"model": "org/target", "draft": "org/small-draft", "heads": {"eagle": "org/eagle-head"}}
    _check_bench_settings(tmp_path / "results.json", settings, "org/target", plan)
    settings["heads"] = {"eagle": "org/other-head"}
    with pytest.raises(ValueError, match="drafted with org/other-head, not org/eagle-head"):
        _check_bench_settings(tmp_path / "results.json", settings, "org/target", plan)


def test_from_bench_refuses_an_interrupted_benchmark(models, tmp_path):
    """Ctrl-C stops `hf-specdec bench` with the prompts measured so far written and
    `"interrupted": true`; --from-bench took that file's draft lengths as the benchmark's, with no
    word that most prompts were never run."""
    path = _bench(tmp_path, "ngram", [10, 9, 7, 3, 1], steps=10)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "interrupted": True}))
    with pytest.raises(ValueError, match=r"was interrupted.*Run it to the end, or pass --num-draft-tokens"):
        export_serving(str(models / "target"), "vllm", method="ngram", from_bench=path)


def test_from_bench_that_is_not_utf8_is_named(models, tmp_path):
    """A file that is not UTF-8 reached the user as the codec's bare message, naming no file."""
    path = tmp_path / "results.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"Cannot read the benchmark results .*results.json"):
        export_serving(str(models / "target"), "vllm", method="ngram", from_bench=path)
