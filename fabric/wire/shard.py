"""Layer-range records: the shard a node holds and the hop a route asks it to run."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Layers ``start..end`` (inclusive) of a model with ``num_layers`` decoder layers."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end < self.num_layers:
            raise ValueError(f"layers {self.start}-{self.end} do not fit a {self.num_layers}-layer model")

    @property
    def is_first(self) -> bool:
        """Holds layer 0, so it embeds tokens."""
        return self.start == 0

    @property
    def is_last(self) -> bool:
        """Holds the last layer, so it has the final norm and lm_head and samples."""
        return self.end == self.num_layers - 1

    @property
    def size(self) -> int:
        return self.end - self.start + 1

    def covers(self, start: int, end: int) -> bool:
        return self.start <= start <= end <= self.end

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"


_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_layers(text: str, num_layers: int) -> Shard:
    """Parse an inclusive range such as ``0-14``; a clear ValueError otherwise."""
    m = _RANGE.match(text)
    if not m:
        raise ValueError(f"--layers takes an inclusive range like 0-14, got {text!r}")
    return Shard(int(m.group(1)), int(m.group(2)), num_layers)


def even_split(num_layers: int, parts: int) -> list[Shard]:
    """Split ``num_layers`` into ``parts`` contiguous shards, sizes differing by at most one."""
    if not 1 <= parts <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} parts")
    base, extra = divmod(num_layers, parts)
    shards, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        shards.append(Shard(start, start + size - 1, num_layers))
        start += size
    return shards
