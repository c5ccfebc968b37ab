"""The tokenizer saved in a checkpoint's folder, read strictly: files that are there but do not load
are an error, never taken for no tokenizer, which would let a draft of another tokenizer be judged
by vocabulary size and pass unchecked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

# Files a saved tokenizer is read from: a folder with none of them holds no tokenizer.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def saved_tokenizer(folder: Path, name: str, *, trust_remote_code: bool, remedy: str) -> Any:
    """The tokenizer saved in `folder`, or None where it holds none. `name` is the folder's subject
    in the error, `remedy` what to do about files that do not load.

    Raises:
        ValueError: tokenizer files are there but do not load.
    """
    if not any((folder / f).is_file() for f in TOKENIZER_MARKERS):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # JSONDecodeError is a ValueError
        first_line = (str(err).strip().splitlines() or [""])[0]  # transformers' may run to ten lines
        raise ValueError(
            f"{name} has tokenizer files that do not load ({type(err).__name__}: {first_line}): {remedy}."
        ) from None
