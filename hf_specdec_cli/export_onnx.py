"""`hf-specdec export-onnx MODEL OUT`: a causal LM with its KV cache, in the Hub's ONNX layout."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-onnx",
        help="export a causal LM with its KV cache to ONNX (for method='onnx' drafting)",
        description="Export MODEL (a folder or Hub id) to OUT/model.onnx in the Hub's decoder layout, "
        "with config, generation config and tokenizer beside it, and check its logits against PyTorch.",
    )
    parser.add_argument("model", help="a transformers folder or Hub repo id")
    parser.add_argument("out", help="output folder")
    parser.add_argument(
        "--dtype", choices=["fp32", "fp16"], default="fp32", help="weights and KV cache (default: fp32)"
    )
    parser.add_argument(
        "--quantize", choices=["int8"], default=None, help="int8 weights in blocks of 32 (MatMulNBits)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torch.onnx import OnnxExporterError

    from hf_specdec.loading import check_model_path
    from hf_specdec.ort import export_onnx_report

    check_model_path(args.model)
    try:
        report = export_onnx_report(
            args.model, args.out, dtype=args.dtype, quantize=args.quantize, progress=not args.quiet
        )
    except OnnxExporterError as err:
        # torch.onnx's own report ends in advice to file an issue with PyTorch; the usual cause here
        # is weights a quantization library holds in tensor types or operators ONNX lacks.
        raise ValueError(
            f"torch.onnx could not export {args.model}. If its weights are quantized (torchao, "
            "optimum-quanto, bitsandbytes, ...), export the unquantized checkpoint instead (--quantize "
            "int8 gives int8 weights)."
        ) from err
    print(
        f"Wrote {report.path}\n"
        f"Parity with PyTorch ({args.dtype}, inputs with a past and a masked hole): max abs logit "
        f"difference {report.max_abs_diff:.2e} (tolerance {report.tolerance:.2e})"
    )
    if report.argmax_agreement is not None:
        print(
            f"int8 model picks PyTorch's top token at {report.argmax_agreement:.0%} of the sample positions"
        )
    print(f"Draft with it: model.generate(..., speculative=dict(method='onnx', draft={str(args.out)!r}))")
    return 0
