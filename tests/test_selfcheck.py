"""`streamrt selfcheck`: PASS only when every cycle, in this process and a spawned one, gives the
same logits_hash and top-1; injected nondeterminism must turn it into FAIL (exit 1)."""

import argparse
import json

import pytest
import torch

from streamrt.cli import selfcheck
from streamrt.cli.main import main
from streamrt.errors import StreamrtError
from streamrt.cli.selfcheck import child_cycles, run_cycles
from streamrt.api.session import Session, _ModelSession
from streamrt.tokenizer import ByteTokenizer


class FixedSession(Session):
    """Logits as a pure function of the prompt: a deterministic model in miniature."""

    name = "fixed"

    def __init__(self):
        self.tokenizer = ByteTokenizer(512)

    def control_logits(self, ids):
        g = torch.Generator().manual_seed(sum(ids))
        return torch.randn(512, generator=g)


class NoisySession(FixedSession):
    """Nondeterminism in miniature: a different nudge on every call."""

    calls = 0

    def control_logits(self, ids):
        NoisySession.calls += 1
        return super().control_logits(ids) + 1e-3 * torch.randn(
            512, generator=torch.Generator().manual_seed(self.calls)
        )


def scripted(monkeypatch, tmp_path, session):
    (tmp_path / "manifest.json").write_text("{}")
    monkeypatch.setattr(selfcheck, "open_session", lambda *a, **k: session)
    # The spawned half runs the same session in this process; the real spawn is tested below.
    monkeypatch.setattr(selfcheck, "child_cycles", lambda d, n, extra: run_cycles(session, n, 2))
    return tmp_path


@pytest.fixture
def fixed(monkeypatch, tmp_path):
    return scripted(monkeypatch, tmp_path, FixedSession())


def test_deterministic_session_passes(fixed, capsys):
    assert main(["selfcheck", "--model", str(fixed), "--cycles", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("logits_hash") == 7 and "PASS: 6/6 cycles bit-identical" in out
    assert "process 2" in out


def test_injected_nondeterminism_fails_with_exit_1(capsys, monkeypatch, tmp_path):
    noisy = scripted(monkeypatch, tmp_path, NoisySession())
    assert main(["selfcheck", "--model", str(noisy), "--cycles", "2", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["result"] == "FAIL" and len(data["cycles"]) == 4
    assert len({c["logits_hash"] for c in data["cycles"]}) > 1


def test_child_mode_prints_only_its_cycles(fixed, capsys):
    assert main(["selfcheck", "--model", str(fixed), "--cycles", "2", "--child"]) == 0
    cycles = json.loads(capsys.readouterr().out)["cycles"]
    assert [c["cycle"] for c in cycles] == [1, 2] and len({c["logits_hash"] for c in cycles}) == 1


def test_a_failing_child_process_is_a_one_line_error(tmp_path):
    with pytest.raises(StreamrtError, match=r"child process failed \(exit 2\): streamrt: --model .*no such directory"):
        child_cycles(tmp_path / "missing", 1, [])


def test_runtime_flags_are_forwarded_to_the_child():
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--cycles", default="3")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--device", default=None)
    args = p.parse_args(["--model", "m", "--cycles", "2", "--window", "8", "--trace"])
    assert selfcheck._forwarded_flags(p, args) == ["--window", "8", "--trace"]


# ---- the real thing: a synthetic tiny-k3.1-pro tree, in-process and spawned ----------


@pytest.fixture(scope="module")
def tiny_tree(tmp_path_factory):
    from streamrt.checkpoint.synth import synth

    root = tmp_path_factory.mktemp("trees") / "tiny-k3.1-pro"
    synth("tiny-k3.1-pro", root, fmt="streamrt", seed=0, device="cpu")
    return root


def test_selfcheck_passes_on_tiny_and_fails_with_injected_noise(tiny_tree, capsys, monkeypatch):
    assert main(["selfcheck", "--model", str(tiny_tree), "--cycles", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["result"] == "PASS" and data["model"].startswith("tiny-k3.1-pro")
    assert [c["process"] for c in data["cycles"]] == [1, 1, 2, 2]
    assert len({c["pid"] for c in data["cycles"]}) == 2
    control_logits = _ModelSession.control_logits  # this process's cycles nudged; the spawned one's not
    monkeypatch.setattr(_ModelSession, "control_logits", lambda self, ids: control_logits(self, ids) + 1e-3)
    assert main(["selfcheck", "--model", str(tiny_tree), "--cycles", "1"]) == 1
    assert "FAIL" in capsys.readouterr().out
