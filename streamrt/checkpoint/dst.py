"""The output directory of a conversion: checked, locked, and recognised when resumed.

A DST is empty, or a previous (partial or complete) conversion of the same source: its
`.convert/state.json` (or, once complete, its manifest) names the source's fingerprint, the
checksum rule and each source shard's size, mtime and header digest. `prepare_dst` returns the
files a previous run completed (its journal) and the shards that changed since, whose files
are redone. One converter at a time: `DstLock` holds an exclusive flock on `.convert/lock`.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from streamrt.fileio import LEGACY_RULE, file_digest, remove_stale_tmp, rule_name, write_bytes_atomic
from streamrt.checkpoint.manifest import MANIFEST, manifest_rule
from streamrt.errors import CheckpointError
from streamrt.jsonio import loads_text

STATE_DIR = ".convert"
LOCK = "lock"  # STATE_DIR/lock, held (flock) for the whole run: one converter per DST
STATE = "state.json"  # STATE_DIR/state.json: the source, its fingerprint and shards
JOURNAL = "journal.jsonl"


def check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise CheckpointError(f"{dst}: DST is inside SRC {src}; choose an output directory outside the release tree")
    if d in s.parents:
        raise CheckpointError(f"{dst}: DST contains SRC {src}; choose a separate output directory")


def _changed_shards(theirs: dict | None, ours: dict[str, dict]) -> set[str]:
    """Shards whose size, mtime or header differ from the run that recorded `theirs`, or whose
    bytes differ where both runs hashed them (--verify-source). No record: all of them."""
    if not isinstance(theirs, dict):
        return set(ours)
    changed = set()
    for name, rec in ours.items():
        old = theirs.get(name)
        if not isinstance(old, dict) or any(old.get(k) != rec[k] for k in ("size", "mtime_ns", "header")):
            changed.add(name)
        elif "blake2b" in rec and old.get("blake2b") not in (None, rec["blake2b"]):
            changed.add(name)
    return changed


def prepare_dst(src: Path, dst: Path, fingerprint: str, shards: dict[str, dict], *,
                hash_sources: bool = False) -> tuple[dict[str, dict], set[str]]:
    """Create or recognise DST; return the already-complete files a previous run recorded and
    the source shards that changed since (files made from those are redone).

    `hash_sources` (`convert --verify-source`): add each shard's content digest to `shards`,
    once DST is known to be ours: hashing a whole release takes hours, and a foreign DST is
    refused at once."""
    state_dir = dst / STATE_DIR
    prior: dict[str, dict] = {}
    changed: set[str] = set()
    rule = rule_name()
    if any(p.name != STATE_DIR for p in dst.iterdir()) or any(p.name != LOCK for p in state_dir.iterdir()):
        state, manifest = state_dir / STATE, dst / MANIFEST
        theirs, their_rule, their_shards = None, None, None
        try:
            if state.is_file():
                st = loads_text(state.read_text())
                theirs, their_rule = st.get("fingerprint"), st.get("checksum", LEGACY_RULE)  # older runs: no key
                their_shards = st.get("shards")
            elif manifest.is_file():
                m = loads_text(manifest.read_text())
                src_rec = m.get("source") or {}
                theirs, their_rule, their_shards = src_rec.get("fingerprint"), manifest_rule(m), src_rec.get("shards")
                files = m.get("files")  # only well-formed entries: anything else is redone, never trusted
                prior = {k: v for k, v in files.items() if isinstance(v, dict)} if isinstance(files, dict) else {}
        except (OSError, ValueError, AttributeError):
            theirs = None
        if theirs != fingerprint:
            raise CheckpointError(
                f"{dst}: DST is not empty and is not a previous partial conversion of {src}; "
                "choose an empty directory (or remove it)"
            )
        if hash_sources:
            _hash_shards(src, shards)
        journal = state_dir / JOURNAL
        if their_rule != rule:  # digests under another rule: redo those files rather than mix rules
            prior = {}
            journal.unlink(missing_ok=True)
        if journal.is_file():
            for line in journal.read_text(errors="replace").splitlines():
                try:  # a kill -9 can leave the last line torn: skip it, that file is redone
                    e = loads_text(line)
                    prior[e["path"]] = {"size": int(e["size"]), "blake2b": str(e["blake2b"])}
                except (ValueError, KeyError, TypeError, OverflowError):  # OverflowError: a size of 1e400
                    continue
        changed = _changed_shards(their_shards, shards)
        for name, rec in shards.items():  # an unchanged shard keeps the content hash a --verify-source run made
            old = their_shards.get(name) if isinstance(their_shards, dict) else None
            kept = isinstance(old, dict) and isinstance(old.get("blake2b"), str)
            if name not in changed and "blake2b" not in rec and kept:
                rec["blake2b"] = old["blake2b"]
        remove_stale_tmp(dst)
    elif hash_sources:  # an empty DST: nothing to recognise
        _hash_shards(src, shards)
    state_dir.mkdir(parents=True, exist_ok=True)
    state = {"source": str(src.resolve()), "fingerprint": fingerprint, "checksum": rule, "shards": shards}
    write_bytes_atomic(state_dir / STATE, json.dumps(state).encode())
    return prior, changed


def recorded_source(dst: Path) -> str | None:
    """The source directory an unfinished conversion into `dst` recorded; None where it cannot say."""
    try:
        source = loads_text((dst / STATE_DIR / STATE).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) and source and source.isprintable() else None


def _hash_shards(src: Path, shards: dict[str, dict]) -> None:
    for name, rec in shards.items():
        try:
            rec["blake2b"] = file_digest(src / name)
        except OSError as e:
            raise CheckpointError(f"{src / name}: cannot read: {e.strerror or e}") from None


class DstLock:
    """An exclusive flock on DST/.convert/lock for the whole run; a second converter is told
    who holds it instead of racing the first one's files."""

    def __init__(self, dst: Path):
        self.path = dst / STATE_DIR / LOCK
        self.fd = -1

    def __enter__(self) -> "DstLock":
        while True:
            try:
                self.path.parent.mkdir(exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise CheckpointError(f"{self.path.parent}: cannot write DST: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise CheckpointError(
                    f"{self.path.parent}: DST is being converted by {holder}; wait for it or choose another DST"
                ) from None
            try:  # the holder may have removed the file between our open and flock: lock the live one
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"streamrt convert pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)  # while still held, so no second run can slip in between
        os.close(self.fd)
        try:
            self.path.parent.rmdir()  # only if nothing else is in it (a refused run leaves nothing)
        except OSError:
            pass
