"""Do two tokenizers map text to the same ids? Decided by their vocabularies, not `vocab_size`.

`config.vocab_size` is the size of the embedding matrix, which model authors pad to a multiple
of 64 or 128 (Qwen2.5-7B: 152064, Qwen2.5-0.5B: 151936, one tokenizer). What matters for
speculative decoding is that every token id means the same string in both models and that the
special tokens that end or frame a generation agree.

Tokenizers that differ may still share most of their tokens, spelled alike (a draft of another
family drafts over those: `drafters.vocabulary`): `token_spellings` reads the bytes each token
stands for, `shared_token_pairs` pairs the ids that spell the same bytes, and `vocabulary_overlap`
measures how much of a text each tokenizer writes with shared tokens.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import re
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
        _CHECKED[key] = (*dropping_refs(_CHECKED, key, target, draft), check)
    return check


def clear_checks() -> None:
    """Forget the remembered outcomes of `compare_tokenizers_once`, `tokenizer_fingerprint` and
    `token_spellings`, and the tokenizers' copies `own_copy` made."""
    _CHECKED.clear()
    _FINGERPRINTS.clear()
    _SPELLINGS.clear()
    _BY_SPELLING.clear()
    _OWN_COPIES.clear()


_FINGERPRINTS: dict[tuple[int, int], tuple[weakref.ref, str]] = {}
_OWN_COPIES: dict[tuple[int, int], tuple[weakref.ref, Any]] = {}


def own_copy(tokenizer: Any) -> Any:
    """A copy of `tokenizer` for this package's own encoding, remembered per tokenizer object and
    size. A fast tokenizer keeps a call's settings (special tokens read as text, truncation,
    padding) on its backend, set at each call and left there: set on the caller's tokenizer they
    would stay after generate, and reach a call on another thread (a server's, sharing it) made
    between its own setting and its encoding. A Python tokenizer takes them per call: itself.
    Every call on the copy reads special tokens' names as text, so none undoes another's setting."""
    if not getattr(tokenizer, "is_fast", False):
        return tokenizer
    return _remembered(_OWN_COPIES, tokenizer, copy.deepcopy)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A sha256 of what `compare_tokenizers` compares: every token's id and the special token ids.
    Two tokenizers with one fingerprint compare alike with any third. Remembered per tokenizer
    object and size (~50 ms for a 50k-token vocabulary)."""
    return _remembered(_FINGERPRINTS, tokenizer, _fingerprint)


def _fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    specials = {attr: getattr(tokenizer, attr, None) for attr in _SPECIAL_ATTRS}
    return hashlib.sha256(json.dumps([vocab, specials]).encode()).hexdigest()


# --- tokens two different tokenizers share --------------------------------------------------------

# Text on which the share of each tokenizer's tokens that the other also has is measured: prose,
# a list, numbers and code, in English. A pair's coverage on other languages can be far lower (on
# Spec-Bench's translation prompts 58% of Gemma-3's tokens were shared with SmolLM2's, 88-97% elsewhere).
PROBE_TEXT = """\
The history of the city begins with a small settlement on the river, where traders met to exchange
grain, salt and cloth. Over the following centuries it grew into a regional capital: its university
was founded in 1348, and by 1900 more than 250,000 people lived within its walls.

Here are three things to remember when you write a report:
1. State the question you are answering in the first sentence.
2. Give the evidence, with numbers where you have them (e.g. 12.5% growth, $3,400 per year).
3. End with what the reader should do next.

def mean(values: list[float]) -> float:
    \"\"\"Return the arithmetic mean of a non-empty list.\"\"\"
    if not values:
        raise ValueError("mean() of an empty list")
    return sum(values) / len(values)

Q: What is the capital of France? A: Paris. Q: How many days are in a leap year? A: 366.
"I don't think so," she said, and closed the door; the meeting was over before it had started.
"""

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True)
class VocabularyOverlap:
    """What two tokenizers of different vocabularies share: tokens that spell the same bytes.

    `target_coverage` and `draft_coverage` are the shares of each tokenizer's own tokens of
    `PROBE_TEXT` that are shared ones: how often a text in that tokenizer's tokens uses a token
    the other vocabulary also has.
    """

    shared: int  # tokens both vocabularies have, special tokens not counted
    target_coverage: float
    draft_coverage: float


def token_spellings(tokenizer: Any) -> list[bytes | None]:
    """The bytes each token id stands for in text, None for special tokens (BOS, EOS, chat markers,
    unused slots): index = token id. Byte-level BPE tokens (GPT-2, Llama 3, Qwen, SmolLM2) are
    mapped back through their byte alphabet; SentencePiece-style ones (Llama 2, Gemma) spell `▁` as
    a space and `<0xNN>` byte-fallback tokens as that byte; added tokens that are not special spell
    their content. Remembered per tokenizer object and size."""
    return _remembered(_SPELLINGS, tokenizer, _spell_tokens)


def spelling(spellings: list[bytes | None], token_id: int) -> bytes | None:
    """A token's bytes in `token_spellings`; None for a special token, or an id past the tokenizer's
    (a model whose head is wider than its tokenizer, padded, can emit those)."""
    return spellings[token_id] if token_id < len(spellings) else None


def shared_token_pairs(target: Any, draft: Any) -> dict[int, int]:
    """Draft token id -> the target token id that spells the same bytes, for every token both
    vocabularies have (one id per spelling on each side: a tokenizer with two ids for one spelling,
    a token and its byte-fallback twin, keeps the one it produces itself)."""
    target_ids = _ids_by_spelling(target)
    return {d: target_ids[b] for b, d in _ids_by_spelling(draft).items() if b in target_ids}


def vocabulary_overlap(target: Any, draft: Any) -> VocabularyOverlap:
    """How much two tokenizers share: the shared tokens, and the share of each one's tokens of
    `PROBE_TEXT` that the other has too."""
    shared = shared_token_pairs(target, draft)
    target_shared = set(shared.values())

    def coverage(tokenizer: Any, ids: set[int]) -> float:
        tokens = own_copy(tokenizer)(PROBE_TEXT, add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]
        return sum(t in ids for t in tokens) / len(tokens)

    return VocabularyOverlap(len(shared), coverage(target, target_shared), coverage(draft, set(shared)))


def _ids_by_spelling(tokenizer: Any) -> dict[bytes, int]:
    return _remembered(_BY_SPELLING, tokenizer, _pick_ids_by_spelling)


def _pick_ids_by_spelling(tokenizer: Any) -> dict[bytes, int]:
    by_spelling: dict[bytes, int] = {}
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(token_spellings(tokenizer)))))
    for i, spelling in enumerate(token_spellings(tokenizer)):
        if spelling is None:
            continue
        known = by_spelling.get(spelling)
        # The tokenizer's own token for these bytes, not its byte-fallback twin; else the first id.
        if known is None or (
            _BYTE_FALLBACK.match(tokens[known] or "") and not _BYTE_FALLBACK.match(tokens[i] or "")
        ):
            by_spelling[spelling] = i
    return by_spelling


def _spell_tokens(tokenizer: Any) -> list[bytes | None]:
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_ids) | {
        i for i, added in tokenizer.added_tokens_decoder.items() if added.special
    }
    added = {i: added.content for i, added in tokenizer.added_tokens_decoder.items()}
    byte_level = _decodes_byte_level(tokenizer)
    spellings: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        if i in special:
            continue
        if i in added:
            spellings[i] = added[i].encode()
        elif byte_level:
            spellings[i] = _byte_level_bytes(token)
        elif match := _BYTE_FALLBACK.match(token):
            spellings[i] = bytes([int(match.group(1), 16)])
        else:
            spellings[i] = token.replace("\u2581", " ").encode()
    return spellings


def _decodes_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder maps a byte alphabet back to bytes (GPT-2's ByteLevel)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None if backend is None else backend.decoder
    if decoder is None:
        return False

    def types(node: Any) -> list[str]:
        if isinstance(node, dict):
            return [node.get("type", ""), *(t for value in node.values() for t in types(value))]
        if isinstance(node, list):
            return [t for value in node for t in types(value)]
        return []

    return "ByteLevel" in types(json.loads(decoder.__getstate__()))


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _byte_level_bytes(token: str) -> bytes:
    alphabet = _byte_alphabet()
    if all(char in alphabet for char in token):
        return bytes(alphabet[char] for char in token)
    return token.encode()  # not of the byte alphabet (a tokenizer's own odd entry): as written


_SPELLINGS: dict[tuple[int, int], tuple[weakref.ref, list[bytes | None]]] = {}
_BY_SPELLING: dict[tuple[int, int], tuple[weakref.ref, dict[bytes, int]]] = {}


def _remembered(memo: dict, tokenizer: Any, compute: Any) -> Any:
    """`compute(tokenizer)`, remembered per tokenizer object and size while the object lives."""
    key = (id(tokenizer), len(tokenizer))
    known = memo.get(key)
    if known is not None and known[0]() is tokenizer:
        return known[1]
    value = compute(tokenizer)
    with contextlib.suppress(TypeError):  # no weak references to it: computed every time
        memo[key] = (*dropping_refs(memo, key, tokenizer), value)
    return value


def dropping_refs(memo: dict, key: Any, *objects: Any) -> tuple[weakref.ref, ...]:
    """Weak references to `objects`, for an entry `memo[key] = (*refs, value)` of a memo keyed by
    their `id()`s, that drop that entry once any of them is collected: the memo keeps nothing of
    objects gone (a tokenizer made for each call would otherwise leave its spellings behind every
    time). Raises TypeError for an object without weak references."""

    count = len(objects)  # not `objects` in `drop`: the callback would keep them alive

    def drop(ref: weakref.ref) -> None:
        entry = memo.get(key)
        if entry is not None and any(ref is held for held in entry[:count]):
            memo.pop(key, None)

    return tuple(weakref.ref(o, drop) for o in objects)
