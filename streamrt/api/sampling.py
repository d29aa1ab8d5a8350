"""`Sampling`: how the next token is drawn, and how many. One value shared by the Python API,
`streamrt run` (built from its flags) and `streamrt selfcheck`."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SEED = 2**44 - 1  # generate seeds row r with seed * 1_000_003 + r, which must fit torch's 64 bits
MAX_NEW_TOKENS = 1 << 20  # the longest context any supported model has


@dataclass(frozen=True)
class Sampling:
    """Greedy (argmax, the same answer every time) when `greedy` or `temperature == 0`; else
    nucleus sampling at `temperature` over the `top_p` mass, seeded by `seed`.

    A bad value is a TypeError or ValueError naming the field."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.95
    seed: int = 0
    greedy: bool = False
    ignore_eos: bool = False  # generate all max_new_tokens (benchmarks); the stop tokens are sampled like any other
    top_k: int = 0  # as vLLM's: <= 0 is off
    min_p: float = 0.0  # as vLLM's: drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0  # as vLLM's: over the prompt and the reply so far

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "seed", "top_k"):
            _check_type(name, getattr(self, name), int, "an int")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            _check_type(name, getattr(self, name), (int, float), "a number")
        for name in ("greedy", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {type(getattr(self, name)).__name__}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0..{MAX_SEED}, got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def _check_type(name: str, value, types, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, types):  # True is an int to Python, not to us
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}"[:200])
