"""Training text for a draft head: the target's own answers to prompts, or a corpus the user gives.

Self-distillation: the head learns to predict what the target generates, so the training text is
the target's greedy continuation of real prompts (prompt tokens included). A plain-text corpus is
used as it is. The target's features and next-token predictions are computed later (`features`).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..bench.suites import Prompt, load_prompt_file, load_suite
from ..loading import left_padded, pad_token_id, prompt_token_ids, use_chat_template
from ..store.fingerprint import weights_fingerprint
from ..store.manifest import write_atomically

MIN_TOKENS = 2_000  # less than this cannot train anything; say so instead of producing a useless head


def load_prompts(suite: str | None, data: str | Path | None) -> list[Prompt] | list[str]:
    """Prompts of a suite or a JSONL file, or the chunks of text of a .txt corpus."""
    if data is not None:
        path = Path(data)
        if path.suffix == ".txt":
            if not path.is_file():
                raise ValueError(f"Training corpus {path} does not exist.")
            text = path.read_text(encoding="utf-8")
            chunks = [c.strip() for c in text.split("\n\n") if c.strip()]
            if not chunks:
                raise ValueError(f"Training corpus {path} is empty.")
            return chunks
        return load_prompt_file(path)
    return load_suite(suite or "specbench-train")


@dataclass
class Sequence:
    """One training text: token ids, and where the target's own answer starts (0 for a corpus)."""

    ids: torch.Tensor
    answer_start: int


def build_sequences(
    model: Any,
    tokenizer: Any,
    source: list[Prompt] | list[str],
    cache_file: Path,
    max_new_tokens: int = 192,
    batch_size: int | None = None,
    max_length: int = 1024,
    answers_per_prompt: int = 1,
) -> list[Sequence]:
    """Token sequences to train on (cached in `cache_file`, so an interrupted run does not redo them).

    Each prompt gets `answers_per_prompt` answers: the first greedy, the others sampled from the
    target's own distribution (its generation config), which shows the head more contexts it must
    draft from; the labels stay the target's greedy choices either way (`features`).

    The cache is used only where its key, a digest of everything that decides the sequences, is
    this call's: every prompt's token ids as the target reads them (chat template applied), or the
    corpus's; and for generated answers the target's weights (`weights_fingerprint`), context
    length and generation config, the padding id, and the settings here.
    """
    if answers_per_prompt < 1:
        raise ValueError(f"answers_per_prompt must be at least 1, got {answers_per_prompt}.")
    max_length = min(max_length, _context(model) or max_length)  # the target reads every sequence whole
    if batch_size is None:  # a GPU generates a wide batch for about the price of a narrow one
        batch_size = 128 if model.device.type == "cuda" else 16
    corpus = isinstance(source[0], str)
    if corpus:
        inputs = [[t for chunk in source for t in tokenizer(chunk + "\n\n")["input_ids"]]]
        settings: dict[str, Any] = {"corpus": True, "max_length": max_length}
    else:
        chat = use_chat_template(tokenizer)
        inputs = [prompt_token_ids(tokenizer, prompt, chat) for prompt in source]
        generation = model.generation_config.to_json_string(use_diff=True, ignore_metadata=True)
        settings = {
            "max_new_tokens": max_new_tokens,
            "max_length": max_length,
            "answers_per_prompt": answers_per_prompt,
            "pad_token_id": pad_token_id(tokenizer, model),
            "context": _context(model),
            "generation_config": json.loads(generation),
            "weights": weights_fingerprint(model),
        }
    key = token_digest(settings, inputs)
    cached = read_cache_file(cache_file)
    if cached is not None and cached.get("key") == key:
        return [Sequence(ids, int(start)) for ids, start in zip(cached["ids"], cached["answer_starts"])]
    if corpus:
        sequences = _corpus_sequences(inputs[0], max_length)
    else:
        sequences = []
        for answer in range(answers_per_prompt):
            sequences += _generated_sequences(
                model,
                inputs,
                settings["pad_token_id"],
                max_new_tokens,
                batch_size,
                max_length,
                sample=answer > 0,
            )
    total = sum(len(s.ids) for s in sequences)
    if total < MIN_TOKENS:
        raise ValueError(
            f"The training data holds only {total} tokens ({len(sequences)} sequences); a head needs "
            f"at least {MIN_TOKENS}. Give more prompts (--suite specbench-train) or a longer corpus (--data)."
        )
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    saved = {
        "key": key,
        "ids": [s.ids for s in sequences],
        "answer_starts": [s.answer_start for s in sequences],
    }
    write_atomically(cache_file, lambda tmp: torch.save(saved, tmp))  # never one that looks complete
    return sequences


def token_digest(settings: dict[str, Any], rows: Iterable[list[int] | torch.Tensor]) -> str:
    """The SHA-256 of `settings` (as JSON) and of every row of token ids with its length: the key of
    a cache computed from exactly these rows with these settings."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for row in rows:
        ids = torch.as_tensor(row, dtype=torch.int64).cpu()
        digest.update(len(ids).to_bytes(8, "little") + ids.numpy().tobytes())
    return digest.hexdigest()


def read_cache_file(path: Path) -> dict[str, Any] | None:
    """What `torch.save` wrote to `path` for a later run, or None when there is none; a damaged one
    is recomputed, with a warning, instead of failing every run until someone deletes it."""
    if not path.is_file():
        return None
    try:
        cached = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError... for one bad file
        warnings.warn(f"{path} cannot be read ({type(err).__name__}); computing it again.", stacklevel=3)
        return None
    return cached if isinstance(cached, dict) else None


def _context(model: Any) -> int | None:
    """How many positions the target reads (None: its config does not say)."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def _corpus_sequences(ids: list[int], max_length: int) -> list[Sequence]:
    """The corpus's token ids cut into sequences the target reads whole."""
    starts = range(0, len(ids), max_length)
    return [Sequence(torch.tensor(ids[i : i + max_length]), 0) for i in starts if len(ids[i:]) > 8]


@torch.no_grad()
def _generated_sequences(
    model: Any,
    prompts: list[list[int]],
    pad: int,
    max_new_tokens: int,
    batch_size: int,
    max_length: int,
    sample: bool = False,
) -> list[Sequence]:
    """Each prompt's token ids followed by the target's answer (greedy, or `sample`d)."""
    context = _context(model)
    room = context - max_new_tokens if context else None  # prompt tokens that fit before the answer
    if room is not None and room < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's context of "
            f"{context} tokens: lower max_new_tokens."
        )
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    # Similar lengths share a batch, so little time goes into padding.
    order = sorted(prompts, key=len)
    too_long = sum(len(p) > room for p in prompts) if room is not None else 0
    if too_long:
        warnings.warn(
            f"{too_long} of {len(order)} prompts are longer than the target's context less the answer "
            f"({context} - {max_new_tokens} tokens); they keep their last {room} tokens.",
            stacklevel=3,
        )
    sequences = []
    desc = "sampling training answers" if sample else "generating training answers"
    with tqdm(total=len(order), desc=desc, unit="prompt") as bar:
        for i in range(0, len(order), batch_size):
            batch = order[i : i + batch_size]
            inputs = left_padded(batch, pad, model.device)
            if room is not None:  # left-padded: each row's last `room` tokens
                inputs = {name: tensor[:, -room:] for name, tensor in inputs.items()}
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad)
            for b in range(len(batch)):
                prompt = inputs["input_ids"][b][inputs["attention_mask"][b].bool()]
                answer = out[b, inputs["input_ids"].shape[1] :].tolist()
                for n, token in enumerate(answer):
                    if token in eos:
                        answer = answer[: n + 1]
                        break
                ids = torch.cat([prompt.cpu(), torch.tensor(answer, dtype=torch.long)])
                cut = max(0, len(ids) - max_length)  # keep the answer and the prompt's end
                sequences.append(Sequence(ids[cut:], max(0, len(prompt) - cut)))
            bar.update(len(batch))
    return sequences
