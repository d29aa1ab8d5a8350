"""`streamrt inspect --gpu-mem ... --cpu-gbps R`: the split floor with the host CPUs computing missed
experts, against a scan of every split written here; the flag's output and its refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from streamrt.cli.main import main
from streamrt.config import load_config
from streamrt.plan.placement import plan_placement

GIB = 1 << 30


def scanned_floor(p, cfg, link, cpu):
    """min over x in [0, E] of max((link bytes - x) / link, x / cpu), on a fine grid of x."""
    total, misses = p.link_bytes_per_token(cfg), p.expert_miss_bytes_per_token(cfg)
    x = np.linspace(0.0, misses, 200001)
    return float(np.min(np.maximum((total - x) / (link * 1e9), x / (cpu * 1e9))))


@pytest.mark.parametrize("gpu_gib,cpu", [(141, 80.0), (141, 5.0), (80, 100.0), (80, 1000.0), (141, 1000.0)])
def test_split_floor_is_the_best_split(gpu_gib, cpu):
    cfg = load_config("kimi-k3.1-pro")
    p = plan_placement(cfg, gpu_gib * GIB)
    h = p.hybrid_s_per_token(cfg, 55.0, cpu, 3350.0)
    base = p.projected_s_per_token(cfg, 55.0, 3350.0)
    want = max(scanned_floor(p, cfg, 55.0, cpu), base["compute_floor_s"])
    assert h["hybrid_s_per_token"] == pytest.approx(want, rel=1e-4)
    assert h["hybrid_s_per_token"] <= base["s_per_token"]  # never slower than the link alone
    assert 0 <= h["cpu_bytes_per_token"] <= p.expert_miss_bytes_per_token(cfg)  # dense bytes never go to the CPU


def test_inspect_prints_and_refuses(capsys):
    assert main(["inspect", "kimi-k3.1-pro", "--gpu-mem", "141G", "--cpu-gbps", "80"]) == 0
    assert "with CPU experts @ 80 GB/s" in capsys.readouterr().out
    assert main(["inspect", "kimi-k3.1-pro", "--gpu-mem", "141G", "--cpu-gbps", "80", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["cpu_gbps"] == 80 and got["hybrid_s_per_token"] < got["s_per_token"]
    assert main(["inspect", "kimi-k3.1-pro", "--gpu-mem", "80G,141G", "--cpu-gbps", "80"]) == 0
    assert "| with CPU experts @ 80 GB/s |" in capsys.readouterr().out
    assert main(["inspect", "kimi-k3.1-pro", "--gpu-mem", "141G", "--cpu-gbps", "0"]) == 2
    assert "--cpu-gbps must be a finite number > 0" in capsys.readouterr().err
