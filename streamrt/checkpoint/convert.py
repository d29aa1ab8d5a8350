"""`streamrt convert SRC DST`: release tree -> streamrt tree (docs/CONTRACTS.md).

Output: config and tokenizer files copied; dense BF16 tensors regrouped into
`dense/resident.safetensors` (always resident) and `dense/plane.L{layer:03d}.safetensors`
(the per-MoE-layer latent/shared plane, streamed); one `.nvfp4` file per routed expert;
`manifest.json` last. The expert path is pure I/O: nibbles are written straight from the
source mapping and the E8M0 -> E4M3 scale repack is integer table work (fp4.mxfp4_to_nvfp4);
nothing is dequantised.

Crash safety: every file is written under a temp name, fsynced and renamed, then appended
to `DST/.convert/journal.jsonl` (path, size, blake2b), in that order on whichever thread
commits it. A re-run removes stale temp files and skips every journaled file whose size and
checksum still match, so kill -9 at any moment costs at most the files in flight (being
written or waiting for their commit). `.convert/state.json` names the source (fingerprint of
its config, index and shard sizes) and the checksum rule, which is how a non-empty DST is
recognised as a previous partial conversion of the same source; after success the manifest
carries both instead. Checksums follow `fileio`'s chunked tree rule; files recorded under
another rule are redone, never mixed in.

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
import fcntl
import json
import os
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from streamrt import fp4
from streamrt.checkpoint.expert_file import HEADER_BYTES, ExpertLayout, parse_header, write_expert_file
from streamrt.checkpoint.fileio import (
    LEGACY_RULE,
    AtomicWriter,
    RangeWriter,
    file_digest,
    fsync_dir,
    remove_stale_tmp,
    rule_name,
    write_bytes_atomic,
)
from streamrt.checkpoint.names import TensorSpec, dense_group, expert_prefix, expert_relpath, is_expert_tensor, strip_prefix
from streamrt.checkpoint.release import ReleaseTree, open_release, release_fingerprint, shard_fingerprints
from streamrt.checkpoint.safetensors_io import build_header, order_for_alignment
from streamrt.config import ModelConfig
from streamrt.errors import CheckpointError

FORMAT, FORMAT_VERSION = "streamrt", 2
READ_VERSIONS = (1, 2)  # 1: whole-file blake2b (fileio.LEGACY_RULE); 2: top-level "checksum" names the rule
MANIFEST = "manifest.json"
STATE_DIR = ".convert"
LOCK = "lock"  # STATE_DIR/lock, held (flock) for the whole run: one converter per DST
KILL_ENV = "STREAMRT_TEST_KILL_AFTER_BYTES"  # test hook: SIGKILL self once this many bytes are written
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


# ---- layout of the converted tree ---------------------------------------------------


def dense_files(specs: list[TensorSpec]) -> dict[str, list[TensorSpec]]:
    """Relative path -> the release specs it holds, in file order (aligned for in-place views)."""
    groups: dict[str, list[TensorSpec]] = {}
    for s in specs:
        groups.setdefault(f"dense/{dense_group(s.name)}.safetensors", []).append(s)
    return {rel: order_for_alignment(v) for rel, v in sorted(groups.items())}


def geometry(cfg: ModelConfig) -> dict:
    return {
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "num_experts": cfg.num_experts,
        "experts_per_token": cfg.experts_per_token,
        "moe_layers": list(cfg.moe_layers),
        "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "expert_file_bytes": ExpertLayout.for_config(cfg).file_bytes,
        "indexer_layers": list(cfg.indexer_layers),
    }


def manifest_rule(m: dict) -> str | None:
    """The checksum rule a manifest's "blake2b" values follow (None if it names none)."""
    return LEGACY_RULE if m.get("format_version") == 1 else m.get("checksum")


def write_manifest(root: Path, cfg: ModelConfig, files: dict, tensor_names: list[str], *, source: dict, modes: dict) -> None:
    """`files` values: {"size", "blake2b"} computed under the current rule (fileio.rule_name())."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "checksum": rule_name(),
        "variant": cfg.variant,
        "geometry": geometry(cfg),
        "expert_global_modes": {"per_matrix": modes.get(0, 0), "per_row": modes.get(1, 0)},
        "source": source,
        "files": {k: files[k] for k in sorted(files)},
        "tensor_names": tensor_names,
    }
    write_bytes_atomic(root / MANIFEST, json.dumps(manifest, indent=1).encode())


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


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise CheckpointError(f"{dst}: DST is inside SRC {src}; choose an output directory outside the release tree")
    if d in s.parents:
        raise CheckpointError(f"{dst}: DST contains SRC {src}; choose a separate output directory")


def _changed_shards(theirs: dict | None, ours: dict[str, dict]) -> set[str]:
    """Shards whose size, mtime or header differ from the run that recorded `theirs`, or whose
    bytes differ where both runs hashed them (--verify-source). No record: all of them."""
    if not isinstance(theirs, dict):
        return set(ours)
    changed = set()
    for name, rec in ours.items():
        old = theirs.get(name)
        if not isinstance(old, dict) or any(old.get(k) != rec[k] for k in ("size", "mtime_ns", "header")):
            changed.add(name)
        elif "blake2b" in rec and old.get("blake2b") not in (None, rec["blake2b"]):
            changed.add(name)
    return changed


def _prepare_dst(src: Path, dst: Path, fingerprint: str, shards: dict[str, dict]) -> tuple[dict[str, dict], set[str]]:
    """Create or recognise DST; return the already-complete files a previous run recorded and
    the source shards that changed since (files made from those are redone)."""
    state_dir = dst / STATE_DIR
    prior: dict[str, dict] = {}
    changed: set[str] = set()
    rule = rule_name()
    if any(p.name != STATE_DIR for p in dst.iterdir()) or any(p.name != LOCK for p in state_dir.iterdir()):
        state, manifest = state_dir / "state.json", dst / MANIFEST
        theirs, their_rule, their_shards = None, None, None
        try:
            if state.is_file():
                st = json.loads(state.read_text())
                theirs, their_rule = st.get("fingerprint"), st.get("checksum", LEGACY_RULE)  # older runs: no key
                their_shards = st.get("shards")
            elif manifest.is_file():
                m = json.loads(manifest.read_text())
                src_rec = m.get("source") or {}
                theirs, their_rule, their_shards = src_rec.get("fingerprint"), manifest_rule(m), src_rec.get("shards")
                prior = m.get("files") or {}
        except (OSError, ValueError, AttributeError):
            theirs = None
        if theirs != fingerprint:
            raise CheckpointError(
                f"{dst}: DST is not empty and is not a previous partial conversion of {src}; "
                "choose an empty directory (or remove it)"
            )
        journal = state_dir / "journal.jsonl"
        if their_rule != rule:  # digests under another rule: redo those files rather than mix rules
            prior = {}
            journal.unlink(missing_ok=True)
        if journal.is_file():
            for line in journal.read_text(errors="replace").splitlines():
                try:  # a kill -9 can leave the last line torn: skip it, that file is redone
                    e = json.loads(line)
                    prior[e["path"]] = {"size": int(e["size"]), "blake2b": str(e["blake2b"])}
                except (ValueError, KeyError, TypeError):
                    continue
        changed = _changed_shards(their_shards, shards)
        for name, rec in shards.items():  # an unchanged shard keeps the content hash a --verify-source run made
            old = their_shards.get(name) if isinstance(their_shards, dict) else None
            if name not in changed and "blake2b" not in rec and isinstance(old, dict) and isinstance(old.get("blake2b"), str):
                rec["blake2b"] = old["blake2b"]
        remove_stale_tmp(dst)
    state_dir.mkdir(parents=True, exist_ok=True)
    state = {"source": str(src.resolve()), "fingerprint": fingerprint, "checksum": rule, "shards": shards}
    write_bytes_atomic(state_dir / "state.json", json.dumps(state).encode())
    return prior, changed


class _DstLock:
    """An exclusive flock on DST/.convert/lock for the whole run; a second converter is told
    who holds it instead of racing the first one's files."""

    def __init__(self, dst: Path):
        self.path = dst / STATE_DIR / LOCK
        self.fd = -1

    def __enter__(self) -> "_DstLock":
        while True:
            try:
                self.path.parent.mkdir(exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise CheckpointError(f"{self.path.parent}: cannot write DST: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise CheckpointError(f"{self.path.parent}: DST is being converted by {holder}; wait for it or choose another DST") from None
            try:  # the holder may have removed the file between our open and flock: lock the live one
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"streamrt convert pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)  # while still held, so no second run can slip in between
        os.close(self.fd)
        try:
            self.path.parent.rmdir()  # only if nothing else is in it (a refused run leaves nothing)
        except OSError:
            pass


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
        tasks.append(Task(rel, len(hdr) + (offs[-1][1] if offs else 0), fill=_dense_fill(rt, hdr, specs), sources=sources))
    layout = ExpertLayout.for_config(cfg)
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            rel = expert_relpath(layer, e)
            p = expert_prefix(layer, e)
            sources = frozenset(rt.weight_map[f"{p}{w}.weight_{k}"] for w in ("w1", "w2", "w3") for k in ("packed", "scale"))
            tasks.append(Task(rel, layout.file_bytes, _expert_task(rt, dst / rel, layer, e, layout, allow_per_row), sources=sources))
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
) -> dict:
    """Convert; returns a summary dict. Raises CheckpointError / ConfigError on bad input.
    `commit_threads`: committer threads (fsync, rename, journal); default `workers`, 0 commits
    inside the writing job. `verify_source`: hash every source shard's bytes, so a re-run
    also catches a shard rewritten in place with its mtime restored."""
    src, dst = Path(src), Path(dst)
    if workers is not None and workers < 0:
        raise CheckpointError(f"--workers must be >= 0 (0: the default, min(16, cores)), got {workers}")
    if commit_threads is not None and commit_threads < 0:
        raise CheckpointError(f"--commit-threads must be >= 0, got {commit_threads}")
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such release directory")
    _check_paths(src, dst)
    rt = open_release(src)  # config gating + headers + every tensor's dtype/shape
    if rt.skipped and log:
        log(f"convert: skipping {len(rt.skipped)} tensors outside the language model (vision tower, projector): "
            f"{rt.skipped_bytes / 2**20:,.1f} MiB")
    fingerprint = release_fingerprint(src)
    shards = shard_fingerprints(src, content=verify_source)
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a directory")
    created = not dst.exists()
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{dst}: cannot create DST: {e.strerror or e}") from None
    try:
        with _DstLock(dst):
            return _convert_locked(rt, src, dst, fingerprint, shards, workers, allow_per_row, progress, check_resumed, log, commit_threads)
    except CheckpointError:
        if created and not any(dst.iterdir()):
            dst.rmdir()  # refused before writing anything: leave no empty DST behind
        raise


def _convert_locked(rt: ReleaseTree, src: Path, dst: Path, fingerprint: str, shards: dict, workers, allow_per_row, progress,
                    check_resumed, log, commit_threads) -> dict:
    prior, changed = _prepare_dst(src, dst, fingerprint, shards)
    tasks = _plan(rt, dst, allow_per_row)
    if changed and prior:
        stale = {t.rel for t in tasks if t.sources & changed}
        prior = {k: v for k, v in prior.items() if k not in stale}
        if log and stale:
            log(f"convert: {len(changed)} source shard(s) changed since the last run; redoing the {len(stale)} files made from them")
    todo_bytes = sum(t.size for t in tasks if not (dst / t.rel).is_file() or (dst / t.rel).stat().st_size != t.size)
    free = shutil.disk_usage(dst).free
    if free < todo_bytes:
        raise CheckpointError(
            f"{dst}: not enough space: the conversion needs {todo_bytes / 2**30:.2f} GiB more, {free / 2**30:.2f} GiB free"
        )

    workers = workers or min(16, os.cpu_count() or 1)
    # Committers sleep in fsync (no GIL, no CPU): as many as workers keeps as many files
    # flushing at once as the inline path did, while the workers go on producing.
    commit_threads = workers if commit_threads is None else commit_threads
    lock = threading.Lock()
    files: dict[str, dict] = {}
    modes = {0: 0, 1: 0}
    counters = {"written": 0, "skipped": 0, "bytes_written": 0}
    kill_at = int(os.environ.get(KILL_ENV, "0") or 0)
    journal = open(dst / STATE_DIR / "journal.jsonl", "a")

    from tqdm import tqdm

    bar = tqdm(total=sum(t.size for t in tasks), unit="B", unit_scale=True, unit_divisor=1024,
               desc="convert", disable=None if progress is None else not progress)

    def on_bytes(n: int) -> None:
        with lock:
            counters["bytes_written"] += n
            bar.update(n)
            if kill_at and counters["bytes_written"] >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def skip_if_complete(t: Task) -> bool:
        """A previous run's file that still matches its journal entry: count it, keep it."""
        path = dst / t.rel
        if not _still_complete(path, prior.get(t.rel), t.size, check_resumed):
            return False
        mode = -1
        if t.rel.endswith(".nvfp4"):
            with open(path, "rb") as f:
                mode = parse_header(f.read(HEADER_BYTES), ExpertLayout.for_config(rt.config), name=str(path)).global_mode
        with lock:
            files[t.rel] = prior[t.rel]
            counters["skipped"] += 1
            modes[mode] = modes.get(mode, 0) + 1
            bar.update(t.size)
        return True

    errors: list[BaseException] = []  # first failure (of a job or a commit) is the one raised
    stop = threading.Event()  # set on any failure: no new file is started
    slots = threading.Semaphore(COMMIT_BACKLOG * workers)
    committer = ThreadPoolExecutor(commit_threads, thread_name_prefix="srt-commit") if commit_threads else None

    def failed(e: BaseException) -> None:
        with lock:
            errors.append(e)
        stop.set()

    def record(t: Task, size: int, digest: str, mode: int) -> None:
        entry = {"size": size, "blake2b": digest}
        with lock:
            files[t.rel] = entry
            counters["written"] += 1
            modes[mode] = modes.get(mode, 0) + 1
            journal.write(json.dumps({"path": t.rel, **entry}) + "\n")
            journal.flush()

    def commit(t: Task, w: AtomicWriter | RangeWriter, mode: int) -> None:
        try:
            size, digest = w.commit()  # fsync + rename; a CheckpointError names the file
        except BaseException:
            w.abort()  # whatever failed, no temp file stays (a no-op if commit cleaned up)
            raise
        record(t, size, digest, mode)  # only after the rename: a journaled file is complete

    def commit_job(t: Task, w: AtomicWriter | RangeWriter, mode: int) -> None:
        try:
            commit(t, w, mode)
        except BaseException as e:
            failed(e)
        finally:
            slots.release()

    def hand_off(t: Task, w: AtomicWriter | RangeWriter, mode: int) -> None:
        """A finished file: commit it here (commit_threads=0) or queue it for the committers."""
        if committer is None:
            commit(t, w, mode)
            return
        slots.acquire()  # backpressure: the writer waits only when the backlog is full
        try:
            committer.submit(commit_job, t, w, mode)
        except BaseException:
            slots.release()
            w.abort()
            raise

    def guarded(fn: Callable, *args) -> None:
        if stop.is_set():  # something failed: start no new file (running ones still finish)
            return
        try:
            fn(*args)
        except BaseException as e:
            failed(e)
            raise

    def run(t: Task) -> None:
        if not skip_if_complete(t):
            hand_off(t, *t.run(on_bytes))  # type: ignore[misc]

    def write_chunk(t: Task, w: RangeWriter, i: int) -> None:
        if w.write_chunk(i, _chunk_pieces(t, w, i), on_bytes):  # the last chunk in finishes the file
            hand_off(t, w, -1)

    writers: list[RangeWriter] = []  # dense files being written

    def submit(ex: ThreadPoolExecutor, t: Task) -> list:
        if t.fill is None:
            return [ex.submit(guarded, run, t)]
        # Checked here, not in a job, so that all its chunk jobs can be queued at once; dense
        # files are few, and a resumed one's digest check hashes on every core anyway.
        if skip_if_complete(t):
            return []
        w = RangeWriter(dst / t.rel, t.size)
        writers.append(w)
        return [ex.submit(guarded, write_chunk, t, w, i) for i in range(len(w.ranges))]

    t0 = time.perf_counter()
    try:
        try:
            with ThreadPoolExecutor(workers) as ex:
                futs = [f for t in tasks for f in submit(ex, t)]  # dense chunks first, then experts
                wait(futs, return_when=FIRST_EXCEPTION)
                if any(f.done() and f.exception() for f in futs):
                    ex.shutdown(wait=True, cancel_futures=True)
        finally:
            if committer is not None:  # after the writers: nothing submits any more
                committer.shutdown(wait=True)  # never cancel: every handed-off file is committed or aborted
        if errors:
            raise errors[0]
    finally:
        for w in writers:  # both pools have drained: no job touches these any more
            w.abort()  # an unfinished file leaves nothing behind (no-op once committed)
        bar.close()
        journal.close()
    seconds = time.perf_counter() - t0

    for d in {(dst / t.rel).parent for t in tasks}:
        fsync_dir(d)
    source = {"path": str(src.resolve()), "fingerprint": fingerprint, "shards": shards}
    write_manifest(dst, rt.config, files, [s.name for s in rt.specs], source=source, modes=modes)
    fsync_dir(dst)
    shutil.rmtree(dst / STATE_DIR, ignore_errors=True)
    rt.close()
    summary = {
        "src": str(src),
        "dst": str(dst),
        "files": len(files),
        "written": counters["written"],
        "skipped": counters["skipped"],
        "tensors_not_converted": len(rt.skipped),
        "bytes_not_converted": rt.skipped_bytes,
        "bytes_written": counters["bytes_written"],
        "seconds": seconds,
        "expert_files_per_matrix_global": modes.get(0, 0),
        "expert_files_per_row_global": modes.get(1, 0),
        "workers": workers,
        "commit_threads": commit_threads,
    }
    if log:
        log(_summary_line(summary))
    return summary


def _summary_line(s: dict) -> str:
    rate = s["bytes_written"] / s["seconds"] / 1e9 if s["seconds"] > 0 else 0.0
    return (
        f"converted {s['src']} -> {s['dst']}: {s['files']} files ({s['written']} written, {s['skipped']} already complete), "
        f"{s['bytes_written'] / 2**30:.2f} GiB in {s['seconds']:.1f} s ({rate:.2f} GB/s); expert global scales: "
        f"{s['expert_files_per_matrix_global']} per matrix, {s['expert_files_per_row_global']} per row"
    )


__all__ = ["convert", "dense_files", "expert_relpath", "write_manifest", "manifest_rule", "geometry", "MANIFEST",
           "FORMAT_VERSION", "READ_VERSIONS"]
