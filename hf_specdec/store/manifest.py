"""What a folder we write holds, recorded when it is written and checked when it is read.

Every folder hf-specdec builds for later reuse (the demo model, int8 ONNX copies, trained heads) gets a
manifest: each file's size and SHA-256 and what the folder was built from, written last and
atomically, so that a folder without a valid manifest is one whose writing did not finish. A reader
checks the manifest before trusting the folder, and rebuilds (or, for what it cannot rebuild, refuses
with the path to delete) instead of handing a truncated or overwritten file to ONNX Runtime or
safetensors. Folders are built in a locked staging folder beside their final place, by one process at
a time (`build_lock`); staging folders that a crashed process left behind are removed by the next
build. A leaf: it imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

MANIFEST_NAME = "hf_specdec_manifest.json"
STAGING_PREFIX = "tmp"  # staging folders: `<parent>/tmp*`, as `tempfile.mkdtemp` names them
_LOCK_NAME = ".hf_specdec_lock"
# A staging folder without a lock is removed once this old: an older version of this package may
# still be building in it (it did not lock), and no export takes that long.
_UNLOCKED_STALE_SECONDS = 6 * 3600.0

# SHA-256 by (path, size, mtime, inode): a file is hashed once per process while it is unchanged, so
# a cache read on every `generate` call costs a `stat` per file, not a read of every byte.
_DIGESTS: dict[tuple[str, int, int, int], str] = {}
_DIGESTS_LOCK = threading.Lock()


def write_manifest(folder: Path, built_from: dict[str, Any], files: Iterable[str] | None = None) -> None:
    """Record `built_from` and the size and SHA-256 of `files` (names relative to `folder`; default:
    every file under it). Call it once the folder is complete: a folder whose manifest is missing or
    disagrees with its files is not trusted."""
    names = sorted(files) if files is not None else _files_under(folder)
    entries = {}
    for name in names:
        path = folder / name
        entries[name] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    manifest = {"format": 1, "built_from": built_from, "files": entries}
    write_atomically(
        folder / MANIFEST_NAME, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    )


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` as `write(tmp)` writes `tmp`, a file beside it that no other writer names, then
    rename `tmp` over `path`: a reader finds the old file or the whole new one, never half of one, and
    writers at once (two saves into one folder) each finish, the last rename winning, instead of
    writing into one shared temporary file and failing to rename it once the other has.

    The name is unique by a random suffix rather than `tempfile.mkstemp`, which creates files
    readable by their owner only: the file keeps the permissions any file written there gets.
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:16]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # what a failed write left


def manifest_problem(folder: Path, built_from: dict[str, Any]) -> str | None:
    """Why `folder` is not what its manifest says it was built as (None when it is): no folder, no
    manifest, one built from something else, one naming a file outside the folder, or a file
    missing, resized or changed since. Symlinks are followed: the Hub cache's snapshots (a head
    uploaded with its manifest) are links into its blobs."""
    if not folder.is_dir():
        return "it does not exist"
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        recorded = manifest["files"]
        recorded_from = manifest["built_from"]
    except FileNotFoundError:
        return f"it has no {MANIFEST_NAME} (its writing did not finish, or an older version wrote it)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its {MANIFEST_NAME} is unreadable ({type(err).__name__}: {err})"
    if recorded_from != built_from:
        return f"it was built from {recorded_from}, not {built_from}"
    for name, entry in recorded.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:  # never read what it names
            return f"it names {name!r}, not a file in {folder}"
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"{name} is {size} bytes, {entry.get('size')} when written"
        if file_digest(path) != entry.get("sha256"):
            return f"{name} changed since it was written (SHA-256 differs)"
    return None


def file_digest(path: Path) -> str:
    """The SHA-256 of `path`, remembered while its size, mtime and inode stay the same."""
    key = (str(path.resolve()), *file_stamp(path))
    with _DIGESTS_LOCK:
        known = _DIGESTS.get(key)
    if known is not None:
        return known
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    with _DIGESTS_LOCK:
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


SAFETENSORS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensors to files


def checkpoint_stamp(folder: Path) -> tuple:
    """The checkpoint in `folder` as it is now, read without opening a file: the name and `file_stamp`
    of its config.json, each safetensors file and the shard index. A file rewritten, added or removed
    changes it."""
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors")), folder / SAFETENSORS_INDEX]
    return tuple((path.name, *file_stamp(path)) for path in files if path.is_file())


def file_stamp(path: Path) -> tuple[int, int, int]:
    """`path`'s size, modification time and inode (of the file a link leads to, as a Hub snapshot's
    to its blob), read without opening it: what tells a file rewritten or replaced since an earlier
    read of it."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


@contextlib.contextmanager
def staging_folder(parent: Path) -> Iterator[Path]:
    """A fresh folder `parent/tmp*` to build in, removed on exit (move what it built out first).

    It is locked while in use; unlocked ones that a crashed or killed process left in `parent` are
    removed first, so they never pile up (an interrupted int8 export of a large model leaves GBs).
    """
    try:
        parent.mkdir(parents=True, exist_ok=True)
        # Locked before it gets its `tmp*` name: a folder under that name is held from the first moment.
        hidden = Path(tempfile.mkdtemp(prefix="." + STAGING_PREFIX, dir=parent))
    except OSError as err:  # anything here is about the cache folder itself
        raise _unwritable(parent, err) from err
    remove_stale_staging(parent)
    folder = hidden.with_name(hidden.name[1:])
    try:
        with _locked(hidden / _LOCK_NAME):
            hidden.rename(folder)
            yield folder
    except OSError as err:
        if err.errno in _WRITE_FAILURES:  # a build's other errors (a source it reads) are its own
            raise _unwritable(parent, err) from err
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(hidden, ignore_errors=True)


# What a write into a full or read-only cache fails with (EFBIG: a file-size limit).
_WRITE_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _unwritable(parent: Path, err: OSError) -> OSError:
    """`err`, saying which cache could not be written and how to put it elsewhere."""
    return type(err)(
        err.errno,
        f"Cannot write to the hf-specdec cache {parent} ({err.strerror or err}): free space there, or "
        "point HF_SPECDEC_CACHE at a writable folder with room.",
    )


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Held while `folder` is checked and built: a process that asks for a folder another one is
    building waits for it, then finds the folder whole, instead of building its own copy alongside."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = folder.parent / f".{folder.name}.lock"
        lock.touch()
    except OSError as err:
        raise _unwritable(folder.parent, err) from err
    with _locked(lock, waiting=f"Waiting for another process building {folder} to finish (it holds {lock})."):
        yield


def remove_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging folders in `parent` that no live process holds; returns them."""
    removed = []
    for folder in parent.glob(STAGING_PREFIX + "*"):
        if folder.is_dir() and not _in_use(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def replace_folder(folder: Path, staging: Path) -> None:
    """Put the finished `staging` where `folder` is, by renames (never a half-written `folder`).

    If another process put a folder there meanwhile, ours replaces it: both were built from the same
    thing, and a reader checks the manifest whichever it finds.
    """
    old = staging.with_name(staging.name + ".old")
    with contextlib.suppress(FileNotFoundError):
        folder.rename(old)
    try:
        staging.rename(folder)
    except OSError:  # another process renamed its copy in between
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _files_under(folder: Path) -> list[str]:
    return sorted(
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file() and path.name not in (MANIFEST_NAME, _LOCK_NAME)
    )


@contextlib.contextmanager
def _locked(path: Path, waiting: str | None = None) -> Iterator[None]:
    """An exclusive lock on the file `path`, held until exit (a process that dies releases it).
    `waiting`: a warning to give once if another process holds it, so that a call waiting minutes
    for another's export says why it does not return."""
    try:
        import fcntl
    except ImportError:  # Windows: staging folders are removed by age only, builds are not serialised
        yield
        return
    with path.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                # stacklevel 5: past this generator, `build_lock`'s and contextlib's frames, to its caller
                warnings.warn(waiting, stacklevel=5)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _in_use(folder: Path) -> bool:
    """Whether a live process holds `folder`'s lock (a process that dies releases it). A folder
    without a lock (an older version's, or where there is no `fcntl`) is judged by its age."""
    try:
        import fcntl

        with (folder / _LOCK_NAME).open("r") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(lock, fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    except (ImportError, OSError):
        try:
            return time.time() - folder.stat().st_mtime < _UNLOCKED_STALE_SECONDS
        except OSError:  # removed meanwhile
            return True
    return False
