"""Typed access to a JSON object that names the field path in every error, and the
plausibility limits a field is held to."""

from __future__ import annotations

import json
import math
from typing import Any

from streamrt.errors import ConfigError

# Plausibility limits: far above any released geometry (K3: 93 layers, 896 experts, hidden
# 7168), low enough that a typo is refused before a schedule, a tensor list or a message
# is built from it.
MAX_LAYERS, MAX_EXPERTS, MAX_DIM, MAX_VOCAB = 1024, 16384, 1 << 17, 1 << 22
MAX_MODEL_BYTES = 1 << 50  # 1 PiB: no machine holds more


def show(v: Any, limit: int = 60) -> str:
    """A value for a message, cut to `limit` characters (a config can hold anything)."""
    if isinstance(v, int) and not isinstance(v, bool):
        digits = len(str(abs(v))) if abs(v) < 10**limit else limit + 1
        text = str(v) if digits <= limit else f"an integer of more than {limit} digits"
    elif isinstance(v, (dict, list)):
        text = f"a JSON {'object' if isinstance(v, dict) else 'array'} of {len(v)} entries"
    else:
        text = json.dumps(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Fields:
    """Typed field access that names the field path in every error."""

    def __init__(self, data: dict, prefix: str, source: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {prefix or 'config'} must be a JSON object")
        self.d, self.prefix, self.source = data, prefix, source

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def err(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.path(key)}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.d and self.d[key] is not None

    def int(self, key: str, default: Any = ..., *, min_value: int = 1, max_value: int | None = None) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(key, f"expected an integer, got {show(v)}")
        if v < min_value:
            raise self.err(key, f"must be >= {min_value}, got {show(v)}")
        if max_value is not None and v > max_value:
            raise self.err(key, f"{show(v)} is implausible (streamrt accepts at most {max_value:,})")
        return v

    def float(self, key: str, default: Any = ..., *, positive: bool = False) -> float:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.err(key, f"expected a number, got {show(v)}")
        if positive and v <= 0:
            raise self.err(key, f"must be > 0, got {v}")
        return float(v)

    def bool(self, key: str, default: Any = ...) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self.err(key, f"expected true or false, got {show(v)}")
        return v

    def str(self, key: str, default: Any = ...) -> str:
        v = self._get(key, default)
        if not isinstance(v, str):
            raise self.err(key, f"expected a string, got {show(v)}")
        return v

    def int_list(self, key: str) -> list[int]:
        v = self._get(key, ...)
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self.err(key, "expected a list of integers")
        return v

    def sub(self, key: str) -> "Fields":
        v = self._get(key, ...)
        if not isinstance(v, dict):
            raise self.err(key, "expected an object")
        return Fields(v, self.path(key), self.source)

    def _get(self, key: str, default: Any) -> Any:
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is ...:
            raise self.err(key, "missing")
        return default


def few(values: list[int], n: int = 8) -> str:
    """A list for a message: at most n entries, then how many more."""
    head = ", ".join(str(v) for v in values[:n])
    return f"[{head}{f', ... ({len(values) - n} more)' if len(values) > n else ''}]"
