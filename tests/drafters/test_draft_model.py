"""The draft-model drafter's own timings: what the policy learns draft costs from; drafts that are no
draft model, refused."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import LoraConfig, PromptTuningConfig, TaskType, get_peft_model

from hf_specdec.config import SpeculativeConfig
from hf_specdec.core.draft import DraftRequest
from hf_specdec.core.processing import ScoreProcessor
from hf_specdec.drafters.draft_model import DraftModelDrafter
from hf_specdec.heads.io import save_head

from ..conftest import random_batch, tiny_llama
from ..helpers import mtp
from ..helpers.block_drafts import random_block_draft
from ..helpers.heads import copied_layer_eagle
from ..helpers.published import write_medusa


def _request(tokens: torch.Tensor, k: int) -> DraftRequest:
    return DraftRequest(
        tokens=tokens,
        attention_mask=torch.ones_like(tokens),
        lengths=[tokens.shape[1]],
        max_tokens=[k],
        do_sample=False,
        processor=ScoreProcessor(None, 64, 1),
        row_ids=[0],
    )


def _drafter(target, draft) -> DraftModelDrafter:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compatibility judged by vocabulary size: known here
        config = SpeculativeConfig(method="draft_model", draft=draft)
        return DraftModelDrafter.from_config(config, target, None)


def test_catch_ups_are_reported_and_steady_steps_are_not(target, good_draft):
    drafter = _drafter(target, good_draft)
    prompt = torch.randint(6, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    first = drafter.propose(_request(prompt, 3))
    assert first.catch_up_seconds > 0  # the whole prompt
    # The next step: the first two draft tokens were accepted and the target added one of its own.
    grown = torch.cat([prompt, first.tokens[:, :2], torch.tensor([[7]])], dim=1)
    second = drafter.propose(_request(grown, 3))
    assert second.catch_up_seconds == 0.0
    assert second.lengths == [3]
    # Ten plain steps later the draft has ten tokens to catch up on before it drafts again.
    later = torch.cat(
        [grown, torch.randint(6, 64, (1, 10), generator=torch.Generator().manual_seed(2))], dim=1
    )
    assert drafter.propose(_request(later, 3)).catch_up_seconds > 0


def test_probe_times_a_draft_token_without_touching_the_drafter(target, good_draft):
    prompt = torch.randint(6, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    probed, fresh = _drafter(target, good_draft), _drafter(target, good_draft)
    seconds = probed.probe_seconds(4)
    assert 0 < seconds < 5
    assert torch.equal(probed.propose(_request(prompt, 4)).tokens, fresh.propose(_request(prompt, 4)).tokens)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_draft_whose_logits_overflowed_stops_drafting_when_sampling(target, good_draft, poison):
    """A draft whose logits hold a NaN or +inf (an fp16 draft that overflowed) leaves no
    distribution to sample a draft token from: its rows stop drafting, as they do greedy, and the
    call decodes as plain would, rather than raising from the draft's torch.multinomial."""
    draft = copy.deepcopy(good_draft)
    draft.lm_head.register_forward_hook(
        lambda module, args, out: out.index_fill(-1, torch.tensor([7]), poison)
    )
    input_ids, attention_mask = random_batch(0, 2)
    spec = SpeculativeConfig(method="draft_model", draft=draft, num_draft_tokens=3)
    out = target.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        max_new_tokens=6,
        speculative=spec,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape[1] > input_ids.shape[1] and out.speculative_stats.drafted == 0


def test_tokenizer_checks_are_remembered_per_pair_of_tokenizers(smollm2_path):
    from transformers import AutoTokenizer

    from hf_specdec.hub.tokenizer_check import compare_tokenizers_once

    one, other = AutoTokenizer.from_pretrained(smollm2_path), AutoTokenizer.from_pretrained(smollm2_path)
    first = compare_tokenizers_once(one, other)
    assert first.compatible and compare_tokenizers_once(one, other) is first
    assert compare_tokenizers_once(other, one) is not first  # another pair is checked anew


def test_a_tokenizer_grown_in_place_is_compared_again(smollm2_path):
    from transformers import AutoTokenizer

    from hf_specdec.hub.tokenizer_check import compare_tokenizers_once

    one, other = AutoTokenizer.from_pretrained(smollm2_path), AutoTokenizer.from_pretrained(smollm2_path)
    assert compare_tokenizers_once(one, other).compatible
    other.add_tokens(["<only-in-the-draft>"])
    one.add_tokens(["<only-in-the-target>"])  # the same new id means another string
    assert not compare_tokenizers_once(one, other).compatible


@pytest.mark.parametrize("translation", ["intersection", "text"])
def test_a_draft_tokenizer_listing_special_tokens_past_its_embedding_drafts(target, translation):
    """Gemma 3's tokenizer, shared by its sizes, lists `<image_soft_token>` at id 262144, past the
    262144 ids of the text-only models: a draft of another tokenizer with its own tokenizer was
    refused as if handed a wrong one. The draft reads text without special tokens, also where the
    text spells one's name (here the target's word "w7"), so it is never fed the id it cannot embed."""
    from ..helpers.tokenizers import word_level

    words = ["<unk>", *(f"w{i}" for i in range(1, 64))]
    draft_tokenizer = word_level(["<unk>", *(f"d{i}" for i in range(1, 8)), *words[8:]])  # 64 ids
    draft_tokenizer.add_special_tokens({"additional_special_tokens": ["w7"]})  # id 64: past the draft's
    prompt = torch.tensor([[1, 7, 8, 9, 7, 8, 9]])  # w7: no draft token spells it
    spec = dict(
        method="draft_model",
        draft=tiny_llama(1),
        draft_tokenizer=draft_tokenizer,
        num_draft_tokens=3,
        options=dict(translation=translation),
    )
    plain = target.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    out = target.generate(
        input_ids=prompt, max_new_tokens=8, do_sample=False, tokenizer=word_level(words), speculative=spec
    )
    assert torch.equal(out, plain)


def test_a_tokenizer_far_smaller_than_its_models_vocabulary_is_named(target):
    """A draft given the target's tokenizer (or the two swapped) passes for a draft sharing it, and
    drafts ids that mean other tokens to it: nothing is refused (the output is the target's), but a
    tokenizer with less than half its model's embedding is named as likely not that model's."""
    from ..helpers.tokenizers import word_level

    tokenizer = word_level(["<unk>", *(f"w{i}" for i in range(1, 64))])  # 64 tokens, the target's
    prompt = torch.tensor([[1, 7, 8, 9, 7, 8, 9]])
    spec = dict(method="draft_model", draft=tiny_llama(1, vocab_size=256), draft_tokenizer=tokenizer)
    plain = target.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    with pytest.warns(
        UserWarning, match=r"as the draft's \(draft_tokenizer=\) has 64 tokens, and its model embeds 256"
    ):
        out = target.generate(
            input_ids=prompt, max_new_tokens=8, do_sample=False, tokenizer=tokenizer, speculative=spec
        )
    assert torch.equal(out, plain)


def test_a_draft_head_given_as_a_draft_model_names_its_method(target):
    """transformers' MtpModel, a head or a block draft of ours is no draft model: refused with the
    method that runs it, before the draft model's first forward would fail inside it."""
    mtp_target, layers = mtp.target_and_layers(num_hidden_layers=2, first_k_dense_replace=2)
    drafts = [
        (mtp_target, layers, "mtp"),
        (target, copied_layer_eagle(target), "eagle"),
        (target, random_block_draft(target, (0, 1)), "dflash"),
    ]
    for model, draft, method in drafts:
        spec = dict(method="draft_model", draft=draft)
        with pytest.raises(ValueError, match=rf"is not a draft model.*method='{method}'"):
            model.generate(torch.tensor([[2, 3, 4]]), max_new_tokens=3, speculative=spec)


def test_a_draft_head_named_as_a_draft_model_is_refused_before_loading(target, tmp_path):
    """Named by its folder, it is told by what the head loaders read (`drafters.kind`), before
    transformers is asked to load it as a causal LM: ours, an authors' layout, a block draft."""
    save_head(copied_layer_eagle(target), tmp_path / "ours")
    save_head(random_block_draft(target, (0, 1)), tmp_path / "block")
    write_medusa(tmp_path / "medusa", target)
    for name, method in (("ours", "eagle"), ("block", "dflash"), ("medusa", "medusa")):
        spec = dict(method="draft_model", draft=str(tmp_path / name))
        with pytest.raises(ValueError, match=rf"is not a draft model.*method='{method}'"):
            target.generate(torch.tensor([[2, 3, 4]]), max_new_tokens=3, speculative=spec)


def test_a_draft_without_weights_is_refused(target, good_draft):
    """A draft built on the `meta` device (never loaded) is refused before its first forward, which
    failed in torch ("Tensor.item() cannot be called on meta tensors")."""
    empty = copy.deepcopy(good_draft).to("meta")
    with pytest.raises(ValueError, match=r"draft LlamaForCausalLM has no weights: .*meta device"):
        _drafter(target, empty)


@pytest.mark.parametrize("method", ["draft_model", "auto"])
def test_a_draft_that_is_no_causal_lm_is_refused_saying_how_to_load_one(target, good_draft, method):
    """A base model without its LM head (what AutoModel loads) or another module: was an
    AttributeError from deep inside (`_supports_default_dynamic_cache`, `config`)."""
    inputs = dict(input_ids=torch.tensor([[7, 8, 9]]), max_new_tokens=2, do_sample=False)
    for draft in (good_draft.model, torch.nn.Linear(3, 3)):
        with pytest.raises(ValueError, match=r"is no causal LM: .*AutoModelForCausalLM"):
            target.generate(**inputs, speculative=dict(method=method, draft=draft))


def test_a_draft_checkpoint_missing_weights_is_refused(target, good_draft, tmp_path):
    """transformers loads a checkpoint that lacks weights with random ones in their place and only
    logs it: a draft whose drafts are noise, slower than no draft. Refused, naming what is missing."""
    from safetensors.torch import load_file, save_file

    from hf_specdec.drafters import draft_model

    good_draft.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 of its weights \(model\.norm\.weight\)"):
        draft_model.load_draft(str(tmp_path), target)
    with pytest.raises(ValueError, match=r"lacks 1 of its weights"):
        target.generate(torch.tensor([[7, 8, 9]]), max_new_tokens=2, speculative=dict(draft=str(tmp_path)))


def test_a_draft_folder_that_is_not_a_causal_lm_is_refused_in_one_line(target, t5_folder):
    """A T5 folder as draft= (`hf-specdec bench --draft ./t5`) reached AutoModelForCausalLM, whose
    error lists every causal config class: some 4,000 characters and no word of what to pass."""
    from hf_specdec.drafters import draft_model

    with pytest.raises(ValueError) as err:
        draft_model.load_draft(str(t5_folder), target)
    message = str(err.value)
    assert f"The draft {t5_folder} is a t5 model (T5ForConditionalGeneration), not a causal LM" in message
    assert "\n" not in message and len(message) < 400


def test_a_draft_named_by_folder_is_the_one_in_that_folder_now(
    target, good_draft, weak_draft, tmp_path, monkeypatch
):
    """The loaded draft is kept by what it was loaded from: a draft saved again into its folder, or
    a relative name read from another working directory, is loaded anew. It was kept by the name
    given, so such calls drafted with the earlier draft without a word (slower, other statistics)."""
    from hf_specdec.drafters import draft_model

    monkeypatch.setattr(draft_model, "_LOADED", {})

    def weight(draft):
        return draft.model.layers[-1].mlp.down_proj.weight

    weak_draft.save_pretrained(tmp_path / "draft")
    assert torch.equal(weight(draft_model.load_draft(str(tmp_path / "draft"), target)[0]), weight(weak_draft))
    good_draft.save_pretrained(tmp_path / "draft")  # retrained, saved over it
    assert torch.equal(weight(draft_model.load_draft(str(tmp_path / "draft"), target)[0]), weight(good_draft))

    weak_draft.save_pretrained(tmp_path / "elsewhere" / "draft")
    monkeypatch.chdir(tmp_path)
    assert torch.equal(weight(draft_model.load_draft("draft", target)[0]), weight(good_draft))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert torch.equal(weight(draft_model.load_draft("draft", target)[0]), weight(weak_draft))


@pytest.mark.parametrize("which", ["draft", "target as its own draft"])
def test_a_draft_given_keeps_its_training_mode(target, good_draft, which):
    """A draft passed in is run in the mode it is in, as transformers runs an `assistant_model`: it
    was switched to eval for good, so a draft mid-training (or a target in train mode passed as its
    own draft, verified then without the dropout plain applies) came back in eval mode."""
    model = copy.deepcopy(target).train()
    draft = model if which != "draft" else copy.deepcopy(good_draft).train()
    ids = torch.tensor([[7, 8, 9, 10, 7, 8, 9]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vocabulary-size check, the target as its own draft
        out = model.generate(
            input_ids=ids,
            max_new_tokens=6,
            do_sample=False,
            speculative=dict(method="draft_model", draft=draft),
        )
    assert all(m.training for m in [*model.modules(), *draft.modules()])
    assert torch.equal(
        out, model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    )  # no dropout here


def test_a_peft_model_drafts_with_its_adapter_and_prompt_learning_is_refused(target):
    """A PEFT model given as the draft failed deep inside (its wrapper class is no transformers
    model); a LoRA one drafts as the model it wraps, adapter and all, and a prompt-tuned one, whose
    virtual tokens only PEFT's own generate adds, is refused naming the remedy."""
    draft = get_peft_model(
        tiny_llama(0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type=TaskType.CAUSAL_LM)
    )
    with torch.no_grad():
        for name, weight in draft.named_parameters():
            if "lora_B" in name:
                weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(3))
    input_ids, attention_mask = random_batch(3, 3)
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False)
    plain = target.generate(**kw)
    for speculative in (dict(method="draft_model", draft=draft), dict(draft=draft)):
        speculative["num_draft_tokens"] = 3  # drafts every step, whatever drafting costs here
        out = target.generate(**kw, speculative=speculative, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.method == "draft_model" and out.speculative_stats.accepted > 0
    prompt_tuned = get_peft_model(
        tiny_llama(0), PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3)
    )
    with pytest.raises(ValueError, match=r"PEFT PROMPT_TUNING model.*get_base_model\(\)"):
        target.generate(**kw, speculative=dict(draft=prompt_tuned))


def test_a_draft_folder_whose_tokenizer_does_not_load_says_so(target, good_draft, tmp_path):
    """A draft folder whose tokenizer files are damaged (a truncated tokenizer.json) was read as
    one without a tokenizer: the pair was judged by vocabulary size alone, with advice to pass
    draft_tokenizer=, which a draft named by folder refuses. Refused, naming the file and the fix."""
    from hf_specdec.drafters import draft_model
    from tests.hub_server import tiny_tokenizer

    good_draft.save_pretrained(tmp_path)
    tiny_tokenizer("A").save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text()[:100])
    with pytest.raises(
        ValueError, match=r"has tokenizer files that do not load \(JSONDecodeError.*download it again"
    ):
        draft_model.load_draft(str(tmp_path), target)


def test_a_draft_folder_without_a_tokenizer_is_not_told_to_pass_draft_tokenizer(target, tmp_path):
    """A draft named by a folder that holds no tokenizer, of another vocabulary size than the
    target's: the error said to pass `draft_tokenizer=`, which a draft named by folder refuses.
    It says to save the tokenizer beside the draft, or to pass the draft loaded."""
    tiny_llama(1, vocab_size=80).save_pretrained(tmp_path)
    spec = dict(method="draft_model", draft=str(tmp_path))
    with pytest.raises(ValueError, match="cannot be compared") as err:
        target.generate(torch.tensor([[7, 8, 9]]), max_new_tokens=2, speculative=spec)
    assert "`draft_tokenizer=` in the SpeculativeConfig" not in str(err.value)
    assert f"its tokenizer saved in {tmp_path}" in str(err.value)
    from tests.hub_server import tiny_tokenizer

    with pytest.raises(ValueError, match="would go unused"):  # what the old advice led to
        spec["draft_tokenizer"] = tiny_tokenizer("A")
        target.generate(torch.tensor([[7, 8, 9]]), max_new_tokens=2, speculative=spec)
