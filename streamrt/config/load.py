"""Where a config comes from: a bundled name, a `config.json`, or a checkpoint directory (whose
tensor index feeds the variant gate)."""

from __future__ import annotations

import stat
from importlib import resources
from pathlib import Path

from streamrt.config.model import ModelConfig
from streamrt.config.parse import config_from_dict
from streamrt.errors import ConfigError
from streamrt.jsonio import load_json

MAX_CONFIG_BYTES = 16 << 20  # a release config.json is ~10 KB
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own header limit
BUNDLED = ("kimi-k3", "kimi-k3.1-pro", "tiny-k3", "tiny-k3.1-pro", "slice-k3.1-pro", "deep-k3.1-pro", "small-k3.1-pro",
           "fanout-k3.1-pro")


def load_config(source: str | Path, *, check_tensors: bool = True) -> ModelConfig:
    """Load a ModelConfig from a bundled name, a `config.json`, or a checkpoint directory.

    For a checkpoint directory the variant gate also checks the indexer tensors against
    the tree's tensor index (release `model.safetensors.index.json` or streamrt
    `manifest.json`), unless `check_tensors` is False.
    """
    path = Path(source)
    kind = _kind(path)
    tensor_names: set[str] | None = None
    if str(source) in BUNDLED and kind is None:
        raw: Path | bytes = resources.files("streamrt").joinpath("configs", f"{source}.json").read_bytes()
        cfg_path = f"<bundled {source}>"
        name = str(source)
    elif kind == "dir":
        raw = path / "config.json"
        if _kind(raw) != "file":
            raise ConfigError(f"{path}: not a checkpoint directory (no config.json)")
        cfg_path, name = str(raw), path.name
        if check_tensors:
            tensor_names = tensor_names_of_tree(path)
    elif kind == "file":
        raw, cfg_path, name = path, str(path), path.stem
    else:
        hint = f" (bundled configs: {', '.join(BUNDLED)})" if "/" not in str(source) else ""
        raise ConfigError(f"{source}: no such config file or checkpoint directory{hint}")
    data = load_json(raw, what="config", name=cfg_path, expect=dict, max_bytes=MAX_CONFIG_BYTES, error=ConfigError,
                     unique_keys=True)
    return config_from_dict(data, name=name, source=cfg_path, tensor_names=tensor_names)


def _kind(path: Path) -> str | None:
    """What is at path: "dir", "file" (a regular one), "other", or None (nothing). pathlib's
    exists / is_file let some OSErrors through (a name too long, a parent we may not
    search): here they are the one-line error naming the path."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL byte
        raise ConfigError(f"{path}: cannot access: {getattr(e, 'strerror', None) or e}") from None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def tensor_names_of_tree(path: Path) -> set[str] | None:
    """Tensor names listed by a checkpoint tree's index, or None if it has none."""
    for index_name in ("model.safetensors.index.json", "manifest.json"):
        f = path / index_name
        if _kind(f) != "file":
            continue
        idx = load_json(f, what="tensor index", expect=dict, error=ConfigError, unique_keys=True)
        key, kind = ("weight_map", dict) if index_name == "model.safetensors.index.json" else ("tensor_names", list)
        names = idx.get(key)
        if not isinstance(names, kind) or not all(isinstance(n, str) for n in names):
            raise ConfigError(
                f"{f}: field {key!r} missing or not {'an object' if kind is dict else 'a list'} of tensor names"
            )
        return set(names)
    single = path / "model.safetensors"
    if _kind(single) == "file":
        return _safetensors_names(single)
    return None


def _safetensors_names(path: Path) -> set[str]:
    """The tensor names in a single-file checkpoint's header (8-byte length, then JSON)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            raw = f.read(n) if 0 <= n <= MAX_HEADER_BYTES else b""
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    if n < 0 or len(raw) != n:
        raise ConfigError(f"{path}: truncated safetensors header")
    hdr = load_json(
        raw,
        what="safetensors header",
        name=str(path),
        expect=dict,
        max_bytes=MAX_HEADER_BYTES,
        error=ConfigError,
        unique_keys=True,
    )
    return {k for k in hdr if k != "__metadata__"}
