"""The README's quick start is what CI runs: the test command must appear verbatim in both."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_COMMAND = "pip install torch==2.13.0 && pip install '.[test]' && python -m pytest -q"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in readme
    ci_lines = [ln.strip() for ln in ci.splitlines() if not ln.strip().startswith("#")]
    assert TEST_COMMAND in ci_lines


def test_readme_quick_start_has_two_commands():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```", 2)[1]
    commands = [ln for ln in block.splitlines()[1:] if ln.strip() and not ln.startswith("#")]
    assert len(commands) == 2, commands
    assert commands[0].startswith("pip install torch==2.13.0 && pip install . && streamrt run")
    assert commands[1] == TEST_COMMAND
