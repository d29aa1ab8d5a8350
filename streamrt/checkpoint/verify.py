"""`streamrt verify DIR [--full]`: is a converted tree whole?

Fast mode checks that every file the config implies is in the manifest and on disk with
the recorded size, and parses every header (expert headers against the layout and their
own (layer, expert); dense safetensors headers bounds-checked and held against the config:
every tensor name, dtype and shape, `reader.check_dense_header`). `--full` also re-hashes every
file against its checksum in the manifest, under the manifest's rule (`tree.digest`): files
hash in parallel, and so do the 64 MiB chunks of a big file (format_version 2), so one
multi-GB file no longer runs on one core. Every bad file is listed by path.

A file the user may edit (`tokenizer_config.json`, reader.USER_EDITABLE, docs/CONTRACTS.md) is
not held to the manifest's size and checksum; it is parsed and checked as `run` reads it instead.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from streamrt.checkpoint.manifest import dense_files
from streamrt.checkpoint.expert_file import HEADER_BYTES, parse_header
from streamrt.checkpoint.names import dense_specs, expert_relpath
from streamrt.checkpoint.reader import USER_EDITABLE, check_dense_header, open_tree
from streamrt.checkpoint.safetensors_io import read_header
from streamrt.errors import StreamrtError
from streamrt.tokenizer import TOKENIZER_CONFIG, check_tokenizer_config


MAX_WORKERS = 1024
# A user-editable file (reader.USER_EDITABLE) may differ from the manifest's size and checksum;
# what it says must still be what run accepts.
_CONTENT_CHECKS = {TOKENIZER_CONFIG: check_tokenizer_config}
_EXPERT_REL = re.compile(r"experts/L(\d{3,})/E(\d{4,})\.nvfp4")


def verify_tree(
    root: str | Path, *, full: bool = False, workers: int | None = None, progress: bool | None = None
) -> tuple[list[tuple[str, str]], int]:
    """Returns ([(relpath, reason)] for every bad file, number of files checked)."""
    if workers is not None and not 1 <= workers <= MAX_WORKERS:
        raise StreamrtError(f"--workers must be between 1 and {MAX_WORKERS}, got {workers}")
    tree = open_tree(root)  # manifest + config gating; a broken manifest is one error
    root = tree.root
    cfg, files = tree.config, tree.manifest["files"]
    expected = ["config.json", *dense_files(dense_specs(cfg))]
    expected += [expert_relpath(l, e) for l in cfg.moe_layers for e in range(cfg.num_experts)]
    bad: list[tuple[str, str]] = [(rel, "missing from manifest.json") for rel in expected if rel not in files]
    # run reads a user-editable file whether or not the manifest lists it (the embedded tree's is unlisted)
    files = {**files, **{rel: {} for rel in USER_EDITABLE - files.keys() if (root / rel).is_file()}}
    rels = sorted(files)
    lock = threading.Lock()

    from tqdm import tqdm

    total = sum(int(files[r].get("size", 0)) for r in rels) if full else len(rels)
    bar = tqdm(total=total, unit="B" if full else "file", unit_scale=full, desc="verify",
               disable=None if progress is None else not progress)

    def check(rel: str) -> None:
        reason = check_file(tree, root / rel, rel, files[rel], full)
        with lock:
            if reason:
                bad.append((rel, reason))
            bar.update(int(files[rel].get("size", 0)) if full else 1)

    try:
        with ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1)) as ex:
            list(ex.map(check, rels))
    finally:
        bar.close()
    return sorted(bad), len(rels)


def check_file(tree, path: Path, rel: str, entry: dict, full: bool) -> str | None:
    """Why the manifest's file `rel` at `path` is bad (None when it is fine); with `full`, its checksum too."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot stat: {e.strerror}"
    if not path.is_file():  # a directory's st_size would read as a wrong size
        return "not a regular file"
    editable = rel in USER_EDITABLE
    if not editable and size != entry.get("size"):
        return f"size {size}, manifest says {entry.get('size')}"
    try:
        if editable:
            _CONTENT_CHECKS[rel](path)
        elif rel.endswith(".nvfp4"):
            want = _ids_of(rel)
            if want is None:
                return "not an expert file name this tree uses (experts/LNNN/ENNNN.nvfp4)"
            with open(path, "rb") as f:
                h = parse_header(f.read(HEADER_BYTES), tree.layout, name=rel, file_size=size)
            if (h.layer, h.expert) != want:
                return f"header says layer {h.layer} expert {h.expert}, path implies layer {want[0]} expert {want[1]}"
        elif rel.endswith(".safetensors"):
            hdr = read_header(path)
            if rel.startswith("dense/"):
                check_dense_header(tree, rel, hdr)
        if full and not editable:
            got = tree.digest(path)
            if got != entry.get("blake2b"):
                return f"checksum mismatch (manifest {entry.get('blake2b')}, file {got})"
    except StreamrtError as e:
        return str(e).replace(f"{path}: ", "").replace(f"{rel}: ", "")
    except OSError as e:
        return f"cannot read: {e.strerror}"
    return None


def _ids_of(rel: str) -> tuple[int, int] | None:
    """(layer, expert) of experts/L{layer:03d}/E{expert:04d}.nvfp4; None for any other name."""
    m = _EXPERT_REL.fullmatch(rel)
    return (int(m.group(1)), int(m.group(2))) if m else None
