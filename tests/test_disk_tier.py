"""The disk tier on the CPU twin: the buffer pool under --host-mem, its scan-resistant
policy, reads in priority order on reader threads, faults injected through constructors
(blocked, short, EIO, truncated reads), the O_DIRECT fallback on tmpfs, the auto tier choice,
the cuFile fallback decision, and logits bit-identical between the pool and mapped tiers."""

import argparse
import asyncio
import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth
from streamrt.errors import CheckpointError, StreamrtError
from streamrt.model import run_sync
from streamrt.loader import DirectExpertProvider, load_model
from streamrt.runtime.options import RuntimeOptions, add_runtime_flags
from streamrt.runtime.scheduler import StreamingRuntime
from streamrt.runtime.stats import DISK_KEYS, PAYLOAD_KEYS, PREFILL_KEYS, STAGING_KEYS, RuntimeStats
from streamrt.runtime.streams import CpuDevice
from streamrt.store.disk_reader import DiskReader, FileReader
from streamrt.store.gds import choose_gds
from streamrt.store.host_tier import choose_host_tier
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import LRU
from streamrt.store.pool import PoolTier, expected_disk_bytes_per_token
from streamrt.trace import Tracer

FB = 8192  # fake expert file bytes (4096-aligned, as the format is)
PROMPT, CONT = [256, 72, 101, 108], [44, 32, 101]


# ---- the pool on its own -----------------------------------------------------------------


def pool_of(budget, policy=None):
    return PoolTier(lambda k: f"/nowhere/{k.layer}_{k.expert}", FB, budget, device=CpuDevice(), stats=RuntimeStats(),
                    policy=policy)


def fill(pool, key):
    """One reference as the scheduler makes it: lookup, else take a buffer and complete the read."""
    if pool.lookup(key) is not None:
        return True
    e = pool.take(key)
    assert e is not None
    e.data.fill_(key.expert % 251)
    pool.complete(e, direct=True, cached=0)
    return False


def test_pool_accounting_never_exceeds_host_mem():
    budget = 5 * FB + 4095  # not a whole number of files: the rest is never allocated
    pool = pool_of(budget)
    assert pool.capacity == 5 and pool.bytes_allocated == 5 * FB <= budget
    assert pool.arena.numel() == pool.bytes_allocated
    g = torch.Generator().manual_seed(0)
    for step in range(400):
        fill(pool, ExpertKey(0, int(torch.randint(0, 17, (1,), generator=g))))
        pool.check()
        assert len(pool) <= pool.capacity and pool.bytes_allocated <= budget
    with pytest.raises(StreamrtError, match="holds no"):
        pool_of(FB - 1)


def test_busy_buffers_are_never_taken():
    pool = pool_of(2 * FB)
    a = pool.take(ExpertKey(0, 0))  # reading
    b = pool.take(ExpertKey(0, 1))
    assert pool.take(ExpertKey(0, 2)) is None  # both reading: nothing to take
    pool.complete(a, direct=True, cached=0)
    a.pins = 1  # a waiter still has to copy from it
    assert pool.take(ExpertKey(0, 2)) is None

    class Pending:
        def query(self):
            return False

        def synchronize(self):
            pass

    a.pins = 0
    a.last_copy = Pending()  # its H2D copy has not executed
    assert pool.take(ExpertKey(0, 2)) is None
    a.last_copy = None
    c = pool.take(ExpertKey(0, 2))
    assert c is not None and c.index == a.index and not a.live
    pool.fail(b)
    pool.check()
    assert ExpertKey(0, 1) not in pool


def cyclic(keys_per_token, tokens):
    return [ExpertKey(l, e) for _ in range(tokens) for l in range(keys_per_token // 4) for e in range(4)]


def test_pool_is_scan_resistant():
    trace = cyclic(64, 12)  # 64 distinct experts in layer order, every token the same
    hits = []
    for cap in (8, 16, 32, 48):
        pool = pool_of(cap * FB)
        hits.append(sum(fill(pool, k) for k in trace))
        pool.check()
    assert hits[0] > 0 and hits == sorted(hits) and len(set(hits)) == len(hits), hits
    # roughly (capacity - 1) / working set after the first token
    assert hits[2] >= 0.9 * (32 - 1) / 64 * 11 * 64
    lru = pool_of(48 * FB, policy=LRU())
    assert sum(fill(lru, k) for k in trace) == 0  # what the pool's policy avoids


def test_pool_keeps_hot_experts_under_skew():
    g = torch.Generator().manual_seed(1)
    trace = []
    for _ in range(300):  # experts 0-3 in every token, the rest uniform over 60
        trace += [ExpertKey(0, e) for e in range(4)]
        trace += [ExpertKey(0, 4 + int(x)) for x in torch.randint(0, 60, (4,), generator=g)]
    pool = pool_of(8 * FB)
    for k in trace:
        fill(pool, k)
    assert all(ExpertKey(0, e) in pool for e in range(4))


def test_expected_disk_bytes_per_token():
    from streamrt.config import load_config

    cfg = load_config("tiny-k3.1-pro")
    per = cfg.working_set_experts * FB
    assert expected_disk_bytes_per_token(cfg, FB, cfg.expert_files * FB) == 0
    assert expected_disk_bytes_per_token(cfg, FB, cfg.expert_files * FB // 4) == int(per * 0.75)


# ---- reads: threads, priorities, faults ---------------------------------------------------


def test_reader_takes_misses_before_guesses_and_cancels():
    gate, order = threading.Event(), []
    r = DiskReader(1)
    try:
        done = threading.Semaphore(0)
        r.submit((0, 0), lambda: gate.wait(), lambda *_: done.release())  # occupies the one thread
        time.sleep(0.05)
        jobs = {n: r.submit(p, lambda n=n: order.append(n), lambda *_: done.release())
                for n, p in (("guess-b", (1, 1, 1)), ("guess-a", (1, 0, 2)), ("miss", (0, 3)), ("dropped", (1, 2, 4)))}
        jobs["guess-b"].raise_priority((0, 4))  # a guess that turned out routed
        assert jobs["dropped"].cancel() and r.queued() == 3
        gate.set()
        for _ in range(4):
            assert done.acquire(timeout=5)
        assert order == ["miss", "guess-b", "guess-a"]
        assert not jobs["miss"].cancel()  # already ran
    finally:
        gate.set()
        r.close()


def write_file(path: Path, nbytes=FB, byte=7):
    path.write_bytes(bytes([byte]) * nbytes)
    return path


def test_file_reader_reads_whole_file(tmp_path):
    p = write_file(tmp_path / "e.bin")
    buf = bytearray(FB)
    res = FileReader(notice=lambda m: None).read_into(p, memoryview(buf), FB)
    assert res.nbytes == FB and bytes(buf) == bytes([7]) * FB


@pytest.mark.parametrize("fault, match", [
    ("short", "short read"), ("eio", "read failed .*Input/output error"), ("truncated", "bytes, expected"),
])
def test_file_reader_faults_are_one_line_naming_the_file(tmp_path, fault, match):
    p = write_file(tmp_path / "E0003.nvfp4")
    if fault == "truncated":
        os.truncate(p, FB - 4096)
    calls = []

    def preadv(fd, bufs, off):
        calls.append(off)
        if fault == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if fault == "short":
            return 4096 if len(calls) == 1 else 0  # then end of file: the file shrank under us
        return os.preadv(fd, bufs, off)

    fr = FileReader(direct=False, preadv=preadv)
    with pytest.raises(CheckpointError, match=match) as ei:
        fr.read_into(p, memoryview(bytearray(FB)), FB)
    msg = str(ei.value)
    assert str(p) in msg and "\n" not in msg


@pytest.mark.parametrize("where", ["open", "read", "tmpfs"])
def test_odirect_unsupported_falls_back_with_one_note(tmp_path, where):
    """Older tmpfs (before Linux 6.6) refuses O_DIRECT at open; some filesystems at the first
    read. Both are injected; `tmpfs` also tries the real /dev/shm (newer kernels accept it)."""
    import mmap

    base = Path("/dev/shm") if where == "tmpfs" else tmp_path
    if where == "tmpfs" and not (base.is_dir() and os.access(base, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    p = write_file(base / f"streamrt-test-{os.getpid()}.bin", byte=9)

    def open_fn(path, flags):
        if where == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return os.open(path, flags)

    def preadv(fd, bufs, off):
        if where == "read":
            flags = open(f"/proc/self/fdinfo/{fd}").read().split("flags:")[1].split()[0]
            if os.O_DIRECT & int(flags, 8):
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return os.preadv(fd, bufs, off)

    try:
        notes = []
        fr = FileReader(notice=notes.append, open_fn=open_fn, preadv=preadv)
        buf = mmap.mmap(-1, FB)  # page-aligned, as pool buffers are
        for _ in range(2):
            res = fr.read_into(p, memoryview(buf), FB)
            assert res.nbytes == FB and buf[:] == bytes([9]) * FB
        if where != "tmpfs" or fr.mode == "buffered":
            assert fr.mode == "buffered" and not res.direct
            assert len(notes) == 1 and "O_DIRECT unsupported" in notes[0]
            assert str(p) in notes[0] and "\n" not in notes[0]
        else:
            assert res.direct and not notes  # this kernel's tmpfs takes O_DIRECT (Linux >= 6.6)
    finally:
        p.unlink()


# ---- the runtime on a tiny tree ------------------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-disk") / "tree"
    synth("tiny-k3.1-pro", root, fmt="streamrt", seed=0, workers=1, progress=False)
    return open_tree(root)


@pytest.fixture(scope="module")
def model(tree):
    return load_model(tree, "cpu", dtype=None)


def decode(model, runner):
    cache = model.new_cache(1)
    with torch.no_grad():
        out = [runner(model.forward_steps(torch.tensor([PROMPT]), cache, last_only=True), 0)]
        for t in CONT:
            out.append(runner(model.forward_steps(torch.tensor([[t]]), cache), 1))
    return out


def pool_runtime(tree, model=None, buffers=40, file_reader=None, tracer=None, **kw):
    opts = RuntimeOptions(device="cpu", host_tier="pool", host_mem=buffers * tree.layout.file_bytes, read_threads=4,
                          **kw)
    return StreamingRuntime(tree, model, opts, workers=2, file_reader=file_reader, tracer=tracer)


def test_pool_logits_bit_identical_to_mapped(tree, model):
    ref = decode(model, lambda g, _: run_sync(g, DirectExpertProvider(tree)))
    results = {}
    for name, opts in (("mapped", dict(host_tier="mapped")),
                       ("pool", dict(host_tier="pool", host_mem=40 * tree.layout.file_bytes, read_threads=3)),
                       ("pool-1", dict(host_tier="pool", host_mem=tree.layout.file_bytes, read_threads=1,
                                       gpu_experts=12))):
        slots = opts.pop("gpu_experts", 48)
        with StreamingRuntime(tree, model, RuntimeOptions(device="cpu", gpu_experts=slots, **opts), workers=2) as rt:
            results[name] = (decode(model, lambda g, t: rt.run(g, tokens=t)), rt.payload(), rt.host_tier_line)
            if rt.host.kind == "pool":
                rt.host.pool.check()
    for name, (logits, p, line) in results.items():
        assert all(torch.equal(a, b) for a, b in zip(logits, ref)), name
        assert tuple(p) == PAYLOAD_KEYS + STAGING_KEYS + DISK_KEYS + PREFILL_KEYS
        assert p["host_tier"] == name.split("-")[0]
        assert line.startswith(f"host tier {p['host_tier']}") and "\n" not in line
    p = results["pool"][1]
    assert p["pool_misses"] > 0 and p["pool_hits"] > 0 and p["bytes_from_disk"] + p["bytes_from_page_cache"] > 0
    assert p["readahead_reads"] > 0  # the next layer's guesses were read into the pool


class BlockingReader(FileReader):
    """Reads wait until released: what a slow drive looks like to the scheduler."""

    def __init__(self):
        super().__init__(notice=lambda m: None)
        self.gate, self.started = threading.Event(), threading.Event()

    def read_into(self, path, buf, nbytes):
        self.started.set()
        assert self.gate.wait(10)
        return super().read_into(path, buf, nbytes)


def test_expert_being_read_is_never_handed_out(tree):
    fr = BlockingReader()
    rt = pool_runtime(tree, file_reader=fr)
    try:
        key = ExpertKey(tree.config.moe_layers[0], 5)
        task = rt.loop.create_task(rt.host.entry(key))
        rt.loop.run_until_complete(asyncio.sleep(0.05))
        assert fr.started.is_set() and not task.done()
        assert key not in rt.host and rt.host.pool.lookup(key) is None and rt.host.pool.peek(key) is None
        assert rt.host.pool.reading(key) is not None
        fr.gate.set()
        e = rt.loop.run_until_complete(task)
        assert e.live and key in rt.host
        assert torch.equal(e.data, torch.frombuffer(bytearray(tree.expert_path(key.layer, key.expert).read_bytes()),
                                                    dtype=torch.uint8))
        rt.host.pool.check()
    finally:
        fr.gate.set()
        rt.close()


@pytest.mark.parametrize("fault", ["eio", "short", "truncated"])
def test_read_fault_is_one_line_and_pool_stays_consistent(tree, fault, tmp_path):
    key = ExpertKey(tree.config.moe_layers[1], 3)
    bad = tmp_path / "E0003.nvfp4"  # a copy of the expert file the faults hit
    bad.write_bytes(tree.expert_path(key.layer, key.expert).read_bytes())
    if fault == "truncated":
        os.truncate(bad, tree.layout.file_bytes - 4096)

    def preadv(fd, bufs, off):
        if os.readlink(f"/proc/self/fd/{fd}") == str(bad):
            if fault == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            if fault == "short":
                return 0 if off else 4096  # a first partial read, then end of file
        return os.preadv(fd, bufs, off)

    rt = pool_runtime(tree, file_reader=FileReader(direct=False, preadv=preadv), buffers=4)
    path_of = rt.host.pool.path_of
    rt.host.pool.path_of = lambda k: bad if k == key else path_of(k)
    try:
        with pytest.raises(CheckpointError) as ei:
            rt.loop.run_until_complete(rt.host.entry(key))
        msg = str(ei.value)
        assert str(bad) in msg and "\n" not in msg
        assert {"eio": "Input/output error", "short": "short read", "truncated": "bytes, expected"}[fault] in msg
        rt.host.pool.check()
        pool = rt.host.pool
        assert key not in rt.host and pool.reading(key) is None and len(pool._free) == pool.capacity
        good = ExpertKey(key.layer, 4)  # the pool still works
        assert rt.loop.run_until_complete(rt.host.entry(good)).live
        rt.host.pool.check()
    finally:
        rt.close()


def test_disk_reads_have_their_own_trace_track(tree, model):
    tracer = Tracer(event_factory=None)
    with pool_runtime(tree, model, tracer=tracer) as rt:
        decode(model, lambda g, t: rt.run(g, tokens=t))
    reads = [e for e in tracer.events if e.get("cat") == "disk" and e["ph"] == "X"]
    assert reads and all(e["name"] == "read" and e["args"]["bytes"] == tree.layout.file_bytes for e in reads)


# ---- choices: tier, threads, cuFile ---------------------------------------------------------


def test_auto_tier_choice():
    G = 1 << 30
    assert choose_host_tier("auto", 38 * G, 64 * G, None)[0] == "mapped"
    kind, budget, why = choose_host_tier("auto", 38 * G, 6 * G, None)
    assert (kind, budget) == ("pool", 6 * G) and "38.0 GiB of experts > --host-mem 6.0 GiB" in why
    kind, budget, _ = choose_host_tier("auto", 38 * G, None, 14 * G)  # no --host-mem: half of what is available
    assert (kind, budget) == ("pool", 7 * G)
    assert choose_host_tier("auto", 38 * G, None, 64 * G)[0] == "mapped"
    assert choose_host_tier("pool", 38 * G, 64 * G, None)[:2] == ("pool", 38 * G)  # never more than the tree
    assert choose_host_tier("mapped", 38 * G, 6 * G, None)[0] == "mapped"
    with pytest.raises(StreamrtError, match="--host-tier: expected auto, mapped or pool"):
        RuntimeOptions(host_tier="disk")  # the flag is checked once, before any tier is chosen


def test_flags():
    ap = add_runtime_flags(argparse.ArgumentParser())
    o = RuntimeOptions.from_args(ap.parse_args(["--host-tier", "pool", "--read-threads", "auto", "--gds", "off"]))
    assert (o.host_tier, o.read_threads, o.gds) == ("pool", -1, "off")
    assert RuntimeOptions.from_args(ap.parse_args([])).read_threads == 16
    with pytest.raises(StreamrtError, match="--read-threads"):
        RuntimeOptions.from_args(ap.parse_args(["--read-threads", "0"]))
    with pytest.raises(StreamrtError, match="--read-threads"):
        RuntimeOptions.from_args(ap.parse_args(["--read-threads", "many"]))


def test_gds_fallback_decision():
    class FakeCuda:
        kind = "cuda"

    class Kvikio:
        __version__ = "0.test"

        def __init__(self, compat):
            self.defaults = type("D", (), {"compat_mode": staticmethod(lambda: compat)})

    def missing():
        raise ImportError("no kvikio")

    assert choose_gds("auto", CpuDevice()).why == "cuFile off (no CUDA device)"
    assert not choose_gds("auto", FakeCuda(), import_kvikio=missing).active
    assert "kvikio not installed" in choose_gds("auto", FakeCuda(), import_kvikio=missing).why
    assert "compatibility mode" in choose_gds("auto", FakeCuda(), import_kvikio=lambda: Kvikio(True)).why
    on = choose_gds("auto", FakeCuda(), import_kvikio=lambda: Kvikio(False))
    assert on.active and on.why == "cuFile on (kvikio 0.test)"
    assert choose_gds("off", FakeCuda(), import_kvikio=lambda: Kvikio(False)).why == "cuFile off (--gds off)"
    with pytest.raises(StreamrtError, match="--gds on: GPUDirect Storage unavailable"):
        choose_gds("on", CpuDevice())


def test_inspect_prints_the_disk_floor(capsys):
    from streamrt.cli.main import main

    assert main(["inspect", "deep-k3.1-pro", "--host-mem", "6G", "--disk-gbps", "2.0"]) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if "disk floor" in l]
    assert len(line) == 1 and "s/token" in line[0] and "GB/token from disk" in line[0] and "pool" in line[0]


def test_both_host_tiers_answer_the_whole_protocol(tree):
    """The scheduler calls either host tier the same way: each has every method and attribute
    of `HostReads`, with the same parameters."""
    import inspect

    from streamrt.runtime.host_reads import HostReads
    from streamrt.runtime.mapped_reads import MappedReads
    from streamrt.runtime.pool_reads import PoolReads

    methods = [n for n, v in vars(HostReads).items() if callable(v) and (not n.startswith("_") or n in
                                                                         ("__len__", "__contains__"))]
    assert {"lookup", "for_guess", "entry", "guess", "cancel_guesses", "unprotect", "end_step", "close"} <= set(methods)
    for cls in (MappedReads, PoolReads):
        for n in methods:
            want = list(inspect.signature(getattr(HostReads, n)).parameters)
            assert list(inspect.signature(getattr(cls, n)).parameters) == want, (cls.__name__, n)
    with StreamingRuntime(tree, None, RuntimeOptions(device="cpu", host_tier="mapped", gpu_experts=8)) as mapped, \
            pool_runtime(tree) as pooled:
        for rt in (mapped, pooled):
            assert all(hasattr(rt.host, a) for a in HostReads.__annotations__), rt.host.kind
            assert rt.stats.host_tier == rt.host.kind and rt.host_tier_line.startswith(f"host tier {rt.host.kind}")
