"""Export a causal LM to ONNX with its KV cache, in the Hub's decoder layout, and load one back.

The layout is optimum's / transformers.js' (onnx-community repos): inputs `input_ids`,
`attention_mask` (2-D, over past + new positions), `position_ids` and
`past_key_values.{i}.key|value` [batch, kv_heads, past, head_dim]; outputs `logits` and
`present.{i}.key|value` [batch, kv_heads, past + new, head_dim]. The attention mask is honoured
position by position, so the holes that ragged batching leaves in the cache stay hidden.

    from hf_specdec.onnx import export_onnx
    export_onnx("path/to/model", "out/")          # out/model.onnx, config, tokenizer; parity-checked
    export_onnx(model, "out-int8/", quantize="int8")
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

INSTALL_HINT = "pip install 'hf-specdec[onnx]'  (or: pip install onnxruntime onnx onnxscript)"
MODEL_FILES = ("model.onnx", "onnx/model.onnx")  # flat folders, and onnx-community repos
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}  # max abs logit difference accepted by the parity check


def require(module: str = "onnxruntime") -> Any:
    """Import an optional ONNX dependency, or fail with the install command."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"The ONNX features of hf-specdec need `{module}`: {INSTALL_HINT}") from err


def find_model_file(folder: str | Path) -> Path:
    """The decoder file in an exported folder: `model.onnx` or `onnx/model.onnx`."""
    folder = Path(folder)
    for name in MODEL_FILES:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"No ONNX decoder in {folder}: expected {' or '.join(MODEL_FILES)}.")


def is_onnx_folder(path: Any) -> bool:
    """A local folder with an ONNX decoder and no PyTorch weights (so only ONNX can load it)."""
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        return False
    folder = Path(path)
    has_torch = any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
    return not has_torch and any((folder / name).is_file() for name in MODEL_FILES)


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

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past_kv):
        from transformers import DynamicCache

        layers = [(past_kv[i], past_kv[i + 1]) for i in range(0, len(past_kv), 2)]
        cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        present = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # updated in place
        return (out.logits, *present)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the Hub decoder layout."""
    kv = [(i, part) for i in range(num_layers) for part in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids"]
    inputs += [f"past_key_values.{i}.{part}" for i, part in kv]
    outputs = ["logits"] + [f"present.{i}.{part}" for i, part in kv]
    return inputs, outputs


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def sample_inputs(
    model: PreTrainedModel, batch: int = 2, past: int = 5, new: int = 3, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Inputs with a real past (row 0 has a hole in it) for tracing and for the parity check."""
    from transformers import DynamicCache

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
            cache=cache,
            use_cache=True,
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
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.onnx"

    steps = ["load", "export", "check"] + (["quantize"] if quantize else []) + ["save config"]
    with _Progress(steps, enabled=progress) as bar:
        bar.step("loading the model")
        model, tokenizer = _load(model_or_path, tokenizer, DTYPES[dtype])
        bar.step("exporting with torch.onnx (dynamo)")
        fp_path = out / "model_fp.onnx" if quantize else path
        _export(model, fp_path)
        add_logits_to_keep(fp_path)
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
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    return ExportReport(path, diff, tolerance, agreement)


def _load(model_or_path: Any, tokenizer: Any, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model_or_path, (str, Path)):
        source = str(model_or_path)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    else:
        model, source = model_or_path, getattr(model_or_path, "name_or_path", "")
    if model.dtype != dtype or model.device.type != "cpu":
        model = copy.deepcopy(model).to(device="cpu", dtype=dtype)  # never touch the caller's model
    if tokenizer is None and source:
        with contextlib.suppress(OSError, ValueError, TypeError):
            tokenizer = AutoTokenizer.from_pretrained(source)
    return model.eval(), tokenizer


def _export(model: PreTrainedModel, path: Path) -> None:
    from torch.export import Dim

    inputs = sample_inputs(model)
    num_layers = (len(inputs) - 3) // 2
    input_names, output_names = io_names(num_layers)
    auto = Dim.AUTO
    dynamic = (
        {0: auto, 1: auto},  # input_ids [batch, new]
        {0: auto, 1: auto},  # attention_mask [batch, past + new]
        {0: auto, 1: auto},  # position_ids [batch, new]
        tuple({0: auto, 2: auto} for _ in inputs[3:]),  # past [batch, kv_heads, past, head_dim]
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with _quiet_export():
        torch.onnx.export(
            DecoderWithPast(model),
            inputs,
            str(path),
            dynamo=True,
            input_names=input_names,
            output_names=output_names,
            dynamic_shapes=dynamic,
            external_data=weight_bytes > 1.8e9,  # protobuf files stop at 2 GB
            verbose=False,
        )


LOGITS_TO_KEEP = "num_logits_to_keep"


def add_logits_to_keep(path: str | Path) -> None:
    """Give the exported decoder an optional input `num_logits_to_keep` (int64 [1], default 0 = every
    position): fed k, the LM head runs on the last k positions only and `logits` is [B, k, V].

    Readers of the Hub layout that do not know the input get every position, as before. A drafter
    needs only the last position's logits, and computing all of them when it catches up on a
    1k-token prompt is ~28 GFLOP of LM head for SmolLM2-135M.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    path = Path(path)
    external = Path(str(path) + ".data").exists()
    model = onnx.load(str(path), load_external_data=external)
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    head = producer.get("logits")
    while head is not None and head.op_type not in ("MatMul", "Gemm"):
        head = producer.get(head.input[0])  # a Cast or bias after the LM head
    if head is None:
        return  # no LM head to find: leave the graph as it is
    hidden = head.input[0]
    graph.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, dtype=np.int64), LOGITS_TO_KEEP))
    graph.initializer.append(
        numpy_helper.from_array(np.array([2**62], dtype=np.int64), "hf_specdec_slice_end")
    )
    graph.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "hf_specdec_slice_axis"))
    start, kept = "hf_specdec_keep_start", "hf_specdec_kept_hidden"
    slice_nodes = [
        helper.make_node("Neg", [LOGITS_TO_KEEP], [start]),  # -0 = 0: every position
        helper.make_node("Slice", [hidden, start, "hf_specdec_slice_end", "hf_specdec_slice_axis"], [kept]),
    ]
    nodes = list(graph.node)
    at = next(i for i, node in enumerate(nodes) if node is head or node == head)
    nodes[at:at] = slice_nodes  # the graph stays in topological order
    head = nodes[at + len(slice_nodes)]
    head.input[0] = kept
    del graph.node[:]
    graph.node.extend(nodes)
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].dim_param = "logits_length"  # no longer the input's length
    onnx.save(model, str(path), save_as_external_data=external, location=path.name + ".data")


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


# What `quantize="int8"` writes; part of the quantized copies' cache stamp, so that copies in an
# older format are rebuilt.
INT8_FORMAT = "matmulnbits-8bit-block32-sym-int8compute, num_logits_to_keep"


def quantize_int8(src: str | Path, dst: str | Path) -> Path:
    """int8 weights in blocks of 32 with their own scale (onnxruntime `MatMulNBits`, bits=8), and
    int8 arithmetic (accuracy level 4: activations quantized per block as well).

    Finer scales are what keep the copy agreeing with the model: on SmolLM2-135M a self-draft in
    this format had 86-100% of its tokens accepted, against 38% for onnxruntime's dynamic int8 with
    one scale per output channel (activations quantized per tensor) and 48% per tensor. A decoding
    step reads ~240 MB instead of ~540 MB (the tied LM head stays fp32). MatMuls whose weight is
    computed in the graph are left as they are.
    """
    ort = require()
    version = tuple(int(part) for part in ort.__version__.split(".")[:2])
    if version < (1, 22):
        raise RuntimeError(
            f"int8 quantization needs onnxruntime >= 1.22 (its 8-bit MatMulNBits kernels); this is "
            f"{ort.__version__}. Upgrade: pip install -U 'hf-specdec[onnx]'."
        )
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    with _quiet_export():
        quantizer = MatMulNBitsQuantizer(
            onnx.load(str(src)), bits=8, block_size=32, is_symmetric=True, accuracy_level=4
        )
        quantizer.process()
        # From ~1B parameters the int8 copy (its embedding and tied LM head stay fp32) passes
        # protobuf's 2 GB limit; the fp32 source then has its weights in a .data file already.
        external = Path(str(src) + ".data").exists()
        quantizer.model.save_model_to_file(str(dst), use_external_data_format=external)
    return Path(dst)


def _remove_onnx(path: Path) -> None:
    path.unlink(missing_ok=True)
    Path(str(path) + ".data").unlink(missing_ok=True)


@contextlib.contextmanager
def _quiet_export():
    """Silence the exporter's chatter (deprecations, torchvision not installed, per-step banners)."""
    names = ("torch.onnx", "torch.export", "onnxruntime", "transformers", None)  # None: the root logger
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(_NullWriter()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _NullWriter:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


class _Progress:
    """A tqdm bar over named steps whose elapsed time keeps ticking during long steps."""

    def __init__(self, steps: list[str], enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=len(steps), desc="export-onnx", unit="step", disable=not enabled)
        self.started = False
        self.done = threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self.done.wait(0.5):
            self.bar.refresh()

    def step(self, what: str) -> None:
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_postfix_str(what)

    def __enter__(self) -> _Progress:
        if not self.bar.disable:
            self.ticker.start()
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        self.done.set()
        if exc_type is None:
            self.bar.update()
            self.bar.set_postfix_str("done")
        self.bar.close()
