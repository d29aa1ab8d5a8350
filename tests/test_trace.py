"""streamrt.trace: recording, Chrome-trace validity, overlap arithmetic, the summarize CLI."""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest

from streamrt import trace as T
from streamrt.cli.main import main as cli_main
from streamrt.trace import NullTracer, Tracer, check_trace, overlap_fraction


class FakeClock:
    """Host clock that advances only when told to, so spans have exact times."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def at(self, us: float) -> None:
        self.t = 100.0 + us / 1e6


def independent_check(trace: dict) -> None:
    """Written apart from check_trace: every span has the keys, and any two spans on one
    (pid, tid) are either disjoint or one contains the other."""
    by_lane: dict[tuple, list[tuple[float, float]]] = {}
    for ev in trace["traceEvents"]:
        if ev["ph"] == "X":
            for k in ("ph", "ts", "dur", "pid", "tid"):
                assert k in ev, (k, ev)
            by_lane.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for spans in by_lane.values():
        for i, (a0, a1) in enumerate(spans):
            for b0, b1 in spans[i + 1:]:
                disjoint = a1 <= b0 or b1 <= a0
                nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
                assert disjoint or nested, ((a0, a1), (b0, b1))


def record_step(clock: FakeClock) -> Tracer:
    tr = Tracer(clock=clock, event_factory=None)
    clock.at(0)
    tr.begin_step()
    # layer 0: a layer span with two nested ops
    with tr.span("compute", "L0", layer=0):
        with tr.span("compute", "attn", layer=0):
            clock.at(40)
        with tr.span("compute", "experts", layer=0):
            clock.at(100)
    # two parallel host reads that overlap partially: must land on separate lanes
    clock.at(110)
    a = tr.span("host-io", "read", layer=1, expert=3, bytes=4096)
    a.__enter__()
    clock.at(120)
    b = tr.span("host-io", "read", layer=1, expert=5, bytes=4096)
    b.__enter__()
    clock.at(130)
    a.__exit__(None, None, None)
    clock.at(150)
    b.__exit__(None, None, None)
    with tr.span("copy", "expert", layer=1, expert=3, bytes=4096):
        clock.at(170)
    tr.instant("store", "evict", layer=0, expert=7)
    tr.counter("bytes_in_flight", 4096)
    with tr.span("compute", "L1", layer=1):
        clock.at(200)
    tr.end_step()
    return tr


def test_written_trace_is_valid_chrome_json(tmp_path):
    tr = record_step(FakeClock())
    path = tr.write(tmp_path / "t.json")
    trace = json.loads(path.read_text())
    independent_check(trace)
    assert check_trace(trace) == []
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temp file left behind

    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_name = {(e["cat"], e["name"], e["args"].get("expert")): e for e in spans}
    assert by_name[("compute", "attn", None)]["ts"] == 0 and by_name[("compute", "attn", None)]["dur"] == 40
    assert by_name[("copy", "expert", 3)]["dur"] == 20 and by_name[("copy", "expert", 3)]["args"]["bytes"] == 4096
    assert all(e["args"]["step"] == 0 for e in spans)
    reads = [e for e in spans if e["cat"] == "host-io"]
    assert len({e["tid"] for e in reads}) == 2, "partially overlapping reads share a lane"
    nested = [e for e in spans if e["cat"] == "compute" and e["args"]["layer"] == 0]
    assert len({e["tid"] for e in nested}) == 1, "nested ops left their layer's lane"
    assert [e["name"] for e in spans if e["cat"] == "step"] == ["step 0"]

    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counters and counters[0]["args"] == {"value": 4096}
    # every pid/tid used has a name, so Perfetto shows "compute", "copy", ... not numbers
    names = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    for e in spans + [e for e in trace["traceEvents"] if e["ph"] == "i"]:
        assert (e["pid"], e["tid"]) in names and e["pid"] in procs


def test_write_replaces_atomically(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("old")
    Tracer(event_factory=None).write(p)
    assert json.loads(p.read_text())["traceEvents"] == []


def test_check_trace_rejects_partial_overlap_and_missing_fields():
    bad = {"traceEvents": [
        {"ph": "X", "name": "a", "ts": 0, "dur": 10, "pid": 1, "tid": 0},
        {"ph": "X", "name": "b", "ts": 5, "dur": 10, "pid": 1, "tid": 0},
        {"ph": "X", "name": "c", "ts": 5, "pid": 1, "tid": 0},
    ]}
    problems = check_trace(bad)
    assert any("partially overlaps" in p for p in problems)
    assert any("missing dur" in p for p in problems)
    ok = {"traceEvents": [
        {"ph": "X", "name": "a", "ts": 0, "dur": 10, "pid": 1, "tid": 0},
        {"ph": "X", "name": "b", "ts": 2, "dur": 3, "pid": 1, "tid": 0},
        {"ph": "X", "name": "c", "ts": 10, "dur": 3, "pid": 1, "tid": 0},
        {"ph": "X", "name": "d", "ts": 5, "dur": 10, "pid": 1, "tid": 1},
    ]}
    assert check_trace(ok) == []


def span(track, ts, dur, **args):
    pid = T.TRACKS.index(track) + 1
    return {"ph": "X", "cat": track, "name": track, "ts": ts, "dur": dur, "pid": pid, "tid": 0, "args": args}


def test_overlap_fraction_known_answers():
    half = {"traceEvents": [span("compute", 0, 100, layer=0), span("copy", 50, 100, layer=1)]}
    assert overlap_fraction(half, 0) == pytest.approx(0.5)
    # two copies, each half under compute; nested compute spans must not count twice
    two = {"traceEvents": [span("compute", 10, 90, layer=0), span("compute", 20, 30, layer=0),
                           span("copy", 0, 20, layer=1), span("copy", 90, 20, layer=1),
                           span("copy", 0, 500, layer=2)]}  # layer 2 copies do not belong to layer 0
    assert overlap_fraction(two, 0) == pytest.approx(0.5)
    assert overlap_fraction(two, 1) == pytest.approx(0.0)
    assert overlap_fraction(two, 5) is None
    full = {"traceEvents": [span("compute", 0, 100, layer=3), span("copy", 10, 10, layer=4)]}
    assert overlap_fraction(full, 3) == pytest.approx(1.0)
    # steps are kept apart: step 1's copy does not hide under step 0's compute
    steps = {"traceEvents": [span("compute", 0, 100, layer=0, step=0), span("copy", 50, 10, layer=1, step=1),
                             span("compute", 200, 100, layer=0, step=1)]}
    assert overlap_fraction(steps, 0) == pytest.approx(0.0)
    assert T.overall_overlap(half) == pytest.approx(0.5)


def synthetic() -> dict:
    return {"traceEvents": [
        span("step", 0, 1000, step=0),
        span("compute", 0, 300, layer=0, step=0),
        span("copy", 100, 400, layer=1, expert=2, bytes=2_000_000, step=0),
        span("stall", 300, 200, layer=1, expert=2, step=0),
        span("compute", 500, 400, layer=1, step=0),
    ]}


def test_layer_table_and_critical_path():
    rows = {r["layer"]: r for r in T.layer_table(synthetic())}
    assert rows[0]["compute_ms"] == pytest.approx(0.3)
    assert rows[1]["copy_ms"] == pytest.approx(0.4) and rows[1]["copy_bytes"] == 2_000_000
    assert rows[1]["stall_ms"] == pytest.approx(0.2)
    assert rows[0]["next_copy_hidden"] == pytest.approx(0.5)  # copy [100,500) vs compute [0,300)
    (cp,) = T.critical_path(synthetic())
    assert cp["wall_ms"] == pytest.approx(1.0)
    assert (cp["compute_ms"], cp["stall_ms"], cp["idle_ms"]) == pytest.approx((0.7, 0.2, 0.1))
    assert cp["stall_blame"] == {"copy L1": pytest.approx(0.2)}


def test_summarize_cli(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(synthetic()))
    assert cli_main(["trace", "summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "critical path" in out and "compute 0.700 + stalled 0.200 + idle/host 0.100" in out
    assert "copy L1 0.200 ms" in out
    assert "50.0 %" in out and "warning" not in out


@pytest.mark.parametrize("content", [None, "{not json", '{"events": []}', '{"traceEvents": [{"ph": "X"}]}'])
def test_summarize_bad_file_is_one_line_error(tmp_path, capsys, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    assert cli_main(["trace", "summarize", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamrt: trace ") and err.count("\n") == 1 and "Traceback" not in err


def test_null_tracer_records_nothing_and_matches_api(tmp_path):
    nt = NullTracer()
    assert not nt.enabled
    nt.begin_step()
    with nt.span("compute", "x", stream=object(), layer=0) as s:
        pass
    assert s is None and nt.span("copy", "y") is nt.span("stall", "z")  # one shared no-op object
    nt.instant("store", "evict", layer=0)
    nt.counter("bytes_in_flight", 1)
    nt.end_step()
    nt.write(tmp_path / "n.json")
    assert nt.events == () and list(tmp_path.iterdir()) == []
    for name, fn in inspect.getmembers(Tracer, inspect.isfunction):
        if not name.startswith("_"):
            assert inspect.signature(getattr(NullTracer, name)).parameters.keys() == \
                inspect.signature(fn).parameters.keys(), name


class FakeStream:
    """A device stream whose own clock the test moves (seconds of GPU time)."""

    def __init__(self, device="cuda:0"):
        self.device, self.now = device, 0.0


class FakeEvent:
    def __init__(self):
        self.t = None

    def record(self, stream):
        self.t = stream.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):  # ms, like torch.cuda.Event
        return (end.t - self.t) * 1e3


def test_stream_spans_resolve_in_flush_only():
    syncs = []
    clock = FakeClock()

    def synchronize(device):  # the host waits for the device: host time moves on to 9 ms
        syncs.append(device)
        clock.at(9000)

    tr = Tracer(clock=clock, event_factory=FakeEvent, synchronize=synchronize)
    copy, comp = FakeStream(), FakeStream()
    tr.begin_step()
    copy.now = 1.000
    with tr.span("copy", "expert", stream=copy, layer=1, expert=0, bytes=10):
        copy.now = 1.004  # the stream ran 4 ms; the host did not move
    comp.now = 1.001
    with tr.span("compute", "L0", stream=comp, layer=0):
        comp.now = 1.003
    assert syncs == [] and tr._spans == []  # nothing resolved, nothing synchronized yet
    # the host finished issuing at 5 ms; the idle device's clock reads 1.005 at the anchor
    copy.now = comp.now = 1.005
    clock.at(5000)
    tr.end_step()
    assert syncs == ["cuda:0"]
    trace = {"traceEvents": tr.events}
    ev = {e["cat"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert (ev["copy"]["ts"], ev["copy"]["dur"]) == pytest.approx((4000, 4000))  # anchor 9 ms = GPU 1.005
    assert (ev["compute"]["ts"], ev["compute"]["dur"]) == pytest.approx((5000, 2000))
    assert overlap_fraction(trace, 0) == pytest.approx(0.5)
    # the host issued everything by 5 ms, but the step lasts until its device work ends
    assert (ev["step"]["ts"], ev["step"]["dur"]) == pytest.approx((0, 8000))


@pytest.mark.gpu
def test_cuda_events_on_device(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    tr = Tracer()
    s = torch.cuda.Stream()
    x = torch.randn(2048, 2048, device="cuda")
    tr.begin_step()
    with torch.cuda.stream(s), tr.span("compute", "mm", stream=s, layer=0):
        for _ in range(10):
            x = x @ x / 2048
    tr.end_step()
    trace = json.loads(tr.write(tmp_path / "g.json").read_text())
    assert check_trace(trace) == []
    (mm,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    (step,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    assert mm["dur"] > 0 and mm["ts"] >= step["ts"] - 100


def test_trace_overlap_script(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "trace_overlap", Path(__file__).parents[1] / "profiling" / "trace_overlap.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(synthetic()))
    assert script.main([str(path), "--require", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "overall: 0.500" in out and "      0         0.400                0.200     0.500" in out
    assert script.main([str(path), "--require", "0.6"]) == 1
    assert script.main([str(tmp_path / "missing.json")]) == 2


def test_the_anchor_is_the_tightest_round_trip():
    """Another process's kernels hold the first anchor back 2 ms on the device; the second runs
    at once. The spans resolve against the second, so they land where the device ran them."""
    clock = FakeClock()
    stream = FakeStream()
    # device seconds each recorded event waits behind foreign work: the span's two events none,
    # the first anchor 2 ms, the second none
    held = iter([0.0, 0.0, 0.002, 0.0])

    class HeldEvent(FakeEvent):
        def record(self, s):
            wait = next(held)
            s.now += wait  # the foreign kernels run first on the device
            super().record(s)
            clock.at((clock.t - 100.0) * 1e6 + wait * 1e6)  # the host waits as long

    tr = Tracer(clock=clock, event_factory=HeldEvent, synchronize=lambda device: None)
    tr.begin_step()
    stream.now = 1.000
    with tr.span("compute", "L0", stream=stream, layer=0):
        stream.now = 1.003  # 3 ms on the device, host at 0
    clock.at(3000)  # the host reaches the flush when the device is idle at 1.003
    tr.end_step()
    (ev,) = [e for e in tr.events if e["ph"] == "X" and e["cat"] == "compute"]
    # against the first (held) anchor alone the span would sit 1 ms early: ts -1000, not 0
    assert (ev["ts"], ev["dur"]) == pytest.approx((0, 3000), abs=1)
