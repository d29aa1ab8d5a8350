"""Reading expert files from the drive: O_DIRECT whole-file reads into caller buffers, on a pool
of reader threads that take jobs in priority order.

`FileReader.read_into(path, buf)` reads one expert file into a 4096-aligned buffer (a pool
buffer: the file format is 4096-aligned, so O_DIRECT needs no bounce buffer) with `os.preadv`,
which releases the GIL, so N threads keep N reads in flight. Where O_DIRECT is refused (tmpfs,
/dev/shm, some network filesystems: EINVAL at open or at the first read) it falls back to
buffered reads for the rest of the process and says so once. Faults are user errors naming the
file: a size that is not the layout's, a short read (the file was truncated under us), EIO.

`DiskReader` is the thread pool. Jobs carry a priority tuple, lowest first: the scheduler
submits routed misses as (0, seq) and read-ahead guesses as (1, rank, seq), so a miss never
waits behind a guess that has not started. A job not yet started can be cancelled (its layer's
router spoke and did not pick it) or raised in priority (a guess that turned out routed).

`resident_bytes(ptr, nbytes)` (mincore) tells how much of a mapping was already in the page
cache: the counters split disk bytes from page-cache hits with it.

Faults are injected in tests through the constructors (`preadv=`, `FileReader` objects), never
through the environment.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import itertools
import mmap
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from streamrt.errors import CheckpointError

PAGE = 4096
DEFAULT_READ_THREADS = 16  # see RuntimeOptions: 16 x 18.6 MB reads in flight saturate an NVMe drive


@dataclass(frozen=True)
class ReadResult:
    nbytes: int
    direct: bool  # O_DIRECT: the bytes came from the drive, not the page cache
    cached: int  # buffered reads: bytes that were already in the page cache (0 for O_DIRECT)
    start_s: float  # time.perf_counter() around the read (trace)
    end_s: float


class FileReader:
    """Whole-file reads into caller buffers, O_DIRECT when the filesystem allows it.

    `preadv` and `open_fn` are injectable (tests slow reads down, cut them short, raise EIO)."""

    def __init__(self, *, direct: bool = True, notice: Callable[[str], None] | None = None,
                 preadv: Callable = os.preadv, open_fn: Callable = os.open) -> None:
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._notice = notice or (lambda msg: print(f"streamrt: {msg}", file=sys.stderr))
        self._preadv, self._open = preadv, open_fn
        self._lock = threading.Lock()
        self.fallback_note: str | None = None

    @property
    def mode(self) -> str:
        return "O_DIRECT" if self.direct else "buffered"

    def read_into(self, path, buf: memoryview, nbytes: int) -> ReadResult:
        """Read the whole file at `path` (exactly `nbytes`) into `buf[:nbytes]`. Thread-safe."""
        t0 = time.perf_counter()
        direct = self.direct
        fd = self._open_file(path, direct)
        if fd is None:  # O_DIRECT refused at open: buffered from now on
            direct, fd = False, self._open_file(path, False)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise not_regular_error(path)
            size = st.st_size
            if size != nbytes:
                raise CheckpointError(f"expert file {path}: {size} bytes, expected {nbytes}; re-run 'streamrt convert'")
            cached = 0 if direct else resident_file_bytes(fd, nbytes)
            try:
                self._read_all(fd, path, buf, nbytes)
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                self._fall_back(path, "EINVAL on read")
                os.close(fd)
                direct, fd = False, self._open_file(path, False)
                cached = resident_file_bytes(fd, nbytes)
                self._read_all(fd, path, buf, nbytes)
        except OSError as e:
            raise CheckpointError(
                f"expert file {path}: read failed ({e.strerror or e}); run 'streamrt verify'"
            ) from None
        finally:
            os.close(fd)
        return ReadResult(nbytes, direct, cached, t0, time.perf_counter())

    def _open_file(self, path, direct: bool) -> int | None:
        # O_NONBLOCK: a FIFO in the file's place would block open() forever; a regular file ignores it
        flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_DIRECT if direct else 0)
        try:
            return self._open(str(path), flags)
        except FileNotFoundError:
            raise CheckpointError(f"expert file {path}: missing; run 'streamrt verify'") from None
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                if not _is_regular(path):  # a directory or device refuses O_DIRECT too: not the filesystem's fault
                    raise not_regular_error(path) from None
                self._fall_back(path, "EINVAL on open")
                return None
            raise CheckpointError(f"expert file {path}: cannot open ({e.strerror or e})") from None

    def _read_all(self, fd: int, path, buf: memoryview, nbytes: int) -> None:
        got = 0
        while got < nbytes:
            n = self._preadv(fd, [buf[got:nbytes]], got)
            if n <= 0:
                raise CheckpointError(
                    f"expert file {path}: short read ({got} of {nbytes} bytes: truncated?); run 'streamrt verify'"
                )
            got += n

    def _fall_back(self, path, why: str) -> None:
        with self._lock:
            if not self.direct:
                return
            self.direct = False
            self.fallback_note = (f"O_DIRECT unsupported where {path} lives ({why}); reading expert files "
                                  f"buffered (through the page cache)")
        self._notice(self.fallback_note)


def not_regular_error(path) -> CheckpointError:
    return CheckpointError(f"expert file {path}: not a regular file; re-run 'streamrt convert'")


def _is_regular(path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


# ---- the reader threads ------------------------------------------------------------------


class ReadJob:
    """One queued read. `cancel()` / `raise_priority()` act only while it has not started."""

    __slots__ = ("priority", "fn", "done", "state", "_reader")

    def __init__(
        self, reader: "DiskReader", priority: tuple, fn: Callable[[], Any],
        done: Callable[[Any, BaseException | None], None],
    ):
        self.priority, self.fn, self.done, self.state, self._reader = priority, fn, done, "queued", reader

    def cancel(self) -> bool:
        return self._reader._cancel(self)

    def raise_priority(self, priority: tuple) -> None:
        self._reader._reprioritize(self, priority)


class DiskReader:
    """`threads` reader threads taking jobs lowest priority first. `done(result, exc)` is called on
    the reader thread when a job finished (the scheduler forwards it to its loop)."""

    def __init__(self, threads: int, *, thread_init: Callable[[], None] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"reader threads must be >= 1, got {threads}")
        self.threads = threads
        self._heap: list[tuple[tuple, int, ReadJob]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.in_flight = 0
        self._workers = [
            threading.Thread(target=self._work, args=(thread_init,), name=f"streamrt-read-{i}", daemon=True)
            for i in range(threads)
        ]
        for w in self._workers:
            w.start()

    def submit(
        self, priority: tuple, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> ReadJob:
        job = ReadJob(self, priority, fn, done)
        with self._cv:
            if self._closed:
                raise RuntimeError("DiskReader is closed")
            heapq.heappush(self._heap, (priority, next(self._seq), job))
            self._cv.notify()
        return job

    def queued(self) -> int:
        with self._cv:
            return len({id(j) for _, _, j in self._heap if j.state == "queued"})

    def _cancel(self, job: ReadJob) -> bool:
        with self._cv:
            if job.state != "queued":
                return False
            job.state = "cancelled"  # its heap entries are skipped
            return True

    def _reprioritize(self, job: ReadJob, priority: tuple) -> None:
        with self._cv:
            if job.state == "queued" and priority < job.priority:
                job.priority = priority
                heapq.heappush(self._heap, (priority, next(self._seq), job))  # the old entry goes stale
                self._cv.notify()

    def _next(self) -> ReadJob | None:
        with self._cv:
            while True:
                while self._heap:
                    prio, _, job = heapq.heappop(self._heap)
                    if job.state == "queued" and prio == job.priority:
                        job.state = "running"
                        self.in_flight += 1
                        return job
                if self._closed:
                    return None
                self._cv.wait()

    def _work(self, thread_init) -> None:
        if thread_init is not None:
            thread_init()
        while (job := self._next()) is not None:
            try:
                result, exc = job.fn(), None
            except BaseException as e:  # handed to the submitter, never lost
                result, exc = None, e
            with self._cv:
                job.state = "done"
                self.in_flight -= 1
            job.done(result, exc)

    def close(self) -> None:
        """Cancel what has not started, finish what has, stop the threads."""
        with self._cv:
            self._closed = True
            pending = list({id(j): j for _, _, j in self._heap if j.state == "queued"}.values())
            for j in pending:
                j.state = "cancelled"
            self._heap.clear()
            self._cv.notify_all()
        for w in self._workers:
            w.join()
        for j in pending:
            j.done(None, ReadCancelled("reader closed"))


class ReadCancelled(Exception):
    """A queued read dropped before it started (its guess was not routed, or shutdown)."""


# ---- how much of a file the page cache holds (mincore) -------------------------------------

_libc = None


def _mincore():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            _libc = False
    return _libc.mincore if _libc else None


def resident_bytes(ptr: int, nbytes: int) -> int | None:
    """Bytes of the page-aligned mapping [ptr, ptr + nbytes) in the page cache now; None if unknown."""
    fn = _mincore()
    if fn is None or nbytes <= 0 or ptr % PAGE:
        return None
    pages = -(-nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if fn(ptr, nbytes, vec) != 0:
        return None
    import numpy as np

    return min(nbytes, int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * PAGE)


def resident_file_bytes(fd: int, nbytes: int) -> int:
    """Bytes of an open file in the page cache (0 when it cannot be told): a mapping that is
    never touched, asked with mincore."""
    import numpy as np

    try:
        mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return 0
    arr = np.frombuffer(mm, dtype=np.uint8)
    try:
        return resident_bytes(arr.ctypes.data, nbytes) or 0
    finally:
        del arr
        mm.close()


# ---- the drive's rate ---------------------------------------------------------------------


def measure_read_rate(paths, nbytes: int, threads: int, *, reader: FileReader | None = None) -> float:
    """Parallel whole-file reads of `paths` (each `nbytes`) with `threads` threads into aligned
    buffers; returns bytes per second. Cold only if the caller dropped the page cache or the
    reader is O_DIRECT."""
    from concurrent.futures import ThreadPoolExecutor

    reader = reader or FileReader()
    bufs = [mmap.mmap(-1, nbytes) for _ in range(threads)]
    slots = list(range(threads))
    lock = threading.Lock()

    def one(path) -> int:
        with lock:
            i = slots.pop()
        try:
            return reader.read_into(path, memoryview(bufs[i]), nbytes).nbytes
        finally:
            with lock:
                slots.append(i)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as ex:
        total = sum(ex.map(one, list(paths)))
    return total / max(time.perf_counter() - t0, 1e-9)


def tune_threads(paths, nbytes: int, *, candidates=(4, 8, 16, 32), files_each: int = 16,
                 reader: FileReader | None = None) -> tuple[int, dict[int, float]]:
    """`--read-threads auto`: the fewest threads within 5 % of the best rate over `files_each`
    files per candidate (different files each time, so O_DIRECT reads stay cold)."""
    paths = list(paths)
    rates, pos = {}, 0
    for n in candidates:
        chunk = paths[pos: pos + max(files_each, n)]
        if len(chunk) < n:
            break
        pos += len(chunk)
        rates[n] = measure_read_rate(chunk, nbytes, n, reader=reader)
    if not rates:
        return DEFAULT_READ_THREADS, rates
    best = max(rates.values())
    return min(n for n, r in rates.items() if r >= 0.95 * best), rates
