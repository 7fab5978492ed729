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


def parse_range(text: str) -> tuple[int, int]:
    """(start, end) of an inclusive range such as ``0-14``, start <= end; a clear ValueError otherwise."""
    m = _RANGE.match(text)
    if not m:
        raise ValueError(f"--layers takes an inclusive range like 0-14, got {text!r}")
    start, end = int(m.group(1)), int(m.group(2))
    if start > end:
        raise ValueError(f"--layers {text} runs backwards: give the first layer, then the last")
    return start, end


def layer_range(text: str) -> str:
    """``--layers`` A-B as an argparse type: refused as the flag is read where it is no range
    (whether it fits the model is known once its config is read)."""
    import argparse

    try:
        parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--layers ")) from None
    return text


def parse_layers(text: str, num_layers: int) -> Shard:
    """Parse an inclusive range such as ``0-14`` of a ``num_layers``-layer model; a clear ValueError otherwise."""
    return Shard(*parse_range(text), num_layers)


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


def balanced_split(num_layers: int, parts: int, layer_cost: float, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[Shard]:
    """Split ``num_layers`` into ``parts`` contiguous shards whose largest memory is least.

    A node's memory is its layers (``layer_cost`` each) plus what its end of the model holds:
    the first shard's ``first_extra`` (a head's tokenizer, its embedding where it is loaded
    whole), the last shard's ``last_extra`` (the final norm and lm_head). An even split gives
    the tail of a tied 1.7B GGUF 1.5-2 layers' worth more than the head, so the ends take fewer
    layers. Where no split is better than ``even_split``'s, that is the answer (its sizes).
    """
    even = even_split(num_layers, parts)
    if parts == 1:
        return even

    def cost(start: int, end: int) -> float:
        return ((end - start + 1) * layer_cost + (first_extra if start == 0 else 0.0)
                + (last_extra if end == num_layers - 1 else 0.0))

    best_even = max(cost(s.start, s.end) for s in even)
    # least[k][i]: the least largest cost of the first i layers in k shards, and where the last one starts
    least = [[(float("inf"), 0)] * (num_layers + 1) for _ in range(parts + 1)]
    least[0][0] = (0.0, 0)
    for k in range(1, parts + 1):
        for i in range(k, num_layers - (parts - k) + 1):
            least[k][i] = min(((max(least[k - 1][j][0], cost(j, i - 1)), j) for j in range(k - 1, i)),
                              key=lambda c: c[0])
    if least[parts][num_layers][0] >= best_even - 1e-9 * max(1.0, best_even):
        return even
    shards, end = [], num_layers
    for k in range(parts, 0, -1):
        start = least[k][end][1]
        shards.append(Shard(start, end - 1, num_layers))
        end = start
    return shards[::-1]
