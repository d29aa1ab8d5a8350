"""`streamrt serve` flag errors: one `streamrt: --flag ...` line, exit 2, before the model loads.

No model is loaded here: in-process runs replace the load's first step (resolving the model
directory) with a marker, and the subprocess runs stop at a check that comes before it.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest

from streamrt.cli.main import main
from streamrt.cli import serve as command
from streamrt.cli.serve import MAX_THREADS, bind_sockets

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")


class ModelLoadStarted(Exception):
    """Raised where the model would start loading: every flag check has passed."""


@pytest.fixture
def no_load(monkeypatch):
    """Stops `serve` where the model load starts; `probes` run there (the sockets are bound then)."""
    probes = []

    def resolve_model_dir(model, notice):
        for probe in probes:
            probe()
        raise ModelLoadStarted

    monkeypatch.setattr(command, "resolve_model_dir", resolve_model_dir)
    return probes


@pytest.fixture
def listening_port():
    """A fresh port with a socket listening on 127.0.0.1, as another server would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_error(capsys, *flags: str) -> str:
    """stderr of an in-process `streamrt serve FLAGS` that must fail a check with exit 2."""
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def serve_subprocess(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamrt", "serve", *flags],
                          capture_output=True, text=True, timeout=120)


def test_threads_past_the_cap_is_one_line_not_a_crash():
    # before the cap, torch got 99999 threads and the process died on a signal after the load
    proc = serve_subprocess("--threads", "99999")
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        2, f"streamrt: --threads must be at most {MAX_THREADS}, got 99999\n", "")


@pytest.mark.parametrize("value, message", [("0", "--threads must be >= 1, got 0"),
                                            (str(MAX_THREADS + 1), f"--threads must be at most {MAX_THREADS}")])
def test_threads_out_of_range(capsys, no_load, value, message):
    assert message in serve_error(capsys, "--threads", value)


def test_threads_at_the_cap_pass_the_checks(monkeypatch, no_load):
    import torch

    counts = []
    monkeypatch.setattr(torch, "set_num_threads", counts.append)  # keep this process's own count
    with pytest.raises(ModelLoadStarted):
        main(["serve", "--threads", str(MAX_THREADS), "--port", "0"])
    assert counts == [MAX_THREADS]


def test_threads_cap_is_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert f"1..{MAX_THREADS}" in capsys.readouterr().out


@pytest.mark.parametrize("host", ["", " ", "\t\n"])
def test_empty_host_is_refused_not_every_interface(capsys, no_load, host):
    err = serve_error(capsys, "--host", host, "--port", "0")
    assert err == "streamrt: --host must not be empty (give 0.0.0.0 to listen on every interface)\n"


def test_empty_host_in_a_subprocess():
    proc = serve_subprocess("--host", "", "--port", "0")
    assert proc.returncode == 2 and proc.stderr.startswith("streamrt: --host must not be empty"), proc.stderr


def test_busy_port_is_refused_before_the_model_loads(listening_port):
    proc = serve_subprocess("--port", str(listening_port))
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        2, f"streamrt: --port {listening_port}: 127.0.0.1:{listening_port} is already in use\n", "")


def test_busy_port_in_process_never_starts_the_load(capsys, no_load, listening_port):
    err = serve_error(capsys, "--port", str(listening_port))
    assert err == f"streamrt: --port {listening_port}: 127.0.0.1:{listening_port} is already in use\n"


def test_port_busy_on_every_interface_is_busy_on_loopback(capsys, no_load):
    with socket.socket() as other:
        other.bind(("0.0.0.0", 0))
        other.listen()
        port = other.getsockname()[1]
        assert "is already in use" in serve_error(capsys, "--port", str(port))


@pytest.mark.parametrize("host, message", [
    ("999.1.1.1", "streamrt: --host 999.1.1.1: cannot resolve ("),
    ("no-such-host.invalid", "streamrt: --host no-such-host.invalid: cannot resolve ("),
    ("a" * 70, "cannot resolve (not a valid host name)"),  # the IDNA codec's UnicodeError
    ("bad\udcffhost", "streamrt: --host 'bad\\udcffhost': cannot resolve ("),  # an undecodable byte
    ("192.0.2.1", "streamrt: --host 192.0.2.1: 192.0.2.1 is not an address of this machine"),  # TEST-NET-1
])
def test_host_that_cannot_be_bound(capsys, no_load, host, message):
    assert message in serve_error(capsys, "--host", host, "--port", "0")


def test_unresolvable_host_in_a_subprocess():
    proc = serve_subprocess("--host", "999.1.1.1")
    assert proc.returncode == 2 and proc.stderr.startswith("streamrt: --host 999.1.1.1: cannot resolve ("), \
        proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_port_is_held_while_the_model_loads_and_freed_after(no_load):
    port = free_port()

    def port_is_taken():
        with socket.socket() as probe, pytest.raises(OSError) as e:
            probe.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE

    no_load.append(port_is_taken)
    with pytest.raises(ModelLoadStarted):
        main(["serve", "--port", str(port)])
    with socket.socket() as probe:  # a failed load closes the sockets
        probe.bind(("127.0.0.1", port))


def test_bind_sockets_port_0_takes_a_free_port():
    sockets = bind_sockets("127.0.0.1", 0)
    try:
        assert [s.getsockname()[0] for s in sockets] == ["127.0.0.1"]
        assert sockets[0].getsockname()[1] != 0
    finally:
        for sock in sockets:
            sock.close()
