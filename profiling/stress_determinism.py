"""Determinism stress test: the streaming runtime's logits, bit for bit, under every sweep knob,
with the CPU twin's completion points made late and random.

    python profiling/stress_determinism.py [--model DIR] [--processes 8] [--rounds 2] [--load 1]
                                           [--fresh-trees 0] [--json out.json]

Reference: every prompt run through `DirectExpertProvider` (each expert read straight from its
file, no store, no runtime), teacher-forced over a fixed continuation, one logits hash per
forward. Every point then runs the same forwards through `StreamingRuntime` and every hash is
compared with the reference's. Points move one knob each: host window, device slots, policy,
`--copies sync`, stage depth and stage cap, the pool tier (with few buffers and reader threads),
`--evict sync`, the prefill chunk, a batch of two, two forwards in lockstep (the server's
prefill beside its decode step), and operand alignment (`misalign`: every dense weight, and
every device slot an expert is computed from, moved off the 64-byte boundary; a BLAS path
that depended on alignment would change the hash).

What makes rare interleavings common (all from this script; the runtime has no hook for it):
  async     `LateCpuDevice`: host-to-device copies run on a copy-stream thread, FIFO, each after
            a random delay; copy events complete only when the copies before them ran; compute
            events complete late; a copy's destination is poisoned (NaN bytes) when it is queued,
            so a slot read before its copy ran, or refilled under a reader, changes the hash; a
            copy from a host mapping already released, or from a pool buffer being re-read, is
            counted as a violation
  delays    random sleeps where mappings open and disk reads complete (pool buffers are
            poisoned before each read)
  evict     the tree's pages dropped from the page cache before each run (posix_fadvise)
  load      busy processes beside the workers
  fresh     `--fresh-trees N`: N times, synthesise and convert a new tree and run `streamrt run`
            on it three times at once (the first runs after a tree is written), hashes compared

Exit 1 on any differing hash or violation. The CI form is tests/test_determinism_stress.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[256 + (7 * i + 3 * j) % 200 for i in range(48)] for j in range(2)]  # equal lengths: a batch of two
CONT = [44, 32, 101, 108, 111]  # forced continuation: every run decodes the same tokens
WS = 32  # tiny-k3.1-pro: 8 MoE layers x top-4 experts per token


def points() -> list[dict]:
    """One knob moved at a time from the defaults (the sweep's knobs and the server's)."""
    pts = [{}]
    pts += [{"window": w} for w in (2, WS // 2, WS, 65536)]
    pts += [{"gpu_experts": m, "gpu_policy": p} for m in (4, 8, 16, 64) for p in ("lru", "lfu")]
    pts += [{"copies": "sync"}, {"copies": "sync", "window": 2, "gpu_experts": 4}]
    pts += [{"stage_depth": d, "gpu_experts": 12} for d in (1, 4)] + [{"stage_max": 2, "gpu_experts": 12}]
    pts += [{"host_tier": "pool", "host_mem": n, "read_threads": t, "gpu_experts": 8}
            for n, t in ((4, 1), (6, 4), (64, 16))]
    pts += [{"evict": "sync", "window": 2}, {"prefetch": "discard"}, {"preparse": True, "window": 8}]
    pts += [{"_chunk": 64}, {"_chunk": 128, "gpu_experts": 8}]
    pts += [{"_batch": 2, "gpu_experts": 16}, {"_lockstep": True, "gpu_experts": 16}]
    pts += [{"_misalign": 16, "gpu_experts": 16}, {"_misalign": 4, "window": 2, "gpu_experts": 4}]
    return pts


def label(p: dict) -> str:
    return ",".join(f"{k.lstrip('_')}={v}" for k, v in p.items()) or "defaults"


# ---- the late CPU twin --------------------------------------------------------------------


class LateEvent:
    """Complete once the stream has run its jobs up to `seq` (copy) or once `due` passed (compute)."""

    __slots__ = ("stream", "seq", "due")

    def __init__(self, stream=None, seq: int = 0, due: float = 0.0):
        self.stream, self.seq, self.due = stream, seq, due

    def query(self) -> bool:
        if self.stream is not None:
            return self.stream.done >= self.seq
        return time.monotonic() >= self.due

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.wait(self.seq)
        else:
            time.sleep(max(0.0, self.due - time.monotonic()))


class CopyStream:
    """One thread running queued jobs in order, each after a random delay."""

    def __init__(self, rng: random.Random, max_delay: float):
        self.rng, self.max_delay = rng, max_delay
        self.jobs: deque = deque()
        self.queued = self.done = 0
        self.cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def put(self, fn) -> int:
        with self.cv:
            self.jobs.append(fn)
            self.queued += 1
            self.cv.notify_all()
            return self.queued

    def wait(self, seq: int) -> None:
        with self.cv:
            while self.done < seq:
                self.cv.wait()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.jobs:
                    self.cv.wait()
                fn = self.jobs.popleft()
            if self.rng.random() < 0.5:
                time.sleep(self.rng.uniform(0, self.max_delay))
            fn()
            with self.cv:
                self.done += 1
                self.cv.notify_all()


def late_device(rng: random.Random, max_delay: float, violations: list):
    """A CpuDevice whose copies and events behave as a GPU's do, only later (see the module doc)."""
    from streamrt.runtime.streams import CpuDevice

    released = RELEASED

    class LateCpuDevice(CpuDevice):
        def __init__(self):
            super().__init__()
            self.stream = CopyStream(rng, max_delay)

        def record_copy_event(self):
            return LateEvent(self.stream, self.stream.queued)

        def record_compute_event(self):
            return LateEvent(due=time.monotonic() + (rng.uniform(0, max_delay) if rng.random() < 0.3 else 0.0))

        def compute_wait(self, event) -> None:
            event.synchronize()  # the compute that follows runs on this thread

        def copy_wait(self, event) -> None:
            self.stream.put(event.synchronize)

        def synchronize(self) -> None:
            self.full_synchronizes += 1
            self.stream.wait(self.stream.queued)

        def copy_h2d(self, dst, src, *, pinned: bool, transient: bool = False) -> None:
            src_ptr = src.data_ptr()
            dst.view(torch.uint8).fill_(0xFF)  # NaN bytes until the copy runs

            def copy():
                if src_ptr in released:
                    violations.append(f"copy from a released host mapping at {src_ptr:#x}")
                if src_ptr in READING:
                    violations.append(f"copy from a pool buffer being read at {src_ptr:#x}")
                dst.copy_(src)

            self.stream.put(copy)

    return LateCpuDevice()


RELEASED: set[int] = set()  # data_ptr of host mappings released (cleared when mapped again)
READING: set[int] = set()  # data_ptr of pool buffers a reader thread is writing now


def install_delays(rng: random.Random, max_delay: float) -> None:
    """Random sleeps where mappings open and disk reads complete; poison pool buffers before each
    read; note released mappings. Patched on the classes, in this process only."""
    from streamrt.store import disk_reader, host_tier

    lock = threading.Lock()

    def jitter():
        with lock:
            d = rng.uniform(0, max_delay) if rng.random() < 0.5 else 0.0
        time.sleep(d)

    open_mapping = host_tier.HostTier.open_mapping

    def late_open(self, key):
        jitter()
        m = open_mapping(self, key)
        RELEASED.discard(m.data.data_ptr())
        return m

    release = host_tier.HostMapping.release

    def noted_release(self):
        if self.data is not None:
            RELEASED.add(self.data.data_ptr())
        release(self)

    read_into = disk_reader.FileReader.read_into

    def late_read(self, path, buf, nbytes):
        arr = torch.frombuffer(buf, dtype=torch.uint8)
        ptr = arr.data_ptr()
        READING.add(ptr)
        try:
            arr[:nbytes].fill_(0xFF)
            jitter()
            return read_into(self, path, buf, nbytes)
        finally:
            READING.discard(ptr)

    host_tier.HostTier.open_mapping = late_open
    host_tier.HostMapping.release = noted_release
    disk_reader.FileReader.read_into = late_read


def drop_page_cache(root: Path) -> None:
    os.sync()
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---- one point: the forwards, their hashes ---------------------------------------------------


def digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.blake2b(t.float().contiguous().numpy().tobytes(), digest_size=8).hexdigest()


def forwards(model, runner, prompts: list[list[int]], chunk: int | None, lockstep_two: bool) -> list[list[str]]:
    """Per prompt: the hashes of its prefill logits and of each teacher-forced decode step."""
    from streamrt.model import ModelCache
    from streamrt.model.lockstep import lockstep

    out: list[list[str]] = [[] for _ in prompts]
    with torch.no_grad():
        if lockstep_two:  # prompt 0 prefilled alone, then prompt 1's prefill beside prompt 0's first step
            c0, c1 = model.new_cache(1), model.new_cache(1)
            out[0].append(digest(runner(model.forward_steps(torch.tensor([prompts[0]]), c0, last_only=True,
                                                            prefill_chunk=chunk), 0)[0, -1]))
            for i, t in enumerate(CONT):
                gens = [model.forward_steps(torch.tensor([[t]]), c0)]
                gens.append(model.forward_steps(torch.tensor([prompts[1]]), c1, last_only=True, prefill_chunk=chunk)
                            if i == 0 else model.forward_steps(torch.tensor([[CONT[i - 1]]]), c1))
                a, b = runner(lockstep(gens), 1)
                out[0].append(digest(a[0, -1]))
                out[1].append(digest(b[0, -1]))
            return out
        caches = []
        for r, p in enumerate(prompts):  # each prompt prefilled on its own, as generate() does
            caches.append(model.new_cache(1))
            logits = runner(model.forward_steps(torch.tensor([p]), caches[-1], last_only=True, prefill_chunk=chunk), 0)
            out[r].append(digest(logits[0, -1]))
        cache = ModelCache.stack(caches) if len(caches) > 1 else caches[0]
        for t in CONT:
            logits = runner(model.forward_steps(torch.tensor([[t]] * len(prompts)), cache), len(prompts))
            for r in range(len(prompts)):
                out[r].append(digest(logits[r, -1]))
    return out


def reference(tree, model) -> list[list[str]]:
    """Each prompt alone through the direct provider (no store, no runtime)."""
    from streamrt.loader import DirectExpertProvider
    from streamrt.model import run_sync

    provider = DirectExpertProvider(tree)
    return [forwards(model, lambda g, _: run_sync(g, provider), [p], None, False)[0] for p in PROMPTS]


@contextmanager
def misaligned(model, device, offset: int):
    """The model's weights, and the device's slot slabs and buffers, `offset` bytes past a 64-byte
    boundary for the duration; yields the device (a plain CpuDevice when None was given)."""
    from probe_alignment import placed
    from streamrt.runtime.streams import CpuDevice

    device = device or CpuDevice()
    device.alloc_slab = lambda slots, n: placed(torch.empty(slots * n, dtype=torch.uint8), offset).view(slots, n)
    device.alloc_buffer = lambda n: placed(torch.empty(n, dtype=torch.uint8), offset)
    saved = [(t, t.data) for t in list(model.parameters()) + list(model.buffers())]
    for t, data in saved:
        t.data = placed(data.contiguous(), offset)
    try:
        yield device
    finally:
        for t, data in saved:
            t.data = data


def run_point(tree, model, point: dict, *, device=None) -> list[list[str]]:
    """The point's forwards through a StreamingRuntime: hashes per prompt (both prompts)."""
    if point.get("_misalign"):
        with misaligned(model, device, point["_misalign"]) as dev:
            return _run_point(tree, model, {k: v for k, v in point.items() if k != "_misalign"}, device=dev)
    return _run_point(tree, model, point, device=device)


def _run_point(tree, model, point: dict, *, device=None) -> list[list[str]]:
    from streamrt.runtime.options import RuntimeOptions
    from streamrt.runtime.scheduler import StreamingRuntime

    kw = {k: v for k, v in point.items() if not k.startswith("_")}
    if "host_mem" in kw:
        kw["host_mem"] *= tree.layout.file_bytes
    batch = 2 if point.get("_batch") or point.get("_lockstep") else 1
    opts = RuntimeOptions(device="cpu", **kw)
    with StreamingRuntime(tree, model, opts, device=device, batch=batch, workers=2) as rt:
        def runner(gen, tokens):
            return rt.run(gen, tokens=tokens)

        if point.get("_lockstep"):
            return forwards(model, runner, PROMPTS, point.get("_chunk"), True)
        if batch == 2:
            return forwards(model, runner, PROMPTS, point.get("_chunk"), False)
        return [forwards(model, runner, [p], point.get("_chunk"), False)[0] for p in PROMPTS]


def plant(bug: str) -> None:
    """A known bug put back (the stress test's own check: it must see it). no-wait: compute
    takes a slot without waiting for its copy event; no-retire: an evicted mapping is released
    without waiting for the copies queued from it; align-path: a product whose bits depend on its
    weight's alignment (as a BLAS with an aligned fast path may), which only the misalign points see."""
    from streamrt.runtime.streamed import StreamedExperts
    from streamrt.store.retire import RetireQueue

    if bug == "no-wait":
        def take(self, e):
            self._events.pop(e, None)
            return self._views[e]

        StreamedExperts.take = take
    elif bug == "no-retire":
        def release(self):
            n = len(self._fifo)
            while self._fifo:
                self._fifo.popleft()[1].release()
            self.released += n
            return n

        RetireQueue.release = release
    elif bug == "align-path":
        from streamrt.backends.torch_backend import TorchBackend

        product = TorchBackend._product

        def by_address(self, x, w):
            y = product(self, x, w)
            return y * (1 + (w.data_ptr() % 64) * 2**-22)  # one rounding per address class

        TorchBackend._product = by_address
    else:
        raise SystemExit(f"--plant: expected no-wait, no-retire or align-path, got {bug!r}")


def worker(args) -> int:
    """One process: every point `rounds` times (shuffled), its hashes as JSON lines on stdout."""
    from streamrt.checkpoint.reader import open_tree
    from streamrt.loader import load_model

    rng = random.Random(args.seed)
    violations: list[str] = []
    if args.delays:
        install_delays(rng, args.max_delay)
    if args.plant:
        plant(args.plant)
    tree = open_tree(Path(args.model))
    model = load_model(tree, "cpu", dtype=None)
    pts = points()
    chosen = [int(i) for i in args.points.split(",")] if args.points else range(len(pts))
    order = [i for _ in range(args.rounds) for i in chosen]
    rng.shuffle(order)
    for i in order:
        RELEASED.clear()  # addresses of the last point's mappings may come back as this point's buffers
        if args.evict:
            drop_page_cache(tree.root)
        late = args.late and (bool(args.plant) or rng.random() < 0.75)
        device = late_device(rng, args.max_delay, violations) if late else None
        try:
            hashes = run_point(tree, model, pts[i], device=device)
            err = None
        except Exception as e:  # a failure is reported, not a crash of the whole worker
            hashes, err = None, f"{type(e).__name__}: {e}"
        print(json.dumps({"point": i, "label": label(pts[i]), "late": late, "hashes": hashes, "error": err,
                          "violations": violations[:5]}), flush=True)
        violations.clear()
    return 0


# ---- the parent: reference, workers, load, fresh trees --------------------------------------------


def burn(seconds: float) -> None:
    """A busy process beside the workers (concurrent load)."""
    end = time.monotonic() + seconds
    a = torch.randn(256, 256)
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def compare(ref: list[list[str]], lines: list[dict]) -> tuple[int, list[str]]:
    """(hash comparisons made, what differed or failed)."""
    n, bad = 0, []
    for r in lines:
        tag = f"point {r['point']} ({r['label']}{', late' if r['late'] else ''})"
        if r["error"]:
            bad.append(f"{tag}: {r['error']}")
            continue
        bad += [f"{tag}: {v}" for v in r["violations"]]
        for p, (got, want) in enumerate(zip(r["hashes"], ref)):
            for s, (g, w) in enumerate(zip(got, want)):
                n += 1
                if g != w:
                    bad.append(f"{tag}: prompt {p} forward {s}: {g} != reference {w}")
    return n, bad


def fresh_trees(count: int, env: dict, evict: bool) -> tuple[int, list[str]]:
    """`synth` + `convert` into a new directory, then three `streamrt run`s at once on it, right away
    (the first runs after the tree was written; with `evict`, the pages dropped first)."""
    n, bad = 0, []
    cmd = [sys.executable, "-m", "streamrt"]
    for i in range(count):
        with tempfile.TemporaryDirectory(prefix="stress-fresh-") as d:
            subprocess.run([*cmd, "synth", "--config", "tiny-k3.1-pro", "--out", f"{d}/rel"], env=env, check=True,
                           capture_output=True)
            subprocess.run([*cmd, "convert", f"{d}/rel", f"{d}/conv"], env=env, check=True, capture_output=True)
            if evict:
                drop_page_cache(Path(d))
            run = [*cmd, "run", "--model", f"{d}/conv", "--prompt", "What's the weather in Paris?", "--greedy",
                   "--max-new-tokens", "8", "--json", "--window", "65536", "--gpu-experts", "16"]
            procs = [subprocess.Popen(run, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                     for _ in range(3)]
            hashes = []
            for p in procs:
                out, _ = p.communicate()
                try:
                    hashes.append(json.loads(out.strip().splitlines()[-1])["stats"]["logits_hash"])
                except (ValueError, IndexError, KeyError):
                    hashes.append(f"failed (exit {p.returncode})")
            n += len(hashes) - 1
            if len(set(hashes)) != 1:
                bad.append(f"fresh tree {i}: logits_hash {hashes}")
    return n, bad


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", metavar="DIR", help="a converted tiny-k3.1-pro tree (default: synthesised)")
    ap.add_argument("--processes", type=int, default=8, help="fresh worker processes (default 8)")
    ap.add_argument("--parallel", type=int, default=2, help="workers running at once (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="every point this many times per worker (default 2)")
    ap.add_argument("--load", type=int, default=1, help="busy processes beside the workers (default 1)")
    ap.add_argument("--fresh-trees", type=int, default=0, help="new trees, each run three times at once (default 0)")
    ap.add_argument("--max-delay", type=float, default=0.003, help="longest injected delay, seconds (default 0.003)")
    ap.add_argument("--no-late", dest="late", action="store_false", help="plain CpuDevice (no late copies/events)")
    ap.add_argument("--no-delays", dest="delays", action="store_false", help="no sleeps at mapping and read completion")
    ap.add_argument("--no-evict", dest="evict", action="store_false", help="keep the page cache between runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--points", metavar="I,J", help="only these points (indices into points())")
    ap.add_argument("--plant", choices=("no-wait", "no-retire", "align-path"), help="put a known bug back (self-check)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("processes", "parallel", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.load < 0 or args.fresh_trees < 0 or args.max_delay < 0:
        ap.error("--load, --fresh-trees and --max-delay must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stress-") as tmp:
        from streamrt.checkpoint.reader import open_tree
        from streamrt.loader import load_model

        if args.model is None:
            from streamrt.checkpoint.synth import synth

            args.model = f"{tmp}/tiny"
            synth("tiny-k3.1-pro", Path(args.model), fmt="streamrt", seed=0, workers=1, progress=False)
        tree = open_tree(Path(args.model))
        if args.plant:  # the reference runs it too: only what differs from the reference's path shows
            plant(args.plant)
        ref = reference(tree, load_model(tree, "cpu", dtype=None))
        flags = [f"--no-{k}" for k in ("late", "delays", "evict") if not getattr(args, k)]
        flags += [f"--{k}={getattr(args, k)}" for k in ("points", "plant") if getattr(args, k)]
        base = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--rounds",
                str(args.rounds), "--max-delay", str(args.max_delay), *flags]
        burn_cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'profiling')!r}); "
                    "import stress_determinism as s; s.burn(24 * 3600)"]
        burners = [subprocess.Popen(burn_cmd, env=env) for _ in range(args.load)]
        lines: list[dict] = []
        try:
            pending = list(range(args.processes))
            while pending:
                batch, pending = pending[:args.parallel], pending[args.parallel:]
                procs = [subprocess.Popen([*base, "--seed", str(args.seed * 10007 + k)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in batch]
                for k, p in zip(batch, procs):
                    out, err = p.communicate()
                    got = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
                    lines += got
                    if p.returncode:
                        lines.append({"point": -1, "label": f"worker {k}", "late": False, "hashes": None,
                                      "violations": [], "error": f"exit {p.returncode}: {err.strip()[-300:]}"})
            fresh_n, fresh_bad = fresh_trees(args.fresh_trees, env, args.evict)
        finally:
            for b in burners:
                b.kill()
                b.wait()
    n, bad = compare(ref, lines)
    report = {"comparisons": n + fresh_n, "runtime_comparisons": n, "fresh_tree_comparisons": fresh_n,
              "differing": len(bad) + len(fresh_bad), "problems": (bad + fresh_bad)[:50], "runs": len(lines),
              "points": len(args.points.split(",")) if args.points else len(points()),
              "seconds": time.monotonic() - t0, "reference": ref,
              "settings": {k: getattr(args, k) for k in ("processes", "rounds", "load", "fresh_trees", "max_delay",
                                                         "late", "delays", "evict", "seed")}}
    print(f"stress: {report['comparisons']} hash comparisons ({len(lines)} runs over {report['points']} points in "
          f"{args.processes} processes, {fresh_n} on fresh trees), {report['differing']} differing or failed, "
          f"{report['seconds']:.0f} s")
    for b in report["problems"][:20]:
        print("  " + b)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["differing"] else 0


if __name__ == "__main__":
    sys.exit(main())
