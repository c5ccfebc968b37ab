"""Loading a target as users do (the checkpoint's own dtype), describing where it runs, encoding prompts.

`load_model` is what `demo`, `bench` and `train-draft` use. Its `dtype="auto"` follows transformers 5:
the dtype the checkpoint declares (config `dtype`, formerly `torch_dtype`), so a bf16 checkpoint such
as SmolLM2, Llama or Qwen runs in bf16. One exception: on a CPU without native bf16 instructions
(`avx512_bf16` or `amx_bf16`) bf16 and fp16 matmuls are emulated and slower than fp32, so there a
half-precision checkpoint is loaded in fp32, with a one-line message saying so.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from .core.checks import check_causal_lm

logger = logging.getLogger(__name__)

# What `--dtype` accepts; "auto" is the checkpoint's own dtype.
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
_HALF = (torch.bfloat16, torch.float16)
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def default_device() -> torch.device:
    """Where a model goes when no device is asked for: the current CUDA device if any, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def native_bf16(device: torch.device | str | None = None) -> bool:
    """Whether `device` (default: the CPU) computes in bf16 natively rather than by emulation.

    CPU: on Linux, whether /proc/cpuinfo lists `avx512_bf16` or `amx_bf16`; elsewhere torch's own
    check of those instruction sets where it has one, else False. CUDA: `torch.cuda.is_bf16_supported()`.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    return _cpu_native_bf16()


@functools.lru_cache(maxsize=1)
def _cpu_native_bf16() -> bool:
    flags = _cpu_flags()
    if flags is not None:
        return any(flag in flags for flag in _NATIVE_BF16_FLAGS)
    checks = [
        getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    return any(bool(check()) for check in checks if check is not None)


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name, as reports show it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resolve_dtype(
    dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None, device: torch.device
) -> tuple[torch.dtype | str, str | None]:
    """The dtype to load with, and a message when "auto" falls back to fp32.

    `checkpoint_dtype` is what the checkpoint declares (None when it declares nothing: transformers'
    "auto" then reads it from the weights). An explicit dtype is always honoured.
    """
    if isinstance(dtype, torch.dtype):
        return dtype, None
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(DTYPE_CHOICES)} or a torch.dtype, got {dtype!r}."
            )
        return _DTYPES[dtype], None
    if checkpoint_dtype in _HALF and device.type == "cpu" and not native_bf16(device):
        return torch.float32, _fallback_message(checkpoint_dtype)
    return checkpoint_dtype or "auto", None


def _fallback_message(checkpoint_dtype: torch.dtype) -> str:
    name = str(checkpoint_dtype).removeprefix("torch.")
    return (
        f"The checkpoint is {name} but this CPU has no native bf16 instructions (avx512_bf16 / amx_bf16): "
        f"loading it in float32, which is faster here (pass dtype={name!r} / --dtype {name} to keep {name})."
    )


def is_missing_path(name: str) -> bool:
    """Whether `name` is a local path that does not exist, not a Hub repo id (owner/name, or a bare
    name): it starts with '.', '/' or '~', or has more than one '/'."""
    return not Path(name).exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1)


def check_model_path(name: str) -> None:
    """Refuse a local path that does not exist: huggingface_hub would call it a malformed repo id."""
    if is_missing_path(name):
        raise FileNotFoundError(
            f"{name!r} is neither a model folder that exists nor a Hub repo id (owner/name): pass a "
            "folder holding config.json and the weights, or a repo id."
        )


def load_model(
    name_or_path: str | Path | Any = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str | None = None,
    tokenizer: Any = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode, as transformers 5 would by default.

    Args:
        name_or_path: a model folder or Hub repo id; None: the offline SmolLM2-135M-Instruct demo model.
            A loaded model is returned as it is (never converted: a dtype or device asked for that
            it does not have is an error), with its tokenizer.
        dtype: "auto" (the checkpoint's dtype, fp32 for a bf16/fp16 checkpoint on a CPU without
            native bf16, see `native_bf16`), "bfloat16", "float16", "float32", or a `torch.dtype`.
        device: where the model goes; default CUDA when available, else the CPU.
        tokenizer: a tokenizer to use instead of loading the model's own.
        trust_remote_code: run the Python code the model's repo or folder ships (`auto_map`), as
            `from_pretrained(..., trust_remote_code=True)`; without it such a model is refused with
            transformers' error, never asked about on stdin.

    Returns:
        (model, tokenizer).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name_or_path is not None and not isinstance(name_or_path, (str, Path)):
        model = _loaded(name_or_path, dtype, device)
        return model, tokenizer or AutoTokenizer.from_pretrained(
            model.name_or_path, trust_remote_code=trust_remote_code
        )
    if name_or_path is None:
        from .demo_model import demo_model_path

        name_or_path = demo_model_path()
    name = str(name_or_path)
    check_model_path(name)
    device = torch.device(device) if device is not None else default_device()
    base = adapter_base(name)  # from_pretrained loads a PEFT adapter onto the base it names
    config = AutoConfig.from_pretrained(base or name, trust_remote_code=trust_remote_code)
    check_causal_lm(config, name)
    declared = checkpoint_dtype(config) if dtype == "auto" else None
    load_dtype, message = resolve_dtype(dtype, declared, device)
    model, info = AutoModelForCausalLM.from_pretrained(
        name, dtype=load_dtype, trust_remote_code=trust_remote_code, output_loading_info=True
    )
    # transformers fills the weights a checkpoint lacks with random values and only logs it (a
    # BERT encoder's folder gets a random LM head): every figure measured on it would be noise.
    # Tied weights, stored once, are not missing.
    if missing := sorted(info["missing_keys"]):
        raise ValueError(
            f"{name} cannot be loaded as a causal LM: its checkpoint lacks {len(missing)} of its weights "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), which transformers would "
            "fill with random values. Pass a complete causal LM checkpoint."
        )
    if dtype == "auto" and declared is None and model.dtype in _HALF:  # a dtype found only in the weights
        load_dtype, message = resolve_dtype("auto", model.dtype, device)
        model = model.to(load_dtype)
    if message:
        logger.warning(message)
    model = model.to(device).eval()
    if base is not None and Path(name).is_dir() and not any(Path(name).glob("tokenizer*.json")):
        name = base  # PEFT saves an adapter without the tokenizer, which is then its base's
    return model, tokenizer or AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def adapter_base(name: str) -> str | None:
    """The base checkpoint a PEFT adapter names (`base_model_name_or_path` of the adapter_config.json
    of a Hub repo, or of a folder without a config.json of its own), which transformers'
    `from_pretrained` loads the adapter onto; None for a model's own checkpoint."""
    from transformers.utils import find_adapter_config_file, is_peft_available

    if not is_peft_available() or (Path(name) / "config.json").exists():
        return None
    found = find_adapter_config_file(name)
    if found is None:
        return None
    return json.loads(Path(found).read_text(encoding="utf-8")).get("base_model_name_or_path")


def _loaded(model: Any, dtype: str | torch.dtype, device: torch.device | str | None) -> Any:
    wanted, _ = resolve_dtype(dtype, model.dtype, model.device)
    if dtype != "auto" and wanted != model.dtype:
        raise ValueError(
            f"The model given is {model.dtype}, not {wanted}: convert it first, or pass its name."
        )
    asked = torch.device(device) if device is not None else None
    if asked is not None and (asked.type, asked.index or 0) != (model.device.type, model.device.index or 0):
        raise ValueError(
            f"The model given is on {model.device}, not {device}: move it first, or pass its name."
        )
    return model


def checkpoint_dtype(config: Any) -> torch.dtype | None:
    """The dtype a model config declares (`dtype`; transformers maps the older `torch_dtype` onto it),
    None if it declares none."""
    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = _DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def describe_runtime(model: Any) -> dict[str, Any]:
    """What a report should say about where `model` ran: dtype, device, CPU and its bf16 support, versions."""
    import transformers

    device = torch.device(getattr(model, "device", "cpu"))
    info = {
        "dtype": str(getattr(model, "dtype", torch.float32)).removeprefix("torch."),
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_native_bf16": native_bf16("cpu"),
        "native_bf16": native_bf16(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def runtime_line(info: dict[str, Any]) -> str:
    """`describe_runtime`'s dict as one line for a report."""
    where = info.get("gpu") or info["cpu"]
    return (
        f"dtype {info['dtype']}, device {info['device']} ({where}), "
        f"native bf16 {'yes' if info['native_bf16'] else 'no'}"
    )


# --- Prompts to model inputs ------------------------------------------------------------------


class PromptLike(Protocol):
    """A prompt with text; `raw` prompts (code completion) never get a chat template."""

    text: str
    raw: bool


def use_chat_template(tokenizer: Any, requested: bool | None = None) -> bool:
    """Whether to wrap prompts in the tokenizer's chat template: `requested`, or (None) when it has one."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if requested and not has_template:
        raise ValueError(
            "--chat-template was requested but the tokenizer has no chat template; "
            "drop --chat-template to benchmark raw prompts."
        )
    return has_template if requested is None else requested


def prompt_token_ids(tokenizer: Any, prompt: str | PromptLike, chat: bool) -> list[int]:
    """A prompt's token ids: as a user message in the chat template when `chat` (and not raw), else as is."""
    text, raw = (prompt, False) if isinstance(prompt, str) else (prompt.text, prompt.raw)
    if chat and not raw:
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(templated, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[str | PromptLike],
    chat: bool,
    pad_id: int,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Left-padded `input_ids` and `attention_mask` (padded here: the tokenizer is left untouched)."""
    return left_padded([prompt_token_ids(tokenizer, p, chat) for p in prompts], pad_id, device)


def left_padded(
    ids: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Token id rows as left-padded `input_ids` and `attention_mask`."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, row in enumerate(ids):
        input_ids[b, width - len(row) :] = torch.tensor(row)
        attention_mask[b, width - len(row) :] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def eos_token_ids(model: Any) -> set[int]:
    """The ids that end generation, from the model's generation config."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def pad_token_id(tokenizer: Any, model: Any) -> int:
    """The id to pad with: the tokenizer's pad token, else the generation config's, else an EOS id."""
    for candidate in (
        tokenizer.pad_token_id,
        model.generation_config.pad_token_id,
        *sorted(eos_token_ids(model)),
    ):
        if candidate is not None:
            return int(candidate)
    return 0
