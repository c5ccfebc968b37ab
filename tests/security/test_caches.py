"""Corrupted caches: every folder and file hf-specdec writes for later reuse is checked before it is
trusted, and one that was truncated, zeroed, deleted or edited is rebuilt with a warning saying so (what
we can rebuild: int8 ONNX copies, the demo model, train-draft's data caches) or refused with a message
naming the path to delete (what we cannot: trained heads, a training checkpoint). Staging folders that
a crashed build left behind are removed by the next build; one a live process builds in is not.

The draft-selection cache (`selections/`) is tested with the selection code.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_specdec import demo_model
from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import CONFIG_NAME, WEIGHTS_NAME, build_head, check_saved_head, save_head
from hf_specdec.ort import cache as ort_cache
from hf_specdec.ort.cache import quantized_copy
from hf_specdec.store.manifest import (
    MANIFEST_NAME,
    build_lock,
    file_digest,
    remove_stale_staging,
    staging_folder,
)
from hf_specdec.train.data import Sequence
from hf_specdec.train.features import cached_target_features
from hf_specdec.train.trainer import CHECKPOINT_DIR, STATE_NAME, TrainConfig, train_head

from ..conftest import assert_greedy_match, child_env, random_batch, tiny_llama
from .tiny_gguf import write_tiny_llama_gguf

ROOT = Path(__file__).resolve().parents[2]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))  # same size: only the content says it changed


def _break_json(path: Path) -> None:
    path.write_text("{not json")


def _edit_json(path: Path) -> None:
    """Valid JSON, one value changed: nothing but the recorded hash can tell."""
    data = json.loads(path.read_text())
    key = next(k for k, v in data.items() if isinstance(v, float))
    path.write_text(json.dumps({**data, key: data[key] * 10}))


CORRUPTIONS = {"truncated": _truncate, "zeroed": _zero, "deleted": Path.unlink, "broken": _break_json}
CORRUPTIONS["edited"] = _edit_json


def _restore(folder: Path, pristine: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(pristine, folder)


# --- the int8 ONNX copy (`speculative="quantized"`) -------------------------------------------------


@pytest.fixture(scope="module")
def int8_copy(tmp_path_factory, target, target_int8):
    """A private cache holding the int8 copy of `target` (found there whole: nothing is exported),
    and the pristine copy it came from."""
    root = tmp_path_factory.mktemp("hf-specdec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_SPECDEC_CACHE", str(root))
        shutil.copytree(target_int8, root / "onnx" / target_int8.name)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            folder = quantized_copy(target)
        assert folder == root / "onnx" / target_int8.name
        yield folder, target_int8


@pytest.fixture
def exports(int8_copy, monkeypatch) -> list[Path]:
    """The folders `quantized_copy` exported into, the export replayed from the pristine copy.

    What a corrupt copy tests is the cache's part (the check, the warning, the staging folder, the
    manifest, the swap), not the export, which tests/ort covers and `target_int8` ran for real once:
    each real export costs up to a minute on a busy 2-core machine. A replayed rebuild is still told apart
    from none at all: it is counted, and the rebuilt files must be the pristine ones."""
    _, pristine = int8_copy
    made: list[Path] = []

    def replay(model, out_dir, *args, **kwargs) -> Path:
        made.append(Path(out_dir))
        shutil.copytree(pristine, out_dir, ignore=shutil.ignore_patterns(MANIFEST_NAME))
        return Path(out_dir) / "model.onnx"

    monkeypatch.setattr(ort_cache, "export_onnx", replay)
    return made


@pytest.mark.filterwarnings("ignore:Building an int8 ONNX copy")
@pytest.mark.parametrize(
    "name,corruption,reason",
    [
        ("model.onnx", "truncated", r"model.onnx is \d+ bytes, \d+ when written"),
        ("model.onnx", "zeroed", r"model.onnx changed since it was written \(SHA-256 differs\)"),
        ("model.onnx", "deleted", r"model.onnx is missing"),
        ("config.json", "broken", r"config.json is \d+ bytes, \d+ when written"),
        ("config.json", "edited", r"config.json (changed since|is \d+ bytes)"),
        (MANIFEST_NAME, "deleted", r"it has no hf_specdec_manifest.json \(its writing did not finish"),
    ],
)
def test_a_corrupt_int8_copy_is_rebuilt(int8_copy, exports, target, name, corruption, reason):
    folder, pristine = int8_copy
    _restore(folder, pristine)
    CORRUPTIONS[corruption](folder / name)
    input_ids, attention_mask = random_batch(3, 2)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    plain = target.generate(**kwargs)
    with pytest.warns(
        UserWarning, match=rf"Rebuilding the int8 ONNX copy in {re.escape(str(folder))}: {reason}"
    ):
        spec = target.generate(**kwargs, speculative=dict(method="quantized", num_draft_tokens=3))
    assert len(exports) == 1 and exports[0].parent.parent == folder.parent  # rebuilt in a staging folder
    for rebuilt in ("model.onnx", "config.json"):
        assert (folder / rebuilt).read_bytes() == (pristine / rebuilt).read_bytes()
    assert_greedy_match(target, plain, spec, attention_mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # rebuilt whole: trusted from now on
        assert quantized_copy(target) == folder
    assert len(exports) == 1


def test_a_crashed_export_leaves_no_staging_folder_behind(tmp_path, target, int8_copy, monkeypatch):
    """An export killed half-way (SIGKILL: no cleanup runs) leaves its staging folder; the next
    `quantized` call removes it, also when its own copy is cached and nothing is exported."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(cache))
    built, pristine = int8_copy
    folder = cache / "onnx" / built.name
    shutil.copytree(pristine, folder)  # `target`'s copy, cached whole
    code = (
        "from tests.conftest import tiny_llama\n"
        "from hf_specdec.ort.cache import quantized_copy\n"
        "quantized_copy(tiny_llama(5, layers=1))\n"
    )
    env = child_env(PYTHONWARNINGS="ignore")
    export = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(cache.glob("onnx/tmp*/model")) and export.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    export.send_signal(signal.SIGKILL)
    export.wait()
    assert list(cache.glob("onnx/tmp*")), "the export was not caught half-way"

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # its copy is cached: nothing is exported
        assert quantized_copy(target) == folder
    left = sorted(p.name for p in (cache / "onnx").iterdir() if not p.name.startswith("."))  # .*.lock
    assert left == [folder.name]


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_cache_says_what_to_do(tmp_path, errno_):
    """A build that cannot write (disk full, read-only) fails naming the cache and the variable that
    moves it, and leaves no staging folder."""
    with pytest.raises(OSError, match=r"HF_SPECDEC_CACHE") as caught, staging_folder(tmp_path / "onnx"):
        raise OSError(errno_, os.strerror(errno_))
    assert caught.value.errno == errno_ and str(tmp_path / "onnx") in str(caught.value)
    assert list((tmp_path / "onnx").iterdir()) == []


def test_a_cache_that_cannot_be_created_says_what_to_do(tmp_path):
    (tmp_path / "file").write_text("")
    unwritable = pytest.raises(OSError, match=r"Cannot write to the hf-specdec cache .*HF_SPECDEC_CACHE")
    with unwritable, staging_folder(tmp_path / "file" / "onnx"):
        pass


def test_other_errors_of_a_build_pass_through(tmp_path):
    passed = pytest.raises(PermissionError, match=r"^\[Errno 13\] the source$")  # reading a source, say
    with passed, staging_folder(tmp_path):
        raise PermissionError(errno.EACCES, "the source")


def test_a_staging_folder_in_use_is_kept(tmp_path):
    with staging_folder(tmp_path) as held:
        (held / "model.onnx").write_bytes(b"half")
        assert remove_stale_staging(tmp_path) == []
        assert held.is_dir()
    assert not held.exists()  # its owner removes it when done


def test_unlocked_staging_folders_are_removed_once_old(tmp_path):
    """Staging folders of versions that did not lock them are removed once hours old (an older
    version may still be building in a recent one)."""
    old, recent = tmp_path / "tmpold", tmp_path / "tmprecent"
    for folder in (old, recent):
        (folder / "model").mkdir(parents=True)
    hours_ago = time.time() - 7 * 3600
    os.utime(old, (hours_ago, hours_ago))
    assert remove_stale_staging(tmp_path) == [old]
    assert recent.is_dir() and not old.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="builds are not locked without fcntl")
def test_waiting_for_a_build_lock_another_process_holds_says_so(tmp_path):
    """A call that finds another process building the same folder (an int8 export takes minutes)
    says, once, that it waits and for which lock file, instead of hanging without a word; a free
    lock says nothing. (Threads stand for processes: each takes the lock through a file of its own.)"""
    folder = tmp_path / "onnx" / "model-int8"
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with build_lock(folder):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    threading.Timer(0.3, release.set).start()
    lock = folder.parent / f".{folder.name}.lock"
    with pytest.warns(UserWarning) as caught, build_lock(folder):
        assert release.is_set()  # taken only once the holder let it go
    holder.join()
    assert [str(w.message) for w in caught] == [
        f"Waiting for another process building {folder} to finish (it holds {lock})."
    ]
    assert caught[0].filename == __file__  # attributed to the caller of build_lock
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with build_lock(folder):
            pass


# --- the demo model (`demo_model_path()`) -----------------------------------------------------------


@pytest.fixture(scope="module")
def demo_source(tmp_path_factory):
    """A tiny GGUF for the demo model's real build, and a pristine build of it."""
    root = tmp_path_factory.mktemp("demo")
    gguf = write_tiny_llama_gguf(root / "tiny.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_SPECDEC_CACHE", str(root / "cache"))
        mp.setenv("HF_SPECDEC_DEMO_GGUF", str(gguf))
        folder = demo_model.demo_model_path(quiet=True)
    shutil.copytree(folder, root / "pristine")
    return gguf, root / "pristine"


@pytest.fixture
def demo_folder(demo_source, tmp_path, monkeypatch):
    gguf, pristine = demo_source
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_SPECDEC_DEMO_GGUF", str(gguf))
    folder = tmp_path / "cache" / "models" / demo_model.DEMO_MODEL_NAME
    _restore(folder, pristine)
    return folder, pristine


@pytest.mark.parametrize(
    "name,corruption,reason",
    [
        ("model.safetensors", "truncated", r"model.safetensors is \d+ bytes, \d+ when written"),
        ("model.safetensors", "zeroed", r"model.safetensors changed since it was written"),
        ("model.safetensors", "deleted", r"model.safetensors is missing"),
        ("config.json", "broken", r"config.json is \d+ bytes"),
        ("tokenizer.json", "broken", r"tokenizer.json is \d+ bytes"),
        ("tokenizer.json", "deleted", r"tokenizer.json is missing"),
    ],
)
def test_a_corrupt_demo_model_is_rebuilt(demo_folder, name, corruption, reason):
    folder, pristine = demo_folder
    CORRUPTIONS[corruption](folder / name)
    with pytest.warns(UserWarning, match=rf"Rebuilding the demo model in {re.escape(str(folder))}: {reason}"):
        assert demo_model.demo_model_path(quiet=True) == folder
    _assert_same_model(folder, pristine)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert demo_model.demo_model_path(quiet=True) == folder


def test_a_demo_model_built_before_manifests_is_adopted_when_whole(demo_folder):
    """A folder an earlier version built (its stamp, no manifest) is kept if its files are whole, and
    rebuilt if they are not; either way it has a manifest afterwards."""
    folder, pristine = demo_folder
    (folder / MANIFEST_NAME).unlink()
    built = (folder / "model.safetensors").stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # adopted, not rebuilt
        assert demo_model.demo_model_path(quiet=True) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == built and (folder / MANIFEST_NAME).is_file()

    (folder / MANIFEST_NAME).unlink()
    _truncate(folder / "model.safetensors")
    with pytest.warns(UserWarning, match=r"Rebuilding the demo model .*has no hf_specdec_manifest.json"):
        demo_model.demo_model_path(quiet=True)
    _assert_same_model(folder, pristine)


def _assert_same_model(folder: Path, pristine: Path) -> None:
    """`folder` loads, and holds what the pristine build held."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = load_file(str(pristine / "model.safetensors"))
    assert all(torch.equal(expected[n], t) for n, t in load_file(str(folder / "model.safetensors")).items())
    assert tokenizer("abc")["input_ids"] == AutoTokenizer.from_pretrained(pristine)("abc")["input_ids"]
    assert model.config.vocab_size == len(tokenizer)


# --- trained heads (written by train-draft, or `save_head`) ---------------------------------------


def _zero_past_the_header(path: Path) -> None:
    """Zero the tensor data of a safetensors file: it still parses, as zeros."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = bytes(len(data) - start)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name,corrupt,message",
    [
        (WEIGHTS_NAME, _zero_past_the_header, r"is corrupt \(head.safetensors changed since it was written"),
        (CONFIG_NAME, _edit_json, r"is corrupt \(head_config.json (changed since|is \d+ bytes)"),
        (WEIGHTS_NAME, _truncate, r"cannot be read .*the checkpoint is corrupt; download or train it again"),
        (WEIGHTS_NAME, Path.unlink, r"are missing: the checkpoint is incomplete"),
        (CONFIG_NAME, _break_json, r"is not valid JSON .*the checkpoint is corrupt"),
    ],
)
def test_a_corrupt_head_is_refused_naming_its_path(target, tmp_path, name, corrupt, message):
    folder = save_head(build_head(EagleHeadConfig.for_target(target), target), tmp_path / "head")
    corrupt(folder / name)
    with pytest.raises(ValueError, match=message) as refused:
        target.generate(
            input_ids=torch.tensor([[1, 7, 8]]),
            max_new_tokens=4,
            speculative=dict(method="eagle", draft=str(folder)),
        )
    assert str(folder) in str(refused.value)


@pytest.mark.parametrize(
    "corrupt,message",
    [(_zero_past_the_header, r"is corrupt \(head.safetensors changed"), (_truncate, r"cannot be read")],
)
def test_a_corrupt_hub_head_names_the_hub_cache_folder_to_delete(
    target, tmp_path, monkeypatch, corrupt, message
):
    """A Hub head damaged in the Hub cache: the message said to delete its snapshot folder (or to
    train the head again), after which it was as corrupt as before: huggingface_hub links the
    snapshot's files again to the damaged blobs it keeps. It now names the repo's cache folder, and
    deleting that downloads the head afresh."""
    from ..helpers.hub import local_hub

    hub = local_hub(tmp_path, monkeypatch)
    try:
        hub.add(
            "someone/eagle-head",
            save_head(build_head(EagleHeadConfig.for_target(target), target), tmp_path / "head"),
        )
        load_head("someone/eagle-head", target, method="eagle")
        repo = tmp_path / "hf-cache" / "models--someone--eagle-head"
        (blob,) = {path.resolve() for path in repo.glob(f"snapshots/*/{WEIGHTS_NAME}")}
        corrupt(blob)
        with pytest.raises(
            ValueError, match=rf"{message}.*[:;] delete {re.escape(str(repo))} \(the Hub cache"
        ):
            load_head("someone/eagle-head", target, method="eagle")
        shutil.rmtree(repo)
        load_head("someone/eagle-head", target, method="eagle")
    finally:
        hub.stop()


@pytest.mark.parametrize("outside", ["../outside.bin", "{tmp}/outside.bin", "sub/../../outside.bin"])
def test_a_manifest_naming_files_outside_its_folder_is_refused(target, tmp_path, outside):
    """A manifest (a head's may come from the Hub) vouches for the files of its own folder only: one
    naming others (`..`, an absolute path) is refused before any of them is read, even when the file
    it names is there and matches."""
    folder = save_head(build_head(EagleHeadConfig.for_target(target), target), tmp_path / "head")
    (tmp_path / "outside.bin").write_bytes(b"not the head")
    name = outside.format(tmp=tmp_path)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["files"][name] = {"size": 12, "sha256": file_digest(tmp_path / "outside.bin")}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"is corrupt \(it names {re.escape(repr(name))}, not a file in"):
        check_saved_head(folder)


# --- train-draft's checkpoint and data caches --------------------------------------------------------


@pytest.fixture(scope="module")
def trainee():
    """A one-layer target and its features on a few of its own continuations (as in tests/train)."""
    model = tiny_llama(40, layers=1, eos_token_id=None)
    input_ids, attention_mask = random_batch(seed=41, batch=12, min_len=3, max_len=8)
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False
    )
    sequences = [
        Sequence(row[input_ids.shape[1] - int(mask.sum()) :], int(mask.sum()))
        for row, mask in zip(out, attention_mask)
    ]
    return model, sequences


class _Payload:
    """Unpickling this writes `path`: what a crafted checkpoint could do with any code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({str(self.path)!r}, 'w').write('ran')",))


def test_a_crafted_resume_state_runs_no_code(trainee, tmp_path):
    model, sequences = trainee
    examples = cached_target_features(model, sequences, (-1,), tmp_path / "features.pt")
    sentinel = tmp_path / "code-ran"
    (tmp_path / "out" / CHECKPOINT_DIR).mkdir(parents=True)
    torch.save({"step": 1, "payload": _Payload(sentinel)}, tmp_path / "out" / CHECKPOINT_DIR / STATE_NAME)
    config = TrainConfig(minutes=0.005, draft_vocab_size=48)
    with pytest.raises(
        ValueError,
        match=r"trainer_state.pt cannot be read: it holds Python objects .*Delete .*checkpoint to train",
    ):
        train_head(model, examples, tmp_path / "out", config)
    assert not sentinel.exists()


def test_the_resume_state_is_plain_data_and_a_damaged_one_names_its_folder(trainee, tmp_path):
    model, sequences = trainee
    examples = cached_target_features(model, sequences, (-1,), tmp_path / "features.pt")
    out = tmp_path / "out"
    train_head(model, examples, out, TrainConfig(minutes=0.005, draft_vocab_size=48))
    state = out / CHECKPOINT_DIR / STATE_NAME
    assert torch.load(state, weights_only=True)["step"] > 0  # loads without unpickling any object
    _truncate(state)
    with pytest.raises(ValueError, match=rf"cannot be read .*Delete {re.escape(str(out / CHECKPOINT_DIR))} "):
        train_head(model, examples, out, TrainConfig(minutes=0.005, draft_vocab_size=48))


def test_a_damaged_feature_cache_is_computed_again(trainee, tmp_path):
    model, sequences = trainee
    cache = tmp_path / "features.pt"
    fresh = cached_target_features(model, sequences, (-1,), cache)
    _truncate(cache)
    with pytest.warns(UserWarning, match=rf"{re.escape(str(cache))} cannot be read .*computing it again"):
        again = cached_target_features(model, sequences, (-1,), cache)
    assert all(
        torch.equal(a.features, b.features) and torch.equal(a.labels, b.labels) for a, b in zip(fresh, again)
    )
    assert torch.load(cache, weights_only=True)["key"]  # rewritten whole
