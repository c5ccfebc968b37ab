"""`speculative=` in generate(), pipelines and streamers, on the real SmolLM2-135M."""

from __future__ import annotations

import copy
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, StaticCache, TextIteratorStreamer, pipeline

from hf_specdec import register_drafter
from hf_specdec.drafters import DRAFTERS, Draft, Drafter
from hf_specdec.heads.io import save_head
from hf_specdec.integration import _ORIGINAL_GENERATE

from .conftest import tiny_llama
from .helpers.heads import copied_layer_eagle
from .helpers.tokenizers import metaspace_bpe

MESSAGES = [
    {
        "role": "user",
        "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
        "The quick brown fox jumps over the lazy dog.",
    }
]


class RecordingStreamer:
    """The streamer protocol generate uses: put(prompt), put(tokens)..., end()."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended += 1


def _inputs(tokenizer, messages=MESSAGES):
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def test_generate_without_speculative_is_transformers_own(smollm2):
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    ours = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    theirs = _ORIGINAL_GENERATE(model, **inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, theirs)
    for off in (False, None):
        assert torch.equal(
            model.generate(**inputs, max_new_tokens=8, do_sample=False, speculative=off), theirs
        )


def test_pipeline_speculative_matches_plain(smollm2):
    model, tokenizer = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    plain = pipe(MESSAGES, max_new_tokens=24, do_sample=False)
    spec = pipe(MESSAGES, max_new_tokens=24, do_sample=False, speculative=True)
    assert spec == plain


def test_pipeline_batched(smollm2):
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    chats = [MESSAGES, [{"role": "user", "content": "Name a colour."}], [{"role": "user", "content": "Hi!"}]]
    plain = pipe(chats, max_new_tokens=16, do_sample=False, batch_size=3)
    spec = pipe(chats, max_new_tokens=16, do_sample=False, batch_size=3, speculative="ngram")
    assert spec == plain


def test_pipeline_returns_the_statistics_with_return_dict_in_generate(smollm2):
    """A pipeline keeps only generate's tensors; the statistics reach each record all the same."""
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    settings = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    (record,) = pipe(MESSAGES, **settings, speculative="ngram")
    assert record["speculative_stats"].method == "ngram" and record["speculative_stats"].emitted > 0
    chats = [MESSAGES, [{"role": "user", "content": "Name a colour."}]]
    batched = pipe(chats, **settings, speculative="ngram", batch_size=2)
    stats = [records[0]["speculative_stats"] for records in batched]
    # One call for the batch: both records share its statistics, which count both rows.
    assert stats[0] is stats[1] and stats[0].emitted > record["speculative_stats"].emitted
    # Nothing changes where no statistics were asked for, or no speculation ran.
    assert "speculative_stats" not in pipe(MESSAGES, max_new_tokens=4, do_sample=False, speculative=True)[0]
    assert "speculative_stats" not in pipe(MESSAGES, **settings)[0]


# A fixed draft length: the default policy may decline to draft on so short a call.
NGRAM_4 = {"method": "ngram", "num_draft_tokens": 4}
FOX = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"


def test_pipeline_options_match_plain(smollm2):
    """The text-generation pipeline's own options around generate: an assistant prefill continued,
    new text only, a stop sequence that ends the call on an accepted draft token (" fox" of the
    draft " fox jumps over the"), and max_new_tokens set at construction and per call."""
    model, tokenizer = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prefill = [*MESSAGES, {"role": "assistant", "content": "the quick brown fox"}]
    calls = [
        (prefill, dict(continue_final_message=True, max_new_tokens=12)),
        (MESSAGES, dict(return_full_text=False, max_new_tokens=12)),
        (FOX, dict(stop_sequence=" fox", max_new_tokens=12)),
    ]
    for prompt, options in calls:
        plain = pipe(prompt, do_sample=False, **options)
        assert pipe(prompt, do_sample=False, speculative=NGRAM_4, **options) == plain, options
    assert plain[0]["generated_text"] == FOX + " brown fox"
    (record,) = pipe(FOX, **calls[-1][1], do_sample=False, speculative=NGRAM_4, return_dict_in_generate=True)
    assert record["speculative_stats"].position_accepted[0] == 1  # " fox" came from the draft
    short = pipeline("text-generation", model=model, tokenizer=tokenizer, max_new_tokens=5, do_sample=False)
    for options in ({}, {"max_new_tokens": 9}):
        assert short(FOX, speculative="ngram", **options) == short(FOX, **options)


def test_a_text_generation_pipeline_keeps_speculative_from_construction(smollm2):
    """Given at construction, speculative= holds for every call; None or False at call time decodes
    plainly; an invalid value is refused by name."""
    model, tokenizer = smollm2
    pipe = pipeline(
        "text-generation", model=model, tokenizer=tokenizer, speculative="ngram", max_new_tokens=6,
        do_sample=False, return_dict_in_generate=True,
    )  # fmt: skip
    (record,) = pipe(FOX)
    assert record["speculative_stats"].method == "ngram"
    for off in (None, False):
        assert pipe(FOX, speculative=off) == [{"generated_text": record["generated_text"]}]
    assert pipe(FOX, speculative="suffix")[0]["speculative_stats"].method == "suffix"
    with pytest.raises(ValueError, match="Unknown speculative method 'bogus'"):
        pipe(FOX, speculative="bogus")


def test_a_streamer_through_a_pipeline_gets_its_text(smollm2):
    """A TextIteratorStreamer handed to the pipeline streams the text the pipeline returns, where a
    stop sequence ends the call inside an accepted draft as where it runs to max_new_tokens."""
    model, tokenizer = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    for options in (dict(max_new_tokens=16), dict(max_new_tokens=16, stop_sequence=" fox")):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
        settings = dict(streamer=streamer, return_full_text=False, do_sample=False, speculative=NGRAM_4)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(pipe, FOX, **settings, **options)
            streamed = "".join(streamer)
            (record,) = future.result()
        plain = pipe(FOX, return_full_text=False, do_sample=False, **options)
        assert streamed == record["generated_text"] == plain[0]["generated_text"]


def test_streamer_gets_every_token_once_in_order(smollm2):
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    streamer = RecordingStreamer()
    out = model.generate(**inputs, max_new_tokens=30, do_sample=False, speculative="ngram", streamer=streamer)
    prompt_len = inputs["input_ids"].shape[1]
    assert streamer.puts[0] == inputs["input_ids"][0].tolist()
    streamed = [t for chunk in streamer.puts[1:] for t in chunk]
    assert streamed == out[0, prompt_len:].tolist()
    assert streamer.ended == 1
    assert any(len(chunk) > 1 for chunk in streamer.puts[1:]), "accepted drafts arrive as multi-token chunks"


def test_text_iterator_streamer(smollm2):
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False, speculative="ngram", streamer=streamer)
    text = "".join(streamer)
    prompt_len = inputs["input_ids"].shape[1]
    assert text == tokenizer.decode(out[0, prompt_len:], skip_special_tokens=False)


def test_a_refused_call_ends_its_stream(smollm2):
    """A refusal comes after generate put the prompt: a chat app's consumer thread, iterating the
    stream, waited forever for its end."""
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    recording, texts = RecordingStreamer(), TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=5)
    for streamer in (recording, texts):
        with pytest.raises(ValueError, match="Tree drafts over a static cache"):
            model.generate(
                **inputs,
                max_new_tokens=8,
                cache_implementation="static",
                speculative={"method": "ngram", "tree": True},
                streamer=streamer,
            )
    assert recording.puts == [inputs["input_ids"][0].tolist()] and recording.ended == 1
    assert "".join(texts) == ""  # ended: no queue.Empty after the timeout


def test_stats_on_smollm2(smollm2):
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    out = model.generate(
        **inputs, max_new_tokens=30, do_sample=False, speculative="ngram", return_dict_in_generate=True
    )
    stats = out.speculative_stats
    assert stats.method == "ngram"
    assert stats.emitted == out.sequences.shape[1] - inputs["input_ids"].shape[1]
    assert stats.accepted > 0 and stats.mean_accepted_length == 1 + stats.accepted / stats.steps
    assert stats.steps == stats.speculative_steps + stats.plain_steps
    assert stats.draft_seconds > 0 and stats.verify_seconds > 0


def test_stop_strings_and_scores(smollm2):
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    kwargs = dict(max_new_tokens=30, do_sample=False, stop_strings=["lazy"], tokenizer=tokenizer)
    plain = model.generate(**inputs, **kwargs, return_dict_in_generate=True, output_scores=True)
    spec = model.generate(
        **inputs, **kwargs, speculative="ngram", return_dict_in_generate=True, output_scores=True
    )
    assert torch.equal(spec.sequences, plain.sequences)
    assert tokenizer.decode(spec.sequences[0]).endswith("lazy")
    assert len(spec.scores) == len(plain.scores)
    for ours, theirs in zip(spec.scores, plain.scores):
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
        torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize(
    "where", ["model_config", "given_config", "argument_none_over_config", "given_config_over_the_models"]
)
def test_stop_strings_are_read_where_generate_reads_them(smollm2, monkeypatch, where):
    """From the generation config generate merges: the model's own included, an argument (even
    None) over the config given, and the config given over the model's (whose " brown" comes first)."""
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    given = GenerationConfig(max_new_tokens=30, do_sample=False, stop_strings=["lazy"])
    kwargs = {
        "model_config": dict(max_new_tokens=30, do_sample=False),
        "given_config": dict(generation_config=given),
        "argument_none_over_config": dict(generation_config=given, stop_strings=None),
        "given_config_over_the_models": dict(generation_config=given),
    }[where]
    if where == "model_config":
        monkeypatch.setattr(model.generation_config, "stop_strings", ["lazy"])
    if where == "given_config_over_the_models":
        monkeypatch.setattr(model.generation_config, "stop_strings", [" brown"])
    plain = model.generate(**inputs, **kwargs, tokenizer=tokenizer)
    spec = model.generate(**inputs, **kwargs, tokenizer=tokenizer, speculative="ngram")
    assert torch.equal(spec, plain)
    assert tokenizer.decode(spec[0]).endswith("lazy") == (where != "argument_none_over_config")
    assert given.stop_strings == ["lazy"]  # the caller's config is left as it was


def test_auto_calls_on_one_model_start_from_what_verifying_cost_before_and_stay_lossless(target):
    """Each `auto` call starts from the verify costs the calls before measured on the model
    (`DEVICE_COSTS`); that changes how much is drafted, never what is generated."""
    from hf_specdec.core.policy import DEVICE_COSTS

    prompts = [torch.tensor([[6, 7, 8, 9] * 4]), torch.tensor([[10, 11, 12] * 5]), torch.tensor([[6, 7] * 6])]
    for ids in prompts * 2:
        plain = target.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
        out = target.generate(input_ids=ids, max_new_tokens=24, do_sample=False, speculative="ngram")
        assert torch.equal(out, plain)
    assert DEVICE_COSTS.policy(target).costs.measured_wide()  # carried: the next call needs no first look


@pytest.fixture(scope="module")
def left_padding(smollm2):
    """SmolLM2's tokenizer padding on the left, a copy: heal_tokens re-pads with its own side."""
    tokenizer = copy.deepcopy(smollm2[1])
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.mark.parametrize("case", ["with_its_mask", "without_a_mask", "chat_narrowed", "padded_batch"])
def test_token_healing_matches_plain(smollm2, left_padding, case):
    """generate heals the prompt after dropping the tokenizer a custom loop would need: healed
    before handing over, with the attention mask plain keeps. SmolLM2 heals "http:" to "http://"
    and "goi" to "goin"."""
    model, tokenizer = smollm2[0], left_padding
    inputs = {
        "with_its_mask": lambda: dict(tokenizer(["Read it at http:"], return_tensors="pt")),
        "without_a_mask": lambda: dict(
            input_ids=tokenizer(["He said he was goi"], return_tensors="pt").input_ids
        ),
        # Healing decodes without special tokens: 26 columns from 32, the mask of ones with them.
        "chat_narrowed": lambda: dict(_inputs(tokenizer)),
        "padded_batch": lambda: dict(
            tokenizer(["Read it at http:", "He said he was goi"], return_tensors="pt", padding=True)
        ),
    }[case]()
    kwargs = dict(max_new_tokens=8, do_sample=False, token_healing=True, tokenizer=tokenizer)
    plain = model.generate(**inputs, **kwargs)
    spec = model.generate(**inputs, **kwargs, speculative="ngram")
    assert torch.equal(spec, plain)
    prompt = inputs["input_ids"]
    assert not torch.equal(spec[:, : prompt.shape[1]], prompt)  # healed, not passed through


def test_token_healing_set_in_a_generation_config(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer(["Read it at http:"], return_tensors="pt")
    config = GenerationConfig(
        token_healing=True, max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=2
    )
    plain = model.generate(**inputs, generation_config=config, tokenizer=tokenizer)
    assert torch.equal(
        model.generate(**inputs, generation_config=config, tokenizer=tokenizer, speculative="ngram"), plain
    )
    assert config.token_healing  # the caller's config is left as it was


def test_token_healing_over_a_bos_matches_plain_without_a_mask():
    """Healing writes the pad token over BOS: plain generate inferred its mask (all ones) from the
    prompt before, which a mask inferred from the healed prompt would not be."""
    tokenizer = metaspace_bpe(160)  # Gemma-style: a BOS before every text
    tokenizer.pad_token = "<unk>"  # a pad that is not EOS: generate infers masks from it
    model = tiny_llama(0, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    kwargs = dict(max_new_tokens=8, do_sample=False, token_healing=True, tokenizer=tokenizer)
    healed = 0
    for text in ["The rabbit said that the fore", "the riv", "walked al"]:
        ids = tokenizer([text], return_tensors="pt").input_ids
        plain = model.generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **kwargs, speculative="ngram"), plain)
        healed += not torch.equal(plain[:, 1 : ids.shape[1]], ids[:, 1:])
    assert healed >= 2


def test_token_healing_refuses_a_padded_batch_it_narrows(smollm2, left_padding):
    """Plain generate would lay the batch's mask over the narrower healed prompts."""
    model, left = smollm2[0], left_padding
    chat = left.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = left(["Hello wor", chat], return_tensors="pt", padding=True)
    with pytest.raises(
        ValueError, match=r"re-tokenized the padded prompt to \d+ columns from \d+: plain generate"
    ):
        model.generate(**inputs, max_new_tokens=4, token_healing=True, tokenizer=left, speculative="ngram")


def test_a_draft_loaded_in_the_call_leaves_the_seeded_sample_plains(tmp_path):
    """Loading a head from its folder initialises modules, which draws from torch's generator: plain
    generate does not, so the sample and the generator after would be another seed's. A seeded tree
    call (chosen without draws: plain's sample) must not see the load."""
    target = tiny_llama(31, vocab_size=8, layers=1, eos_token_id=None)
    folder = save_head(copied_layer_eagle(target), tmp_path / "head")
    input_ids = torch.tensor([[1, 3, 4, 3, 4, 3, 4, 6, 3, 4]])
    kwargs = dict(max_new_tokens=8, do_sample=True, temperature=0.5)
    torch.manual_seed(0)
    plain, plain_after = target.generate(input_ids, **kwargs), torch.rand(3)
    torch.manual_seed(0)
    ours = target.generate(
        input_ids, **kwargs, speculative=dict(method="eagle", draft=str(folder), tree=True)
    )
    assert torch.equal(ours, plain) and torch.equal(torch.rand(3), plain_after)


def test_a_drafter_built_on_another_thread_leaves_this_threads_seeded_sample_plains():
    """A server thread seeds a request while another thread's call builds its drafter, which
    initialises a module before its weights would load. Saving and restoring torch's generator around
    the build (fork_rng) fed the seeded numbers to that module, then rewound the seed away."""
    loading, loaded = threading.Event(), threading.Event()

    class _LoadsSlowly(Drafter):
        name: ClassVar[str] = "_loads_slowly"
        takes_draft: ClassVar[bool] = False

        @classmethod
        def from_config(cls, config, target, tokenizer):
            loading.set()
            loaded.wait(timeout=60)
            torch.nn.Linear(8, 8)  # initialised, then its weights would load
            return cls()

        def propose(self, request):
            return Draft.empty(len(request.max_tokens), request.tokens.device)

    target = tiny_llama(31, vocab_size=8, layers=1, eos_token_id=None)
    input_ids = torch.tensor([[1, 3, 4, 3, 4, 3, 4, 6, 3, 4]])
    kwargs = dict(max_new_tokens=8, do_sample=True)
    torch.manual_seed(0)
    plain = target.generate(input_ids, **kwargs)
    register_drafter(_LoadsSlowly)
    try:
        other = threading.Thread(
            target=target.generate,
            args=(input_ids,),
            kwargs=dict(max_new_tokens=2, speculative="_loads_slowly"),
        )
        other.start()
        assert loading.wait(timeout=60)
        torch.manual_seed(0)  # this thread's request, seeded while the other builds
        loaded.set()
        other.join()
        assert torch.equal(target.generate(input_ids, **kwargs), plain)
    finally:
        DRAFTERS.pop("_loads_slowly")


def test_a_drafter_that_builds_a_transformers_model_leaves_the_seeded_generator():
    """Building a drafter that initialises a transformers model (a draft built from its config, or
    loaded with weights missing from its checkpoint) drew from torch's default generator: the next
    seeded sample was not plain's."""

    class _BuildsAModel(Drafter):
        name: ClassVar[str] = "_builds_a_model"
        takes_draft: ClassVar[bool] = False

        @classmethod
        def from_config(cls, config, target, tokenizer):
            type(target)(target.config)  # initialised under transformers' guard of torch.nn.init
            return cls()

        def propose(self, request):
            return Draft.empty(len(request.max_tokens), request.tokens.device)

    target = tiny_llama(31, vocab_size=8, layers=1, eos_token_id=None)
    torch.manual_seed(0)
    expected = torch.rand(3)
    register_drafter(_BuildsAModel)
    try:
        torch.manual_seed(0)
        target.generate(torch.tensor([[1, 3, 4]]), max_new_tokens=2, speculative="_builds_a_model")
        assert torch.equal(torch.rand(3), expected)
    finally:
        DRAFTERS.pop("_builds_a_model")


def test_a_pipeline_hands_its_tokenizer_to_a_draft_of_another_tokenizer():
    """A text-generation pipeline passes generate no tokenizer (only for stop strings and
    transformers' assistant_tokenizer=): a draft of another tokenizer was refused, "no tokenizers
    were given", though the pipeline holds the target's."""
    from hf_specdec.hub.tokenizer_check import PROBE_TEXT, shared_token_pairs

    from .helpers.tokenizers import CORPUS, byte_level_bpe, translated_copy

    corpus = CORPUS + PROBE_TEXT
    target_tok, draft_tok = byte_level_bpe(400, corpus), metaspace_bpe(200, corpus, bos=False)
    target = tiny_llama(0, len(target_tok), eos_token_id=target_tok.eos_token_id)
    draft = translated_copy(target, shared_token_pairs(target_tok, draft_tok), len(draft_tok), seed=1)
    target_tok.pad_token = target_tok.eos_token
    pipe = pipeline("text-generation", model=target, tokenizer=target_tok)
    prompts = ["the fox walked to the", "Once upon a time there was a little"]
    spec = dict(method="draft_model", draft=draft, draft_tokenizer=draft_tok, num_draft_tokens=4)
    kwargs = dict(max_new_tokens=10, do_sample=False, batch_size=2, return_dict_in_generate=True)
    out = pipe(prompts, speculative=spec, **kwargs)
    assert [[r["generated_text"] for r in rows] for rows in out] == [
        [r["generated_text"] for r in rows] for rows in pipe(prompts, **kwargs)
    ]
    assert out[0][0]["speculative_stats"].translation.startswith("token-level intersection")


@pytest.mark.parametrize("where", ["given_config", "given_by_position"])
def test_speculative_set_in_a_given_generation_config_is_refused_rather_than_ignored(target, where):
    """generate reads no `speculative` from a generation config (transformers keeps unknown entries
    there without a word), so a call would decode plainly where the user asked for speculation."""
    prompt = torch.tensor([[1, 7, 8, 9, 7, 8, 9, 7, 8]])
    config = GenerationConfig(max_new_tokens=4, speculative="ngram")
    calls = {
        "given_config": lambda: target.generate(prompt, generation_config=config),
        "given_by_position": lambda: target.generate(prompt, config),
    }
    with pytest.raises(ValueError, match=r"speculative='ngram' in the generation config passed"):
        calls[where]()


def test_speculative_in_the_models_generation_config_is_warned_of_and_plain_calls_still_run(
    target, monkeypatch
):
    """A checkpoint's generation config may carry the entry: plain calls decode as without it, and
    the user hears that it is not read."""
    prompt = torch.tensor([[1, 7, 8, 9, 7, 8, 9, 7, 8]])
    monkeypatch.setattr(target.generation_config, "speculative", "ngram", raising=False)
    with pytest.warns(UserWarning, match=r"speculative='ngram' in .*generation_config is not read"):
        out = target.generate(prompt, max_new_tokens=4)
    assert torch.equal(out, _ORIGINAL_GENERATE(target, prompt, max_new_tokens=4))
    monkeypatch.setattr(target.generation_config, "speculative", False, raising=False)  # says what it does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.generate(prompt, max_new_tokens=4)


def test_paged_cache_is_refused_rather_than_speculation_dropped(target):
    """generate sends cache_implementation='paged' to continuous batching before its custom_generate
    hook: speculative= would be dropped without a word (any draft=, even one that cannot load)."""
    prompt = torch.tensor([[1, 7, 9, 11, 7, 9]])
    with pytest.raises(ValueError, match="cache_implementation='paged'"):
        target.generate(prompt, max_new_tokens=4, cache_implementation="paged", speculative=True)


def test_continuous_batching_refuses_speculative_rather_than_dropping_it(target):
    """generate_batch takes any keyword and reads only max_new_tokens: speculative= would be dropped
    without a word, as with generate(cache_implementation='paged')."""
    prompts = [[1, 7, 9, 11, 7, 9], [1, 8, 8, 12]]
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=5, pad_token_id=0)
    for speculative in (True, "ngram", dict(method="draft_model", draft="/no/such/folder")):
        with pytest.raises(ValueError, match=r"generate_batch.*continuous batching, which does not draft"):
            target.generate_batch(prompts, generation_config=config, speculative=speculative)
    expected = [
        _ORIGINAL_GENERATE(target, torch.tensor([p]), generation_config=config)[0, len(p) :] for p in prompts
    ]
    # False (and None) run it as without: one run, as continuous batching takes seconds on a CPU.
    out = target.generate_batch(prompts, generation_config=config, warmup=False, speculative=False)
    assert [r.generated_tokens for r in out.values()] == [e.tolist() for e in expected]


def _filled_static_cache(model, prompt):
    """A StaticCache holding a first turn, and the conversation's ids with two new tokens."""
    cache = StaticCache(config=model.config, max_cache_len=64)
    first = model.generate(prompt, max_new_tokens=4, do_sample=False, past_key_values=cache)
    return cache, torch.cat([first, torch.tensor([[11, 12]])], dim=1)


# What speculative decoding here cannot reproduce and plain generate decodes, and its refusal.
_PLAIN_ONLY = {
    "use_cache=False": (lambda model, ids: (ids, dict(use_cache=False)), "needs the KV cache"),
    "guidance_scale": (lambda model, ids: (ids, dict(guidance_scale=1.5)), "ClassifierFreeGuidance"),
    "inputs_embeds": (
        lambda model, ids: (None, dict(inputs_embeds=model.get_input_embeddings()(ids))),
        "inputs_embeds is not supported",
    ),
    "filled StaticCache": (
        lambda model, ids: (lambda cache, ids: (ids, dict(past_key_values=cache)))(
            *_filled_static_cache(model, ids)
        ),
        "not a filled StaticCache",
    ),
    "beam search": (lambda model, ids: (ids, dict(num_beams=3)), "beam search"),
    # transformers' own streamers refuse a batch; plain generate streams it to one of one's own
    "a streamer with a batch": (
        lambda model, ids: (torch.cat([ids, ids.flip(-1)]), dict(streamer=RecordingStreamer())),
        "stream with batch size 1",
    ),
}


@pytest.mark.parametrize("case", list(_PLAIN_ONLY))
def test_a_call_speculation_cannot_reproduce_is_decoded_plainly_under_auto_and_refused_by_name(target, case):
    """`speculative=True` promises plain's output: where plain generate decodes a call that
    speculation here cannot reproduce, auto decodes it plainly and says why (it raised); a named
    method still refuses it with the error that says what to do."""
    from hf_specdec.core.checks import Unsupported

    build, refusal = _PLAIN_ONLY[case]
    prompt = torch.tensor([[1, 7, 8, 9, 10, 7, 8, 9]])
    ids, kw = build(target, prompt)
    greedy = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(ids, **greedy, **kw)
    plain_kw = kw
    ids, kw = build(target, prompt)  # a filled cache afresh
    out = target.generate(ids, **greedy, **kw, speculative=True)
    assert torch.equal(out.sequences, plain.sequences)
    if "streamer" in kw:  # every put as plain's
        assert kw["streamer"].puts == plain_kw["streamer"].puts and kw["streamer"].ended == 1
    if case != "beam search":  # generate's beam output, as plain's: no statistics
        assert out.speculative_stats.method == "plain"
        assert refusal in out.speculative_stats.selection
    ids, kw = build(target, prompt)
    with pytest.raises(Unsupported, match=refusal):
        target.generate(ids, **greedy, **kw, speculative="ngram")


def test_beam_search_decoded_plainly_refuses_a_streamer_as_plain_does(target):
    prompt = torch.tensor([[1, 7, 8, 9]])
    for given in ({}, {"speculative": True}):
        with pytest.raises(ValueError, match="`streamer` cannot be used with beam search"):
            target.generate(prompt, max_new_tokens=4, num_beams=2, streamer=RecordingStreamer(), **given)


@pytest.fixture(scope="module")
def own_attention() -> str:
    """An attention implementation registered as a user registers one (a kernel of their own): sdpa
    under another name, so plain decoding's output is sdpa's, while our masks are not its own."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("sdpa_of_a_test", sdpa_attention_forward)
    AttentionMaskInterface.register("sdpa_of_a_test", sdpa_mask)
    return "sdpa_of_a_test"


def test_a_sliding_window_under_another_attention_is_decoded_plainly_and_trees_become_chains(own_attention):
    """The loop keeps a sliding window whole and masks it itself, and masks a tree's branches, with
    4D masks only sdpa and eager attention take: under another attention (flash attention's, a
    kernel of one's own) every speculative call raised from inside the loop. A sliding-window model
    is now decoded plainly by auto (refused by name before the loop), and `tree="auto"` drafts chains."""
    from transformers import MistralConfig, MistralForCausalLM

    from hf_specdec.core.checks import Unsupported

    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, initializer_range=0.4, eos_token_id=5, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    sliding = MistralForCausalLM(config).eval()
    full = tiny_llama(0)
    prompt = torch.tensor([[1, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]])
    greedy = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    for model in (sliding, full):
        model.set_attn_implementation(own_attention)
    plain = sliding.generate(prompt, **greedy)
    out = sliding.generate(prompt, **greedy, speculative=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.speculative_stats.method == "plain" and own_attention in out.speculative_stats.selection
    with pytest.raises(Unsupported, match="need attn_implementation='sdpa' or 'eager'"):
        sliding.generate(prompt, **greedy, speculative="ngram")
    out = full.generate(prompt, **greedy, speculative={"method": "ngram", "tree": "auto"})
    assert torch.equal(out.sequences, full.generate(prompt, **greedy).sequences)
    assert out.speculative_stats.method == "ngram"
    with pytest.raises(ValueError, match="takes no tree mask"):
        full.generate(prompt, **greedy, speculative={"method": "ngram", "tree": True})


def _tiny_llava_pipeline():
    """An image-text-to-text pipeline over a tiny LLaVA: a word-level tokenizer (`<image>` id 4) and a
    CLIP image processor at 20x20 pixels, 16 soft tokens an image."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    from .helpers.tokenizers import word_level

    words = word_level(["<unk>", "<pad>", "<s>", "</s>", "<image>"] + [f"w{i}" for i in range(5, 64)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words.backend_tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="</s>",
        extra_special_tokens={"image_token": "<image>"},
    )  # fmt: skip
    tokenizer.chat_template = (
        "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
        "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
    )
    images = CLIPImageProcessor(size={"shortest_edge": 20}, crop_size={"height": 20, "width": 20})
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=5, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=tokenizer.chat_template,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=1, eos_token_id=None,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=20,
        patch_size=5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(
        LlavaConfig(text_config=text, vision_config=vision, image_token_id=4)
    )
    return pipeline("image-text-to-text", model=model.eval(), processor=processor)


def test_an_image_text_to_text_pipeline_speculates(monkeypatch):
    """image-text-to-text (and any-to-any) pipelines hand the arguments they do not know to the
    processor, not to generate: `pipe(chat, speculative=...)` decoded plainly without a word."""
    from PIL import Image

    import hf_specdec.integration

    calls = []
    decode = hf_specdec.integration.speculative_decode
    monkeypatch.setattr(
        hf_specdec.integration, "speculative_decode", lambda *a, **k: calls.append(1) or decode(*a, **k)
    )
    pipe = _tiny_llava_pipeline()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    chat = [[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": t}]}]
            for t in ("w10 w11 w12 w10 w11", "w20 w21")]  # fmt: skip
    plain = pipe(text=chat, max_new_tokens=12, batch_size=2)
    assert pipe(text=chat, max_new_tokens=12, batch_size=2, speculative="ngram") == plain
    assert calls == [1]
    kept = pipeline("image-text-to-text", model=pipe.model, processor=pipe.processor, speculative="ngram")
    assert kept(text=chat, max_new_tokens=12, batch_size=2) == plain  # given once, kept for every call
    assert calls == [1, 1]
    assert kept(text=chat, max_new_tokens=12, batch_size=2, speculative=None) == plain  # as text-generation
    assert calls == [1, 1]
    with pytest.raises(ValueError, match="speculative= is given twice"):
        pipe(text=chat, max_new_tokens=4, speculative="ngram", generate_kwargs={"speculative": "ngram"})


def test_speculative_in_an_image_text_pipelines_generate_kwargs_is_one_route_of_the_call(monkeypatch):
    """`generate_kwargs={"speculative": ...}` is the same setting as `speculative=`: at call time it
    overrides the one given at construction (None or False decodes plainly, another method drafts
    with it), as the call's generate_kwargs override construction's in transformers, given at
    construction it holds for every call, and only the two routes in one call are given twice."""
    from PIL import Image

    import hf_specdec.integration

    methods = []
    decode = hf_specdec.integration.speculative_decode
    monkeypatch.setattr(
        hf_specdec.integration,
        "speculative_decode",
        lambda *a, **k: methods.append(type(k["drafter"]).__name__) or decode(*a, **k),
    )
    pipe = _tiny_llava_pipeline()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    chat = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "w10 w11"}]}
    ]
    plain = pipe(text=chat, max_new_tokens=6)
    kept = pipeline("image-text-to-text", model=pipe.model, processor=pipe.processor, speculative="ngram")
    for off in (None, False):
        assert kept(text=chat, max_new_tokens=6, generate_kwargs={"speculative": off}) == plain
    assert methods == []
    assert kept(text=chat, max_new_tokens=6, generate_kwargs={"speculative": "suffix"}) == plain
    assert methods == ["SuffixDrafter"]
    in_kwargs = pipeline(
        "image-text-to-text",
        model=pipe.model,
        processor=pipe.processor,
        generate_kwargs={"speculative": "ngram"},
    )
    assert in_kwargs(text=chat, max_new_tokens=6) == plain
    assert methods == ["SuffixDrafter", "NgramDrafter"]
    with pytest.raises(ValueError, match="speculative= is given twice"):
        pipe(text=chat, max_new_tokens=6, speculative="ngram", generate_kwargs={"speculative": None})


@pytest.mark.parametrize("speculative", [True, "ngram"])
def test_a_model_whose_generate_runs_its_own_loop_refuses_speculative_by_name(speculative):
    """MusicGen's `generate` (as Dia's, RAG-Token's, CLVP's) is a loop of its own that never calls
    the generate hooked here: `speculative=` fell to transformers' check of model arguments, which
    named it only as an argument the model does not use, as for a typo."""
    from transformers import MusicgenDecoderConfig, MusicgenForCausalLM

    config = MusicgenDecoderConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64,
        num_codebooks=2, pad_token_id=0, bos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MusicgenForCausalLM(config).eval()
    # Its generation config leaves these unset, which its own loop needs.
    kwargs = dict(max_new_tokens=4, do_sample=False, decoder_start_token_id=0, num_return_sequences=1)
    prompt = torch.zeros(2 * config.num_codebooks, 1, dtype=torch.long)
    model.generate(prompt, **kwargs)  # plain decodes
    own_loop = r"MusicgenForCausalLM\.generate decodes with a loop of its own.*Drop speculative="
    with pytest.raises(ValueError, match=own_loop):
        model.generate(prompt, **kwargs, speculative=speculative)


def _tiny_blip2():
    """A tiny random BLIP-2 over OPT, whose own generate hands its language model `inputs_embeds`."""
    from transformers import Blip2Config, Blip2ForConditionalGeneration, OPTConfig

    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    text = OPTConfig(
        vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=128,
    )  # fmt: skip
    config = Blip2Config(
        vision_config=dict(layers, image_size=20, patch_size=5),
        qformer_config=dict(layers, vocab_size=64, encoder_hidden_size=32),
        text_config=text.to_dict(), num_query_tokens=4, image_token_index=5,
    )  # fmt: skip
    torch.manual_seed(0)
    return Blip2ForConditionalGeneration(config).eval()


def test_a_models_own_generate_handing_its_language_model_embeddings_is_decoded_plainly():
    """BLIP-2's generate (as InstructBLIP's, BLIP's, Kosmos-2's) calls its language model's with
    inputs it prepared itself (`inputs_embeds`): speculative=True gives plain's output, decoded
    plainly, and a named method's refusal says that such a model's own generate passes them."""
    model = _tiny_blip2()
    pixels = torch.randn(2, 3, 20, 20, generator=torch.Generator().manual_seed(1))
    prompt = torch.tensor([[5] * 4 + [1, 10, 11, 12, 10, 11], [5] * 4 + [1, 20, 21, 22, 23, 24]])
    kwargs = dict(pixel_values=pixels, input_ids=prompt, max_new_tokens=6, do_sample=False)
    kwargs.update(return_dict_in_generate=True)
    plain = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.speculative_stats.method == "plain" and "inputs_embeds" in out.speculative_stats.selection
    refusal = r"inputs_embeds is not supported.*a model's own generate builds them"
    with pytest.raises(ValueError, match=refusal):
        model.generate(**kwargs, speculative="ngram")


def _tiny_csm():
    """A tiny random CSM, whose `_sample` runs its depth decoder for the other codebooks each step."""
    from transformers import CsmConfig, CsmForConditionalGeneration

    layers = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    layers.update(num_key_value_heads=2)
    depth = dict(layers, num_codebooks=3, backbone_hidden_size=32, vocab_size=6, max_position_embeddings=10)
    codec = dict(
        model_type="mimi", hidden_size=32, num_filters=8, num_residual_layers=1, upsampling_ratios=[8, 4],
        codebook_size=64, vector_quantization_hidden_dimension=64, upsample_groups=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, sliding_window=4, codebook_dim=64, use_cache=False,
    )  # fmt: skip
    config = CsmConfig(
        depth_decoder_config=depth, codec_config=codec, **layers, num_codebooks=3, vocab_size=6,
        text_vocab_size=16, max_position_embeddings=64, bos_token_id=1, pad_token_id=2, eos_token_id=3,
        codebook_pad_token_id=2, codebook_eos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    return CsmForConditionalGeneration(config).eval()


def test_a_model_whose_own_sample_loop_decodes_each_step_is_decoded_plainly(caplog):
    """CSM's generate is transformers' with a `_sample` of its own (its depth decoder fills the other
    codebooks of each frame), and its prompts are [batch, frames, codebooks]: speculative=True failed
    on the prompt's shape ("too many values to unpack"), and a named method was refused for
    position_ids the call never passed. The loop replaces `_sample`, so it is decoded plainly, and
    the output is CSM's own (which it rebuilds from generate's fields: no `speculative_stats`)."""
    model = _tiny_csm()
    prompt = torch.tensor([[[4, 5, 4], [5, 4, 5], [4, 5, 4], [5, 4, 5]]] * 2)
    kwargs = dict(input_ids=prompt, max_new_tokens=5, do_sample=False, depth_decoder_do_sample=False)
    plain = model.generate(**kwargs, return_dict_in_generate=True)
    with caplog.at_level("INFO", logger="hf_specdec"):
        out = model.generate(**kwargs, return_dict_in_generate=True, speculative=True)
    assert type(out) is type(plain) and torch.equal(out.sequences, plain.sequences)
    own_loop = "CsmForConditionalGeneration decodes each step with a loop of its own"
    assert f"decodes plainly: {own_loop}" in caplog.text
    assert torch.equal(model.generate(**kwargs, speculative=True), plain.sequences)
    with pytest.raises(ValueError, match=own_loop):
        model.generate(**kwargs, speculative="ngram")


def test_a_pipeline_over_a_model_whose_generation_config_holds_speculative_still_runs(smollm2):
    """A text-generation pipeline passes generate a copy of the model's generation config: the entry
    a checkpoint brought is warned of there as in a plain call, not refused as the caller's."""
    model, tokenizer = smollm2
    plain = pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = plain(MESSAGES, max_new_tokens=6, do_sample=False)
    model.generation_config.speculative = "ngram"
    try:
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        with pytest.warns(UserWarning, match="generation_config is not read"):
            assert pipe(MESSAGES, max_new_tokens=6, do_sample=False) == expected
    finally:
        del model.generation_config.speculative
