"""`serving/plans.py`: each method's plan, or its refusal with what to use instead; every registered
drafter has one or the other."""

from __future__ import annotations

import pytest

from hf_specdec import DRAFTERS
from hf_specdec.serving import ServingExportError, export_serving
from hf_specdec.serving.plans import PLANS, REFUSALS

from ..conftest import tiny_llama


def test_every_registered_drafter_has_a_serving_plan_or_a_refusal():
    """A new drafter fails here until plans.py serves it (PLANS) or refuses it (REFUSALS)."""
    undecided = set(DRAFTERS) - set(PLANS) - set(REFUSALS)
    assert not undecided, f"add a plan or a refusal for {sorted(undecided)} in hf_specdec/serving/plans.py"
    assert not set(PLANS) & set(REFUSALS), "a method is both served and refused"
    assert set(PLANS) | set(REFUSALS) <= set(DRAFTERS), "a plan for a method no drafter registers"


@pytest.mark.parametrize("method", sorted(REFUSALS))
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_refused_method_is_what_the_user_sees(models, tmp_path, engine, method):
    with pytest.raises(ServingExportError) as raised:
        export_serving(str(models / "target"), engine, method=method, num_draft_tokens=3, out=tmp_path)
    assert str(raised.value) == REFUSALS[method]
    assert "export --method" in str(raised.value).lower()  # it says what to export instead
    assert not (tmp_path / "serving.json").exists()


def test_a_drafter_registered_without_a_plan_is_refused_with_what_to_export(models, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "_unplanned", DRAFTERS["ngram"])
    refusal = f"'_unplanned' has no serving plan.*Export --method {' / '.join(sorted(PLANS))} instead"
    with pytest.raises(ServingExportError, match=refusal):
        export_serving(str(models / "target"), "vllm", method="_unplanned", num_draft_tokens=3)
    with pytest.raises(
        ValueError, match="Unknown method 'nope'; valid methods: .*draft_model.*eagle.*medusa"
    ):
        export_serving(str(models / "target"), "vllm", method="nope", num_draft_tokens=3)


REFUSALS_BY_CASE = {
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
    "tokenizers-differ": (
        lambda m: dict(model=m / "target-words", method="draft_model", draft=m / "draft-other-words"),
        "read the draft's token ids as the target's, but .*draft-other-words's tokenizer is not",
    ),
    "draft-tokenizer-that-does-not-load": (
        lambda m: dict(model=m / "target-words", method="draft_model", draft=m / "draft-broken-tokenizer"),
        "draft-broken-tokenizer has tokenizer files that do not load .*save or download it again",
    ),
    "our-eagle1-style-head": (
        lambda m: dict(method="eagle", head=m / "head-ours"),
        "EAGLE-1-style head .* would draft differently",
    ),
    "mtp-on-a-target-without-mtp-layers": (
        lambda m: dict(method="mtp"),
        "method='mtp' drafts with a model's own multi-token-prediction layers, and transformers .* "
        "loads none for LlamaForCausalLM",
    ),
    # vLLM's `SpeculativeConfig.hf_config_override` and SGLang's `ModelConfig._config_draft_model`
    # read such a draft checkpoint as its MTP layers (vLLM 0.33 switches to method mtp).
    "draft-with-mtp-layers": (
        lambda m: dict(model=m / "mtp-target", method="draft_model", draft=m / "mtp-target"),
        r"mtp-target declares MTP layers \(config.num_mtp_layers=1, .*\): vLLM and SGLang load .* "
        "as those MTP layers, not as a draft model.* --method ngram",
    ),
    "onnx-without-source": (
        lambda m: dict(method="onnx", draft=m / "draft-onnx-bare"),
        "does not record which model it was exported from",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS_BY_CASE))
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_refusals_say_what_to_use_instead(models, tmp_path, engine, case):
    bare = models / "draft-onnx-bare"
    if not bare.exists():
        bare.mkdir()
        (bare / "model.onnx").write_bytes(b"")
        (bare / "config.json").write_text((models / "draft" / "config.json").read_text())
    arguments, message = REFUSALS_BY_CASE[case]
    kwargs = {key: str(v) for key, v in arguments(models).items() if key != "method"}
    target = kwargs.pop("model", str(models / "target"))
    with pytest.raises(ServingExportError, match=message):
        export_serving(
            target,
            engine,
            method=arguments(models).get("method"),
            num_draft_tokens=3,
            out=tmp_path,
            **kwargs,
        )
    assert not (tmp_path / "serving.json").exists()


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
    from ..heads.test_published import write_eagle1

    folder = write_eagle1(tmp_path / "eagle1", tiny_llama(0), weights="model.safetensors", bias=False)
    result = export_serving(str(models / "target"), engine, head=str(folder), num_draft_tokens=3)
    assert (result["engine_method"], result["draft"]) == (expected, str(folder))


def test_suffix_is_served_as_vllms_suffix_decoding_and_as_sglangs_prompt_lookup(models):
    """vLLM 0.34 (`vllm/v1/worker/gpu/spec_decode/suffix/`) runs suffix decoding on the GPU without
    arctic-inference, bounds its corpus by `suffix_decoding_corpus_tokens` and ignores the length
    rule's `suffix_decoding_max_spec_factor` / `_min_token_prob`."""
    options = {"max_spec_factor": 2.0, "min_token_prob": 0.2, "max_corpus_tokens": 5000}
    target = str(models / "target")
    vllm = export_serving(target, "vllm", method="suffix", options=options, num_draft_tokens=4)
    assert vllm["speculative_config"] == {
        "method": "suffix",
        "num_speculative_tokens": 4,
        "suffix_decoding_corpus_tokens": 5000,
    }
    caveats = " ".join(vllm["caveats"])
    assert "needs `pip install arctic-inference`" not in caveats and "no extra package" in caveats
    assert "length rule and probability floor" in caveats and "SGLang" not in caveats
    assert "no equivalent in vLLM or SGLang" not in caveats  # max_corpus_tokens is carried
    sglang = export_serving(target, "sglang", method="suffix", num_draft_tokens=4)
    assert sglang["engine_method"] == "NGRAM" and "has no suffix decoding" in " ".join(sglang["caveats"])
    with pytest.raises(ValueError, match="Unknown option\\(s\\) \\['nope'\\] for SuffixConfig"):
        export_serving(
            str(models / "target"), "vllm", method="suffix", options={"nope": 1}, num_draft_tokens=4
        )


@pytest.mark.parametrize(
    "target, arguments, options, dropped",
    [
        ("target", {"method": "ngram"}, {"max_matches": 2, "max_ngram": 3}, "max_matches=2"),
        ("target", {"method": "suffix"}, {"min_gain": 1.2, "max_spec_factor": 2.0}, "min_gain=1.2"),
        (
            "meta-llama/Llama-3.1-8B-Instruct",
            {"method": "eagle", "head": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
            {"tree_top_k": 8, "min_confidence": 0.5},
            "min_confidence=0.5, tree_top_k=8",
        ),
    ],
)
def test_every_plan_names_the_options_it_does_not_carry(models, target, arguments, options, dropped):
    model = str(models / target) if target == "target" else target
    result = export_serving(model, "vllm", options=options, num_draft_tokens=3, **arguments)
    caveats = " ".join(result["caveats"])
    assert f"Options {dropped} have no equivalent" in caveats
    carried = {"max_ngram": 3, "max_spec_factor": 2.0}
    assert not any(f"{key}={value!r}" in caveats for key, value in carried.items())
    with pytest.raises(ValueError, match="Unknown option\\(s\\) \\['nope'\\]"):
        export_serving(model, "vllm", options={"nope": 1}, num_draft_tokens=3, **arguments)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("given", ["draft", "head"])
def test_a_draft_given_to_a_draft_free_method_is_refused(models, method, given):
    with pytest.raises(
        ValueError, match=f"method '{method}' drafts without a draft of yours.*drop --{given}"
    ):
        export_serving(
            str(models / "target"),
            "vllm",
            method=method,
            num_draft_tokens=3,
            **{given: str(models / "draft")},
        )
