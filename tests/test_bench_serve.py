"""profiling/bench_serve.py in CI size: one server, rows through /v1/chat/completions and
/v1/messages, the tokens each row generated counted from what the endpoint streamed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profiling"))


def test_bench_serve_rows_through_chat_and_messages(tmp_path, capsys):
    import bench_serve

    out = tmp_path / "bench.json"
    assert bench_serve.main(["--clients", "1,2", "--max-tokens", "5", "--api", "chat,messages", "--no-bare",
                             "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["api"], r["clients"]) for r in rows] == [("chat", 1), ("chat", 2), ("messages", 1), ("messages", 2)]
    for r in rows:  # every reply runs past 5 tokens (its think channel alone is longer): 5 per client
        assert r["tokens"] == 5 * r["clients"] and r["tok_s"] > 0 and r["decode_steps"] >= 4
    printed = capsys.readouterr().out
    assert printed.count("messages") == 2


def test_bench_serve_refuses_an_unknown_api(capsys):
    import bench_serve

    with pytest.raises(SystemExit) as e:
        bench_serve.parse_args(["--api", "chat,grpc"])
    assert e.value.code == 2 and "--api: 'grpc'" in capsys.readouterr().err
