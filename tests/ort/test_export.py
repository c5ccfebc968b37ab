"""The exporter: the Hub's ONNX decoder layout, checked against PyTorch."""

from __future__ import annotations

from hf_specdec.ort import export_onnx_report
from hf_specdec.ort.session import OnnxDecoder


def test_export_writes_hub_layout_and_matches_pytorch(onnx_dirs, weak_draft, tmp_path):
    folder = onnx_dirs["good"]
    assert {"model.onnx", "config.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    names = {i.name for i in OnnxDecoder.load(folder).session.get_inputs()}
    assert {"input_ids", "attention_mask", "position_ids", "past_key_values.1.value"} <= names
    report = export_onnx_report(weak_draft, tmp_path / "again", progress=False)
    assert report.max_abs_diff < report.tolerance <= 1e-2
