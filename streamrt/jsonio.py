"""Reading JSON a user or a disk handed us: one helper, one-line errors, bounded work.

    from streamrt.jsonio import load_json
    data = load_json(path, what="manifest", expect=dict)                       # CheckpointError
    data = load_json(raw_bytes, what="safetensors header", name=str(path))     # bytes already read
    data = load_json(cfg_file, what="config", error=ConfigError, max_bytes=1 << 20)

Every problem is one `error` (a StreamrtError subclass, CheckpointError by default) whose
message starts with the file name and says what was wrong: too large, not UTF-8 (with the
byte offset), nested deeper than `max_depth` (checked on the bytes BEFORE `json.loads`
recurses, so 1,000 nested brackets are an error, not a RecursionError), invalid JSON (line
and column), a non-standard constant (NaN, Infinity), a number too long to convert, or the
wrong top-level type (`expect`); with `unique_keys`, an object naming a key twice
(json.loads would keep the last copy silently). A file that cannot be read is the same one-line error;
nothing else escapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from streamrt.errors import CheckpointError, StreamrtError, clip

DEFAULT_MAX_DEPTH = 64  # our formats nest at most ~4 levels; 64 leaves room and stays far from recursion
DEFAULT_MAX_BYTES = 100 << 20  # the safetensors header limit; callers reading small files pass less

_KEEP = b'"[]{}'
_DROP = bytes(b for b in range(256) if b not in _KEEP)


def json_depth(data: bytes, limit: int | None = None) -> int:
    """Maximum bracket nesting of JSON text, counting only brackets outside strings.

    Linear C-speed passes, no recursion: drop escaped backslashes and quotes, keep only quotes
    and brackets, drop what lies between quotes, then peel innermost bracket pairs one level
    per pass. Unclosed openers count as levels (such text is invalid JSON anyway). With
    `limit`, stops once the depth passes it (returns limit + 1): never more than limit + 1 passes."""
    bare = bytes(data).replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP)
    outside = b"".join(bare.split(b'"')[::2])
    skeleton = outside.replace(b"{", b"[").replace(b"}", b"]")
    depth = 0
    while True:
        peeled = skeleton.replace(b"[]", b"")
        if len(peeled) == len(skeleton):
            return depth + skeleton.count(b"[")
        skeleton, depth = peeled, depth + 1
        if limit is not None and depth > limit:
            return depth


def loads_text(text: str, max_depth: int = DEFAULT_MAX_DEPTH):
    """json.loads for JSON inside a message (a tool call's arguments, a value the model wrote):
    ValueError when it is not standard JSON (NaN, Infinity, a number past float's range, which
    strict clients cannot parse when we send it on) or nests deeper than `max_depth` (checked on
    the text before json.loads recurses, so never a RecursionError)."""
    if json_depth(text.encode("utf-8", "surrogatepass"), max_depth) > max_depth:
        raise ValueError(f"JSON nested more than {max_depth} levels deep")
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def dumps_text(value) -> str:
    """json.dumps keeping non-ASCII as is, unless a string holds a lone surrogate (a model may
    escape one: `"\\ud800"`), which no UTF-8 output can carry: then everything escaped."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value)
    return text


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:20]} is past float's range")
    return value


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


class _DuplicateKey(ValueError):
    pass


def _unique_keys_object(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object_pairs_hook that refuses a key named twice in one object."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(f"key {clip(key, 100)!r} appears twice in one object; the file is ambiguous")
            seen.add(key)
    return obj


def load_json(
    source: str | os.PathLike | bytes | bytearray | memoryview,
    *,
    what: str,
    name: str | None = None,
    expect: type | tuple[type, ...] | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_bytes: int = DEFAULT_MAX_BYTES,
    error: type[StreamrtError] = CheckpointError,
    unique_keys: bool = False,
):
    """Parse JSON from a path or from bytes already read.

    source: a path (read here) or the bytes themselves.
    what:   what the JSON is, for the message ("manifest", "config", "safetensors header").
    name:   the file the message names (default: the path; for bytes give the file they came from).
    expect: required type of the top-level value (e.g. dict), or None for any.
    max_depth, max_bytes: limits, checked before parsing.
    error:  the StreamrtError subclass raised (ConfigError for configs).
    unique_keys: refuse an object that names a key twice (headers, indexes, configs: which
            copy counts must not depend on the parser).

    Returns the parsed value; raises `error("<name>: <what>: <reason>")`, always one line."""
    data, label = _read_source(source, what, name, max_bytes, error)
    fail = lambda reason: error(f"{label}: {what}: {reason}")  # noqa: E731
    if len(data) > max_bytes:
        raise fail(f"{len(data):,} bytes, over the {max_bytes:,}-byte limit for this file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); the file is corrupt") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    depth = json_depth(data, max_depth)
    if depth > max_depth:
        raise fail(f"nested more than {max_depth} levels deep; the file is corrupt")
    try:
        value = json.loads(text, parse_constant=_reject_constant,
                           object_pairs_hook=_unique_keys_object if unique_keys else None)
    except json.JSONDecodeError as e:
        raise fail(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except _DuplicateKey as e:
        raise fail(str(e)) from None
    except (ValueError, RecursionError) as e:  # a constant we reject, an int past Python's digit limit
        reason = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise fail(f"invalid JSON: {reason[:120]}") from None
    if expect is not None and not isinstance(value, expect):
        want = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise fail(f"expected a JSON {want}, got {_TYPE_NAMES.get(type(value), type(value).__name__)}")
    return value


def _read_source(source, what: str, name: str | None, max_bytes: int, error: type[StreamrtError]) -> tuple[bytes, str]:
    """(the bytes, the name messages give them): from a path, read here with its size checked
    before reading, or the bytes themselves."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), name or "<bytes>"
    path = Path(source)
    label = name or str(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{label}: {what}: {size:,} bytes, over the {max_bytes:,}-byte limit for this file")
        with open(path, "rb") as f:
            return f.read(max_bytes + 1), label
    except OSError as e:
        raise error(f"{label}: cannot read {what}: {e.strerror or e}") from None


_TYPE_NAMES = {dict: "object", list: "array", str: "string", int: "integer", float: "number",
               bool: "boolean", type(None): "null"}


def type_name(value) -> str:
    """The JSON name of a parsed value's type, for messages ("object", "array", ...)."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


__all__ = ["load_json", "json_depth", "type_name", "DEFAULT_MAX_DEPTH", "DEFAULT_MAX_BYTES"]
