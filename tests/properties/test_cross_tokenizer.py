"""A draft model of another tokenizer (GUIDE §6): greedy token-identical to plain `generate` through
either translation, over ragged batches and trees; sampling over the shared tokens exactly the
target's distribution by enumeration, with a control the test rejects; transformers' own universal
assisted decoding on the same pair as the reference. Tokenizers are real ones trained by the tests
(`helpers.tokenizers`); drafts are copies of the target moved to their own vocabulary, so that they
agree with it often enough for acceptance to be exercised."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.hub.tokenizer_check import PROBE_TEXT, shared_token_pairs

from ..conftest import assert_greedy_match, tiny_llama
from ..helpers.sampling import (
    ALPHA,
    NEW,
    PROMPT,
    ROWS,
    SETTINGS,
    VOCAB,
    chi2_pvalue,
    continuation_index,
    exact_distribution,
    sample,
)
from ..helpers.tokenizers import CORPUS, byte_level_bpe, metaspace_bpe, translated_copy, word_level

PROMPTS = ["the fox walked to the", "Once upon a time there was a little", "def add(a, b):\n   "]


@pytest.fixture(scope="module")
def pairs():
    """name -> (target, its tokenizer, draft, its tokenizer): byte-level BPE and SentencePiece-style
    BPE both ways round (TLI), and the byte-level one with a near-character draft (UAD)."""
    corpus = CORPUS + PROBE_TEXT
    byte_level, metaspace, characters = (
        byte_level_bpe(400, corpus),
        metaspace_bpe(200, corpus),
        metaspace_bpe(90, corpus),
    )
    # Without a BOS the draft reads exactly the target's text: a faithful copy, drafts mostly accepted.
    metaspace_no_bos = metaspace_bpe(200, corpus, bos=False)
    out = {}
    for name, (target_tok, draft_tok) in {
        "byte<-meta": (byte_level, metaspace_no_bos),
        "meta<-byte": (metaspace, byte_level),
        "byte<-chars": (byte_level, characters),
    }.items():
        target = tiny_llama(0, len(target_tok), eos_token_id=target_tok.eos_token_id)
        shared = shared_token_pairs(target_tok, draft_tok)
        # As a real model writes real text mostly with shared tokens (96% here on the probe text), this
        # random one prefers them: zero logits for the others, which leaves them rarely the argmax.
        unshared = sorted(set(range(len(target_tok))) - {*shared.values(), target_tok.eos_token_id})
        with torch.no_grad():
            target.lm_head.weight[unshared] = 0.0
        out[name] = (target, target_tok, translated_copy(target, shared, len(draft_tok), seed=1), draft_tok)
    return out


def _batch(tokenizer, prompts=PROMPTS):
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer(prompts, return_tensors="pt", padding=True)


FOREIGN = ["東京 🦜", "zebra quiz jive", "Ελληνικά ✓"]


TLI, UAD = "token-level intersection (TLI)", "text re-tokenization (UAD), greedy only"
CASES = {  # name -> (pair, translation option, what is stated, tree)
    "tli": ("byte<-meta", "auto", TLI, False),
    "tli-reverse": ("meta<-byte", "auto", TLI, False),
    "tli-tree": ("byte<-meta", "auto", TLI, True),
    "uad-chosen": ("byte<-chars", "auto", UAD, False),
    "uad-asked": ("byte<-meta", "text", UAD, False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.filterwarnings("error:speculative= settings")  # a translated draft reads `translation`
def test_greedy_is_identical_to_plain_across_tokenizers(pairs, case):
    name, translation, stated, tree = CASES[case]
    target, target_tok, draft, draft_tok = pairs[name]
    inputs = _batch(target_tok)
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=16)
    spec = dict(
        method="draft_model",
        draft=draft,
        draft_tokenizer=draft_tok,
        num_draft_tokens=4,
        tree=tree,
        options=dict(translation=translation),
    )
    out = target.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=16,
        tokenizer=target_tok,
        speculative=spec,
        return_dict_in_generate=True,
    )
    assert_greedy_match(target, plain, out.sequences, inputs["attention_mask"])
    stats = out.speculative_stats
    assert stats.translation.startswith(stated) and stated in str(stats)
    if name != "byte<-chars":  # a copy of the target on the shared tokens: its drafts are accepted
        assert stats.accepted > 0
    if case == "tli":  # ... all of them where it reads exactly the target's tokens (no BOS of its own)
        assert stats.acceptance_rate == 1.0
    assert (stats.tree_steps > 0) == tree


def test_a_draft_translates_only_the_tokens_a_row_gained(pairs, monkeypatch):
    """Token-level intersection spells a target token outside the shared tokens in the draft's
    tokens once per row, when the row gains it, not again at every draft: a step's host work follows
    what it adds, not the context (spelling the whole context again cost ~9 ms a step at 4,000 CJK
    tokens). Over a ragged batch whose first row finishes early and leaves it, still plain's output."""
    from hf_specdec.drafters.vocabulary import TokenIntersection

    target, target_tok, draft, draft_tok = pairs["byte<-meta"]
    # Text the draft's vocabulary lacks, in bytes the target's spells and the draft's cannot.
    inputs = _batch(target_tok, [f"{prompt} ({words})" for prompt, words in zip(PROMPTS, FOREIGN)])
    free = target.generate(**inputs, do_sample=False, max_new_tokens=24)[:, inputs["input_ids"].shape[1] :]
    # A token the first row says early and the others not at all: the first row's end of text.
    stop = next(t for t in free[0, 2:].tolist() if t not in free[1:])
    settings = dict(do_sample=False, max_new_tokens=24, eos_token_id=stop)
    plain = target.generate(**inputs, **settings)
    spelled = []
    spell = TokenIntersection._spell
    monkeypatch.setattr(TokenIntersection, "_spell", lambda self, t: spelled.append(t) or spell(self, t))
    spec = dict(method="draft_model", draft=draft, draft_tokenizer=draft_tok, num_draft_tokens=2)
    out = target.generate(
        **inputs, **settings, tokenizer=target_tok, speculative=spec, return_dict_in_generate=True
    )
    assert_greedy_match(target, plain, out.sequences, inputs["attention_mask"])
    assert out.speculative_stats.translation.startswith(TLI)
    continuations = out.sequences[:, inputs["input_ids"].shape[1] :]
    assert stop in continuations[0, :12] and stop not in continuations[1:]  # the first row ended early
    shared = set(shared_token_pairs(target_tok, draft_tok).values()) | {target_tok.eos_token_id}
    outside = [t for t in out.sequences.flatten().tolist() if t not in shared]
    assert out.speculative_stats.steps >= 8 and len(outside) >= 10
    assert len(spelled) <= len(outside)


def test_transformers_universal_assisted_decoding_is_the_reference(pairs):
    """transformers' own `assistant_model=` with `tokenizer=` / `assistant_tokenizer=` (UAD) on the
    same pair gives plain greedy's tokens; so do both our translations."""
    target, target_tok, draft, draft_tok = pairs["byte<-meta"]
    inputs = target_tok(PROMPTS[1], return_tensors="pt")
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=16)
    theirs = target.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=16,
        assistant_model=draft,
        tokenizer=target_tok,
        assistant_tokenizer=draft_tok,
    )
    assert torch.equal(theirs, plain)
    for translation in ("intersection", "text"):
        spec = dict(
            method="draft_model",
            draft=draft,
            draft_tokenizer=draft_tok,
            options=dict(translation=translation),
        )
        ours = target.generate(
            **inputs, do_sample=False, max_new_tokens=16, tokenizer=target_tok, speculative=spec
        )
        assert torch.equal(ours, theirs), translation


def test_sampling_with_a_draft_only_text_can_translate_is_refused_with_the_way_out(pairs):
    target, target_tok, draft, draft_tok = pairs["byte<-chars"]
    inputs = target_tok(PROMPTS[0], return_tensors="pt")
    spec = dict(method="draft_model", draft=draft, draft_tokenizer=draft_tok)
    with pytest.raises(
        ValueError, match=r"greedy decoding only with this draft: text re-tokenization \(UAD\)"
    ):
        target.generate(**inputs, do_sample=True, max_new_tokens=2, tokenizer=target_tok, speculative=spec)
    forced = dict(spec, options=dict(translation="intersection"))  # exact, if slow
    out = target.generate(
        **inputs, do_sample=True, max_new_tokens=4, tokenizer=target_tok, speculative=forced
    )
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4


# --- sampling: exact over the shared tokens -------------------------------------------------------

TARGET_WORDS = ["<unk>", "a", "b", "c", "d", "e", "f", "g"]  # VOCAB tokens; PROMPT is c d e ...
DRAFT_WORDS = ["<unk>", "c", "a", "x", "e", "g", "y", "b", "z", "q"]  # shares a b c e g; not d f


@pytest.fixture(scope="module")
def word_pair():
    assert len(TARGET_WORDS) == VOCAB
    target, target_tok, draft_tok = (
        tiny_llama(20, VOCAB, eos_token_id=None),
        word_level(TARGET_WORDS),
        word_level(DRAFT_WORDS),
    )
    shared = shared_token_pairs(target_tok, draft_tok)
    return target, target_tok, translated_copy(target, shared, len(DRAFT_WORDS), seed=21), draft_tok


@pytest.mark.parametrize("setting", ["temp", "topk_topp"])
def test_sampling_over_the_shared_tokens_follows_the_target_distribution(word_pair, setting):
    """The draft proposes only a, b, c, e, g (in its own ids), the target can say d and f too: every
    3-token continuation still comes at exactly the target's probability."""
    target, target_tok, draft, draft_tok = word_pair
    # Forced: these word vocabularies share too little of the probe text for the automatic choice.
    options = dict(translation="intersection")
    spec = dict(
        method="draft_model", draft=draft, draft_tokenizer=draft_tok, num_draft_tokens=2, options=options
    )
    samples = sample(target, {**SETTINGS[setting], "tokenizer": target_tok}, seed=3, speculative=spec)
    pvalue = chi2_pvalue(continuation_index(samples), exact_distribution(target, SETTINGS[setting]))
    assert pvalue > ALPHA, f"p = {pvalue:.2e}"


def test_control_the_draft_alone_over_the_shared_tokens_is_rejected(word_pair):
    """What the draft proposes, taken as the answer (its distribution over the shared tokens, in the
    target's ids), fails the same test."""
    from hf_specdec.drafters.vocabulary import TokenIntersection

    target, target_tok, draft, draft_tok = word_pair
    tli = TokenIntersection(target_tok, draft_tok, VOCAB, len(DRAFT_WORDS), torch.device("cpu"))
    settings = SETTINGS["temp"]
    context = tli.draft_sequence(torch.tensor(PROMPT)).sequence[None].repeat(ROWS, 1)
    unshared = sorted(set(range(len(DRAFT_WORDS))) - set(tli.draft_index.tolist()))
    torch.manual_seed(4)
    drafted = draft.generate(
        input_ids=context,
        attention_mask=torch.ones_like(context),
        max_new_tokens=NEW,
        do_sample=True,
        suppress_tokens=unshared,
        **settings,
    )[:, context.shape[1] :]
    to_target = torch.zeros(len(DRAFT_WORDS), dtype=torch.long)
    to_target[tli.draft_index] = tli.target_index
    samples = torch.cat([torch.tensor(PROMPT).repeat(ROWS, 1), to_target[drafted]], dim=1)
    assert chi2_pvalue(continuation_index(samples), exact_distribution(target, settings)) < ALPHA


@pytest.mark.parametrize("translation", ["intersection", "text"])
def test_a_draft_of_another_tokenizer_drafts_eagerly_beside_a_compiled_target(pairs, translation):
    """Its sequences are not the target's lengths, so the target's capacity cannot size a static
    cache for it: it keeps its own dynamic cache (`compile_forwards` leaves it alone)."""
    from transformers import CompileConfig

    from hf_specdec import SpeculativeConfig
    from hf_specdec.drafters.draft_model import DraftModelDrafter

    target, target_tok, draft, draft_tok = pairs["byte<-meta"]
    config = SpeculativeConfig(
        method="draft_model", draft=draft, draft_tokenizer=draft_tok, options=dict(translation=translation)
    )
    drafter = DraftModelDrafter.from_config(config, target, target_tok)
    drafter.compile_forwards(CompileConfig(), 64, (1, 5), 1)
    assert drafter.kv is None and drafter.decoder.compiled is None


def test_a_draft_of_another_vocabulary_without_tokenizers_is_refused_with_what_to_pass(pairs):
    """Without both tokenizers nothing says which of the draft's tokens are the target's."""
    target, target_tok, draft, draft_tok = pairs["byte<-meta"]
    inputs = target_tok(PROMPTS[0], return_tensors="pt")
    spec = dict(method="draft_model", draft=draft)
    with pytest.raises(ValueError, match=r"without the target's \(`tokenizer=` .* and the draft's \(`draft_"):
        target.generate(**inputs, max_new_tokens=2, speculative=spec)
    with pytest.raises(ValueError, match=r"without the target's \(`tokenizer=` to generate\(\)\)\. Pass it"):
        target.generate(**inputs, max_new_tokens=2, speculative=spec | dict(draft_tokenizer=draft_tok))
