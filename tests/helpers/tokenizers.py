"""Real tokenizers of different vocabularies, trained by the tests on a short built-in text (BPE
training is deterministic and takes milliseconds), and draft models that speak another vocabulary.

- `byte_level_bpe`: GPT-2 / Llama 3 / SmolLM2 style, spaces spelled `Ġ`, no BOS;
- `metaspace_bpe`: SentencePiece / Gemma style, spaces spelled `▁`, a BOS before every text;
- `word_level`: one token per word, for vocabularies small enough to enumerate.
"""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from ..conftest import tiny_llama

CORPUS = """\
Once upon a time there was a little fox who lived in the forest near the river. Every morning the
fox walked to the river to drink, and every evening it walked back to its home under the old tree.
One day the fox met a rabbit at the river. The rabbit said that the forest was too quiet, and the
fox said that the river was too loud. They laughed, and from that day on they were friends.
The fox and the rabbit walked along the river together, talking about the forest and the trees.
def add(a, b):
    return a + b
print(add(2, 3))
"""


_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_level_bpe(vocab_size: int, corpus: str = CORPUS) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def metaspace_bpe(vocab_size: int, corpus: str = CORPUS, bos: bool = True) -> PreTrainedTokenizerFast:
    """Split into words, numbers and punctuation as GPT-2 does, so that its merges are mostly the
    byte-level tokenizer's, spelled with `▁` and without a byte alphabet; `bos`: a BOS before
    every text."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated"),
            pre_tokenizers.Metaspace(prepend_scheme="never", split=False),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator([corpus] * 4, trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def word_level(words: list[str]) -> PreTrainedTokenizerFast:
    """One token per word, ids in the order given; the first word is the unknown token."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0])


def translated_copy(target: LlamaForCausalLM, pairs: dict[int, int], vocab_size: int, seed: int):
    """A draft of `vocab_size` tokens that is `target` on the tokens they share (`pairs`: draft id ->
    target id): the same layers, its embedding and output rows moved to the draft's ids, the other
    rows random. Read token for token (token-level intersection) it predicts what the target does."""
    draft = tiny_llama(seed, vocab_size, eos_token_id=None)
    state = {k: v for k, v in target.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    draft.load_state_dict(state, strict=False)
    draft_ids, target_ids = torch.tensor(list(pairs)), torch.tensor(list(pairs.values()))
    with torch.no_grad():
        draft.model.embed_tokens.weight[draft_ids] = target.model.embed_tokens.weight[target_ids]
        draft.lm_head.weight[draft_ids] = target.lm_head.weight[target_ids]
    return draft
