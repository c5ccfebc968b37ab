"""`export-serving`: what `speculative=` runs, as a vLLM or SGLang command, checked against golden files.

Each engine × method writes `serving.json` for tiny offline models; the file must equal
`tests/golden/serving/<engine>-<case>.json` once the temporary folders and the version are replaced
by placeholders. After an intended change of the output, regenerate the golden files with

    HF_SPECDEC_REGEN_GOLDEN=1 python -m pytest tests/test_serving.py

and review the diff. Refusals are checked by their messages.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import hf_specdec
from hf_specdec.cli import main
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import build_head, save_head
from hf_specdec.heads.medusa import MedusaHeadConfig
from hf_specdec.serving import SGLANG_VERSION, ServingExportError, export_serving, median_draft_length

from .conftest import tiny_llama

GOLDEN = Path(__file__).parent / "golden" / "serving"
# What sglang 0.5.23 accepts on its command line, read from the wheel by bench/sglang_flags.py
# --write-list (provenance: the wheel's name and sha256 inside); rerun it for a new sglang.
SGLANG_FLAGS = Path(__file__).parent / "golden" / "sglang_flags.json"
REGENERATE = os.environ.get("HF_SPECDEC_REGEN_GOLDEN") == "1"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Targets, drafts and heads saved as folders, as a user would pass them."""
    root = tmp_path_factory.mktemp("models")
    tiny_llama(0).save_pretrained(root / "target")
    tiny_llama(1).save_pretrained(root / "draft")
    tiny_llama(2, vocab_size=96).save_pretrained(root / "draft-vocab96")
    target8 = tiny_llama(0, layers=8)
    target8.save_pretrained(root / "target8")
    torch.manual_seed(5)
    eagle3 = EagleHeadConfig.for_target(
        target8, variant="eagle3", feature_layers=[1, 3, 6], draft_vocab_size=40
    )
    save_head(build_head(eagle3, target8), root / "head-eagle3")
    target = tiny_llama(0)
    save_head(build_head(EagleHeadConfig.for_target(target, input_norms=True), target), root / "head-ours")
    save_head(build_head(MedusaHeadConfig.for_target(target, num_heads=2), target), root / "head-medusa")
    onnx = root / "draft-onnx"  # an export-onnx folder: config, no PyTorch weights
    onnx.mkdir()
    (onnx / "model.onnx").write_bytes(b"")
    config = json.loads((root / "draft" / "config.json").read_text())
    (onnx / "config.json").write_text(json.dumps({**config, "_name_or_path": str(root / "draft")}))
    return root


CASES = {
    "ngram": lambda m: dict(model=m / "target", method="ngram", options={"max_ngram": 3}),
    "draft_model": lambda m: dict(model=m / "target", method="draft_model", draft=m / "draft"),
    "eagle3-head": lambda m: dict(model=m / "target8", head=m / "head-eagle3"),
    "onnx": lambda m: dict(model=m / "target", method="onnx", draft=m / "draft-onnx"),
}


def _export(models: Path, out: Path, engine: str, case: str, k: int = 3) -> dict:
    kwargs = {key: str(v) if isinstance(v, Path) else v for key, v in CASES[case](models).items()}
    return export_serving(engine=engine, num_draft_tokens=k, out=out, **kwargs)


def _placeholders(text: str, models: Path, out: Path) -> str:
    text = text.replace(str(out), "<out>").replace(str(models), "<models>")
    return text.replace(f"hf-specdec {hf_specdec.__version__}", "hf-specdec <version>")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_serving_json_matches_golden(models, tmp_path, engine, case):
    result = _export(models, tmp_path, engine, case)
    written = (tmp_path / "serving.json").read_text()
    assert json.loads(written) == result
    got = _placeholders(written, models, tmp_path)
    golden = GOLDEN / f"{engine}-{case}.json"
    if REGENERATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got)
    assert golden.is_file(), f"no golden file {golden}: run with HF_SPECDEC_REGEN_GOLDEN=1"
    assert got == golden.read_text()


def test_vllm_config_always_names_its_method(models, tmp_path):
    for case in CASES:
        result = _export(models, tmp_path / case, "vllm", case)
        assert result["speculative_config"]["method"] == result["engine_method"]
        assert json.loads(result["command"][-1]) == result["speculative_config"]
        assert repr(result["speculative_config"]) in result["python"]


def test_eagle3_head_is_written_in_each_engines_layout(models, tmp_path):
    vllm = _export(models, tmp_path / "v", "vllm", "eagle3-head")
    config = json.loads((Path(vllm["draft"]) / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    sglang = _export(models, tmp_path / "s", "sglang", "eagle3-head")
    config = json.loads((Path(sglang["draft"]) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang's: one less


def test_no_method_exports_what_speculative_true_picks(models, tmp_path):
    result = export_serving(str(models / "target"), "vllm", num_draft_tokens=2, out=tmp_path)
    assert result["method"] == "ngram"  # a local folder with no Hub origin: draft-free
    assert result["caveats"][0].startswith("Chosen as speculative=True would")
    with_draft = export_serving(
        str(models / "target"), "sglang", draft=str(models / "draft"), num_draft_tokens=2
    )
    assert (with_draft["method"], with_draft["engine_method"]) == ("draft_model", "STANDALONE")


# --- refusals ---------------------------------------------------------------------------------------


REFUSALS = {
    "medusa": (
        lambda m: dict(method="medusa", head=m / "head-medusa"),
        r"removed in 0\.33; vLLM 0\.32 and earlier still had it\) nor by SGLang 0\.5\.23",
    ),
    "medusa-head-without-method": (lambda m: dict(head=m / "head-medusa"), "Medusa heads cannot be served"),
    "quantized": (lambda m: dict(method="quantized"), "int8 copy of the target itself, which neither vLLM"),
    "vocab-sizes-differ": (
        lambda m: dict(method="draft_model", draft=m / "draft-vocab96"),
        "need the draft's vocab_size to equal the target's, but .* has 96 and .* has 64",
    ),
    "our-eagle1-style-head": (
        lambda m: dict(method="eagle", head=m / "head-ours"),
        "EAGLE-1-style head .* would draft differently",
    ),
    "onnx-without-source": (
        lambda m: dict(method="onnx", draft=m / "draft-onnx-bare"),
        "does not record which model it was exported from",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_refusals_say_what_to_use_instead(models, tmp_path, engine, case):
    bare = models / "draft-onnx-bare"
    if not bare.exists():
        bare.mkdir()
        (bare / "model.onnx").write_bytes(b"")
        (bare / "config.json").write_text((models / "draft" / "config.json").read_text())
    arguments, message = REFUSALS[case]
    kwargs = {key: str(v) for key, v in arguments(models).items() if key != "method"}
    with pytest.raises(ServingExportError, match=message):
        export_serving(
            str(models / "target"),
            engine,
            method=arguments(models).get("method"),
            num_draft_tokens=3,
            out=tmp_path,
            **kwargs,
        )
    assert not (tmp_path / "serving.json").exists()


def test_bad_arguments(models):
    with pytest.raises(ValueError, match="Unknown engine 'tgi'"):
        export_serving(str(models / "target"), "tgi", method="ngram", num_draft_tokens=3)
    with pytest.raises(ValueError, match="positive integer"):
        export_serving(str(models / "target"), "vllm", method="ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="needs --draft"):
        export_serving(str(models / "target"), "vllm", method="draft_model", num_draft_tokens=3)


# --- measured draft length ----------------------------------------------------------------------


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


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_prints_the_command_and_writes_serving_json(models, tmp_path, capsys):
    code = main(
        ["export-serving", str(models / "target"), "--engine", "vllm", "--method", "ngram"]
        + ["--num-draft-tokens", "4", "--option", "min_ngram=1", "--out", str(tmp_path)]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith(f"vllm serve {models / 'target'} --speculative-config ")
    config = json.loads((tmp_path / "serving.json").read_text())["speculative_config"]
    assert config == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    assert "note: " in err


def test_cli_refusal_exits_1_with_the_message(models, tmp_path, capsys):
    code = main(
        ["export-serving", str(models / "target"), "--engine", "sglang", "--method", "quantized"]
        + ["--out", str(tmp_path)]
    )
    assert code == 1
    assert "error: method 'quantized' drafts with an int8 copy" in capsys.readouterr().err


@pytest.mark.parametrize(
    "target, head, expected",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", ("eagle3", "EAGLE3")),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B", ("eagle", "EAGLE")),
    ],
)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_published_heads_the_registry_knows_are_served_as_published(engine, target, head, expected):
    """The engines read the authors' layouts themselves: nothing is downloaded or converted."""
    result = export_serving(target, engine, head=head, num_draft_tokens=3)
    assert (result["engine_method"], result["draft"]) == (expected[engine == "sglang"], head)
    assert head in " ".join(result["command"])


def test_a_published_head_for_another_target_is_refused():
    with pytest.raises(
        ServingExportError, match="trained for meta-llama/Llama-3.1-8B-Instruct, not for lmsys"
    ):
        export_serving("lmsys/vicuna-7b-v1.3", "vllm", head="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")


def test_a_published_medusa_head_is_refused():
    with pytest.raises(ServingExportError, match="Medusa heads cannot be served"):
        export_serving("lmsys/vicuna-7b-v1.3", "vllm", head="FasterDecoding/medusa-vicuna-7b-v1.3")


def test_options_the_engines_lack_are_named_in_the_caveats(models):
    result = export_serving(
        str(models / "target"),
        "vllm",
        method="onnx",
        draft=str(models / "draft-onnx"),
        options={"min_confidence": 0.3, "threads": 2},
        num_draft_tokens=3,
    )
    assert "Options min_confidence=0.3 have no equivalent" in " ".join(result["caveats"])
    assert "Options threads=2 have no equivalent" in " ".join(result["caveats"])
    with pytest.raises(ValueError, match="Unknown option\\(s\\) \\['max_ngram'\\] for DraftModelConfig"):
        export_serving(str(models / "target"), "vllm", draft=str(models / "draft"), options={"max_ngram": 3})


@pytest.mark.parametrize("engine, expected", [("vllm", "eagle"), ("sglang", "EAGLE")])
def test_a_published_eagle1_folder_is_served_as_it_is(models, tmp_path, engine, expected):
    from .heads.test_published import write_eagle1

    folder = write_eagle1(tmp_path / "eagle1", tiny_llama(0), weights="model.safetensors", bias=False)
    result = export_serving(str(models / "target"), engine, head=str(folder), num_draft_tokens=3)
    assert (result["engine_method"], result["draft"]) == (expected, str(folder))


# --- SGLang flags, against the wheel's argument definitions -------------------------------------


def _sglang_flags_module():
    path = Path(__file__).parents[1] / "bench" / "sglang_flags.py"
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
    """Every flag, value type and algorithm name we write, checked against what bench/sglang_flags.py
    read from the sglang wheel (its checked-in list): SGLang stops at an unknown flag."""
    accepted = json.loads(SGLANG_FLAGS.read_text())
    assert accepted["version"] == SGLANG_VERSION, "rerun bench/sglang_flags.py --write-list"
    if case in PUBLISHED_SGLANG:
        target, head = PUBLISHED_SGLANG[case]
        result = export_serving(target, "sglang", head=head, num_draft_tokens=3)
    else:
        result = _export(models, tmp_path, "sglang", case)
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
