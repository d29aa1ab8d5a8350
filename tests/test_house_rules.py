"""House rules for the package's source: no module over 500 lines, no function over 60.

Read with `ast`, so a function's length is from its `def` (decorators included) to its last
line, nested functions counted inside their parent and on their own."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "streamrt"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def offenders(source: str, name: str) -> list[str]:
    """Every rule `source` (the module `name`) breaks, one line each."""
    out = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        out.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - first + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{name}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return out


def test_modules_and_functions_are_short():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        found += offenders(path.read_text(), str(path.relative_to(PKG.parent)))
    assert not found, f"{len(found)} over the house limits:\n" + "\n".join(found)


def test_the_checker_counts_what_it_should():
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    fits = f"def f():\n{body}\n"  # 60 lines with its def
    assert offenders(fits, "m") == []
    over = f"@decorated\ndef f():\n{body}\n"  # the decorator makes 61
    assert offenders(over, "m") == ["m:2 f: 61 lines (at most 60)"]
    nested = f"class C:\n    async def g(self):\n{body.replace('    ', '        ')}\n        y = 1\n"
    assert offenders(nested, "m") == ["m:2 g: 61 lines (at most 60)"]
    assert offenders("x = 1\n" * 501, "big") == ["big: 501 lines (at most 500)"]
