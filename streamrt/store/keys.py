"""`ExpertKey`: the name of one routed expert (one file in the converted tree)."""

from __future__ import annotations

from typing import NamedTuple


class ExpertKey(NamedTuple):
    layer: int
    expert: int

    def __str__(self) -> str:
        return f"L{self.layer:03d}/E{self.expert:04d}"
