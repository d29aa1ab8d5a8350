"""profiling/bench_host_path.py runs on the current code: its host-only backend builds from the
backend's own settings, so a new backend field cannot leave the benchmark broken unseen."""

import importlib.util
import re
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_host_path", Path(__file__).parents[1] / "profiling" / "bench_host_path.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

ROW = re.compile(r"^(\w+) +host ms/step .*rows: ([\d.]+); .*?(\d+) launches \+ (\d+) torch ops/step(.*)$", re.M)


def test_bench_host_path_rows(tmp_path, capsys):
    from streamrt.backends import cuda_driver

    real = (cuda_driver.driver, cuda_driver.make_current, cuda_driver.current_stream, cuda_driver._pdl_attr)
    assert bench.main(["--workdir", str(tmp_path), "--steps", "1", "--repeats", "1"]) == 0
    # the stub driver is gone again: later tests in this process launch on a GPU where there is one
    assert (cuda_driver.driver, cuda_driver.make_current, cuda_driver.current_stream, cuda_driver._pdl_attr) == real
    out = capsys.readouterr().out
    rows = {m.group(1): m for m in ROW.finditer(out)}
    assert set(rows) == {"runtime", "stream", "segments"}, out
    launches = {name: int(m.group(3)) for name, m in rows.items()}
    # op by op: at least the router, the expert FFN and one GEMV launch for each of the 92 MoE layers
    assert launches["runtime"] > 3 * 92
    assert launches["stream"] == launches["runtime"]  # the same step, experts moved or not
    # between the replays only the scheduler's guesses launch, a GEMV and a top-k for each MoE
    # layer: the first's from the step's embeddings, every later one's from the layer before
    assert launches["segments"] == 2 * 92, out
    fills = re.search(r"([\d.]+) MiB of slot fills", rows["stream"].group(5))
    assert fills and float(fills.group(1)) > 0
    assert all(float(m.group(2)) > 0 for m in rows.values())
