"""profiling/bench_host_path.py runs on the current code: its host-only backend builds from the
backend's own settings, so a new backend field cannot leave the benchmark broken unseen."""

import importlib.util
import re
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_host_path", Path(__file__).parents[1] / "profiling" / "bench_host_path.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_bench_host_path_rows(tmp_path, capsys):
    assert bench.main(["--workdir", str(tmp_path), "--steps", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): m for m in re.finditer(r"^(\w+) +host ms/step .*rows: ([\d.]+); .*?(\d+) launches/step(.*)$", out, re.M)}
    assert set(rows) == {"runtime", "stream", "segments"}, out
    # op by op: at least the router, the expert FFN and one GEMV launch for each of the 92 MoE layers
    assert int(rows["runtime"].group(3)) > 3 * 92
    assert rows["stream"].group(3) == rows["runtime"].group(3)  # the same step, experts moved or not
    assert rows["segments"].group(3) == "0"  # graph replays stand in for every launch
    fills = re.search(r"([\d.]+) MiB of slot fills", rows["stream"].group(4))
    assert fills and float(fills.group(1)) > 0
    assert all(float(m.group(2)) > 0 for m in rows.values())
