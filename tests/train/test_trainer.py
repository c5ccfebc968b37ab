"""Training heads: it learns, it saves a head that drafts losslessly, it resumes, it refuses bad data."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec.heads.checkpoint import load_head
from hf_specdec.train import train_draft
from hf_specdec.train.data import MIN_TOKENS, Sequence, build_sequences, load_prompts
from hf_specdec.train.features import target_features
from hf_specdec.train.trainer import TrainConfig, _index_of, _loss, _new_head, feature_layers, train_head

from ..conftest import assert_greedy_match, random_batch, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(40, layers=1, eos_token_id=None)


@pytest.fixture(scope="module")
def examples(target):
    """The target's own greedy continuations of random prompts, as the trainer sees them."""
    input_ids, attention_mask = random_batch(seed=41, batch=48, min_len=3, max_len=8)
    out = target.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=48, do_sample=False
    )
    sequences = []
    for row, mask in zip(out, attention_mask):
        prompt_len = int(mask.sum())
        sequences.append(Sequence(row[input_ids.shape[1] - prompt_len :], prompt_len))
    return target_features(target, sequences, layers=(-1,))


def test_features_are_the_targets_hidden_states_and_greedy_tokens(target, examples):
    e = examples[0]
    with torch.no_grad():
        out = target(e.ids[None], output_hidden_states=True)
    torch.testing.assert_close(e.features.float(), out.hidden_states[-1][0], atol=2e-2, rtol=2e-2)  # bf16
    assert torch.equal(e.labels, out.logits[0].argmax(-1))
    # In the answer the target's greedy choice is the next token itself.
    assert torch.equal(e.labels[e.answer_start - 1 : -1], e.ids[e.answer_start :])


STEPS = {"eagle": 80, "medusa": 600, "mtp": 80}  # Medusa's heads, one linear layer each, learn more slowly


@pytest.mark.parametrize("method", ["eagle", "medusa", "mtp"])
def test_training_lowers_the_loss_and_saves_a_lossless_head(target, examples, method, tmp_path):
    # A step cap, not a time budget alone: on a loaded machine 15 s were too few steps to learn.
    config = TrainConfig(
        method=method,
        minutes=5,
        max_steps=STEPS[method],
        draft_vocab_size=48,
        eval_every_minutes=5,
        holdout=0.1,
    )
    head = _new_head(target, examples, config)
    to_draft = _index_of(head.draft_vocab, 64)
    with torch.no_grad():
        before = float(_loss(head, examples[:16], to_draft, config)[0])
    log = train_head(target, examples, tmp_path, config)
    trained = load_head(str(tmp_path), target, method=method)
    with torch.no_grad():
        after = float(_loss(trained.float(), examples[:16], to_draft, config)[0])
    assert after < 0.8 * before, (before, after)
    saved = json.loads((tmp_path / "training.json").read_text())
    assert saved["steps"] == log["steps"] == STEPS[method] and saved["history"][-1]["tau"] >= 1.0
    assert len(saved["history"][-1]["acceptance"]) == (4 if method == "medusa" else 3)

    input_ids, attention_mask = random_batch(seed=42, batch=3)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=32, do_sample=False)
    plain = target.generate(**kwargs)
    spec = target.generate(**kwargs, speculative=dict(method=method, draft=str(tmp_path), num_draft_tokens=3))
    assert_greedy_match(target, plain, spec, attention_mask)


def test_medusa_learns_the_targets_greedy_tokens_not_the_texts(target, examples):
    """In a corpus or an answer sampled from the target (`--answers-per-prompt`), the token that
    follows is not what the target picks greedily there, which is what a draft is verified against.
    EAGLE and DFlash learn the target's choices (`labels`); Medusa learnt the text's tokens, and its
    held-out acceptance judged against them too, so that a head trained on a corpus learnt the
    corpus. Its loss and verdicts are now the same whatever tokens the text holds."""
    config = TrainConfig(method="medusa", draft_vocab_size=48)
    head = _new_head(target, examples, config)
    to_draft = _index_of(head.draft_vocab, 64)
    greedy = examples[0]
    start = greedy.answer_start
    torch.manual_seed(0)
    other = torch.randint(3, 64, (len(greedy.ids) - start,))
    sampled = type(greedy)(torch.cat([greedy.ids[:start], other]), greedy.features, greedy.labels, start)
    with torch.no_grad():
        loss, hits = _loss(head, [greedy], to_draft, config, judge=True)
        sampled_loss, sampled_hits = _loss(head, [sampled], to_draft, config, judge=True)
    assert torch.equal(loss, sampled_loss) and torch.equal(hits, sampled_hits)


def test_a_block_draft_learns_and_drafts_losslessly(target, examples, tmp_path):
    """DFlash training: blocks anchored in the answers, a held-out estimate per block position."""
    config = TrainConfig(
        method="dflash", minutes=5, max_steps=60, draft_vocab_size=48, block_size=4, draft_layers=1, anchors=8
    )
    sequences = [Sequence(e.ids, e.answer_start) for e in examples]
    examples = target_features(target, sequences, layers=feature_layers(target, config))  # layer 0 read
    head = _new_head(target, examples, config)
    to_draft = _index_of(head.draft_vocab, 64)
    torch.manual_seed(0)  # the same random anchors before and after
    with torch.no_grad():
        before = float(_loss(head, examples[:16], to_draft, config)[0])
    log = train_head(target, examples, tmp_path, config)
    trained = load_head(str(tmp_path), target, method="dflash")
    torch.manual_seed(0)
    with torch.no_grad():
        after = float(_loss(trained.float(), examples[:16], to_draft, config)[0])
    assert after < 0.8 * before, (before, after)
    estimate = log["history"][-1]
    assert len(estimate["acceptance"]) == 3 and 1.0 <= estimate["tau"] <= 4.0

    input_ids, attention_mask = random_batch(seed=42, batch=3)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=32, do_sample=False)
    plain = target.generate(**kwargs)
    spec = target.generate(**kwargs, speculative=dict(method="dflash", draft=str(tmp_path)))
    assert_greedy_match(target, plain, spec, attention_mask)


def test_an_interrupted_run_resumes_where_it_stopped(target, examples, tmp_path):
    first = train_head(target, examples, tmp_path, TrainConfig(minutes=0.05, draft_vocab_size=48))
    assert first["resumed_at_step"] is None
    second = train_head(target, examples, tmp_path, TrainConfig(minutes=0.1, draft_vocab_size=48))
    assert second["resumed_at_step"] == first["steps"]
    assert second["steps"] > first["steps"]
    assert second["train_seconds"] >= 0.1 * 60 - 1


def test_a_checkpoint_of_another_run_is_not_resumed(target, examples, tmp_path):
    """Resuming takes the step count, time spent and weights of the checkpoint in `out`: one saved
    for another head (method, draft vocabulary) or another target is refused, naming what differs
    and the folder to delete, instead of training on from it (a head trained for another model, or
    a draft vocabulary other than the one asked for, and the budget already spent)."""
    train_head(target, examples, tmp_path, TrainConfig(minutes=5, max_steps=1, draft_vocab_size=48))
    other = tiny_llama(41, vocab_size=80, layers=1, eos_token_id=None)
    other.name_or_path = "another/model"
    for model, settings, differs in [
        (target, {"method": "medusa"}, r"method: 'eagle' in the checkpoint, 'medusa' now"),
        (target, {"draft_vocab_size": 32}, r"draft_vocab_size: 48 in the checkpoint, 32 now"),
        (other, {}, r"target: '' in the checkpoint, 'another/model' now"),
    ]:
        config = TrainConfig(minutes=5, max_steps=2, **{"draft_vocab_size": 48, **settings})
        with pytest.raises(ValueError, match=rf"saved for another run \(.*{differs}.*\)\. Delete {tmp_path}"):
            train_head(model, examples, tmp_path, config)
    resumed = train_head(target, examples, tmp_path, TrainConfig(minutes=5, max_steps=2, draft_vocab_size=48))
    assert resumed["resumed_at_step"] == 1


def test_empty_and_short_data_are_refused(target, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="is empty"):
        load_prompts(None, empty)
    short = tmp_path / "short.txt"
    short.write_text("a few words only")

    class Tokenizer:  # a whitespace tokenizer is enough to count tokens
        def __call__(self, text):
            return {"input_ids": [7] * len(text.split())}

    with pytest.raises(ValueError, match=f"at least {MIN_TOKENS}"):
        build_sequences(target, Tokenizer(), load_prompts(None, short), tmp_path / "seq.pt")
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(None, tmp_path / "missing.txt")


def test_train_draft_command_on_the_real_demo_model(smollm2_path, tmp_path, capsys):
    """The CLI end to end on SmolLM2 with its real tokenizer: read a corpus, train, save, report."""
    from hf_specdec.cli import main

    from ..helpers.heads import training_corpus

    # A fixed share of the docs, over MIN_TOKENS: the target's features cost grows with it.
    corpus = training_corpus(tmp_path)
    out = tmp_path / "head"
    args = ["train-draft", "--target", str(smollm2_path), "--method", "medusa", "--out", str(out)]
    code = main([*args, "--data", str(corpus), "--minutes", "0.1", "--draft-vocab", "1024"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Held-out estimate" in printed and "τ ≈" in printed
    log = json.loads((out / "training.json").read_text())
    assert log["data"]["tokens"] >= MIN_TOKENS and log["data"]["source"] == str(corpus)
    assert (out / "head.safetensors").is_file() and (out / "training.png").is_file()


def test_a_run_resumes_for_the_same_target_folder_however_it_is_spelled(tmp_path, monkeypatch):
    """The checkpoint named the target as typed: the same folder given as an absolute path, or as
    `../model` from another folder, was refused as another run's ('target: 'model' in the
    checkpoint, '../model' now'). The head now records the folder resolved."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import hf_specdec

    from ..helpers.heads import training_corpus

    folder = tmp_path / "model"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(hf_specdec.demo_model_path(quiet=True)).save_pretrained(folder)
    corpus, out = training_corpus(tmp_path), tmp_path / "head"
    settings = dict(method="eagle", minutes=1.0, draft_vocab_size=256, batch_tokens=512)
    monkeypatch.chdir(tmp_path)
    train_draft("model", out, data=corpus, config=TrainConfig(max_steps=1, **settings))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    log = train_draft("../model", out, data=corpus, config=TrainConfig(max_steps=2, **settings))
    assert log["steps"] == 2
    assert json.loads((out / "head_config.json").read_text())["target"] == str(folder.resolve())


def test_features_are_cached_for_resuming(target, examples, tmp_path, monkeypatch):
    from hf_specdec.train import features
    from hf_specdec.train.features import cached_target_features

    sequences = [Sequence(e.ids, e.answer_start) for e in examples[:4]]
    first = cached_target_features(target, sequences, (-1,), tmp_path / "features.pt")

    def unusable(*args, **kwargs):  # the second call must not run the target
        raise AssertionError("the target ran again")

    monkeypatch.setattr(features, "target_features", unusable)
    again = cached_target_features(target, sequences, (-1,), tmp_path / "features.pt")
    assert all(
        torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels) for a, b in zip(first, again)
    )


def test_held_out_estimate_handles_answers_shorter_than_a_draft(target, examples):
    config = TrainConfig(draft_vocab_size=48)
    head = _new_head(target, examples, config)
    short = examples[0]
    one_token = type(short)(
        short.ids[: short.answer_start + 1],
        short.features[: short.answer_start + 1],
        short.labels[: short.answer_start + 1],
        short.answer_start,
    )
    from hf_specdec.train.trainer import evaluate

    estimate = evaluate(head, [one_token, examples[1]], _index_of(head.draft_vocab, 64), config)
    assert estimate["tau"] >= 1.0 and len(estimate["acceptance"]) == 3


def test_sampled_answers_add_sequences_after_the_greedy_ones(smollm2_path, tmp_path):
    """answers_per_prompt=2 on SmolLM2: each prompt's greedy answer, then one sampled from the target;
    same prompt tokens, the answers differ somewhere. Fewer than one answer is refused."""
    from pathlib import Path

    from hf_specdec.loading import load_model

    model, tokenizer = load_model(str(smollm2_path), dtype="float32", device="cpu")
    root = Path(__file__).resolve().parents[2]
    text = "\n\n".join(
        path.read_text() for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    )
    paragraphs = [p for p in text.split("\n\n") if len(p) > 600][:4]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "Summarize:\n" + p}) + "\n" for p in paragraphs))
    source = load_prompts(None, prompts)
    torch.manual_seed(0)
    sequences = build_sequences(
        model, tokenizer, source, tmp_path / "seq.pt", max_new_tokens=16, answers_per_prompt=2
    )
    greedy, sampled = sequences[: len(source)], sequences[len(source) :]
    assert len(sampled) == len(greedy) == len(source)
    assert all(torch.equal(g.ids[: g.answer_start], s.ids[: s.answer_start]) for g, s in zip(greedy, sampled))
    assert any(not torch.equal(g.ids, s.ids) for g, s in zip(greedy, sampled))
    with pytest.raises(ValueError, match="at least 1"):
        build_sequences(model, tokenizer, source, tmp_path / "none.pt", answers_per_prompt=0)


def test_prompts_and_corpus_longer_than_the_context_are_cut_to_it(smollm2_path, tmp_path, monkeypatch):
    """A prompt longer than the target's context (less the answer's tokens) keeps its end, with a
    warning, and a corpus is cut into chunks the target can read: a GPT-2 (learned positions) failed
    with `IndexError: index out of range` once generation reached the longest prompts, and a Llama
    generated past its context without a word."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    monkeypatch.setattr("hf_specdec.train.data.MIN_TOKENS", 1)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = None  # raw prompts: a tokenizer without a chat template works too
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=48)
    model = GPT2LMHeadModel(config).eval()
    words = "the quick brown fox jumps over the lazy dog " * 12
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hello there", words]))
    with pytest.warns(UserWarning, match=r"1 of 2 prompts are longer than the target's context"):
        sequences = build_sequences(model, tokenizer, load_prompts(None, prompts), tmp_path / "a.pt", 8)
    assert [len(s.ids) for s in sequences] == [len(tokenizer("Hello there")["input_ids"]) + 8, 48]
    assert sequences[1].answer_start == 40  # the prompt's last 40 tokens, then its 8 answer tokens
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(words)
    chunks = build_sequences(model, tokenizer, load_prompts(None, corpus), tmp_path / "b.pt")
    assert len(chunks) > 1 and max(len(s.ids) for s in chunks) == 48
    target_features(model, chunks + sequences, layers=(-1,))  # the target reads them all


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"minutes": 0}, r"`minutes` of TrainConfig must be above 0, got 0"),
        ({"medusa_heads": 0}, r"`medusa_heads` of TrainConfig must be an integer >= 1, got 0"),
        ({"method": "lookahead"}, r"`method` of TrainConfig must be one of 'eagle', 'medusa'"),
        # `--target-layers` with `--method eagle` was ignored without a word.
        ({"target_layers": [1]}, r"`target_layers` .* read only when training dflash, not eagle; leave"),
        ({"method": "dflash", "medusa_heads": 3}, r"`medusa_heads` .* only when training medusa, not dflash"),
        ({"method": "medusa", "unrolled_steps": 2}, r"`unrolled_steps` .* training eagle or mtp, not medusa"),
    ],
)
def test_train_settings_are_checked_before_any_work(fields, message, tmp_path):
    """`train-draft --minutes 0` (or --heads 0) generated answers for minutes before failing."""
    with pytest.raises(ValueError, match=message):
        TrainConfig(**fields)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 0"):
        train_draft("/no/model/needed", tmp_path, max_new_tokens=0)  # refused before loading it


def test_an_out_that_cannot_take_the_head_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """`train-draft --out FILE` generated the training data, minutes, then failed with `[Errno 20]
    Not a directory`; `--out` the target's own folder wrote the head, its log and checkpoints among
    the model's files. Both are refused before the target loads."""
    from hf_specdec.cli import main

    model, a_file = tmp_path / "model", tmp_path / "a-file"
    model.mkdir()
    a_file.write_text("")

    def unusable(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("hf_specdec.train.load_model", unusable)
    with pytest.raises(ValueError, match="is a file; pass a folder for the head"):
        train_draft(str(model), a_file)
    with pytest.raises(ValueError, match=r"cannot be made \(Not a directory\); pass another folder"):
        train_draft(str(model), a_file / "head")  # failed after the data, writing it
    with pytest.raises(ValueError, match="is the target's own folder; pass another folder"):
        train_draft(str(model), model)
    monkeypatch.chdir(model)
    with pytest.raises(ValueError, match="is the target's own folder"):  # however it is spelled
        train_draft("../model", ".")
    assert main(["train-draft", "--target", str(model), "--out", str(model)]) == 2
    assert "is the target's own folder" in capsys.readouterr().err
    assert main(["train-draft", "--target", str(model), "--out", "head", "--target-layers", "1"]) == 2
    assert "`target_layers` of TrainConfig is read only when training dflash" in capsys.readouterr().err


def test_target_layers_the_target_lacks_are_refused_before_any_answer_is_generated(
    target, tmp_path, monkeypatch
):
    """`train-draft --method dflash --target-layers 40` for a shallower target generated the training
    answers (minutes with the default suite) before saying the layers were not the target's."""

    def unusable(*args, **kwargs):
        raise AssertionError("answers were generated")

    monkeypatch.setattr("hf_specdec.train.build_sequences", unusable)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some text.")
    config = TrainConfig(method="dflash", target_layers=[0, 40])
    with pytest.raises(ValueError, match=r"target_layers \[0, 40\] are not layers of this 1-layer target"):
        train_draft(target, tmp_path / "head", data=corpus, tokenizer=object(), config=config)


def test_a_checkpoint_of_another_run_is_refused_before_any_answer_is_generated(
    target, examples, tmp_path, monkeypatch
):
    """`train-draft --out DIR` for another target (or method) than DIR's checkpoint generated the
    training answers and the target's features, minutes, writing them over the ones DIR's own run had
    cached, and only then refused the checkpoint."""
    train_head(target, examples, tmp_path, TrainConfig(minutes=5, max_steps=1, draft_vocab_size=48))
    other = tiny_llama(41, layers=1, eos_token_id=None)
    other.name_or_path = "another/model"

    def unusable(*args, **kwargs):
        raise AssertionError("answers were generated")

    monkeypatch.setattr("hf_specdec.train.build_sequences", unusable)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some text.")
    for model, method, differs in [
        (other, "eagle", r"target: '' in the checkpoint, 'another/model' now"),
        (target, "medusa", r"method: 'eagle' in the checkpoint, 'medusa' now"),
    ]:
        config = TrainConfig(method=method, minutes=5, draft_vocab_size=48)
        with pytest.raises(ValueError, match=rf"saved for another run \(.*{differs}"):
            train_draft(model, tmp_path, data=corpus, tokenizer=object(), config=config)


def test_the_target_is_handed_back_as_trainable_as_it_was_given(examples, tmp_path):
    """Training freezes the target (a head shares its embedding and LM head); a model the user goes
    on fine-tuning afterwards must not stay frozen."""
    model = tiny_llama(40, layers=1, eos_token_id=None)
    model.model.norm.requires_grad_(False)  # one part frozen by the user: it stays so
    train_head(model, examples, tmp_path, TrainConfig(minutes=5, max_steps=1, draft_vocab_size=48))
    frozen = {name for name, parameter in model.named_parameters() if not parameter.requires_grad}
    assert frozen == {"model.norm.weight"}
