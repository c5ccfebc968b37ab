"""Is a checkpoint's folder safe to hand to transformers? Decided by reading its JSON files ourselves,
before `from_pretrained` sees them.

transformers runs a repo's own Python code when its config (or tokenizer config) has an `auto_map`
and the caller passes `trust_remote_code=True`; left unset, it asks on stdin. Every load of ours
passes `trust_remote_code` explicitly (False unless the user opted in), and refuses such a folder
here first, so the reason is ours and names the opt-in. Weights fetched from the Hub must be
safetensors: a `pytorch_model.bin` is a pickle, and unpickling can run code.

Each check returns None when the folder passes, else why not as a phrase that completes
"the draft ... cannot be used:" (the Hub search lists it among its rejected candidates).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .download import SAFETENSORS_INDEX, ShardIndexError, weights_files

MAX_CONFIG_BYTES = 1 << 20  # a causal LM's config.json is a few kB; a larger one is refused unread
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # added tokens and chat templates make these larger
# `attn_implementation` (and the experts') may name a Hub repo of compiled kernels to download and run.
_KERNEL_KEYS = ("attn_implementation", "_attn_implementation", "experts_implementation")
OPT_IN = "pass trust_remote_code=True (SpeculativeConfig, select_draft or --trust-remote-code) to run it"
NO_PICKLES = (
    "no safetensors weights (pickled weights such as pytorch_model.bin are never loaded from the Hub: "
    "unpickling can run code); load it with from_pretrained yourself and pass the loaded model"
)


def read_json(path: Path, limit: int | None = MAX_CONFIG_BYTES) -> tuple[Any, str | None]:
    """(the JSON value of `path`, None), or (None, why it cannot be read): missing, larger than
    `limit` bytes (then it is not read at all), not UTF-8 JSON."""
    try:
        size = path.stat().st_size
    except OSError:
        return None, f"has no {path.name}"
    if limit is not None and size > limit:
        return None, f"{path.name} is larger than {limit >> 20} MiB ({size} bytes)"
    try:
        return json.loads(path.read_bytes()), None
    except (ValueError, UnicodeDecodeError):  # json.JSONDecodeError is a ValueError
        return None, f"{path.name} is not valid JSON"


def remote_code_problem(config: Any, *, trust_remote_code: bool, name: str = "config.json") -> str | None:
    """Why loading `config` (a parsed config.json, or `name`) would run code from the repo, if it would."""
    if not isinstance(config, dict):
        return f"{name} is not a JSON object"
    if trust_remote_code:
        return None
    if "auto_map" in config:
        return f"needs custom code (auto_map in {name}), which is never run unless you {OPT_IN}"
    kernels = [config[k] for k in _KERNEL_KEYS if isinstance(config.get(k), str) and "/" in config[k]]
    if kernels:
        return f"asks for the Hub kernel {kernels[0]!r} in {name}, code that is never run unless you {OPT_IN}"
    return None


def draft_config_problem(config: Any, *, trust_remote_code: bool) -> str | None:
    """Why a Hub repo's parsed config.json does not describe a draft we load, if it does not."""
    problem = remote_code_problem(config, trust_remote_code=trust_remote_code)
    if problem:
        return problem
    if "quantization_config" in config:
        return "quantized checkpoint"
    if trust_remote_code and "auto_map" in config:
        return None  # the user lets its own code load it
    if config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type {config.get('model_type')!r} is not a causal LM transformers can load"
    return None


def tokenizer_problem(folder: Path, *, trust_remote_code: bool) -> str | None:
    """Why loading the tokenizer in `folder` would run the repo's code (or cannot be read), if so."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return None
    config, unreadable = read_json(path, MAX_TOKENIZER_CONFIG_BYTES)
    if unreadable:
        return unreadable
    return remote_code_problem(config, trust_remote_code=trust_remote_code, name="tokenizer_config.json")


def weights_problem(folder: Path) -> str | None:
    """Why `folder` lacks a whole set of safetensors weights (`weights_files`: one file, or every shard
    its index names)."""
    try:
        names = {path.name for path in folder.iterdir() if path.is_file()}
    except OSError:  # no folder
        names = set()
    try:
        files = weights_files(names, lambda: _shard_index(folder))
    except ShardIndexError as err:
        return str(err)
    if not files:
        return NO_PICKLES
    missing = [name for name in files if not (folder / name).is_file()]
    return f"safetensors shards {missing[:3]} are missing" if missing else None


def _shard_index(folder: Path) -> Any:
    index, unreadable = read_json(folder / SAFETENSORS_INDEX, MAX_TOKENIZER_CONFIG_BYTES)
    if unreadable:
        raise ShardIndexError(unreadable)
    return index


def hub_config_problem(folder: Path, *, trust_remote_code: bool) -> str | None:
    """Why the config.json and tokenizer config of a Hub repo's files in `folder` do not describe a
    draft we load (its weights need not be there yet), if they do not."""
    config, unreadable = read_json(folder / "config.json")
    problem = unreadable or draft_config_problem(config, trust_remote_code=trust_remote_code)
    return problem or tokenizer_problem(folder, trust_remote_code=trust_remote_code)


def checkpoint_problem(folder: Path, *, trust_remote_code: bool, from_hub: bool) -> str | None:
    """Why `folder` cannot be loaded as a draft without running its code, if it cannot.

    A folder from the Hub (`from_hub`) must also be a causal LM transformers knows, unquantized,
    with safetensors weights (`hub_config_problem`, `weights_problem`); a folder of the user's needs
    only not to run code unasked (its pickles, if any, transformers reads with `weights_only=True`)."""
    if from_hub:
        return hub_config_problem(folder, trust_remote_code=trust_remote_code) or weights_problem(folder)
    config, unreadable = read_json(folder / "config.json", limit=None)
    problem = unreadable or remote_code_problem(config, trust_remote_code=trust_remote_code)
    return problem or tokenizer_problem(folder, trust_remote_code=trust_remote_code)
