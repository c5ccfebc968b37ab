"""What plain decoding feeds the model besides the prompt: models that PEFT rewires for its own
`generate` call (prompt learning, arguments hooked into the layers) are decoded plainly by
`speculative=True` and refused by a named method, never decoded as if PEFT had not rewired them."""

from __future__ import annotations

import functools

import pytest
import torch
from peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model
from transformers import LlamaForCausalLM

from ..conftest import random_batch, tiny_llama

GREEDY = dict(max_new_tokens=16, do_sample=False)


def _lora(model, name: str, seed: int, **options):
    """`model` with a LoRA adapter whose B weights are not zero, so that it changes the outputs."""
    modules = ["q_proj", "v_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=16, target_modules=modules, task_type=TaskType.CAUSAL_LM, **options)
    if hasattr(model, "peft_config"):
        model.add_adapter(name, config)
    else:
        model = get_peft_model(model, config, adapter_name=name)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, weight in model.named_parameters():
            if "lora_B" in key and f".{name}." in key:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    return model.eval()


@pytest.mark.parametrize("config", [PrefixTuningConfig, PromptTuningConfig])
def test_prompt_learning_decodes_plainly_under_auto_and_named_methods_refuse(config):
    """Prefix and prompt tuning add their virtual tokens in the input preparation PEFT puts on the
    model for its `generate` call, which the loop never called: it decoded the bare model's text."""
    torch.manual_seed(1)
    model = get_peft_model(tiny_llama(0), config(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=5)).eval()
    with torch.no_grad():
        for weight in model.prompt_encoder.parameters():
            weight.normal_(0, 1.0)
    input_ids, attention_mask = random_batch(3, 2)
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, return_dict_in_generate=True, **GREEDY)
    plain = model.generate(**kw)
    assert not torch.equal(plain.sequences, tiny_llama(0).generate(**kw).sequences)  # the prompt counts
    out = model.generate(**kw, speculative=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.speculative_stats.method == "plain"
    assert "prepare_inputs_for_generation" in out.speculative_stats.selection
    with pytest.raises(ValueError, match="prepare_inputs_for_generation is replaced.*Drop speculative="):
        model.generate(**kw, speculative="ngram")
    with model.disable_adapter():  # PEFT leaves the model's own input preparation: it speculates
        bare = model.generate(**kw, speculative="ngram")
    assert torch.equal(bare.sequences, tiny_llama(0).generate(**kw).sequences)
    assert bare.speculative_stats.method == "ngram"


def test_arguments_peft_hooks_into_the_layers_decode_plainly_under_auto_and_named_methods_refuse():
    """aLoRA applies its adapter to the last few tokens of each forward: a verify forward wider than
    that ran its first tokens without it, and the text differed from plain's. A mixed batch's
    adapter per row stopped matching the rows once one had finished (PEFT's error)."""
    input_ids, attention_mask = random_batch(3, 3)
    prompt = input_ids[:1, -8:].clone()
    prompt[0, -3:-1] = torch.tensor([40, 41])  # the invocation, 3 tokens from the end: offset 3
    alora = _lora(tiny_llama(0), "default", 7, alora_invocation_tokens=[40, 41])
    wide = dict(method="ngram", num_draft_tokens=6)
    for model, kw in (
        (alora, dict(input_ids=prompt, attention_mask=torch.ones_like(prompt))),
        (
            _lora(_lora(tiny_llama(0), "a", 7), "b", 11),
            dict(input_ids=input_ids, attention_mask=attention_mask, adapter_names=["a", "b", "__base__"]),
        ),
    ):
        plain = model.generate(**kw, **GREEDY)
        out = model.generate(**kw, **GREEDY, speculative=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.method == "plain"
        with pytest.raises(ValueError, match="PEFT hooks arguments of this call"):
            model.generate(**kw, **GREEDY, speculative=wide)


def test_a_lora_adapter_speculates():
    """The active adapter, or another one set active, is in the layers' weights: nothing to refuse."""
    model = _lora(_lora(tiny_llama(0), "a", 7), "b", 11)
    input_ids, attention_mask = random_batch(3, 3)
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, **GREEDY)
    for name in ("a", "b"):
        model.set_adapter(name)
        plain = model.generate(**kw)
        out = model.generate(**kw, speculative="ngram", return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.method == "ngram"


class _Boostable(LlamaForCausalLM):
    """A user's model class whose forward reads an input of its own."""

    @functools.wraps(LlamaForCausalLM.forward)
    def forward(self, *args, boost=None, **kwargs):
        out = super().forward(*args, **kwargs)
        if boost is not None:
            out.logits[..., boost] += 100.0
        return out


class _Boosted(_Boostable):
    """It prepares that input for every forward."""

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return {**super().prepare_inputs_for_generation(*args, **kwargs), "boost": 7}


class _Counted(_Boostable):
    """It carries that input from step to step (transformers' preparation passes it on)."""

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        return {**model_kwargs, "boost": 7}


@pytest.mark.parametrize(
    "cls, method",
    [(_Boosted, "prepare_inputs_for_generation"), (_Counted, "_update_model_kwargs_for_generation")],
)
def test_a_model_class_preparing_its_own_inputs_decodes_plainly_under_auto_and_named_methods_refuse(
    cls, method
):
    """A subclass's (or remote code's) input preparation feeds the model what plain decoding gives
    it, and the loop builds each step's inputs without it: auto decodes such a class plainly, a
    named method refuses it."""
    model = cls(tiny_llama(0).config).eval()
    model.load_state_dict(tiny_llama(0).state_dict())
    input_ids, attention_mask = random_batch(3, 2)
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, **GREEDY)
    plain = model.generate(**kw)
    assert bool((plain[:, input_ids.shape[1] + 1 :] == 7).all())  # the class's own input counts
    out = model.generate(**kw, speculative=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.method == "plain"
    assert f"{cls.__name__}.{method}" in out.speculative_stats.selection
    with pytest.raises(ValueError, match=f"{method} .* is not transformers' own.*Drop speculative="):
        model.generate(**kw, speculative="ngram")
