"""Crash-safe file output: write a temp name, hash as we go, fsync, rename; and the checksum rule.
The fsync + rename (`commit()`) may run on another thread than the writing (`finish()`).

A final path therefore only ever holds a complete, fsynced file; a kill -9 leaves at most
a `.srt-*.tmp` file next to it, which the next run removes. A full disk (ENOSPC / EDQUOT)
becomes one `CheckpointError` after the temp file is deleted: nothing half written.

Checksum (the one definition; manifest `"checksum": "blake2b64-tree-64MiB"`, format_version 2):
split the file into consecutive 64 MiB chunks (the last may be shorter; an empty file is one
empty chunk), take blake2b with an 8-byte digest of each chunk, and the file's checksum is
blake2b (8-byte digest) of the concatenated chunk digests, as 16 hex digits. Chunks hash
independently, so a multi-GB file hashes on every core (hashlib releases the GIL on large
buffers) and the result does not depend on the thread count. format_version 1 trees (converted
before this rule) use `LEGACY_RULE`: blake2b-64 of the whole file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

from streamrt.diskspace import nearest_existing, writable_dir_error  # noqa: F401  (re-exported)
from streamrt.errors import CheckpointError

TMP_PREFIX, TMP_SUFFIX = ".srt-", ".tmp"
DIGEST_BYTES = 8  # blake2b-64: 16 hex chars in the manifest
CHUNK_BYTES = 64 << 20  # tree-hash chunk; tests shrink it (read at call time, not import time)
LEGACY_RULE = "blake2b64"  # format_version 1: whole-file blake2b-64, one thread
READ_BYTES = 8 << 20  # pread buffer per hashing thread
_ZEROS = bytes(1 << 16)
_RULE_RE = re.compile(r"blake2b64-tree-(\d+)(MiB|KiB|B)")
_UNITS = {"MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


def new_hash():
    """Plain blake2b-64 (fingerprints, chunk digests, the legacy rule)."""
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


# ---- the checksum rule ---------------------------------------------------------------


def rule_name(chunk_bytes: int | None = None) -> str:
    """The manifest's "checksum" value for the tree rule with this chunk size."""
    c = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    for unit in ("MiB", "KiB"):
        if c % _UNITS[unit] == 0:
            return f"blake2b64-tree-{c // _UNITS[unit]}{unit}"
    return f"blake2b64-tree-{c}B"


def rule_chunk(rule: str) -> int | None:
    """Chunk size of a rule name; None for the legacy whole-file rule; ValueError if unknown."""
    if rule == LEGACY_RULE:
        return None
    m = _RULE_RE.fullmatch(rule or "")
    c = int(m.group(1)) * _UNITS[m.group(2)] if m else 0
    if not 4096 <= c <= 1 << 30:  # a sane range: guards against a typo'd manifest
        raise ValueError(f"unknown checksum rule {rule!r}")
    return c


def combine(chunk_digests: list[bytes]) -> str:
    """The tree rule's top level: blake2b-64 over the chunk digests in file order."""
    return hashlib.blake2b(b"".join(chunk_digests), digest_size=DIGEST_BYTES).hexdigest()


def _chunk_of(rule: str | None, chunk_bytes: int | None) -> int | None:
    """No rule: the current tree rule (or its `chunk_bytes` variant); else the rule's chunk."""
    if rule is None:
        return CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return rule_chunk(rule)


def _ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)] or [(0, 0)]


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_local = threading.local()


def hash_pool() -> ThreadPoolExecutor:
    """One process-wide pool for chunk hashing, one thread per core: nested callers (verify's
    per-file workers, convert's writers) share it, so memory stays cores x READ_BYTES.
    Its jobs never wait on the pool, so callers blocking on it cannot deadlock."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(2, os.cpu_count() or 1), thread_name_prefix="srt-hash")
        return _pool


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has none of the parent's threads: start afresh


os.register_at_fork(after_in_child=_forget_pool)


def _hash_into(h, fd: int, off: int, n: int):
    """Feed bytes [off, off+n) of fd to h, read with pread (page cache when hot)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray(READ_BYTES)
    while n:
        k = os.preadv(fd, [memoryview(buf)[: min(n, READ_BYTES)]], off)
        if k <= 0:
            raise OSError(errno.EIO, "file shorter than expected while hashing")
        h.update(memoryview(buf)[:k])
        off, n = off + k, n - k
    return h


def _hash_range(fd: int, off: int, n: int) -> bytes:
    return _hash_into(new_hash(), fd, off, n).digest()


def _gather(futs: list[Future]) -> list[bytes]:
    wait(futs)  # every job done before the caller may close the fd, even on an error
    return [f.result() for f in futs]


def _tree_digest(size: int, chunk: int, one: Callable[[int, int], bytes]) -> str:
    """The tree rule over `size` bytes, `one(off, n)` digesting one chunk: a single chunk on
    this thread (no pool hop), more in the shared pool."""
    ranges = _ranges(size, chunk)
    if len(ranges) == 1:
        return combine([one(0, size)])
    pool = hash_pool()
    return combine(_gather([pool.submit(one, off, n) for off, n in ranges]))


def fd_digest(fd: int, size: int, rule: str | None = None, chunk_bytes: int | None = None) -> str:
    """Checksum of the first `size` bytes of fd under `rule` (default: the current tree rule,
    or the tree rule with `chunk_bytes`). Multi-chunk files hash in the shared pool."""
    chunk = _chunk_of(rule, chunk_bytes)
    if chunk is None:  # legacy: one sequential pass
        return _hash_into(new_hash(), fd, 0, size).hexdigest()
    return _tree_digest(size, chunk, lambda off, n: _hash_range(fd, off, n))


def open_regular(path: Path) -> int:
    """A read-only fd of path, which must be a regular file: a FIFO standing in a file's place
    would block open() forever (O_NONBLOCK), and a directory or device is no tree file. An
    OSError from the open is the caller's to word."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return fd


def file_digest(path: Path, rule: str | None = None, *, chunk_bytes: int | None = None) -> str:
    """Checksum of a file under `rule` (a manifest "checksum" value; default the current rule)."""
    fd = open_regular(path)
    try:
        return fd_digest(fd, os.fstat(fd).st_size, rule, chunk_bytes)
    finally:
        os.close(fd)


def buffer_digest(data, rule: str | None = None, *, chunk_bytes: int | None = None) -> str:
    """Checksum of an in-memory buffer (e.g. a file's mapping) under `rule`; no second read."""
    mv = memoryview(data).cast("B")
    chunk = _chunk_of(rule, chunk_bytes)
    if chunk is None:
        return hashlib.blake2b(mv, digest_size=DIGEST_BYTES).hexdigest()
    return _tree_digest(len(mv), chunk,
                        lambda off, n: hashlib.blake2b(mv[off : off + n], digest_size=DIGEST_BYTES).digest())


def tmp_path(path: Path) -> Path:
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}{TMP_SUFFIX}")


def is_tmp(name: str) -> bool:
    return name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX)


class DiskFull(CheckpointError):
    """A write that ran out of space; its message says how to resume."""


def disk_full_error(path: Path, e: OSError) -> DiskFull:
    return DiskFull(
        f"{path}: disk full ({os.strerror(e.errno)}); the partial file was removed, nothing is half written. "
        "Free space and re-run the same command to resume"
    )


def write_error(path: Path, e: OSError) -> CheckpointError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return disk_full_error(path, e)
    return CheckpointError(f"{path}: write failed: {e.strerror or e}")


def create_tmp(path: Path, tmp: Path, flags: int) -> int:
    """The parent directories and the open temp file of a writer. An OSError (permission
    denied, a file where a directory belongs, a name too long) is one CheckpointError naming
    the final path; nothing was written yet."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(tmp, flags | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(path, e) from None
        raise CheckpointError(f"{path}: cannot create: {e.strerror or e}") from None


class AtomicWriter:
    """`with AtomicWriter(path) as w: w.write(...)`; commits (fsync + rename) on clean exit,
    `w.digest` is then the file's checksum under the current tree rule.

    Commit is two steps: `finish()` (all bytes written, hash closed) and `commit()` (fsync,
    close, rename: the part that waits on the disk). `defer_commit=True` makes a clean exit
    only finish, so the durable part can run on another thread; the owner must then call
    `commit()` or `abort()` exactly as for a plain writer. Until the rename the file exists
    only under its temp name.

    Small files hash inline as they are written. `background_hash=True` (multi-chunk files)
    hands each completed chunk to the shared hash pool, which reads it back from the page
    cache: the caller may reuse its buffer at once, chunks hash on all cores while writing
    continues, and the last chunk hashes while fsync runs."""

    def __init__(self, path: Path, on_bytes: Callable[[int], None] | None = None, *, background_hash: bool = False,
                 defer_commit: bool = False):
        self.path = Path(path)
        self.tmp = tmp_path(self.path)
        self.size = 0
        self.on_bytes = on_bytes
        self.digest: str | None = None
        self.chunk = CHUNK_BYTES
        self.background = background_hash
        self.defer_commit = defer_commit
        self.finished = self.committed = False
        self.fd = create_tmp(self.path, self.tmp, os.O_RDWR if background_hash else os.O_WRONLY)
        self.parts: list = []  # chunk digests (inline) or futures of them (background), in order
        self.cur = new_hash()  # inline mode: the chunk being written
        self.cur_n = 0

    def write(self, data) -> None:
        if self.finished:
            raise AssertionError(f"{self.path}: write after finish()")
        mv = memoryview(data).cast("B")
        total = len(mv)
        if not self.background:
            self._hash_inline(mv)
        while mv:
            try:
                n = os.write(self.fd, mv)
            except OSError as e:
                self._fail(e)
            mv = mv[n:]
        self.size += total
        if self.background:  # every chunk now complete on disk (page cache) goes to the pool
            while (len(self.parts) + 1) * self.chunk <= self.size:
                self.parts.append(hash_pool().submit(_hash_range, self.fd, len(self.parts) * self.chunk, self.chunk))
        if self.on_bytes:
            self.on_bytes(total)

    def _hash_inline(self, mv: memoryview) -> None:
        while mv:
            k = min(len(mv), self.chunk - self.cur_n)
            self.cur.update(mv[:k])
            self.cur_n += k
            mv = mv[k:]
            if self.cur_n == self.chunk:
                self.parts.append(self.cur.digest())
                self.cur, self.cur_n = new_hash(), 0

    def pad_to(self, offset: int) -> None:
        while self.size < offset:
            self.write(_ZEROS[: min(len(_ZEROS), offset - self.size)])

    def finish(self) -> None:
        """Every byte is written: close the hash (background: the last chunk goes to the pool).
        Not durable yet; commit() or abort() next, on any thread. Idempotent."""
        if self.finished:
            return
        done = len(self.parts) * self.chunk
        if self.background:
            if done < self.size or self.size == 0:  # the short last chunk (an empty file is one chunk)
                self.parts.append(hash_pool().submit(_hash_range, self.fd, done, self.size - done))
        elif self.cur_n or self.size == 0:
            self.parts.append(self.cur.digest())
        self.finished = True

    def commit(self) -> tuple[int, str]:
        """finish() if needed, then the durable part: fsync, close, rename. On an OSError the
        temp file is removed and a CheckpointError names the final path."""
        self.finish()
        try:
            os.fsync(self.fd)  # overlaps the pool still hashing
            digest = combine(_gather(self.parts) if self.background else self.parts)
            self.parts = []
            fd, self.fd = self.fd, -1  # closed even if close() itself reports an error
            os.close(fd)
            os.replace(self.tmp, self.path)
        except OSError as e:
            self._fail(e)
        self.committed = True
        self.digest = digest
        return self.size, digest

    def abort(self) -> None:
        """Drop the temp file (and any hash jobs); a no-op once committed."""
        if self.committed:
            return
        if self.background:  # no job may read the fd after it is closed (the number gets reused)
            for f in self.parts:
                f.cancel()
            wait(self.parts)
        self.parts = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def _fail(self, e: OSError):
        self.abort()
        raise write_error(self.path, e) from None

    def __enter__(self) -> "AtomicWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.defer_commit:
            self.finish()
        elif exc_type is None:
            self.commit()
        else:
            self.abort()


class RangeWriter:
    """A file of known size written as its checksum chunks, by several threads at once and in
    any order: `write_chunk(i, pieces)` pwrites chunk i and hashes it from memory (no read-back);
    when every chunk is in, `commit()` fsyncs and renames (on any thread). Same bytes, temp
    name and checksum as AtomicWriter. On an error, call `abort()` once no write_chunk is
    running any more (a closed fd number gets reused); it is a no-op after a commit."""

    def __init__(self, path: Path, size: int):
        self.path = Path(path)
        self.tmp = tmp_path(self.path)
        self.size = size
        self.ranges = _ranges(size, CHUNK_BYTES)  # chunk i is bytes [off, off + n)
        self.digests: list[bytes | None] = [None] * len(self.ranges)
        self.left = len(self.ranges)
        self.lock = threading.Lock()
        self.digest: str | None = None
        self.fd = create_tmp(self.path, self.tmp, os.O_WRONLY)

    def write_chunk(self, i: int, pieces, on_bytes: Callable[[int], None] | None = None) -> bool:
        """Chunk i from `pieces`, consecutive buffers (each may be reused once the next is
        asked for) that must add up to the chunk exactly. True if it was the last chunk."""
        off, n = self.ranges[i]
        h, pos = new_hash(), off
        for piece in pieces:
            mv = memoryview(piece).cast("B")
            h.update(mv)  # while the piece is still in cache
            self._pwrite(mv, pos)
            pos += len(mv)
            if on_bytes:
                on_bytes(len(mv))
        if pos != off + n:
            raise AssertionError(f"{self.path}: chunk {i} got {pos - off} bytes, expected {n}")
        with self.lock:
            self.digests[i] = h.digest()
            self.left -= 1
            return self.left == 0

    def _pwrite(self, mv: memoryview, pos: int) -> None:
        while mv:
            try:
                k = os.pwrite(self.fd, mv, pos)
            except OSError as e:
                raise write_error(self.path, e) from None
            mv, pos = mv[k:], pos + k

    def finish(self) -> None:
        """Every chunk is in (AtomicWriter's protocol: commit() may then run on any thread)."""
        if self.left:
            raise AssertionError(f"{self.path}: commit with {self.left} chunks missing")

    def commit(self) -> tuple[int, str]:
        """fsync, close, rename. On an OSError the temp file is removed and a CheckpointError
        names the final path."""
        self.finish()
        digest = combine(self.digests)  # type: ignore[arg-type]
        try:
            os.fsync(self.fd)
            fd, self.fd = self.fd, -1
            os.close(fd)
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()  # every chunk is in: no write_chunk still uses the fd
            raise write_error(self.path, e) from None
        self.digest = digest
        return self.size, digest

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.digest is None:
            self.tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: Path, data: bytes) -> tuple[int, str]:
    """Write data to path atomically (temp name, fsync, rename); (size, checksum). An OSError
    (the temp file cannot be created, a full disk, ...) is one CheckpointError naming path."""
    with AtomicWriter(path) as w:
        w.write(data)
    return w.size, w.digest  # type: ignore[return-value]


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """A user-facing output file (stats JSON, trace, sweep CSV / PNG) written atomically: the
    path holds the old file or the complete new one, never a torn one. str is UTF-8."""
    path = Path(path)
    write_bytes_atomic(path, data.encode() if isinstance(data, str) else data)
    return path


def check_output_path(path: str | os.PathLike, flag: str) -> Path:
    """Before any work: StreamrtError (one line, naming `flag` and the path) unless `path` can
    be written: not a directory, device, FIFO or socket, in an existing directory where files
    can be created (a missing one is an error, not made: a typo must not build a tree of
    directories). Returns the path."""
    from streamrt.errors import StreamrtError

    path = Path(path).expanduser()
    if path.name in ("", ".", ".."):
        raise StreamrtError(f"{flag} {path}: not a file name")
    try:  # pathlib lets some OSErrors through (a name too long, a parent we may not search)
        if path.is_dir():
            raise StreamrtError(f"{flag} {path}: is a directory; give a file name")
        # the write is temp file + rename, which would replace a device or FIFO (as root,
        # --stats-json /dev/null turned /dev/null into a regular file for the whole system)
        if path.exists() and not path.is_file():
            raise StreamrtError(f"{flag} {path}: not a regular file (a device, FIFO or socket); give a file name")
        parent = nearest_existing(path.parent)
        parent_is_dir = parent.is_dir()
    except OSError as e:
        raise StreamrtError(f"{flag} {path}: cannot be written: {e.strerror or e}") from None
    if parent_is_dir and parent != path.parent:
        raise StreamrtError(f"{flag} {path}: directory {path.parent} does not exist; create it first")
    if not parent_is_dir:
        raise StreamrtError(f"{flag} {path}: {parent} is not a directory")
    why = writable_dir_error(parent)
    if why:
        raise StreamrtError(f"{flag} {path}: cannot write in {parent}: {why}")
    return path


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
