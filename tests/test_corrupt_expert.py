"""A flipped byte inside one expert file: `verify --full` names the file, and `run` stops with
a one-line error naming it instead of decoding with wrong weights."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamrt.checkpoint.reader import open_tree
from streamrt.checkpoint.synth import synth


@pytest.fixture(scope="module")
def corrupt_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt") / "tree"
    synth("tiny-k3.1-pro", root, fmt="streamrt", seed=3, device="cpu")
    tree = open_tree(root)
    # Flip every expert of the first MoE layer: whatever the router picks, it meets a bad file.
    layer = tree.config.moe_layers[0]
    victims = []
    for e in range(tree.config.num_experts):
        p = tree.expert_path(layer, e)
        data = bytearray(p.read_bytes())
        off = tree.layout.file_bytes // 2  # inside the nibble payload, past the header
        data[off] ^= 0x10
        p.write_bytes(bytes(data))
        victims.append(p)
    return root, victims


def _streamrt(*args):
    return subprocess.run([sys.executable, "-m", "streamrt", *args], capture_output=True, text=True, timeout=300)


def test_verify_full_names_the_corrupt_files(corrupt_tree):
    root, victims = corrupt_tree
    r = _streamrt("verify", str(root), "--full")
    assert r.returncode == 1
    out = r.stdout + r.stderr
    for p in victims[:3]:
        assert p.name in out


def test_run_fails_with_a_clear_error(corrupt_tree):
    root, victims = corrupt_tree
    r = _streamrt("run", "--model", str(root), "--prompt", "hi", "--max-new-tokens", "2", "--greedy")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "checksum mismatch" in r.stderr and "Traceback" not in r.stderr
    assert any(p.name in r.stderr for p in victims)
    lines = r.stderr.strip().splitlines()  # the start line naming the host tier, then the one-line error
    assert "checksum mismatch" in lines[-1] and all(x.startswith("streamrt: host tier") for x in lines[:-1])


def test_run_without_verification_does_not_check(corrupt_tree):
    """`--verify-experts off` keeps header checks only: the flipped payload byte goes unnoticed
    (which is why `first` is the default)."""
    root, _ = corrupt_tree
    r = _streamrt("run", "--model", str(root), "--prompt", "hi", "--max-new-tokens", "2", "--greedy",
                  "--verify-experts", "off")
    assert r.returncode == 0, r.stderr
