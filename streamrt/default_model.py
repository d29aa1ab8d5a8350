"""The embedded default model: what `streamrt run` uses without `--model`.

A trained small model ships as package data under `streamrt/assets/default_model/` (a
converted streamrt tree). Until it does, a synthetic `tiny-k3.1-pro` tree is built once,
with the checkpoint pipeline's synth (written straight as a converted tree), into the cache directory
(`$STREAMRT_CACHE`, else `~/.cache/streamrt`). The build goes to a temporary sibling and is
renamed into place, so a crashed or concurrent build never leaves a half tree behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Callable

from streamrt.errors import StreamrtError

SYNTH_NAME = "tiny-k3.1-pro"
SYNTH_SEED = 0
# Bump when the synth or tree format changes, so stale caches are rebuilt, not misread.
CACHE_VERSION = 1


def cache_root() -> Path:
    env = os.environ.get("STREAMRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "streamrt"


def packaged_model_dir() -> Path | None:
    """The trained default model shipped as package data, if this build carries one."""
    try:
        root = resources.files("streamrt") / "assets" / "default_model"
        path = Path(str(root))
    except (ModuleNotFoundError, TypeError):
        return None
    return path if (path / "manifest.json").is_file() else None


def synthetic_model_dir() -> Path:
    return cache_root() / "default" / f"{SYNTH_NAME}-synth{SYNTH_SEED}-v{CACHE_VERSION}"


def default_model_dir(notice: Callable[[str], None] = print) -> Path:
    """The default model's streamrt tree, building the synthetic one on first use."""
    packaged = packaged_model_dir()
    if packaged is not None:
        return packaged
    target = synthetic_model_dir()
    if (target / "manifest.json").is_file():
        return target
    notice(f"streamrt: no trained default model in this build; building a synthetic {SYNTH_NAME} into {target} (once)")
    build_synthetic_tree(target)
    return target


def build_synthetic_tree(target: Path) -> None:
    try:
        from streamrt.checkpoint.synth import synth
    except ImportError as exc:
        raise StreamrtError(f"cannot build the default model: checkpoint pipeline unavailable ({exc})") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tree = work / "tree"
        # Straight to a converted tree, on the CPU so every machine builds the same bytes.
        synth(SYNTH_NAME, tree, seed=SYNTH_SEED, fmt="streamrt", device="cpu", progress=False)
        try:
            os.replace(tree, target)
        except OSError:
            if not (target / "manifest.json").is_file():  # lost a race only if the winner finished
                raise
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("streamrt"):
            raise
        raise StreamrtError(f"cannot build the default model: {exc.name} is missing from this build") from None
    except OSError as exc:
        raise StreamrtError(f"cannot build the default model into {target}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
