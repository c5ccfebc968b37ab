"""`RaggedKV` alone, on a real tiny model: rows fed with holes, rolled back, hold what a plain forward
over the kept tokens would have cached, and decode on from there as it would."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_specdec.core.compat import cache_argument
from hf_specdec.core.kv import HOLES_BOUND, RaggedKV, Slots

from ..conftest import random_batch
from ..helpers.architectures import RECURRENT, VOCAB, tiny

CPU = torch.device("cpu")
CLOSE = dict(atol=1e-5, rtol=1e-4)  # a padded batch and one unpadded row round apart


def _plain(model, sequence: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A plain forward over one row's real tokens: its logits [n, V] and each layer's keys [heads, n, dim]."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=sequence[None], use_cache=True, **{cache_argument(model): cache})
    return out.logits[0], [layer.keys[0] for layer in cache.layers]


def _assert_holds(kv: RaggedKV, row: int, model, sequence: torch.Tensor) -> None:
    """Cache row `row`'s real columns hold the keys a plain forward over `sequence` caches."""
    assert int(kv.lengths[row]) == len(sequence)
    _, plain_keys = _plain(model, sequence)
    for layer, keys in zip(kv.cache.layers, plain_keys):
        torch.testing.assert_close(layer.keys[row][:, kv.mask[row]], keys, **CLOSE)


def _prompts(kv: RaggedKV, seed: int, batch: int) -> list[torch.Tensor]:
    """Feed `batch` left-padded prompts; returns each row's real tokens."""
    input_ids, attention_mask = random_batch(seed, batch)
    with torch.no_grad():
        kv.forward(input_ids, attention_mask.bool(), logits_to_keep=1)
    return [input_ids[b][attention_mask[b].bool()] for b in range(batch)]


def _decodes_on(kv: RaggedKV, model, sequences: list[torch.Tensor]) -> None:
    """One more token for every row: its logits are a plain forward's after the row's sequence."""
    token = torch.arange(len(sequences))[:, None] + 10
    with torch.no_grad():
        logits = kv.forward(token, None, logits_to_keep=1).logits[:, -1]
    for row, sequence in enumerate(sequences):
        expected, _ = _plain(model, torch.cat([sequence, token[row]]))
        torch.testing.assert_close(logits[row], expected[-1], **CLOSE)


def test_slots_gather_and_scatter_the_steps_rows():
    whole, some = Slots([0, 1, 2], 3, CPU), Slots([2, 0], 3, CPU)
    batched = torch.arange(6).reshape(3, 2)
    assert whole.whole and whole.gather(batched) is batched
    assert not some.whole and some.gather(batched).tolist() == [[4, 5], [0, 1]]
    assert some.scatter(torch.tensor([[7, 7], [8, 8]]), torch.zeros(3, 2, dtype=torch.long)).tolist() == [
        [8, 8],
        [0, 0],
        [7, 7],
    ]


def test_slots_feed_holes_to_the_other_rows_and_lower_the_steps_own():
    whole, some = Slots([0, 1, 2], 3, CPU), Slots([2, 0], 3, CPU)
    tokens = torch.tensor([[7, 7], [8, 8]])
    fed, valid = some.fed(tokens, None)
    assert fed.tolist() == [[8, 8], [0, 0], [7, 7]] and valid.tolist() == [[1, 1], [0, 0], [1, 1]]
    assert whole.fed(fed, None) == (fed, None)  # the whole batch: as given
    assert some.placed(torch.ones(2, 2, 3)).sum(dim=(1, 2)).tolist() == [6, 0, 6]
    lengths = torch.tensor([5, 5, 5])
    assert some.less(lengths, [1, 2]).tolist() == [3, 5, 4] and lengths.tolist() == [5, 5, 5]


def test_rows_fed_with_holes_and_rolled_back_hold_a_plain_forwards_cache(target):
    """A step of rows 0 and 2 only (row 1 finished, still cached): row 0 feeds 4 real tokens and
    keeps 3, row 2 feeds 2 real tokens and 2 holes and keeps 1. Each row's logits and cache are
    a plain forward's over its own tokens; row 1 is left as it was."""
    kv = RaggedKV(target, None, 3, CPU)
    sequences = _prompts(kv, 0, 3)
    feed = torch.tensor([[11, 12, 13, 14], [21, 22, 0, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    slots = Slots([0, 2], 3, CPU)
    with torch.no_grad():
        output = kv.forward_rows(slots, feed, valid)
    for b, row in enumerate(slots.rows):
        real = int(valid[b].sum())
        expected, _ = _plain(target, torch.cat([sequences[row], feed[b, :real]]))
        torch.testing.assert_close(output.logits[row, :real], expected[-real:], **CLOSE)

    kv.roll_back(slots, 4, rejected=[1, 1])
    sequences[0] = torch.cat([sequences[0], feed[0, :3]])
    sequences[2] = torch.cat([sequences[2], feed[1, :1]])
    for row, sequence in enumerate(sequences):
        _assert_holds(kv, row, target, sequence)
    _decodes_on(kv, target, sequences)


def test_holes_fed_past_a_whole_draft_leave_the_cache_when_it_is_kept(target):
    """One row feeds 3 real tokens and 3 holes (a draft widened to a width already paid for) and
    keeps every real one: nothing is rejected, yet the holes leave the cache, so later forwards
    need no attention mask again (`all_real`)."""
    kv = RaggedKV(target, None, 1, CPU)
    sequences = _prompts(kv, 1, 1)
    feed = torch.tensor([[11, 12, 13, 0, 0, 0]])
    valid = torch.tensor([[True, True, True, False, False, False]])
    with torch.no_grad():
        kv.forward_rows(Slots([0], 1, CPU), feed, valid)
    assert not kv.all_real
    kv.roll_back(Slots([0], 1, CPU), 6, rejected=[0], widened=True)
    sequences[0] = torch.cat([sequences[0], feed[0, :3]])
    assert kv.all_real and kv.width == len(sequences[0])
    _assert_holds(kv, 0, target, sequences[0])
    _decodes_on(kv, target, sequences)


def test_a_tree_fed_beside_a_hole_and_rolled_back_to_its_path_holds_a_plain_forwards_cache(target):
    """Row 1 feeds a token and a tree of four nodes below it (row 0 is a hole); it keeps the path
    node 0 -> node 2, which `roll_back` moves to the front before dropping the rest."""
    kv = RaggedKV(target, None, 2, CPU)
    sequences = _prompts(kv, 1, 2)
    feed = torch.tensor([[30, 31, 32, 33, 34]])  # a token, then nodes 0..3
    parents = torch.tensor([[-1, -1, 0, 2]])  # nodes 0 and 1 below the token, 0 - 2 - 3
    slots = Slots([1], 2, CPU)
    with torch.no_grad():
        output = kv.forward_rows(slots, feed, None, parents)
    for column, path in [(3, [30, 31, 33]), (2, [30, 32]), (4, [30, 31, 33, 34])]:
        expected, _ = _plain(target, torch.cat([sequences[1], torch.tensor(path)]))
        torch.testing.assert_close(output.logits[1, column], expected[-1], **CLOSE)

    kv.roll_back(slots, 5, rejected=[2], paths=[[0, 2]])
    sequences[1] = torch.cat([sequences[1], torch.tensor([30, 31, 33])])
    for row, sequence in enumerate(sequences):
        _assert_holds(kv, row, target, sequence)
    _decodes_on(kv, target, sequences)


def test_a_tree_rolled_back_on_a_sparse_attention_model_moves_its_indexer_keys_with_its_keys():
    """DeepSeek-V3.2's indexer scores every cached column by a key of its own to choose the columns
    attention reads (`DynamicIndexedLayer.indexer_keys`): the accepted path moved to the front of a
    tree's columns left those keys where they were, so the next steps chose columns by other tokens'
    keys. Both move now: the cache holds what a plain forward over the kept tokens caches."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, index_topk=64, index_head_dim=16, index_n_heads=2,
        n_routed_experts=2,
        num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v32", **sizes)).eval()
    kv = RaggedKV(model, None, 1, CPU)
    sequence = torch.tensor([5, 6, 7, 8, 9, 10])
    with torch.no_grad():
        kv.forward(sequence[None], None, logits_to_keep=1)
        kv.forward_rows(
            Slots([0], 1, CPU), torch.tensor([[30, 31, 32, 33, 34]]), None, torch.tensor([[-1, -1, 0, 2]])
        )
    kv.roll_back(Slots([0], 1, CPU), 5, rejected=[2], paths=[[0, 2]])
    kept = torch.cat([sequence, torch.tensor([30, 31, 33])])
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=kept[None], use_cache=True, **{cache_argument(model): plain})
    assert int(kv.lengths[0]) == len(kept)
    for layer, expected in zip(kv.cache.layers, plain.layers, strict=True):
        torch.testing.assert_close(layer.keys[0][:, kv.mask[0]], expected.keys[0], **CLOSE)
        torch.testing.assert_close(layer.indexer_keys[0][kv.mask[0]], expected.indexer_keys[0], **CLOSE)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_rows_that_keep_different_numbers_of_drafts_leave_no_more_holes_than_the_bound(name):
    """Four rows feed 5 tokens a step for 40 steps and keep 1 to 5 of them, each its own number: the
    holes left mid-cache are compacted away whenever they would make the cache more than HOLES_BOUND
    wider than its widest row needs (without compaction they would pass it). Each row then holds
    its tokens in order, and decodes on (a sliding window of 16 included) as a plain forward would."""
    model = tiny(name, 0, **({"sliding_window": 16} if name == "mistral" else {}))
    kv = RaggedKV(model, None, 4, CPU)
    sequences = _prompts(kv, 2, 4)
    prompts = [len(sequence) for sequence in sequences]
    g = torch.Generator().manual_seed(0)
    slots, widest = Slots([0, 1, 2, 3], 4, CPU), 0
    for _ in range(40):
        feed = torch.randint(6, VOCAB, (4, 5), generator=g)
        kept = torch.randint(1, 6, (4,), generator=g).tolist()
        with torch.no_grad():
            kv.forward_rows(slots, feed, None)
        kv.roll_back(slots, 5, rejected=[5 - n for n in kept])
        sequences = [torch.cat([seq, feed[b, :n]]) for b, (seq, n) in enumerate(zip(sequences, kept))]
        # Plain decoding's cache: the prompt's columns, then the longest row's tokens after it.
        needed = kv.prompt_width + max(len(sequence) - n for sequence, n in zip(sequences, prompts))
        widest = max(widest, kv.width / needed)
    assert widest <= 1 + HOLES_BOUND
    if name == "llama":  # a sliding window's plain cache keeps its window only
        for row, sequence in enumerate(sequences):
            _assert_holds(kv, row, model, sequence)
    _decodes_on(kv, model, sequences)


@pytest.mark.parametrize("name", list(RECURRENT))
def test_a_recurrent_state_rolls_back_to_the_last_token_kept(name):
    """Linear-attention and state-space layers hold a state a row, not a column a token: tokens fed
    over several forwards and then cut are undone by restoring the state recorded after the last
    token kept, so that what is fed next sees what a plain forward over the kept tokens would."""
    model = tiny(name, 0, eos_token_id=None)
    kv = RaggedKV(model, None, 1, CPU)
    assert kv.recurrent
    prompt, fed, after = (
        torch.randint(3, VOCAB, (1, 7)),
        torch.randint(3, VOCAB, (1, 5)),
        torch.randint(3, VOCAB, (1, 3)),
    )
    with torch.no_grad():
        kv.forward(prompt, None, logits_to_keep=1)
        kv.forward(fed[:, :1], None)  # a drafter's pattern: one token, then several at once
        kv.forward(fed[:, 1:], None)
        kv.truncate(torch.tensor([7 + 2]))  # keep two of the five
        ours = kv.forward(after, None).logits[0]
        plain = model(input_ids=torch.cat([prompt, fed[:, :2], after], dim=1)).logits[0, -3:]
        kept_three = model(input_ids=torch.cat([prompt, fed[:, :3], after], dim=1)).logits[0, -3:]
    torch.testing.assert_close(ours, plain, **CLOSE)
    assert not torch.allclose(ours, kept_three, **CLOSE)  # the control: a state one token off differs
    assert all(not getattr(layer, "record_past", False) for layer in kv.finished_cache().layers)


def test_a_recurrent_state_is_rolled_back_one_row_at_a_time():
    with pytest.raises(ValueError, match="one row at a time: call generate with one sequence"):
        RaggedKV(tiny("mamba", 0), None, 2, CPU)


ROTARIES = {  # frequencies transformers sets from each forward's length, past a context of 32
    "llama": dict(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 4.0}),
    "phi3": dict(
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 32,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(ROTARIES))
def test_rotary_frequencies_set_by_a_forwards_length_never_see_a_verify_forward_cross_the_context(name):
    model = tiny(name, 0, **ROTARIES[name])
    prompt = torch.randint(6, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))

    def generate(new: int, **speculative) -> torch.Tensor:
        return model.generate(prompt, max_new_tokens=new, do_sample=False, **speculative)

    # Within the context every forward has the trained frequencies: drafts are verified as usual.
    ngram = {"method": "ngram", "num_draft_tokens": 5}
    assert generate(12, speculative=ngram).tolist() == generate(12).tolist()
    # Across it, a verify forward would rotate its tokens by its last one's length: refused by
    # name, decoded plainly by `auto` (verify forwards of 6 tokens differ from plain at step 13).
    with pytest.raises(ValueError, match="rotary frequencies from each forward's length.*max_new_tokens"):
        generate(30, speculative=ngram)
    out = model.generate(
        prompt, max_new_tokens=30, do_sample=False, speculative=True, return_dict_in_generate=True
    )
    assert out.sequences.tolist() == generate(30).tolist()
    stats = out.speculative_stats
    assert stats.method == "plain" and "original context of 32" in stats.selection


def test_a_draft_heads_output_is_read_without_transformers_deprecation_warning(monkeypatch):
    """A head's output (EAGLE's, an MTP layer's) holds no cache: looking for one under the old name
    `past_key_values` made transformers warn the user that it is deprecated ("Use `cache` instead"),
    though they had passed neither name."""
    import transformers.utils.generic as generic

    from ..conftest import tiny_llama
    from ..helpers.heads import copied_layer_eagle

    warned: list[str] = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a, **k: warned.append(message))
    target = tiny_llama(30, layers=1)
    prompt = torch.tensor([[1, 7, 9, 11, 7, 9]])
    speculative = dict(method="eagle", draft=copied_layer_eagle(target), num_draft_tokens=3)
    with torch.no_grad():
        target.generate(prompt, max_new_tokens=6, do_sample=False, speculative=speculative)
    assert not [message for message in warned if "deprecated" in message]
