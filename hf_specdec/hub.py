"""The Hub, as this package uses it: endpoint and offline mode read when called (huggingface_hub
reads them once, at import), and model files downloaded into the Hub cache. A leaf: it imports
nothing of ours, so draft selection, the Hub search and head loading can all use it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "config.json",
)
_MODEL_FILES = re.compile(r"^(config\.json|generation_config\.json|model.*\.safetensors(\.index\.json)?)$")


def hub_endpoint() -> str:
    """`$HF_ENDPOINT` read now, else the endpoint huggingface_hub read at import."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE`, read now (huggingface_hub reads it once, at import)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or value.upper() in {"1", "ON", "YES", "TRUE"}


def download_model(repo_id: str, *, token: str | None = None, revision: str | None = None) -> Path:
    """Download a model's config, generation config and safetensors weights; return the folder."""
    info = HfApi(endpoint=hub_endpoint(), token=token).model_info(
        repo_id, revision=revision, expand=["siblings"]
    )
    names = [s.rfilename for s in info.siblings or [] if _MODEL_FILES.match(s.rfilename)]
    names += [s.rfilename for s in info.siblings or [] if s.rfilename in TOKENIZER_FILES]
    return download_files(repo_id, sorted(set(names)), token=token, revision=revision)


def download_files(repo_id: str, names: list[str], *, token: str | None, revision: str | None) -> Path:
    """Download `names` from one commit of `repo_id` into the Hub cache; return their folder."""
    paths = [
        hf_hub_download(
            repo_id,
            name,
            revision=revision,
            token=token,
            endpoint=hub_endpoint(),
            cache_dir=os.environ.get("HF_HUB_CACHE"),
        )
        for name in names
    ]
    return Path(paths[0]).parent
