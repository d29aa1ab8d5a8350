"""Crash-safe file output: write a temp name, hash as we go, fsync, rename.

A final path therefore only ever holds a complete, fsynced file; a kill -9 leaves at most
a `.srt-*.tmp` file next to it, which the next run removes. A full disk (ENOSPC / EDQUOT)
becomes one `CheckpointError` after the temp file is deleted: nothing half written.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import Callable

from streamrt.errors import CheckpointError

TMP_PREFIX, TMP_SUFFIX = ".srt-", ".tmp"
DIGEST_BYTES = 8  # blake2b-64: 16 hex chars in the manifest
_ZEROS = bytes(1 << 16)


def new_hash():
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


def file_digest(path: Path, chunk: int = 8 << 20) -> str:
    h = new_hash()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        mv = memoryview(buf)
        while n := f.readinto(buf):
            h.update(mv[:n])
    return h.hexdigest()


def tmp_path(path: Path) -> Path:
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}{TMP_SUFFIX}")


def is_tmp(name: str) -> bool:
    return name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX)


def disk_full_error(path: Path, e: OSError) -> CheckpointError:
    return CheckpointError(
        f"{path}: disk full ({os.strerror(e.errno)}); the partial file was removed, nothing is half written. "
        "Free space and re-run the same command to resume"
    )


class _BackgroundHasher:
    """Hashes what a writer has already written by reading it back from the page cache on
    its own thread: one big file then costs max(hash, write), not their sum."""

    CHUNK = 16 << 20

    def __init__(self, fd: int):
        self.fd, self.hash, self.error = fd, new_hash(), None
        self.q: queue.Queue = queue.Queue()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        buf = bytearray(self.CHUNK)
        while (item := self.q.get()) is not None:
            off, n = item
            try:
                while n and self.error is None:
                    k = os.preadv(self.fd, [memoryview(buf)[: min(n, self.CHUNK)]], off)
                    if k <= 0:
                        raise OSError(errno.EIO, "short read of the file being written")
                    self.hash.update(memoryview(buf)[:k])
                    off, n = off + k, n - k
            except OSError as e:
                self.error = e

    def add(self, offset: int, n: int) -> None:
        self.q.put((offset, n))

    def finish(self) -> str:
        self.q.put(None)
        self.t.join()
        if self.error:
            raise self.error
        return self.hash.hexdigest()


class AtomicWriter:
    """`with AtomicWriter(path) as w: w.write(...)`; commits (fsync + rename) on clean exit.

    `background_hash=True` (for multi-GB files) hashes on a helper thread that reads the
    written bytes back, so hashing overlaps writing."""

    def __init__(self, path: Path, on_bytes: Callable[[int], None] | None = None, *, background_hash: bool = False):
        self.path = Path(path)
        self.tmp = tmp_path(self.path)
        self.size = 0
        self.on_bytes = on_bytes
        self.digest: str | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR if background_hash else os.O_WRONLY
        self.fd = os.open(self.tmp, flags | os.O_CREAT | os.O_TRUNC, 0o644)
        self.hash = None if background_hash else new_hash()
        self.hasher = _BackgroundHasher(self.fd) if background_hash else None

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        if self.hash is not None:
            self.hash.update(mv)
        total = len(mv)
        while mv:
            try:
                n = os.write(self.fd, mv)
            except OSError as e:
                self._fail(e)
            mv = mv[n:]
        if self.hasher is not None:
            self.hasher.add(self.size, total)
        self.size += total
        if self.on_bytes:
            self.on_bytes(total)

    def pad_to(self, offset: int) -> None:
        while self.size < offset:
            self.write(_ZEROS[: min(len(_ZEROS), offset - self.size)])

    def commit(self) -> tuple[int, str]:
        try:
            digest = self.hasher.finish() if self.hasher is not None else self.hash.hexdigest()
            self.hasher = None
            os.fsync(self.fd)
        except OSError as e:
            self._fail(e)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.path)
        self.digest = digest
        return self.size, digest

    def abort(self) -> None:
        if self.hasher is not None:
            self.hasher.error = self.hasher.error or OSError(errno.ECANCELED, "aborted")
            try:
                self.hasher.finish()
            except OSError:
                pass
            self.hasher = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def _fail(self, e: OSError):
        self.abort()
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(self.path, e) from None
        raise CheckpointError(f"{self.path}: write failed: {e.strerror or e}") from None

    def __enter__(self) -> "AtomicWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_bytes_atomic(path: Path, data: bytes) -> tuple[int, str]:
    with AtomicWriter(path) as w:
        w.write(data)
    return w.size, w.digest  # type: ignore[return-value]


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_tmp(root: Path) -> int:
    """Delete temp files a killed run left behind under root; returns how many."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            if is_tmp(f):
                os.unlink(os.path.join(dirpath, f))
                n += 1
    return n
