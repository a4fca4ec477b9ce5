"""Durable writes: every file or directory the project publishes goes through here (torch-free; the
components use it too), so that a crash at any moment leaves the old content or the whole new one.

A file is written under a temporary name beside it, fsynced, renamed over the target, and the directory is
fsynced (the rename itself is durable only then). A directory is built beside its target, every file in it
fsynced, exchanged with the old one in one step, and its parent fsynced.

    write_json(layout.summary_path(out), summary, indent=1)
    with staging_dir(dest) as tmp:
        (tmp / "model.safetensors").write_bytes(data)     # dest appears, complete, when the block ends
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

__all__ = ["temp_name", "fsync_file", "fsync_dir", "fsync_tree", "rename_unsynced", "move", "publish_file",
           "write_bytes", "write_text", "write_json", "copy_file", "publish_dir", "staging_dir"]


def temp_name(path: Path) -> Path:
    """The temporary name a file is written under before ``publish_file`` renames it to ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def fsync_file(path: Path) -> None:
    # Any descriptor of the file will do: fsync flushes the inode's data, not one descriptor's writes.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the names created, renamed or removed in directory ``path`` durable."""
    fsync_file(path)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (``root`` included)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def rename_unsynced(src: Path, dst: Path) -> None:
    """Rename ``src`` over ``dst`` atomically but without waiting for the disk: only for many files placed in
    a directory that a later commit record (a manifest, a marker) written with ``write_*`` makes count."""
    os.replace(src, dst)


def move(src: Path, dst: Path) -> None:
    """Rename ``src`` over ``dst`` atomically and durably (the directories fsynced)."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)
    if Path(src).parent != Path(dst).parent:
        fsync_dir(Path(src).parent)


def publish_file(tmp: Path, path: Path) -> None:
    """``tmp``, written in full, becomes ``path``: fsync, rename, fsync of the directory."""
    fsync_file(tmp)
    move(tmp, path)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the whole new one."""
    tmp = temp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    move(tmp, path)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: Path, obj, *, indent: int | None = None) -> None:
    write_bytes(path, json.dumps(obj, indent=indent).encode())


def copy_file(src: Path, path: Path) -> None:
    """Copy ``src`` to ``path`` durably (the old file or the whole copy, never a part)."""
    tmp = temp_name(path)
    shutil.copyfile(src, tmp)
    publish_file(tmp, path)


def publish_dir(staged: Path, path: Path) -> None:
    """Directory ``staged``, complete, becomes ``path``: its files fsynced, then swapped in, so that ``path``
    is at every moment the old directory or the whole new one.

    Where the file system cannot exchange two names atomically (Lustre, kernels before 3.15), the old one is
    set aside first: ``path`` is then absent for the moment between two renames.
    """
    staged, path = Path(staged), Path(path)
    fsync_tree(staged)
    if path.exists() and _exchange(staged, path):
        fsync_dir(path.parent)
        shutil.rmtree(staged)       # the old one, under the staged name
        return
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(staged, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_libc = ctypes.CDLL(None, use_errno=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap names ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


@contextlib.contextmanager
def staging_dir(path: Path) -> Iterator[Path]:
    """An empty directory beside ``path`` to build it in; published as ``path`` when the block ends, removed
    if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, path)
