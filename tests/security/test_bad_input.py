"""Bad input, one case a row: each is refused with the exception type a caller can catch and a message
that names what to do instead (not a TypeError from a comparison deep inside, nor a model's IndexError).

The cases older than this suite live in tests/core/test_checks.py; these are the ones the red-team pass
found unclear.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import huggingface_hub.constants
import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from hf_specdec import FixedDraftLength
from hf_specdec.core.checks import Unsupported
from hf_specdec.drafters import DRAFTERS, Draft, Drafter, register_drafter
from hf_specdec.drafters.head_drafter import HeadDrafterConfig
from hf_specdec.drafters.onnx import OnnxDraftConfig
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import CONFIG_NAME, build_head, save_head
from hf_specdec.heads.medusa import MedusaHeadConfig
from hf_specdec.hub.download import HubFileError
from hf_specdec.store.manifest import MANIFEST_NAME

from ..conftest import tiny_llama
from ..heads.test_published import write_eagle1
from ..helpers.tokenizers import word_level

PROMPT = torch.tensor([[1, 7, 8, 9, 7, 8]])


class _OutOfVocabulary(Drafter):
    """A custom drafter that proposes the id one past the target's vocabulary."""

    name: ClassVar[str] = "_out_of_vocabulary"

    @classmethod
    def from_config(cls, config, target, tokenizer):
        return cls()

    def propose(self, request):
        rows = len(request.row_ids)
        return Draft(torch.full((rows, 2), 64, dtype=torch.long), [2] * rows)


class _FloatTokens(_OutOfVocabulary):
    name: ClassVar[str] = "_float_tokens"

    def propose(self, request):
        rows = len(request.row_ids)
        return Draft(torch.full((rows, 2), 7.0), [2] * rows)


class _NegativePadding(_OutOfVocabulary):
    """Row 0 proposes one token and pads with -1: the padding is fed to the target too."""

    name: ClassVar[str] = "_negative_padding"

    def propose(self, request):
        return Draft(torch.tensor([[7, -1]]), [1])


class _ConfidenceAboveOne(_OutOfVocabulary):
    """Valid ids, but confidences that are no probability: the policy would read 1.5 as odds."""

    name: ClassVar[str] = "_confidence_above_one"

    def propose(self, request):
        rows = len(request.row_ids)
        return Draft(torch.full((rows, 2), 7), [2] * rows, confidence=torch.full((rows, 2), 1.5))


_CUSTOM_DRAFTERS = (_OutOfVocabulary, _FloatTokens, _NegativePadding, _ConfidenceAboveOne)


@pytest.fixture(scope="module", autouse=True)
def custom_drafters():
    for cls in _CUSTOM_DRAFTERS:
        register_drafter(cls)
    yield
    for cls in _CUSTOM_DRAFTERS:
        DRAFTERS.pop(cls.name)


def _generate(**speculative: Any) -> Callable[..., None]:
    def call(target, tmp_path, monkeypatch):
        target.generate(input_ids=PROMPT, max_new_tokens=4, speculative=speculative)

    return call


def _with_head_config(edit: Callable[[dict], Any], method: str = "eagle") -> Callable[..., None]:
    """Generate with a head saved for `target` whose head_config.json was then replaced by `edit(config)`."""

    def call(target, tmp_path, monkeypatch):
        config_cls = EagleHeadConfig if method == "eagle" else MedusaHeadConfig
        folder = save_head(build_head(config_cls.for_target(target), target), tmp_path / "head")
        config = json.loads((folder / CONFIG_NAME).read_text())
        (folder / CONFIG_NAME).write_text(json.dumps(edit(config)))
        # A hand-written config, as a published head's (no manifest): the config's own check answers,
        # not the manifest's "this folder changed since it was saved".
        (folder / MANIFEST_NAME).unlink()
        target.generate(
            input_ids=PROMPT, max_new_tokens=4, speculative=dict(method=method, draft=str(folder))
        )

    return call


def _medusa(**options: Any) -> Callable[..., None]:
    """Generate with a Medusa head built for `target`, given `options`."""

    def call(target, tmp_path, monkeypatch):
        head = build_head(MedusaHeadConfig.for_target(target), target)
        spec = dict(method="medusa", draft=head, options=options)
        target.generate(input_ids=PROMPT, max_new_tokens=4, speculative=spec)

    return call


def _with_published_config(edit: Callable[[dict], Any]) -> Callable[..., None]:
    """Generate with an EAGLE-1 head in the reference layout whose config.json is `edit(config)`."""

    def call(target, tmp_path, monkeypatch):
        folder = write_eagle1(tmp_path / "published", target, weights="model.safetensors")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(edit(config)))
        target.generate(
            input_ids=PROMPT, max_new_tokens=4, speculative=dict(method="eagle", draft=str(folder))
        )

    return call


def _set(**fields: Any) -> Callable[[dict], dict]:
    return lambda config: {**config, **fields}


def _rope(kind: str) -> Callable[[dict], dict]:
    return lambda config: {**config, "rope_parameters": {"rope_type": kind, "rope_theta": 1e4}}


def _inputs_embeds(target, tmp_path, monkeypatch):
    embeds = target.get_input_embeddings()(PROMPT)
    target.generate(inputs_embeds=embeds, max_new_tokens=4, speculative="ngram")


def _encoder_decoder_draft(target, tmp_path, monkeypatch):
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    )
    target.generate(input_ids=PROMPT, max_new_tokens=4, speculative=dict(method="draft_model", draft=t5))


def _missing_relative_folder(target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Offline, so that the Hub's answer comes at once (transformers would retry huggingface.co for ~20 s).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    target.generate(
        input_ids=PROMPT, max_new_tokens=4, speculative=dict(method="draft_model", draft="drafts/missing")
    )


def _weak_draft():
    return tiny_llama(1)


def _cross_tokenizer_generate(draft_words: int, tokenizer: Any = None) -> Callable[..., None]:
    """Generate with `_weak_draft()` (64 ids) through the shared tokens, the target's tokenizer a
    word-level one of 64 words (or `tokenizer`, as given), the draft's one of `draft_words`, which
    spells the target's words past its 64th id (PROMPT's among them)."""

    def call(target, tmp_path, monkeypatch):
        words = ["<unk>", *(f"w{i}" for i in range(1, 64))]
        spelled = ["<unk>", *(f"d{i}" for i in range(1, 64)), *words[4 : draft_words - 60]]  # w4...
        spec = dict(
            method="draft_model",
            draft=_weak_draft(),
            draft_tokenizer=word_level(spelled),
            options=dict(translation="intersection"),
        )
        given = word_level(words) if tokenizer is None else tokenizer
        target.generate(input_ids=PROMPT, max_new_tokens=4, tokenizer=given, speculative=spec)

    return call


# name -> (what to run with (target, tmp_path, monkeypatch), exception type, regex for the message's fix)
CASES: dict[str, tuple[Callable[..., None], type[Exception], str]] = {
    "inputs_embeds_without_input_ids": (  # what speculative=True decodes plainly
        _inputs_embeds,
        Unsupported,
        r"inputs_embeds is not supported: pass the prompt's token ids as input_ids instead",
    ),
    "draft_of_a_wrong_type": (
        _generate(method="draft_model", draft=123),
        TypeError,
        r"`draft` must be a local folder, a Hub repo id, or a loaded model .*got 123 \(int\)",
    ),
    # A draft wrapped by torch.compile: was an AttributeError from deep inside, for every method.
    **{
        f"draft_wrapped_by_torch_compile_{method}": (
            _generate(method=method, draft=torch.compile(_weak_draft(), backend="eager")),
            ValueError,
            r"The draft is wrapped by torch.compile \(OptimizedModule of LlamaForCausalLM\): pass the model "
            r"itself \(draft=compiled._orig_mod\), compiled in place with draft.compile\(\)",
        )
        for method in ("draft_model", "auto")
    },
    # Drafters that take no draft of the user's ran without it, without a word.
    "draft_given_to_ngram": (
        _generate(method="ngram", draft=_weak_draft()),
        ValueError,
        r"method='ngram' drafts without a draft of yours, and draft=LlamaForCausalLM would go unused: drop "
        r"draft= \(and draft_tokenizer=\), or pass method='draft_model' to draft with it",
    ),
    "draft_repo_given_to_suffix": (
        _generate(method="suffix", draft="some/repo"),
        ValueError,
        r"method='suffix' drafts without a draft of yours, and draft='some/repo' would go unused",
    ),
    "draft_given_to_quantized": (  # it drafts with an int8 copy of the target, exported here
        _generate(method="quantized", draft=_weak_draft()),
        ValueError,
        r"method='quantized' drafts without a draft of yours",
    ),
    "draft_tokenizer_without_a_draft": (
        _generate(method="ngram", draft_tokenizer=word_level(["<unk>", "fox"])),
        ValueError,
        r"`draft_tokenizer` is the tokenizer of the draft model given as draft=, and no draft was given "
        r"\(method='ngram'\): pass draft=<your draft model> with it, or drop draft_tokenizer=",
    ),
    # A draft_tokenizer that no drafter would read: a head's, an assistant's, or beside a draft named
    # by folder or repo (loaded with its own).
    "draft_tokenizer_given_to_eagle": (
        _generate(method="eagle", draft="some/head", draft_tokenizer=word_level(["<unk>", "fox"])),
        ValueError,
        r"method='eagle' drafts in the target's own tokens, and draft_tokenizer= would go unused: drop it",
    ),
    "draft_tokenizer_given_to_assistant": (
        _generate(method="assistant", draft="some/assistant", draft_tokenizer=word_level(["<unk>", "fox"])),
        ValueError,
        r"method='assistant' drafts in the target's own tokens",
    ),
    "draft_tokenizer_beside_a_named_draft": (
        _generate(method="draft_model", draft="drafts/small", draft_tokenizer=word_level(["<unk>", "fox"])),
        ValueError,
        r"The draft 'drafts/small' is loaded with its own tokenizer, and draft_tokenizer= would go unused",
    ),
    # Tokenizers given as paths (an AttributeError deep inside, or unread beside a draft of the
    # target's vocabulary size).
    "draft_tokenizer_a_path": (
        _generate(method="draft_model", draft=_weak_draft(), draft_tokenizer="drafts/small"),
        TypeError,
        r"SpeculativeConfig\(draft_tokenizer=\.\.\.\) must be a loaded tokenizer, e\.g\. "
        r"AutoTokenizer\.from_pretrained\(\.\.\.\), got 'drafts/small' \(str\)",
    ),
    "target_tokenizer_a_path": (
        _cross_tokenizer_generate(draft_words=70, tokenizer="models/target"),
        TypeError,
        r"generate\(tokenizer=\.\.\.\) must be a loaded tokenizer, e\.g\. AutoTokenizer\.from_pretrained",
    ),
    # A draft tokenizer with ids the draft cannot embed (the draft's IndexError before).
    "draft_tokenizer_larger_than_the_draft": (
        _cross_tokenizer_generate(draft_words=70),
        ValueError,
        r"draft_tokenizer= has 70 tokens but the draft model's vocabulary has only 64 ids: pass the "
        r"draft's own tokenizer, or resize the draft's embeddings \(draft\.resize_token_embeddings\(70\)\)",
    ),
    "encoder_decoder_draft": (
        _encoder_decoder_draft,
        ValueError,
        r"T5ForConditionalGeneration is an encoder-decoder model; a draft must be a decoder-only causal LM",
    ),
    "missing_relative_draft_folder": (
        _missing_relative_folder,
        HubFileError,  # a ValueError: the name is tried as a Hub repo id once no such folder exists
        r"(?s)draft='drafts/missing' is not a local folder \(there is no .*drafts/missing\).*"
        r"Check the path \(a relative one starts from",
    ),
    "policy_of_a_wrong_type": (
        _generate(method="ngram", policy=4),
        TypeError,
        r"`policy` must be a draft-length policy object such as hf_specdec.AdaptiveDraftLength\(\), got 4 "
        r"\(int\); a fixed draft length goes in num_draft_tokens=<k>",
    ),
    "policy_beside_a_fixed_draft_length": (
        _generate(method="ngram", num_draft_tokens=3, policy=FixedDraftLength(2)),
        ValueError,
        r"num_draft_tokens=3 and policy=FixedDraftLength\(\.\.\.\) both choose the draft length: pass one",
    ),
    "policy_in_both_fields": (
        _generate(method="ngram", num_draft_tokens=FixedDraftLength(2), policy=FixedDraftLength(2)),
        ValueError,
        r"Both `num_draft_tokens` and `policy` were given a draft-length policy: pass it once, as policy=",
    ),
    "num_draft_tokens_a_word": (
        _generate(method="ngram", num_draft_tokens="fast"),
        ValueError,
        r'`num_draft_tokens` must be a positive integer or "auto" \(a draft-length policy object goes in '
        r"policy=\), got 'fast'",
    ),
    "tree_a_word": (
        _generate(method="ngram", tree="yes"),
        ValueError,
        r"`tree` must be True, False or 'auto' \(cap a tree's nodes with max_tree_nodes=<n>\), got 'yes'",
    ),
    "max_tree_nodes_of_a_wrong_type": (
        _generate(method="ngram", tree=True, max_tree_nodes="8"),
        TypeError,
        r"`max_tree_nodes` must be a positive integer or None, got '8' \(str\)",
    ),
    "max_tree_nodes_zero": (
        _generate(method="ngram", tree=True, max_tree_nodes=0),
        ValueError,
        r"`max_tree_nodes` must be a positive integer or None, got 0",
    ),
    "tree_a_number_beside_max_tree_nodes": (
        _generate(method="ngram", tree=5, max_tree_nodes=3),
        ValueError,
        r"tree=5 and max_tree_nodes=3 both cap the tree's nodes: pass tree=True, max_tree_nodes=<n>",
    ),
    "options_none": (
        _generate(method="ngram", options=None),
        TypeError,
        r"`options` must be a dict of the drafter's settings, e.g. options=\{'max_ngram': 4\}",
    ),
    "ngram_option_of_a_wrong_type": (
        _generate(method="ngram", options={"max_ngram": "x"}),
        TypeError,
        r"`max_ngram` of NgramConfig must be an integer, got 'x' \(str\)",
    ),
    "ngram_option_out_of_range": (
        _generate(method="ngram", options={"max_matches": 0}),
        ValueError,
        r"`max_matches` of NgramConfig must be an integer >= 1, got 0",
    ),
    "draft_model_confidence_out_of_range": (
        _generate(method="draft_model", draft=_weak_draft(), options={"min_confidence": 2}),
        ValueError,
        r"`min_confidence` of DraftModelConfig must be a number from 0 to 1, got 2",
    ),
    "draft_model_flag_of_a_wrong_type": (
        _generate(method="draft_model", draft=_weak_draft(), options={"tokenizer_verified": "yes"}),
        TypeError,
        r"`tokenizer_verified` of DraftModelConfig must be True or False, got 'yes'",
    ),
    "tree_top_k_of_a_wrong_type": (
        _generate(method="draft_model", draft=_weak_draft(), options={"tree_top_k": "2"}),
        TypeError,
        r"`tree_top_k` of DraftModelConfig must be an integer, got '2'",
    ),
    "onnx_provider_unknown": (
        lambda *_: OnnxDraftConfig(provider="tpu"),
        ValueError,
        r"`provider` of OnnxDraftConfig must be one of 'auto', 'cpu', 'cuda', got 'tpu'",
    ),
    "onnx_threads_negative": (
        lambda *_: OnnxDraftConfig(threads=-2),
        ValueError,
        r"`threads` of OnnxDraftConfig must be an integer >= 0, got -2",
    ),
    "head_drafter_confidence_of_a_wrong_type": (
        lambda *_: HeadDrafterConfig(min_confidence="high"),
        TypeError,
        r"`min_confidence` of HeadDrafterConfig must be a number, got 'high'",
    ),
    "custom_drafter_ids_outside_the_vocabulary": (
        _generate(method="_out_of_vocabulary"),
        ValueError,
        r"drafter _OutOfVocabulary \(method='_out_of_vocabulary'\) proposed token id 64, outside the "
        r"target's vocabulary \(ids 0..63\)\. Draft.tokens must hold the target's token ids",
    ),
    "custom_drafter_negative_padding": (
        _generate(method="_negative_padding"),
        ValueError,
        r"_NegativePadding .*proposed token id -1.*padding past each row's length included \(pad with 0\)",
    ),
    "custom_drafter_confidence_above_one": (
        _generate(method="_confidence_above_one"),
        ValueError,
        r"_ConfidenceAboveOne .*returned Draft.confidence from 1.5 to 1.5; .*a probability from 0 to 1",
    ),
    "custom_drafter_float_ids": (
        _generate(method="_float_tokens"),
        TypeError,
        r"_FloatTokens .*Draft.tokens of dtype torch.float32; .*return a torch.long tensor",
    ),
    "head_config_a_json_list": (
        _with_head_config(lambda config: [config]),
        ValueError,
        r"head_config.json holds \[\{.*, not a head config \(a JSON object\).*train or download the head",
    ),
    "head_config_null": (
        _with_head_config(lambda config: None),
        ValueError,
        r"head_config.json holds null, not a head config \(a JSON object\)",
    ),
    "head_config_zero_heads": (
        _with_head_config(_set(num_attention_heads=0)),
        ValueError,
        r"head_config.json does not describe a valid EagleHeadConfig: `num_attention_heads` of "
        r"EagleHeadConfig must be an integer >= 1, got 0.*train or download the head again",
    ),
    "head_config_negative_head_dim": (
        _with_head_config(_set(head_dim=-8)),
        ValueError,
        r"`head_dim` of EagleHeadConfig must be an integer >= 1, got -8",
    ),
    "head_config_heads_not_a_multiple_of_kv_heads": (
        _with_head_config(_set(num_attention_heads=3)),
        ValueError,
        r"num_attention_heads \(3\) must be a multiple of its num_key_value_heads \(2\)",
    ),
    "head_config_unknown_rope_type": (
        _with_head_config(_rope("spiral")),
        ValueError,
        r"rope_type 'spiral'; transformers knows 'default', 'dynamic', .*'yarn'",
    ),
    "head_config_string_eps": (
        _with_head_config(_set(rms_norm_eps="1e-6")),
        ValueError,
        r"`rms_norm_eps` of EagleHeadConfig must be a number, got '1e-6' \(str\)",
    ),
    "head_config_string_hidden_size": (
        _with_head_config(_set(hidden_size="32")),
        ValueError,
        r"`hidden_size` of EagleHeadConfig must be an integer, got '32' \(str\)",
    ),
    "published_head_config_a_json_list": (
        _with_published_config(lambda config: [config]),
        ValueError,
        r"config.json holds \[\{.*, not a config \(a JSON object\): the checkpoint is corrupt",
    ),
    "published_head_config_zero_heads": (
        _with_published_config(_set(num_attention_heads=0)),
        ValueError,
        r"config.json does not describe a valid EagleHeadConfig: `num_attention_heads` of EagleHeadConfig "
        r"must be an integer >= 1, got 0",
    ),
    "published_head_config_string_eps": (
        _with_published_config(_set(rms_norm_eps="small")),
        ValueError,
        r"config.json does not describe an EAGLE head's shape: its sizes and rms_norm_eps must be numbers "
        r"\(ValueError: could not convert.*Fix the file, or download the head again",
    ),
    "published_head_config_negative_head_dim": (
        _with_published_config(_set(head_dim=-8)),
        ValueError,
        r"config.json does not describe a valid EagleHeadConfig: `head_dim` of EagleHeadConfig must be an "
        r"integer >= 1, got -8",
    ),
    "medusa_compile_with_target": (  # its heads run once per step: nothing per token to compile
        _medusa(compile_with_target=False),
        ValueError,
        r"Unknown option\(s\) \['compile_with_target'\] for ChainTreeConfig; valid: \['min_confidence', "
        r"'tree_top_k'\]",
    ),
    "medusa_head_config_zero_heads": (
        _with_head_config(_set(num_heads=0), method="medusa"),
        ValueError,
        r"`num_heads` of MedusaHeadConfig must be an integer >= 1, got 0",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_with_the_fix(name, target, tmp_path, monkeypatch):
    call, error, fix = CASES[name]
    with pytest.raises(error, match=fix) as raised:
        call(target, tmp_path, monkeypatch)
    assert type(raised.value) is error, f"{type(raised.value).__name__}: {raised.value}"


def test_a_drafter_with_valid_ids_passes_the_seam(target):
    """The check at the seam refuses ids outside the vocabulary only: the last id is fine."""

    class _LastId(_OutOfVocabulary):
        name: ClassVar[str] = "_last_id"

        def propose(self, request):
            rows = len(request.row_ids)
            return Draft(torch.full((rows, 1), 63, dtype=torch.long), [1] * rows)

    register_drafter(_LastId)
    try:
        plain = target.generate(input_ids=PROMPT, max_new_tokens=6, do_sample=False)
        spec = target.generate(input_ids=PROMPT, max_new_tokens=6, do_sample=False, speculative="_last_id")
    finally:
        DRAFTERS.pop("_last_id")
    assert torch.equal(plain, spec)


def test_cases_cover_every_options_class():
    """Every drafter's options dataclass refuses a value of the wrong type by name (one home: fields.py)."""
    import dataclasses

    declared = {cls.options_class for cls in DRAFTERS.values() if cls.options_class is not None}
    assert {OnnxDraftConfig, HeadDrafterConfig} <= declared
    for config_cls in declared:
        for field in dataclasses.fields(config_cls):
            with pytest.raises(TypeError, match=rf"`{field.name}` of {config_cls.__name__} must be"):
                config_cls(**{field.name: object()})


def test_path_in_the_head_message_is_the_file(target, tmp_path):
    """The head-config messages name the file to fix or delete."""
    call, _, _ = CASES["head_config_zero_heads"]
    with pytest.raises(ValueError) as raised:
        call(target, tmp_path, None)
    assert str(Path(tmp_path) / "head" / CONFIG_NAME) in str(raised.value)
