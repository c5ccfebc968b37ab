"""`export_serving`: what `speculative=` runs, as a vLLM or SGLang command, checked against golden files.

Each engine × method writes `serving.json` for tiny offline models; the file must equal
`tests/golden/serving/<engine>-<case>.json` once the temporary folders and the version are replaced
by placeholders. After an intended change of the output, regenerate the golden files with

    HF_SPECDEC_REGEN_GOLDEN=1 python -m pytest tests/serving/test_export.py

and review the diff. Refusals are checked by their messages (test_plans.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import hf_specdec
from hf_specdec.config import SpeculativeConfig
from hf_specdec.selection.choice import DRAFT_FREE_AUTO
from hf_specdec.selection.method import resolve_method
from hf_specdec.serving import ServingExportError, export_serving

from .conftest import CASES, export_case

GOLDEN = Path(__file__).parents[1] / "golden" / "serving"
REGENERATE = os.environ.get("HF_SPECDEC_REGEN_GOLDEN") == "1"


def _placeholders(text: str, models: Path, out: Path) -> str:
    text = text.replace(str(out), "<out>").replace(str(models), "<models>")
    return text.replace(f"hf-specdec {hf_specdec.__version__}", "hf-specdec <version>")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_serving_json_matches_golden(models, tmp_path, engine, case):
    result = export_case(models, tmp_path, engine, case)
    written = (tmp_path / "serving.json").read_text()
    assert json.loads(written) == result
    got = _placeholders(written, models, tmp_path)
    golden = GOLDEN / f"{engine}-{case}.json"
    if REGENERATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got)
    assert golden.is_file(), f"no golden file {golden}: run with HF_SPECDEC_REGEN_GOLDEN=1"
    assert got == golden.read_text()


def test_no_method_exports_what_speculative_true_picks(models, tmp_path):
    result = export_serving(str(models / "target"), "vllm", num_draft_tokens=2, out=tmp_path)
    runs, _ = resolve_method(SpeculativeConfig(method="auto"), str(models / "target"))
    assert result["method"] == runs.method == DRAFT_FREE_AUTO  # a local folder, no Hub origin: draft-free
    chosen = f"Chosen as speculative=True would for {models / 'target'}: suffix ("
    assert result["caveats"][0].startswith(chosen)
    sglang = export_serving(str(models / "target"), "sglang", num_draft_tokens=2)
    assert sglang["engine_method"] == "NGRAM"  # SGLang has no suffix decoding: it says what it serves
    assert any("no suffix decoding" in caveat for caveat in sglang["caveats"])
    with_draft = export_serving(
        str(models / "target"), "sglang", draft=str(models / "draft"), num_draft_tokens=2
    )
    assert (with_draft["method"], with_draft["engine_method"]) == ("draft_model", "STANDALONE")


def test_a_checkpoint_with_mtp_layers_exports_them(models, tmp_path):
    """As speculative=True chooses: the target's own MTP layers, no draft in either engine."""
    vllm = export_serving(str(models / "mtp-target"), "vllm", num_draft_tokens=2)
    assert vllm["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    sglang = export_serving(str(models / "mtp-target"), "sglang", num_draft_tokens=2)
    assert sglang["method"] == "mtp" and "--speculative-draft-model-path" not in sglang["command"]
    assert sglang["command"][sglang["command"].index("--speculative-algorithm") + 1] == "EAGLE"
    with pytest.raises(ServingExportError, match="no engine equivalent.*drop --draft"):
        export_serving(str(models / "mtp-target"), "vllm", method="mtp", draft=str(models / "draft"))


def test_bad_arguments(models):
    with pytest.raises(ValueError, match="Unknown engine 'tgi'"):
        export_serving(str(models / "target"), "tgi", method="ngram", num_draft_tokens=3)
    with pytest.raises(ValueError, match="positive integer"):
        export_serving(str(models / "target"), "vllm", method="ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="needs --draft"):
        export_serving(str(models / "target"), "vllm", method="draft_model", num_draft_tokens=3)
