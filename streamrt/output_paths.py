"""Output paths checked before any work: `check_output_path` (--stats-json, --trace, the sweep's
--out files) and the probes it is made of, so a bad path is one line naming the flag and never
costs a load or a generation."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from streamrt.errors import StreamrtError
from streamrt.fileio import TMP_PREFIX, TMP_SUFFIX


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
    be written: not a directory, device, FIFO or socket, and the nearest existing parent a
    directory where files can be created (missing parents are created at write time). Returns
    the path."""
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
    if not parent_is_dir:
        raise StreamrtError(f"{flag} {path}: {parent} is not a directory")
    why = writable_dir_error(parent)
    if why:
        raise StreamrtError(f"{flag} {path}: cannot write in {parent}: {why}")
    return path
