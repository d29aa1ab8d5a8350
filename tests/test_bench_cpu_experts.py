"""profiling/bench_cpu_experts.py runs on the current kernel at a tiny shape and prints one row per
(threads, rows) with positive rates (the figures themselves are for the benchmark, not for CI)."""

import importlib.util
import re
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_cpu_experts", Path(__file__).parents[1] / "profiling" / "bench_cpu_experts.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

NUM = r"([\d.e+-]+)"
ROW = re.compile(r"^\| (\d+) \| (\d+) \| " + r" \| ".join([NUM] * 5) + r" \|$", re.M)


def test_bench_prints_a_row_per_thread_and_row_count(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMRT_CACHE", str(tmp_path))
    args = ["--threads", "1", "2", "--rows", "1", "3", "--experts", "2", "--dl", "64", "--inter", "32",
            "--reps", "1", "--ram-mib", "8", "--torch", "--batch", "2", "--kernel-first"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    rows = ROW.findall(out)
    assert [(t, m) for t, m, *_ in rows] == [("1", "1"), ("1", "3"), ("2", "1"), ("2", "3")], out
    assert all(float(v) > 0 for row in rows for v in row[2:5]), out
    assert "kernel " in out.splitlines()[0]


def test_baseline_source_is_timed_in_the_same_run(capsys, tmp_path, monkeypatch):
    """--baseline SRC builds that kernel source too and adds its ms, ratio and the speed-up to each row;
    a source that does not compile is one line naming the flag."""
    monkeypatch.setenv("STREAMRT_CACHE", str(tmp_path))
    args = ["--threads", "1", "--rows", "1", "2", "--experts", "2", "--dl", "64", "--inter", "32", "--reps", "1",
            "--ram-mib", "8", "--baseline", str(bench.build.SOURCE)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| 1 \| (\d) \| " + r" \| ".join([NUM] * 6) + r" \| ([\d.]+)x \|$", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"], out
    assert all(float(v) > 0 for r in rows for v in r[1:]), out
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C")
    with pytest.raises(SystemExit, match="--baseline") as e:
        bench.main([*args[:-1], str(bad)])
    assert "\n" not in str(e.value)
