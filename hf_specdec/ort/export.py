"""Export a causal LM to ONNX with its KV cache, in the Hub's decoder layout (see `layout`), and
check it against PyTorch. The attention mask is honoured position by position, so the holes that
ragged batching leaves in the cache stay hidden.

    from hf_specdec.ort import export_onnx
    export_onnx("path/to/model", "out/")          # out/model.onnx, config, tokenizer; parity-checked
    export_onnx(model, "out-int8/", quantize="int8")
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.export import Dim
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..core.checks import check_causal_checkpoint
from ..core.compat import cache_argument
from ..core.masks import allowed_keys, in_attention_format
from .graph import add_logits_to_keep, add_tree_mask_default
from .layout import io_names, require
from .progress import Progress, quiet
from .quantize import quantize_int8

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}  # max abs logit difference accepted by the parity check


@dataclass
class ExportReport:
    """What `export_onnx` wrote and how closely the ONNX logits follow PyTorch's."""

    path: Path
    max_abs_diff: float  # of the un-quantized export against PyTorch, on inputs with a past
    tolerance: float
    argmax_agreement: float | None = None  # of the int8 model with PyTorch, when quantized


class DecoderWithPast(torch.nn.Module):
    """`(input_ids, attention_mask, position_ids, *past_kv) -> (logits, *present_kv)` for export.

    `past_kv` is flat: key and value of layer 0, then of layer 1, ...
    """

    def __init__(self, model: PreTrainedModel, tree_mask: bool = False) -> None:
        """`tree_mask`: the last input is `layout.TREE_MASK` (see `tree_attention`)."""
        super().__init__()
        self.model = model
        self.tree_mask = tree_mask

    def forward(self, input_ids, attention_mask, position_ids, *past_kv):
        if self.tree_mask:
            *past_kv, visible = past_kv
            attention_mask = tree_attention(self.model, attention_mask, input_ids.shape[1], visible)
        layers = [(past_kv[i], past_kv[i + 1]) for i in range(0, len(past_kv), 2)]
        cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{cache_argument(self.model): cache},
        )
        present = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # updated in place
        return (out.logits, *present)


def takes_tree_mask(model: PreTrainedModel) -> bool:
    """Whether `model`'s export gets a `TREE_MASK` input: every layer attends to the whole context
    (one 4D mask serves them all; sliding-window layers would need their window in it too) through
    sdpa or eager attention (which take the 4D mask `tree_attention` builds)."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        full = all(kind == "full_attention" for kind in layer_types)
    else:
        full = getattr(config, "sliding_window", None) is None
    return full and config._attn_implementation in ("sdpa", "eager")


def tree_attention(
    model: PreTrainedModel,
    attention_mask: torch.Tensor,  # [B, past + new], 1 where a column holds a real token
    new: int,
    visible: torch.Tensor,  # [B, new, past + new] bool, or [1, 1, 1] True (the default: no tree)
) -> torch.Tensor:
    """The 4D mask [B, 1, new, past + new] the model would build from `attention_mask` (each new
    token sees the real tokens up to its own column), further limited to `visible`: a tree draft's
    node sees its ancestors only; `RaggedKV`'s tree masks, by the same rules (`core.masks`)."""
    width = attention_mask.shape[1]
    queries = torch.arange(width - new, width, device=attention_mask.device)
    allowed = allowed_keys(attention_mask.bool(), queries, visible)
    implementation = model.config.get_text_config(decoder=True)._attn_implementation
    return in_attention_format(allowed, implementation, model.dtype)


def sample_inputs(
    model: PreTrainedModel, batch: int = 2, past: int = 5, new: int = 3, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Inputs with a real past (row 0 has a hole in it) for tracing and for the parity check."""
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (batch, past), generator=g)
    ids = torch.randint(0, vocab, (batch, new), generator=g)
    mask = torch.ones(batch, past + new, dtype=torch.long)
    mask[0, past // 2] = 0  # a hole in the middle of the cache, as ragged batching leaves them
    real = mask.cumsum(dim=1) - 1
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(
            input_ids=prefix,
            attention_mask=mask[:, :past],
            position_ids=real[:, :past].clamp_min(0),
            use_cache=True,
            **{cache_argument(model): cache},
        )
    past_kv = [t.detach() for layer in cache.layers for t in (layer.keys, layer.values)]
    return (ids, mask, real[:, past:].contiguous(), *past_kv)


def export_onnx(
    model_or_path: PreTrainedModel | str | Path,
    out_dir: str | Path,
    dtype: str = "fp32",
    quantize: str | None = None,
    *,
    tokenizer: Any = None,
    progress: bool = True,
) -> Path:
    """Export a causal LM with its KV cache to `out_dir/model.onnx` and check it against PyTorch.

    Args:
        model_or_path: a loaded `PreTrainedModel`, or a folder / Hub id to load one from.
        out_dir: written with `model.onnx`, `config.json`, `generation_config.json` and, when one
            can be found, the tokenizer files.
        dtype: "fp32" or "fp16" weights and KV cache.
        quantize: None, or "int8": int8 weights in blocks of 32 (onnxruntime MatMulNBits; see
            `quantize_int8`).
        tokenizer: saved beside the model; by default loaded from `model_or_path`.
        progress: show a progress bar.

    Returns the path of `model.onnx`. Raises `RuntimeError` when the parity check fails.
    """
    return export_onnx_report(
        model_or_path, out_dir, dtype, quantize, tokenizer=tokenizer, progress=progress
    ).path


def export_onnx_report(
    model_or_path: PreTrainedModel | str | Path,
    out_dir: str | Path,
    dtype: str = "fp32",
    quantize: str | None = None,
    *,
    tokenizer: Any = None,
    progress: bool = True,
) -> ExportReport:
    """`export_onnx`, returning the parity figures as well (the CLI prints them)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}.")
    if quantize and dtype != "fp32":
        raise ValueError("quantize='int8' quantizes fp32 weights; use dtype='fp32'.")
    for module in ("onnxruntime", "onnx", "onnxscript"):
        require(module)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; pass a folder for the ONNX export.")
    path = out / "model.onnx"

    steps = ["load", "export", "check"] + (["quantize"] if quantize else []) + ["save config"]
    with Progress(steps, enabled=progress) as bar, contextlib.ExitStack() as stack:
        bar.step("loading the model")
        model, tokenizer = _load(model_or_path, tokenizer, DTYPES[dtype])
        stack.enter_context(_in_eval_mode(model))
        out.mkdir(parents=True, exist_ok=True)  # once the model loaded: a bad name leaves no folder
        bar.step("exporting with torch.onnx (dynamo)")
        fp_path = out / "model_fp.onnx" if quantize else path
        _export(model, fp_path)
        add_logits_to_keep(fp_path)
        add_tree_mask_default(fp_path)
        bar.step("checking logits against PyTorch")
        diff = max_abs_diff(model, fp_path)
        tolerance = TOLERANCE[dtype] * max(1.0, _logit_scale(model))
        if not diff <= tolerance:
            raise RuntimeError(
                f"The ONNX export of {type(model).__name__} does not reproduce PyTorch: max abs logit "
                f"difference {diff:.3g} > tolerance {tolerance:.3g}. The file is kept at {fp_path}."
            )
        agreement = None
        if quantize:
            bar.step("quantizing weights to int8 (blocks of 32)")
            quantize_int8(fp_path, path)
            _remove_onnx(fp_path)
            agreement = argmax_agreement(model, path)
        bar.step("saving config, generation config and tokenizer")
        model.config.save_pretrained(out)
        _record_source(out, model_or_path)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    return ExportReport(path, diff, tolerance, agreement)


def _record_source(out: Path, model_or_path: Any) -> None:
    """Name the model exported in `out/config.json` (`_name_or_path`: a folder's absolute path, or a
    Hub id), which transformers no longer writes there: `export-serving` serves an ONNX draft with
    the model it was exported from (`serving.sources.onnx_source`), and without it refuses the folder."""
    named = isinstance(model_or_path, (str, Path))
    source = str(model_or_path if named else getattr(model_or_path, "name_or_path", "") or "")
    if not source:  # a model built in memory: nothing to name
        return
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["_name_or_path"] = str(Path(source).resolve()) if Path(source).is_dir() else source
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _load(model_or_path: Any, tokenizer: Any, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    if isinstance(model_or_path, (str, Path)):
        source = str(model_or_path)
        # A model that needs its repo's code: load it yourself (trust_remote_code=True) and pass it.
        check_causal_checkpoint(source, source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, trust_remote_code=False)
    else:
        model, source = model_or_path, getattr(model_or_path, "name_or_path", "")
    if model.dtype != dtype or model.device.type != "cpu":
        model = _cpu_copy(model, dtype)  # never touch the caller's model
    if tokenizer is None and source:
        with contextlib.suppress(OSError, ValueError, TypeError):
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    return model, tokenizer


@contextlib.contextmanager
def _in_eval_mode(model: PreTrainedModel) -> Iterator[None]:
    """`model` in eval mode (no dropout traced or checked), each module back in its own mode after:
    the caller's model (a target `method="quantized"` exports) is not left switched to eval."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _cpu_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of `model` on the CPU with floating-point weights in `dtype`, made tensor by tensor:
    no weight is ever duplicated where it lives (deep-copying a GPU model first would take twice
    its memory there). Shared tensors (tied embeddings) stay shared."""
    copies: dict[int, Any] = {}  # deepcopy's memo: id of an original -> its copy
    for p in model.parameters():
        copies[id(p)] = torch.nn.Parameter(_to_cpu(p, dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        copies[id(b)] = _to_cpu(b, dtype)
    for module in model.modules():  # tensors kept as plain attributes (a rotary embedding's)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in copies:
                copies[id(value)] = value.detach().to("cpu")
    return copy.deepcopy(model, copies)


def _to_cpu(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = tensor.detach().to("cpu")
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _export(model: PreTrainedModel, path: Path, tree_mask: bool | None = None) -> None:
    """`tree_mask`: give the graph a `TREE_MASK` input (None: where `takes_tree_mask(model)`)."""
    inputs = sample_inputs(model)
    num_layers = (len(inputs) - 3) // 2
    tree = takes_tree_mask(model) if tree_mask is None else tree_mask
    input_names, output_names = io_names(num_layers, tree)
    auto = Dim.AUTO
    rest = tuple({0: auto, 2: auto} for _ in inputs[3:])  # past [batch, kv_heads, past, head_dim]
    if tree:  # traced with a tree's shape; `add_tree_mask_default` makes it optional
        batch, new = inputs[0].shape
        inputs = (*inputs, torch.ones(batch, new, inputs[1].shape[1], dtype=torch.bool))
        rest = (*rest, {0: auto, 1: auto, 2: auto})  # TREE_MASK [batch, new, past + new]
    dynamic = (
        {0: auto, 1: auto},  # input_ids [batch, new]
        {0: auto, 1: auto},  # attention_mask [batch, past + new]
        {0: auto, 1: auto},  # position_ids [batch, new]
        rest,
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with quiet():
        torch.onnx.export(
            DecoderWithPast(model, tree),
            inputs,
            str(path),
            dynamo=True,
            input_names=input_names,
            output_names=output_names,
            dynamic_shapes=dynamic,
            external_data=weight_bytes > 1.8e9,  # protobuf files stop at 2 GB
            verbose=False,
        )


def run_session(session: Any, inputs: tuple[torch.Tensor, ...]) -> list[Any]:
    """Run an ONNX decoder session on the tensors `sample_inputs` makes."""
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {name: t.numpy() for name, t in zip(names, inputs)})


def _reference(model: PreTrainedModel, path: Path, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ort = require()
    inputs = sample_inputs(model, seed=seed)
    with torch.no_grad():
        expected = DecoderWithPast(model)(*inputs)[0].float()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(run_session(session, inputs)[0]).float()
    return expected, got


def max_abs_diff(model: PreTrainedModel, path: str | Path, seed: int = 0) -> float:
    """Max abs difference between the ONNX and PyTorch logits on inputs with a past and a hole."""
    expected, got = _reference(model, Path(path), seed)
    return float((expected - got).abs().max())


def argmax_agreement(model: PreTrainedModel, path: str | Path, seed: int = 0) -> float:
    """Share of sample positions where the ONNX model's top token is PyTorch's."""
    expected, got = _reference(model, Path(path), seed)
    return float((expected.argmax(-1) == got.argmax(-1)).float().mean())


def _logit_scale(model: PreTrainedModel) -> float:
    """Largest |logit| on the sample inputs: the tolerance is relative to it."""
    with torch.no_grad():
        return float(DecoderWithPast(model)(*sample_inputs(model))[0].abs().max())


def _remove_onnx(path: Path) -> None:
    path.unlink(missing_ok=True)
    Path(str(path) + ".data").unlink(missing_ok=True)
