"""The rooms of the package and which way their imports may point (docs/ARCHITECTURE.md).

Imports are read with `ast` from the source, function-level imports included, so a lazy
import cannot hide a dependency that points the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "streamrt"

# A module may not import any of these (prefix match on the dotted name).
FORBIDDEN = {
    # the model is written against the Backend protocol; which backend runs it is the caller's choice
    "streamrt.model": (
        "streamrt.backends",
        "streamrt.runtime",
        "streamrt.store",
        "streamrt.serve",
        "streamrt.run_cmd",
        "streamrt.parallel",
    ),
    # a tree's readers depend on its format, never on the program that writes it
    "streamrt.checkpoint.reader": ("streamrt.checkpoint.convert", "streamrt.checkpoint.synth"),
    "streamrt.checkpoint.verify": ("streamrt.checkpoint.convert", "streamrt.checkpoint.synth"),
    "streamrt.checkpoint.manifest": (
        "streamrt.checkpoint.convert",
        "streamrt.checkpoint.synth",
        "streamrt.checkpoint.reader",
    ),
    "streamrt.checkpoint.release": ("streamrt.checkpoint.convert", "streamrt.checkpoint.synth"),
    "streamrt.checkpoint.names": ("streamrt.checkpoint.",),
    "streamrt.checkpoint": (
        "streamrt.model",
        "streamrt.runtime",
        "streamrt.store",
        "streamrt.backends",
        "streamrt.serve",
        "streamrt.parallel",
    ),
    # the store holds bytes; the runtime drives it
    "streamrt.store": ("streamrt.runtime", "streamrt.model", "streamrt.serve", "streamrt.run_cmd", "streamrt.parallel"),
    "streamrt.backends": (
        "streamrt.model",
        "streamrt.runtime",
        "streamrt.store",
        "streamrt.serve",
        "streamrt.checkpoint",
        "streamrt.parallel",
    ),
    "streamrt.config": ("streamrt.",),
    "streamrt.ops": ("streamrt.",),
    "streamrt.jsonio": ("streamrt.",),
    "streamrt.fp4": ("streamrt.checkpoint", "streamrt.model", "streamrt.runtime", "streamrt.backends"),
    "streamrt.runtime": ("streamrt.serve", "streamrt.run_cmd", "streamrt.cli", "streamrt.parallel"),
    # expert parallelism composes model, backend and runtime for one rank; the commands compose it
    "streamrt.parallel": ("streamrt.serve", "streamrt.run_cmd", "streamrt.cli", "streamrt.session"),
}
# leaves: they import nothing of ours but errors
ALLOWED_EVERYWHERE = ("streamrt.errors", "streamrt.jsonio", "streamrt.fileio")
# Exceptions to a room's bans: the model is typed against the Backend protocol; the config
# package's modules import one another (and nothing else of ours).
ALLOWED = {"streamrt.model": ("streamrt.backends.base",), "streamrt.config": ("streamrt.config",)}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, me: str, is_package: bool = False) -> set[str]:
    """Every streamrt module the source of module `me` imports, at any depth in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                parts = me.split(".")
                base = parts[: len(parts) - node.level + is_package]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from streamrt.backends import nvrtc`
    return {m for m in out if m == "streamrt" or m.startswith("streamrt.")}


def _under(name: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return name == prefix or name.startswith(prefix + ".")


def violations(me: str, source: str, is_package: bool = False) -> list[str]:
    bad = []
    for room, banned in FORBIDDEN.items():
        if not _under(me, room):
            continue
        allowed = ALLOWED_EVERYWHERE + ALLOWED.get(room, ())
        found = set()
        for imp in imports_of(source, me, is_package):
            if any(_under(imp, a) for a in allowed) or _under(imp, me):
                continue
            if any(_under(imp, b) and not (b.endswith(".") and imp == b.rstrip(".")) for b in banned):
                found.add(imp)
        # `from X import name` reads as X and X.name: report X alone when both are banned
        bad += [f"{me} imports {imp} (room {room} may not import {', '.join(banned)})"
                for imp in sorted(found) if imp.rsplit(".", 1)[0] not in found]
    return bad


SOURCES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down(path):
    assert violations(module_name(path), path.read_text(), path.name == "__init__.py") == []


def test_the_checker_sees_a_function_level_import():
    """A lazy import in a function body counts as much as one at the top."""
    lazy = "def f():\n    from streamrt.backends.torch_backend import TorchBackend\n    return TorchBackend\n"
    found = violations("streamrt.model.probe", lazy)
    assert len(found) == 1 and "streamrt.backends.torch_backend" in found[0]
    assert violations("streamrt.model.probe", "from streamrt.backends import nvrtc\n")
    assert violations("streamrt.store.probe", "import streamrt.runtime.streams\n")
    assert violations("streamrt.checkpoint.reader", "from . import convert\n")
    assert violations("streamrt.checkpoint.reader", "from streamrt.checkpoint.manifest import MANIFEST\n") == []
    assert violations("streamrt.model.probe", "from streamrt.backends.base import Backend\n") == []
    assert violations("streamrt.config.parse", "from streamrt.config.fields import Fields\n") == []
    assert violations("streamrt.config.parse", "from streamrt.ops import select_topk\n")
