"""The expert store and the runtime flags under hostile conditions: an expert file replaced by
a FIFO, a directory or a device; --stats-json / --trace at a device; --gpu-experts or a pool
--host-mem beyond what the tree or the machine has; Ctrl-C mid-step. Each is one line naming the
file or flag, never a hang, a traceback or damage outside the run."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from streamrt.errors import CheckpointError, StreamrtError
from streamrt.runtime.options import RuntimeOptions
from streamrt.runtime.stats import RuntimeStats
from streamrt.runtime.streams import CpuDevice
from streamrt.store.device_tier import DeviceTier
from streamrt.store.disk_reader import FileReader
from streamrt.store.host_tier import HostTier, choose_host_tier
from streamrt.store.keys import ExpertKey
from streamrt.store.policies import LRU
from streamrt.store.pool import PoolTier
from streamrt.store.retire import RetireQueue

FB = 8192  # fake expert file bytes (4096-aligned, as the format is)


def _within(seconds, fn):
    """Run fn on a daemon thread for at most `seconds`: (the thread, fn's exception or None)."""
    box = {}

    def call():
        try:
            fn()
        except BaseException as e:  # handed to the test
            box["exc"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return t, box.get("exc")


def _unblock(fifo):
    """Open the FIFO's write end, so a reader blocked in open() returns (old code)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _open_mapped(path):
    host = HostTier(lambda k: path, FB, 2, device=CpuDevice(), retire=RetireQueue(), stats=RuntimeStats())
    host.get(ExpertKey(0, 0))


def _read_pooled(path):
    FileReader(notice=lambda m: None).read_into(path, memoryview(bytearray(FB)), FB)


@pytest.mark.parametrize("tier", ["mapped", "pool"])
def test_fifo_in_place_of_an_expert_file_is_an_error_not_a_hang(tmp_path, tier):
    fifo = tmp_path / "E0003.nvfp4"
    os.mkfifo(fifo)
    t, exc = _within(5, lambda: (_open_mapped if tier == "mapped" else _read_pooled)(fifo))
    if t.is_alive():
        _unblock(fifo)
        t.join(5)
        pytest.fail(f"{tier} tier: open() of a FIFO expert file blocked")
    assert isinstance(exc, CheckpointError), exc
    msg = str(exc)
    assert str(fifo) in msg and "not a regular file" in msg and "\n" not in msg


def test_directory_in_place_of_an_expert_file_keeps_o_direct(tmp_path):
    """A directory refuses O_DIRECT with EINVAL, as tmpfs does: that must not be taken for a
    filesystem without O_DIRECT (all later reads buffered) nor reported as a size mismatch."""
    d = tmp_path / "E0003.nvfp4"
    d.mkdir()
    notes = []
    fr = FileReader(notice=notes.append)
    with pytest.raises(CheckpointError, match="not a regular file") as ei:
        fr.read_into(d, memoryview(bytearray(FB)), FB)
    assert str(d) in str(ei.value) and "\n" not in str(ei.value)
    assert not notes and fr.fallback_note is None


def test_device_in_place_of_an_expert_file_keeps_o_direct(tmp_path):
    link = tmp_path / "E0003.nvfp4"
    link.symlink_to("/dev/zero")
    notes = []
    fr = FileReader(notice=notes.append)
    with pytest.raises(CheckpointError, match="not a regular file"):
        fr.read_into(link, memoryview(bytearray(FB)), FB)
    assert not notes


@pytest.mark.parametrize("flag", ["stats_json", "trace"])
def test_output_at_a_device_or_fifo_is_refused_before_work(tmp_path, flag):
    """The write is temp file + rename: at /dev/null (as root) it replaced the device with a
    regular file for the whole machine. Checked without writing anything."""
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    for target in ("/dev/null", str(fifo)):
        with pytest.raises(StreamrtError, match="not a regular file") as ei:
            RuntimeOptions(**{flag: target}).check_output_paths()
        msg = str(ei.value)
        assert target in msg and "--" + flag.replace("_", "-") in msg and "\n" not in msg
    assert fifo.exists() and not fifo.is_file()


def test_gpu_experts_beyond_the_trees_experts_allocates_only_what_can_be_used():
    cfg = SimpleNamespace(working_set_experts=32, expert_files=256, num_experts=32, experts_per_token=4)
    r = RuntimeOptions(gpu_experts=1 << 20).resolve(cfg, FB, CpuDevice())
    assert r.gpu_experts == 256


def test_device_slab_that_cannot_be_allocated_is_one_line_naming_the_flag():
    with pytest.raises(StreamrtError, match="--gpu-experts") as ei:
        DeviceTier(1 << 20, 1 << 30, device=CpuDevice(), policy=LRU(), stats=RuntimeStats())  # 1 PiB
    assert "\n" not in str(ei.value)



def test_pool_above_available_memory_is_refused():
    """--host-tier pool --host-mem beyond RAM: the buffers are touched (page-locked on CUDA), so
    the run would end in the OOM killer; one line naming the flag instead."""
    G = 1 << 30
    with pytest.raises(StreamrtError, match="--host-mem .* more than the 14.0 GiB of memory available"):
        choose_host_tier("pool", 38 * G, 64 * G, 14 * G)
    assert choose_host_tier("pool", 38 * G, 8 * G, 14 * G)[:2] == ("pool", 8 * G)
    assert choose_host_tier("mapped", 38 * G, 64 * G, 14 * G)[0] == "mapped"  # mappings are page cache


def test_pool_arena_that_cannot_be_allocated_is_one_line_naming_the_flag():
    with pytest.raises(StreamrtError, match="--host-mem") as ei:
        PoolTier(lambda k: None, 1 << 20, 1 << 48, device=CpuDevice(), stats=RuntimeStats())  # 256 TiB
    assert "\n" not in str(ei.value)


def test_ctrl_c_mid_step_leaves_no_pending_tasks(tmp_path_factory, caplog):
    """SIGINT during a pool-tier step: close() must end the interrupted step's tasks, else
    the run's last words are one "Task was destroyed but it is pending!" per fetch."""
    from streamrt.checkpoint.reader import open_tree
    from streamrt.checkpoint.synth import synth
    from streamrt.loader import load_model
    from streamrt.runtime.scheduler import StreamingRuntime

    root = tmp_path_factory.mktemp("edge-store") / "tree"
    synth("tiny-k3.1-pro", root, fmt="streamrt", seed=0, workers=1, progress=False)
    tree = open_tree(root)

    main, reads = threading.main_thread().ident, []

    class SlowReader(FileReader):
        def read_into(self, path, buf, nbytes):
            reads.append(path)
            if len(reads) == 3:  # mid-fetch whatever the machine's speed: reads done and queued
                signal.pthread_kill(main, signal.SIGALRM)
            time.sleep(0.02)
            return super().read_into(path, buf, nbytes)

    model = load_model(tree, "cpu", dtype=None)
    opts = RuntimeOptions(device="cpu", host_tier="pool", host_mem=8 * tree.layout.file_bytes, read_threads=2,
                          gpu_experts=tree.config.experts_per_token)
    rt = StreamingRuntime(tree, model, opts, workers=2, file_reader=SlowReader(notice=lambda m: None))

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            rt.run(model.forward_steps(torch.tensor([[256, 72, 101, 108] * 64]), model.new_cache(1), last_only=True))
    finally:
        signal.signal(signal.SIGALRM, old)
    pending = [t for t in asyncio.all_tasks(rt.loop) if not t.done()]
    rt.close()
    gc.collect()
    assert pending, "the step was not cut short mid-fetch (the test needs it to be)"
    assert all(t.done() for t in pending)
    assert "Task was destroyed" not in caplog.text


def test_fifo_in_place_of_a_dense_file_is_an_error_not_a_hang(tmp_path):
    """The dense files are read through the tree's header check and a private mapping: the same
    FIFO must be one line naming the file, not an open() that never returns."""
    from streamrt.checkpoint.safetensors_io import read_header

    fifo = tmp_path / "plane.L001.safetensors"
    os.mkfifo(fifo)
    t, exc = _within(5, lambda: read_header(fifo))
    if t.is_alive():
        _unblock(fifo)
        t.join(5)
        pytest.fail("read_header of a FIFO dense file blocked")
    assert isinstance(exc, CheckpointError) and str(fifo) in str(exc) and "not a regular file" in str(exc), exc
