"""`serving/engines.py`: vLLM's config and snippet agree, heads are written in each engine's layout, and
SGLang's flags are ones the sglang wheel accepts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hf_specdec.serving import SGLANG_VERSION, export_serving
from hf_specdec.serving.base import ServingPlan
from hf_specdec.serving.engines import render_vllm

from .conftest import CASES, export_case

ROOT = Path(__file__).parents[2]
# What sglang 0.5.23 accepts on its command line, read from the wheel by benchmarks/engines/sglang_flags.py
# --write-list (provenance: the wheel's name and sha256 inside); rerun it for a new sglang.
SGLANG_FLAGS = ROOT / "tests" / "golden" / "sglang_flags.json"


def test_vllm_config_always_names_its_method(models, tmp_path):
    for case in CASES:
        result = export_case(models, tmp_path / case, "vllm", case)
        assert result["speculative_config"]["method"] == result["engine_method"]
        assert json.loads(result["command"][-1]) == result["speculative_config"]
        assert repr(result["speculative_config"]) in result["python"]


def test_eagle3_head_is_written_in_each_engines_layout(models, tmp_path):
    vllm = export_case(models, tmp_path / "v", "vllm", "eagle3-head")
    config = json.loads((Path(vllm["draft"]) / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    sglang = export_case(models, tmp_path / "s", "sglang", "eagle3-head")
    config = json.loads((Path(sglang["draft"]) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang's: one less


def test_sglang_ngram_caveat_names_the_devices_sglang_runs_it_on(models, tmp_path):
    # sglang 0.5.23, srt/arg_groups/speculative_hook.py `_handle_ngram`: "Ngram speculative decoding
    # only supports CUDA, CPU, or XPU devices."
    result = export_case(models, tmp_path, "sglang", "ngram")
    caveat = next(caveat for caveat in result["caveats"] if "NGRAM" in caveat)
    assert "CUDA only" not in caveat and "(on CUDA, CPU or XPU)" in caveat


# --- SGLang flags, against the wheel's argument definitions -------------------------------------


def _sglang_flags_module():
    path = ROOT / "benchmarks" / "engines" / "sglang_flags.py"
    spec = importlib.util.spec_from_file_location("sglang_flags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PUBLISHED_SGLANG = {
    "published-eagle1": ("meta-llama/Meta-Llama-3-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B"),
    "published-eagle3": ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
}


@pytest.mark.parametrize("case", [*CASES, *PUBLISHED_SGLANG])
def test_sglang_commands_use_only_flags_and_values_the_wheel_accepts(models, tmp_path, case):
    """Every flag, value type and algorithm name we write, checked against what
    benchmarks/engines/sglang_flags.py read from the sglang wheel (its checked-in list):
    SGLang stops at an unknown
    flag."""
    accepted = json.loads(SGLANG_FLAGS.read_text())
    assert accepted["version"] == SGLANG_VERSION, "rerun benchmarks/engines/sglang_flags.py --write-list"
    if case in PUBLISHED_SGLANG:
        target, head = PUBLISHED_SGLANG[case]
        result = export_serving(target, "sglang", head=head, num_draft_tokens=3)
    else:
        result = export_case(models, tmp_path, "sglang", case)
    assert _sglang_flags_module().check_command(result["command"], accepted) == []


def test_the_flag_check_catches_what_sglang_would_refuse():
    accepted = json.loads(SGLANG_FLAGS.read_text())
    command = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
        "--speculative-algorithm",
        "MEDUSA",
    ]
    command += ["--speculative-num-steps", "three", "--speculative-ngram-min-match-window-size", "2"]
    problems = _sglang_flags_module().check_command(command, accepted)
    assert any("'MEDUSA' is not a builtin" in p for p in problems)
    assert "--speculative-num-steps takes an integer, not 'three'" in problems
    assert "unknown flag --speculative-ngram-min-match-window-size" in problems


@pytest.mark.parametrize(("k", "served"), [(2, 2), (3, 3), (4, 3), (5, 3), (6, 6), (7, 6)])
def test_vllm_mtp_draft_length_is_a_multiple_of_the_layers_past_them(k, served):
    """vLLM 0.33 / 0.34 (`vllm/config/speculative.py`, `SpeculativeConfig.__post_init__`) refuses
    `num_speculative_tokens` above a target's MTP layer count n ("n_predict") unless it is a multiple
    of n: with 3 layers (Step-3.5), 4 or 5 would not start."""
    plan = ServingPlan("mtp", {"vllm": "mtp", "sglang": "EAGLE"}, mtp_layers=3)
    rendered = render_vllm("org/target", plan, k, None)
    assert rendered["speculative_config"]["num_speculative_tokens"] == served
    assert any("multiples of 3" in c for c in rendered["caveats"]) == (served != k)


def test_vllm_mtp_export_says_so_where_the_layers_could_not_be_counted():
    plan = ServingPlan("mtp", {"vllm": "mtp", "sglang": "EAGLE"})  # a Hub id not downloaded here
    rendered = render_vllm("org/target", plan, 4, None)
    assert rendered["speculative_config"]["num_speculative_tokens"] == 4
    assert any("could not be counted here" in c for c in rendered["caveats"])
