"""Where output goes, asked before any work: `check_output_path` (--stats-json, --trace, the
sweep's --out files), whether files can be created in a directory, whether there is room
(`space_error`), and sizes in units a reader can use (`human_bytes`). A bad path is one line
naming the flag and never costs a load or a generation."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from streamrt.errors import StreamrtError
from streamrt.fileio import TMP_PREFIX, TMP_SUFFIX

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (what a directory still to be made lives in)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_dir_error(directory: Path) -> str | None:
    """Why files cannot be created in an existing directory (None if they can). Probed by
    creating and removing a temp file: permission bits say nothing for root, a read-only
    mount or /proc."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + "probe-", suffix=TMP_SUFFIX, dir=directory)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return None


def check_output_path(path: str | os.PathLike, flag: str) -> Path:
    """Before any work: StreamrtError (one line, naming `flag` and the path) unless `path` can
    be written: not a directory, device, FIFO or socket, in an existing directory where files
    can be created (a missing one is an error, not made: a typo must not build a tree of
    directories). Returns the path."""
    path = Path(path).expanduser()
    if path.name in ("", ".", ".."):
        raise StreamrtError(f"{flag} {path}: not a file name")
    try:  # pathlib lets some OSErrors through (a name too long, a parent we may not search)
        if path.is_dir():
            raise StreamrtError(f"{flag} {path}: is a directory; give a file name")
        # the write is temp file + rename, which would replace a device or FIFO (as root,
        # --stats-json /dev/null turned /dev/null into a regular file for the whole system)
        if path.exists() and not path.is_file():
            raise StreamrtError(f"{flag} {path}: not a regular file (a device, FIFO or socket); give a file name")
        parent = nearest_existing(path.parent)
        parent_is_dir = parent.is_dir()
    except OSError as e:
        raise StreamrtError(f"{flag} {path}: cannot be written: {e.strerror or e}") from None
    if parent_is_dir and parent != path.parent:
        raise StreamrtError(f"{flag} {path}: directory {path.parent} does not exist; create it first")
    if not parent_is_dir:
        raise StreamrtError(f"{flag} {path}: {parent} is not a directory")
    why = writable_dir_error(parent)
    if why:
        raise StreamrtError(f"{flag} {path}: cannot write in {parent}: {why}")
    return path


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', 3 -> '3 B', 5.2e9 -> '4.8 GiB', 6e11 -> '559 GiB': the largest unit in
    which the number is >= 1; never '0.0 GiB' for a size that is not zero."""
    n = float(n)
    sign, n = ("-" if n < 0 else ""), abs(n)
    unit = 0
    # Compare the rounded figure, so 1023.7 KiB prints as 1.0 MiB, not 1024 KiB.
    while round(n) >= 1024 and unit < len(_UNITS) - 1:
        n /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{n:.0f} B"
    return f"{sign}{n:.1f} {_UNITS[unit]}" if round(n, 1) < 100 else f"{sign}{n:.0f} {_UNITS[unit]}"


def space_error(path: Path, need: int) -> str | None:
    """Why `need` bytes cannot be written under `path` (which may not exist yet), or None: the
    real cause first (a read-only file system, no permission), then the room left."""
    where = nearest_existing(Path(path))
    why = writable_dir_error(where) if where.is_dir() else None
    if why:
        return f"cannot write in {where}: {why}"
    free = shutil.disk_usage(where).free
    if free < need:
        return f"needs {human_bytes(need)}, only {human_bytes(free)} free on the file system of {where}"
    return None
