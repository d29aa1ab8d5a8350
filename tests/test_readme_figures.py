"""The README's quoted commands re-run on the embedded model print what the README says they
print (replies, token counts, selfcheck hash): tests/readme_check.py, which CI runs here."""

from __future__ import annotations

import importlib.util
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("readme_check", ROOT / "tests" / "readme_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["readme_check"] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_the_checker_reads_every_quoted_figure():
    rc = _checker()
    quoted = rc.quoted_commands((ROOT / "README.md").read_text())
    assert [q.command.split()[1] for q in quoted] == ["run", "run", "run", "selfcheck"]
    for q in quoted[:3]:
        f = rc.facts(q.lines)
        assert f["reply"] and f["tokens"] > 0 and f["prefill"] > 0, (q.command, f)
    f = rc.facts(quoted[3].lines)
    assert f["verdict"][0] == "PASS" and len(f["cycles"]) == 1 and f["verdict"][3] == next(iter(f["cycles"]))[0]


def test_the_checker_sees_a_stale_figure():
    """A README that quotes another hash or another answer than the run prints is caught."""
    rc = _checker()
    q = rc.quoted_commands((ROOT / "README.md").read_text())
    stale_hash = secrets.token_hex(8)
    lines = [ln.replace(rc.facts(q[3].lines)["verdict"][3], stale_hash) for ln in q[3].lines]
    assert rc.facts(lines) != rc.facts(q[3].lines)
    answer = [ln.replace("Paris", "Lyon") for ln in q[0].lines]
    assert rc.facts(answer)["reply"] != rc.facts(q[0].lines)["reply"]


def test_readme_figures_match_what_the_commands_print_now():
    problems = _checker().check()
    assert not problems, "\n".join(problems)


def test_the_hash_is_compared_on_the_readme_cpu_class_and_top1_everywhere(monkeypatch):
    """A selfcheck that prints another hash is caught on the CPU class the README names and let
    pass on another class; another top-1 is caught on any class."""
    rc = _checker()
    readme = (ROOT / "README.md").read_text()
    named = rc.HASH_CLASS.search(readme).group(1)
    verdict = rc.facts(rc.quoted_commands(readme)[3].lines)["verdict"]
    printed = {"hash": secrets.token_hex(8), "top": verdict[4]}

    def rerun(q):  # each command prints what the README quotes, but the selfcheck's figures
        lines = q.lines
        if q.command.split()[1] == "selfcheck":
            lines = [ln.replace(verdict[3], printed["hash"]).replace(f"top-1 {verdict[4]}", f"top-1 {printed['top']}")
                     for ln in lines]
        return 0, rc.facts(lines), ""

    monkeypatch.setattr(rc, "rerun", rerun)
    monkeypatch.setattr(rc, "cpu_class", lambda: ("the README's", named))
    assert len(rc.check()) == 2  # verdict and cycles
    monkeypatch.setattr(rc, "cpu_class", lambda: ("another", "0" * 8 if named != "0" * 8 else "1" * 8))
    assert rc.check() == []
    printed["top"] = str(int(verdict[4]) + 1)
    assert len(rc.check()) == 2
