"""The README's Python example runs as shown: extracted from the README, executed on the
embedded default model (CPU), its output as the README shows it and as `streamrt run --greedy`
answers the same prompts."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from streamrt.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _section() -> str:
    return README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]


def test_the_readme_python_example_runs_and_matches_the_cli(capsys):
    section = _section()
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = section.split("```python\n", 1)[1].split("```\n", 2)[2].split("```", 1)[0]  # the output block
    prompts = re.findall(r'generate\("([^"]+)"', code)
    assert len(prompts) == 2 and "streamrt.load(" in code

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(line.strip() for line in lines), lines
    assert out.getvalue() == shown.lstrip("\n"), (out.getvalue(), shown)

    for prompt, line in zip(prompts, lines):
        capsys.readouterr()
        assert main(["run", "--greedy", "--prompt", prompt]) == 0
        assert capsys.readouterr().out == line + "\n"
