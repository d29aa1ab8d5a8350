"""`--cpu-experts` end to end under `streamrt run` on a machine without a GPU: a share of the routed
experts on the host CPU kernel, the rest on the torch path; the answer depends on the share,
never on window or device slots; the counters say what the CPU computed; bad values are one line."""

from __future__ import annotations

import json
import re

import pytest
import serve_process

from streamrt.cli.main import main

PROMPT = "What is the capital of France?"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STREAMRT_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def run(capsys, tmp_path, *flags) -> tuple[dict, dict]:
    stats = tmp_path / f"stats{len(list(tmp_path.iterdir()))}.json"
    argv = ["run", "--prompt", PROMPT, "--greedy", "--json", "--max-new-tokens", "6", "--device", "cpu",
            "--stats-json", str(stats), *flags]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    if "--cpu-experts" in flags:  # the start line says what runs where
        assert "streamrt: CPU experts: " in err and "kernel " in err, err
    return json.loads(out), json.loads(stats.read_text())


def test_answers_depend_on_the_share_not_on_window_or_slots(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    first, stats = run(capsys, tmp_path, "--cpu-experts", "0.5", "--window", "4", "--gpu-experts", "8",
                       "--trace", str(trace))
    again, _ = run(capsys, tmp_path, "--cpu-experts", "50%", "--window", "64", "--gpu-experts", "64",
                   "--cpu-threads", "1")
    assert again["stats"]["logits_hash"] == first["stats"]["logits_hash"]
    assert (again["content"], again["thinking"]) == (first["content"], first["thinking"])
    assert stats["cpu_experts"] > 0 and stats["cpu_expert_rows"] >= stats["cpu_experts"]
    assert stats["cpu_expert_s"] > 0
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "cpu experts"]
    assert spans and all(e["ph"] == "X" and e["args"]["rows"] >= e["args"]["experts"] >= 1 for e in spans)
    assert sum(e["args"]["experts"] for e in spans) >= stats["cpu_experts"]  # the trace covers prefill too


def test_share_zero_is_the_torch_path_and_auto_puts_every_expert_on_the_cpu(capsys, tmp_path):
    off, off_stats = run(capsys, tmp_path)
    zero, zero_stats = run(capsys, tmp_path, "--cpu-experts", "0")
    assert zero["stats"]["logits_hash"] == off["stats"]["logits_hash"]
    assert "cpu_experts" not in off_stats and zero_stats["cpu_experts"] == 0
    auto, auto_stats = run(capsys, tmp_path, "--cpu-experts", "auto")
    # every routed expert of every layer request: as many as the device tier was asked for
    assert auto_stats["cpu_experts"] == auto_stats["device_hits"] + auto_stats["device_misses"] > 0
    # the embedded model's tokens survive the kernel's rounding
    assert (auto["content"], auto["thinking"]) == (off["content"], off["thinking"])


@pytest.mark.parametrize("flags,message", [
    (["--cpu-experts", "1.5"], "--cpu-experts: expected off, auto or a share in [0, 1]"),
    (["--cpu-experts", "many"], "--cpu-experts: expected off, auto or a share"),
    (["--cpu-threads", "-2"], "--cpu-threads must be 0"),
])
def test_bad_values_are_one_line_exit_2(capsys, flags, message):
    assert main(["run", "--prompt", PROMPT, "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_no_compiler_is_one_line_before_any_weights(capsys, monkeypatch):
    from streamrt.backends.cpu_expert import build

    build.load_library.cache_clear()
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        assert main(["run", "--prompt", PROMPT, "--device", "cpu", "--cpu-experts", "auto"]) == 2
    finally:
        build.load_library.cache_clear()
    err = capsys.readouterr().err.strip()
    assert "need a C compiler" in err and "\n" not in err


def test_serve_with_cpu_experts_answers_as_run_does(capsys, tmp_path):
    """`serve --cpu-experts 0.5` (batched decode rows) gives the tokens `run --cpu-experts 0.5` gives."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    want, _ = run(capsys, tmp_path, "--cpu-experts", "0.5", "--max-new-tokens", "24")
    server = serve_process.serve("--device", "cpu", "--cpu-experts", "0.5")
    url = server.url
    try:
        body = {"model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                "temperature": 0}
        got = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        server.stop()
    assert want["thinking"] or want["content"]
    assert (got["content"] or "") == want["content"]
    assert (got.get("reasoning_content") or "") == want["thinking"]
    counted = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(streamrt_cpu_expert\w*) (\S+)$", metrics, re.M)}
    assert counted["streamrt_cpu_experts_total"] > 0 and counted["streamrt_cpu_expert_rows_total"] >= \
        counted["streamrt_cpu_experts_total"] and counted["streamrt_cpu_expert_seconds_total"] > 0, counted
