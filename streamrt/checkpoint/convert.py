"""`streamrt convert SRC DST`: release tree -> streamrt tree (docs/CONTRACTS.md).

Output: config and tokenizer files copied; dense tensors (BF16, F32 where released) regrouped into
`dense/resident.safetensors` (always resident) and `dense/plane.L{layer:03d}.safetensors`
(the per-MoE-layer latent/shared plane, streamed); one `.nvfp4` file per routed expert;
`manifest.json` last. The expert path is pure I/O: nibbles are written straight from the
source mapping and the E8M0 -> E4M3 scale repack is integer table work (fp4.mxfp4_to_nvfp4);
nothing is dequantised.

Crash safety: every file is written under a temp name, fsynced and renamed, then appended
to `DST/.convert/journal.jsonl` (path, size, blake2b), in that order on whichever thread
commits it. A re-run removes stale temp files and skips every journaled file whose size and
checksum still match, so kill -9 at any moment costs at most the files in flight (being
written or waiting for their commit). How a non-empty DST is recognised as a previous
conversion of the same source, which of its files a changed source shard invalidates, and the
lock that keeps a second converter out are `dst.py`'s. Checksums follow `fileio`'s chunked
tree rule; files recorded under another rule are redone, never mixed in.

Parallelism: one pool runs whole-file jobs (copies, experts) and, for dense files, one job
per checksum chunk: chunks are independent in both bytes and digest, so a multi-GB dense file
is written (pwrite into one temp file) and hashed on every core, and the last chunk to finish
finishes it (fileio.RangeWriter). Dense chunks are queued first, experts after.

Commit stage: a job that finished a file (bytes written, hash closed) hands the writer to a
small pool of committer threads (fsync, rename, journal record) and moves on, so writer
threads never wait on writeback or journal commits and dirty pages keep streaming out. At
most COMMIT_BACKLOG x workers files are finished but not yet committed (bounded dirty memory,
bounded open fds); a writer blocks when the backlog is full. `commit_threads=0` commits inside
the job, as before the stage existed. A failed commit removes its temp file, stops new files
from starting and is raised once everything in flight has settled.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from streamrt import fp4
from streamrt.checkpoint.dst import JOURNAL, STATE_DIR, DstLock, check_paths, prepare_dst
from streamrt.checkpoint.expert_file import HEADER_BYTES, ExpertLayout, parse_header, write_expert_file
from streamrt.output_paths import space_error
from streamrt.fileio import AtomicWriter, DiskFull, RangeWriter, file_digest, fsync_dir
from streamrt.checkpoint.manifest import dense_files, write_manifest
from streamrt.checkpoint.names import TensorSpec, expert_prefix, expert_relpath, is_expert_tensor, strip_prefix
from streamrt.checkpoint.release import ReleaseTree, open_release, release_fingerprint, shard_fingerprints
from streamrt.checkpoint.safetensors_io import build_header
from streamrt.errors import CheckpointError
from streamrt.tokenizer import TOKENIZER_CONFIG, check_tokenizer_config, load_tokenizer

PIECE_BYTES = 4 << 20  # dense bytes per pread/hash/pwrite step: the buffer stays in the CPU cache
COMMIT_BACKLOG = 4  # finished-but-uncommitted files allowed per worker (4 x 16 x 18.6 MB ~ 1.2 GB dirty)
_scratch = threading.local()  # per-thread read buffers, reused across files


def _buffer(key: str, nbytes: int) -> memoryview:
    """A per-thread buffer of at least nbytes; reused, so its pages fault in only once."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    b = bufs.get(key)
    if b is None or len(b) < nbytes:
        b = bufs[key] = bytearray(nbytes)
    return memoryview(b)[:nbytes]


# ---- the conversion ------------------------------------------------------------------


@dataclass
class Task:
    """One output file: either one job (`run`), or, for dense files, one job per checksum chunk,
    each producing its bytes with `fill`."""

    rel: str
    size: int  # expected final size
    # on_bytes -> (finished, uncommitted AtomicWriter, global_mode)
    run: Callable[[Callable[[int], None]], tuple[AtomicWriter, int]] | None = None
    fill: Callable[[int, memoryview], None] | None = None  # (offset, buf): the file's bytes there into buf
    sources: frozenset[str] = frozenset()  # source shards the file is made from


def _plan(rt: ReleaseTree, dst: Path, allow_per_row: bool) -> list[Task]:
    cfg = rt.config
    tasks: list[Task] = []
    for f in [rt.root / "config.json", *rt.tokenizer_files()]:
        tasks.append(Task(f.name, f.stat().st_size, _copy_task(f, dst / f.name)))
    dense = [s for s in rt.specs if not is_expert_tensor(s.name)]  # with the dtypes as stored
    for rel, specs in dense_files(dense).items():
        renamed = [TensorSpec(strip_prefix(s.name), s.shape, s.dtype) for s in specs]
        hdr, offs = build_header(renamed)
        sources = frozenset(rt.weight_map[s.name] for s in specs)
        size = len(hdr) + (offs[-1][1] if offs else 0)
        tasks.append(Task(rel, size, fill=_dense_fill(rt, hdr, specs), sources=sources))
    layout = ExpertLayout.for_config(cfg)
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            rel = expert_relpath(layer, e)
            p = expert_prefix(layer, e)
            sources = frozenset(rt.weight_map[f"{p}{w}.weight_{k}"]
                                for w in ("w1", "w2", "w3") for k in ("packed", "scale"))
            fill = _expert_task(rt, dst / rel, layer, e, layout, allow_per_row)
            tasks.append(Task(rel, layout.file_bytes, fill, sources=sources))
    return tasks


def _copy_task(src: Path, out: Path):
    def run(on_bytes):
        with AtomicWriter(out, on_bytes, defer_commit=True) as w:
            w.write(src.read_bytes())
        return w, -1

    return run


def _dense_fill(rt: ReleaseTree, header: bytes, specs: list[TensorSpec]):
    """fill(off, buf): bytes [off, off + len(buf)) of the dense file (header, then the tensors
    back to back, as build_header lays them out), so any range can be produced on its own."""
    starts, pos = [], len(header)  # file offset of each tensor
    for s in specs:
        starts.append(pos)
        pos += s.nbytes

    def fill(off: int, buf: memoryview) -> None:
        end = off + len(buf)
        if off < len(header):
            k = min(len(header), end) - off
            buf[:k] = header[off : off + k]
        # from the tensor holding `off` on (a full-size dense file has thousands of tensors and
        # pieces: scanning them all per piece would be quadratic)
        for i in range(max(0, bisect.bisect_right(starts, off) - 1), len(specs)):
            start, s = starts[i], specs[i]
            if start >= end:
                break
            lo, hi = max(start, off), min(start + s.nbytes, end)
            if lo < hi:
                rt.read_into(s.name, buf[lo - off : hi - off], lo - start)

    return fill


def _chunk_pieces(t: Task, w: RangeWriter, i: int):
    """Chunk i of a dense file as PIECE_BYTES buffers, filled one at a time into the thread's
    reused buffer (each is consumed before the next is filled)."""
    off, n = w.ranges[i]
    for p in range(off, off + n, PIECE_BYTES):
        buf = _buffer("piece", min(PIECE_BYTES, off + n - p))
        t.fill(p, buf)  # type: ignore[misc]
        yield buf


def _expert_task(rt: ReleaseTree, out: Path, layer: int, e: int, layout: ExpertLayout, allow_per_row: bool):
    def run(on_bytes):
        mx = rt.expert_mxfp4(layer, e, _buffer)  # NaN scales -> CheckpointError naming shard and tensor
        mats, per_row = {}, False
        for m, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            packed, scales = mx[w]
            name = f"{expert_prefix(layer, e)}{w}"
            label = f"{rt.root / rt.weight_map[name + '.weight_packed']}: tensor {name}"
            p, s, g, pr = fp4.repack_expert_matrix(packed, scales, allow_per_row=allow_per_row, name=label)
            mats[m], per_row = (p, s, g), per_row or pr
        w = write_expert_file(
            out, mats, layer=layer, expert=e, global_mode=int(per_row), layout=layout, on_bytes=on_bytes,
            defer_commit=True,
        )
        return w, int(per_row)

    return run


def _still_complete(path: Path, entry: dict | None, expected_size: int, check_digest: bool) -> bool:
    if not entry or entry.get("size") != expected_size:
        return False
    try:
        if path.stat().st_size != expected_size:
            return False
        return not check_digest or file_digest(path) == entry.get("blake2b")
    except OSError:
        return False


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    workers: int | None = None,
    allow_per_row: bool = False,
    progress: bool | None = None,
    check_resumed: bool = True,
    log: Callable[[str], None] | None = None,
    commit_threads: int | None = None,
    verify_source: bool = False,
    on_written: Callable[[int], None] | None = None,
) -> dict:
    """Convert; returns a summary dict. Raises CheckpointError / ConfigError on bad input: the
    config, headers, dtypes and shapes before DST is touched; bad tensor data (a NaN scale) once
    it is read, with the files converted so far kept in DST for a re-run to resume.

    `commit_threads`: committer threads (fsync, rename, journal); default `workers`, 0 commits
    inside the writing job. `verify_source`: hash every source shard's bytes, so a re-run also
    catches a shard rewritten in place with its mtime restored. `on_written(total)`: called
    with the bytes written so far, under the progress lock (progress reporting; the crash
    tests kill the process from it)."""
    src, dst = Path(src), Path(dst)
    if workers is not None and workers < 0:
        raise CheckpointError(f"--workers must be >= 0 (0: the default, min(16, cores)), got {workers}")
    if commit_threads is not None and commit_threads < 0:
        raise CheckpointError(f"--commit-threads must be >= 0, got {commit_threads}")
    rt = _open_source(src, dst, log)
    fingerprint = release_fingerprint(src)
    shards = shard_fingerprints(src, rt.shards)  # content hashes (--verify-source) once DST is known to be ours
    created = _make_dst(dst)
    try:
        with DstLock(dst):
            prior, changed = prepare_dst(src, dst, fingerprint, shards, hash_sources=verify_source)
            tasks = _plan(rt, dst, allow_per_row)
            if changed and prior:
                stale = {t.rel for t in tasks if t.sources & changed}
                prior = {k: v for k, v in prior.items() if k not in stale}
                if log and stale:
                    log(f"convert: {len(changed)} source shard(s) changed since the last run; "
                        f"redoing the {len(stale)} files made from them")
            _check_space(dst, tasks)
            _make_dirs(dst, tasks)
            run = Conversion(rt, dst, tasks, prior, workers=workers, commit_threads=commit_threads,
                             check_resumed=check_resumed, progress=progress, on_written=on_written)
            try:
                run.execute()
            except DiskFull:  # says how to resume already
                raise
            except CheckpointError as e:  # bad source data, found once read
                raise CheckpointError(f"{e}; the files converted so far stay in {dst}: once the source is fixed, "
                                      "a re-run resumes") from None
            source = {"path": str(src.resolve()), "fingerprint": fingerprint, "shards": shards}
            return run.finish(src, source, log)
    except CheckpointError:
        if created and not any(dst.iterdir()):
            dst.rmdir()  # refused before writing anything: leave no empty DST behind
        raise


def _open_source(src: Path, dst: Path, log: Callable[[str], None] | None):
    """The release at `src`, validated before DST is touched: config gating, headers, every
    tensor's dtype and shape, and the tokenizer files (copied as they are: refused now what
    `run` would refuse after the conversion)."""
    try:
        src_is_dir = src.is_dir()
    except OSError as e:  # e.g. a name longer than the file system allows
        raise CheckpointError(f"{src}: cannot read SRC: {e.strerror or e}") from None
    if not src_is_dir:
        raise CheckpointError(f"{src}: no such release directory")
    check_paths(src, dst)
    rt = open_release(src)
    if os.path.lexists(src / TOKENIZER_CONFIG):  # lexists: a directory or a dangling link there is refused
        check_tokenizer_config(src / TOKENIZER_CONFIG)
    load_tokenizer(src, rt.config.vocab_size, rt.config.eos_token_id)
    if rt.skipped and log:
        log(f"convert: skipping {len(rt.skipped)} tensors outside the language model (vision tower, projector): "
            f"{rt.skipped_bytes / 2**20:,.1f} MiB")
    return rt


def _make_dst(dst: Path) -> bool:
    """DST as a directory; True when this call created it."""
    try:
        if dst.exists() and not dst.is_dir():
            raise CheckpointError(f"{dst}: exists and is not a directory")
        created = not dst.exists()
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # unwritable, or a name longer than the file system allows
        raise CheckpointError(f"{dst}: cannot create DST: {e.strerror or e}") from None
    return created


def _check_space(dst: Path, tasks: list[Task]) -> None:
    todo = sum(t.size for t in tasks if not (dst / t.rel).is_file() or (dst / t.rel).stat().st_size != t.size)
    why = space_error(dst, todo)
    if why:
        raise CheckpointError(f"{dst}: not enough space for the conversion: {why}")


def _make_dirs(dst: Path, tasks: list[Task]) -> None:
    """Every output directory, before any file is written: a file standing where a directory
    belongs (a DST resumed after someone edited it) is one line now, not a worker's traceback."""
    for d in sorted({(dst / t.rel).parent for t in tasks}):
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{d}: cannot create the output directory: {e.strerror or e}") from None


class Conversion:
    """One run over the planned files: a pool of writer threads (whole files, and dense files
    chunk by chunk), a small pool of committers (fsync, rename, journal), the counters, and the
    first failure, which stops new files from starting and is raised once all in flight settle."""

    def __init__(self, rt: ReleaseTree, dst: Path, tasks: list[Task], prior: dict[str, dict], *, workers: int | None,
                 commit_threads: int | None, check_resumed: bool, progress: bool | None,
                 on_written: Callable[[int], None] | None):
        from tqdm import tqdm

        self.rt, self.dst, self.tasks, self.prior = rt, dst, tasks, prior
        self.workers = workers or min(16, os.cpu_count() or 1)
        # Committers sleep in fsync (no GIL, no CPU): as many as workers keeps as many files
        # flushing at once as the inline path did, while the workers go on producing.
        self.commit_threads = self.workers if commit_threads is None else commit_threads
        self.check_resumed, self.on_written = check_resumed, on_written
        self.lock = threading.Lock()
        self.files: dict[str, dict] = {}
        self.modes = {0: 0, 1: 0}
        self.counters = {"written": 0, "skipped": 0, "bytes_written": 0}
        self.errors: list[BaseException] = []  # first failure (of a job or a commit) is the one raised
        self.stop = threading.Event()  # set on any failure: no new file is started
        self.slots = threading.Semaphore(COMMIT_BACKLOG * self.workers)
        self.writers: list[RangeWriter] = []  # dense files being written
        self.bar = tqdm(total=sum(t.size for t in tasks), unit="B", unit_scale=True, unit_divisor=1024,
                        desc="convert", disable=None if progress is None else not progress)
        self.seconds = 0.0

    # -- the run -----------------------------------------------------------------------

    def execute(self) -> None:
        path = self.dst / STATE_DIR / JOURNAL
        try:
            journal = open(path, "a")
        except OSError as e:  # a directory in its place, no permission
            raise CheckpointError(f"{path}: cannot open the conversion journal: {e.strerror or e}") from None
        committer = (ThreadPoolExecutor(self.commit_threads, thread_name_prefix="srt-commit")
                     if self.commit_threads else None)
        self.journal, self.committer = journal, committer
        t0 = time.perf_counter()
        try:
            try:
                with ThreadPoolExecutor(self.workers) as ex:
                    futs = [f for t in self.tasks for f in self._submit(ex, t)]  # dense chunks first, then experts
                    wait(futs, return_when=FIRST_EXCEPTION)
                    if any(f.done() and f.exception() for f in futs):
                        ex.shutdown(wait=True, cancel_futures=True)
            finally:
                if committer is not None:  # after the writers: nothing submits any more
                    committer.shutdown(wait=True)  # never cancel: every handed-off file is committed or aborted
            if self.errors:
                raise self.errors[0]
        finally:
            for w in self.writers:  # both pools have drained: no job touches these any more
                w.abort()  # an unfinished file leaves nothing behind (no-op once committed)
            self.bar.close()
            journal.close()
        self.seconds = time.perf_counter() - t0

    def finish(self, src: Path, source: dict, log: Callable[[str], None] | None) -> dict:
        """Directories synced, the manifest written last, the state removed; the summary."""
        for d in {(self.dst / t.rel).parent for t in self.tasks}:
            fsync_dir(d)
        write_manifest(self.dst, self.rt.config, self.files, [s.name for s in self.rt.specs], source=source,
                       modes=self.modes)
        fsync_dir(self.dst)
        shutil.rmtree(self.dst / STATE_DIR, ignore_errors=True)
        self.rt.close()
        summary = {
            "src": str(src),
            "dst": str(self.dst),
            "files": len(self.files),
            **self.counters,
            "tensors_not_converted": len(self.rt.skipped),
            "bytes_not_converted": self.rt.skipped_bytes,
            "seconds": self.seconds,
            "expert_files_per_matrix_global": self.modes.get(0, 0),
            "expert_files_per_row_global": self.modes.get(1, 0),
            "workers": self.workers,
            "commit_threads": self.commit_threads,
        }
        if log:
            log(_summary_line(summary))
        return summary

    # -- jobs --------------------------------------------------------------------------

    def _submit(self, ex: ThreadPoolExecutor, t: Task) -> list:
        if t.fill is None:
            return [ex.submit(self._guarded, self._run_file, t)]
        # Checked here, not in a job, so that all its chunk jobs can be queued at once; dense
        # files are few, and a resumed one's digest check hashes on every core anyway.
        if self._skip_if_complete(t):
            return []
        w = RangeWriter(self.dst / t.rel, t.size)
        self.writers.append(w)
        return [ex.submit(self._guarded, self._write_chunk, t, w, i) for i in range(len(w.ranges))]

    def _guarded(self, fn: Callable, *args) -> None:
        if self.stop.is_set():  # something failed: start no new file (running ones still finish)
            return
        try:
            fn(*args)
        except BaseException as e:
            self._failed(e)
            raise

    def _run_file(self, t: Task) -> None:
        if not self._skip_if_complete(t):
            self._hand_off(t, *t.run(self._on_bytes))  # type: ignore[misc]

    def _write_chunk(self, t: Task, w: RangeWriter, i: int) -> None:
        if w.write_chunk(i, _chunk_pieces(t, w, i), self._on_bytes):  # the last chunk in finishes the file
            self._hand_off(t, w, -1)

    def _skip_if_complete(self, t: Task) -> bool:
        """A previous run's file that still matches its journal entry: count it, keep it."""
        path = self.dst / t.rel
        if not _still_complete(path, self.prior.get(t.rel), t.size, self.check_resumed):
            return False
        mode = -1
        if t.rel.endswith(".nvfp4"):
            with open(path, "rb") as f:
                layout = ExpertLayout.for_config(self.rt.config)
                mode = parse_header(f.read(HEADER_BYTES), layout, name=str(path)).global_mode
        with self.lock:
            self.files[t.rel] = self.prior[t.rel]
            self.counters["skipped"] += 1
            self.modes[mode] = self.modes.get(mode, 0) + 1
            self.bar.update(t.size)
        return True

    # -- commits -----------------------------------------------------------------------

    def _hand_off(self, t: Task, w: AtomicWriter | RangeWriter, mode: int) -> None:
        """A finished file: commit it here (commit_threads=0) or queue it for the committers."""
        if self.committer is None:
            self._commit(t, w, mode)
            return
        self.slots.acquire()  # backpressure: the writer waits only when the backlog is full
        try:
            self.committer.submit(self._commit_job, t, w, mode)
        except BaseException:
            self.slots.release()
            w.abort()
            raise

    def _commit_job(self, t: Task, w: AtomicWriter | RangeWriter, mode: int) -> None:
        try:
            self._commit(t, w, mode)
        except BaseException as e:
            self._failed(e)
        finally:
            self.slots.release()

    def _commit(self, t: Task, w: AtomicWriter | RangeWriter, mode: int) -> None:
        try:
            size, digest = w.commit()  # fsync + rename; a CheckpointError names the file
        except BaseException:
            w.abort()  # whatever failed, no temp file stays (a no-op if commit cleaned up)
            raise
        entry = {"size": size, "blake2b": digest}  # journaled only after the rename: a journaled file is complete
        with self.lock:
            self.files[t.rel] = entry
            self.counters["written"] += 1
            self.modes[mode] = self.modes.get(mode, 0) + 1
            self.journal.write(json.dumps({"path": t.rel, **entry}) + "\n")
            self.journal.flush()

    # -- bookkeeping -------------------------------------------------------------------

    def _on_bytes(self, n: int) -> None:
        with self.lock:
            self.counters["bytes_written"] += n
            self.bar.update(n)
            if self.on_written is not None:
                self.on_written(self.counters["bytes_written"])

    def _failed(self, e: BaseException) -> None:
        with self.lock:
            self.errors.append(e)
        self.stop.set()


def _summary_line(s: dict) -> str:
    rate = s["bytes_written"] / s["seconds"] / 1e9 if s["seconds"] > 0 else 0.0
    return (
        f"converted {s['src']} -> {s['dst']}: {s['files']} files ({s['written']} written, "
        f"{s['skipped']} already complete), "
        f"{s['bytes_written'] / 2**30:.2f} GiB in {s['seconds']:.1f} s ({rate:.2f} GB/s); expert global scales: "
        f"{s['expert_files_per_matrix_global']} per matrix, {s['expert_files_per_row_global']} per row"
    )


__all__ = ["convert", "Conversion"]
