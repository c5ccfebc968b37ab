"""Do two tokenizers map text to the same ids? Decided by their vocabularies, not `vocab_size`.

`config.vocab_size` is the size of the embedding matrix, which model authors pad to a multiple
of 64 or 128 (Qwen2.5-7B: 152064, Qwen2.5-0.5B: 151936, one tokenizer). What matters for
speculative decoding is that every token id means the same string in both models and that the
special tokens that end or frame a generation agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref
from dataclasses import dataclass, field
from typing import Any

_SPECIAL_ATTRS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


@dataclass
class TokenizerCheck:
    """The outcome of comparing a target's tokenizer with a draft's."""

    compatible: bool
    shared_vocab_size: int  # ids below this mean the same token in both
    differences: list[str] = field(default_factory=list)  # human-readable, the first few

    def explain(self) -> str:
        if self.compatible:
            return f"tokenizers agree on all {self.shared_vocab_size} token ids and on their special tokens"
        return "tokenizers differ: " + "; ".join(self.differences)


def compare_tokenizers(target: Any, draft: Any, *, max_reported: int = 5) -> TokenizerCheck:
    """Compare two tokenizers by their token-to-id maps and special tokens.

    Args:
        target: the target model's tokenizer (any `PreTrainedTokenizerBase`).
        draft: the draft model's tokenizer.
        max_reported: how many differing tokens to name in `differences`.
    """
    target_vocab: dict[str, int] = target.get_vocab()
    draft_vocab: dict[str, int] = draft.get_vocab()
    differences: list[str] = []

    # Every id both tokenizers have must mean the same string. Ids above the shared range are fine
    # (padding, added tokens of a fine-tune); inside it a difference silently changes meaning.
    target_by_id = {idx: token for token, idx in target_vocab.items()}
    draft_by_id = {idx: token for token, idx in draft_vocab.items()}
    shared = min(len(target_vocab), len(draft_vocab))
    differing = [i for i in range(shared) if target_by_id.get(i) != draft_by_id.get(i)]
    for i in differing[:max_reported]:
        differences.append(
            f"id {i} is {target_by_id.get(i)!r} in the target but {draft_by_id.get(i)!r} in the draft"
        )
    if len(differing) > max_reported:
        differences.append(f"... {len(differing) - max_reported} more ids mean different tokens")

    for attr in _SPECIAL_ATTRS:
        t_id, d_id = getattr(target, attr, None), getattr(draft, attr, None)
        if attr == "pad_token_id" or t_id is None or d_id is None:
            continue  # pad only fills batches; a missing special token is not a conflict
        if t_id != d_id:
            differences.append(f"{attr} is {t_id} in the target but {d_id} in the draft")

    return TokenizerCheck(compatible=not differences, shared_vocab_size=shared, differences=differences)


# Comparing two 50k-token vocabularies takes ~70 ms, and a draft model checks its tokenizer on
# every generate call: remember outcomes for as long as both tokenizer objects live.
_CHECKED: dict[tuple[int, int, int, int], tuple[weakref.ref, weakref.ref, TokenizerCheck]] = {}


def compare_tokenizers_once(target: Any, draft: Any) -> TokenizerCheck:
    """`compare_tokenizers`, remembered per pair of tokenizer objects and their sizes (tokens added
    to either in place make it compare again)."""
    key = (id(target), id(draft), len(target), len(draft))
    known = _CHECKED.get(key)
    if known is not None and known[0]() is target and known[1]() is draft:
        return known[2]
    check = compare_tokenizers(target, draft)
    with contextlib.suppress(TypeError):  # no weak references to it: checked every time
        _CHECKED[key] = (weakref.ref(target), weakref.ref(draft), check)
    return check


def clear_checks() -> None:
    """Forget the remembered outcomes of `compare_tokenizers_once` and `tokenizer_fingerprint`."""
    _CHECKED.clear()
    _FINGERPRINTS.clear()


_FINGERPRINTS: dict[tuple[int, int], tuple[weakref.ref, str]] = {}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A sha256 of what `compare_tokenizers` compares: every token's id and the special token ids.
    Two tokenizers with one fingerprint compare alike with any third. Remembered per tokenizer
    object and size (~50 ms for a 50k-token vocabulary)."""
    key = (id(tokenizer), len(tokenizer))
    known = _FINGERPRINTS.get(key)
    if known is not None and known[0]() is tokenizer:
        return known[1]
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    specials = {attr: getattr(tokenizer, attr, None) for attr in _SPECIAL_ATTRS}
    digest = hashlib.sha256(json.dumps([vocab, specials]).encode()).hexdigest()
    with contextlib.suppress(TypeError):  # no weak references to it: computed every time
        _FINGERPRINTS[key] = (weakref.ref(tokenizer), digest)
    return digest
