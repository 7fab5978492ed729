"""How `meshnet up` splits a model's layers: by the memory each node will hold, the ends of the
model (a head's tokenizer, a tail's lm_head) taking fewer layers where they hold more."""
from __future__ import annotations

import itertools

import pytest

from fabric.wire.shard import Shard, balanced_split, even_split


def largest(shards: list[Shard], layer: float, first: float, last: float) -> float:
    return max(s.size * layer + (first if s.is_first else 0) + (last if s.is_last else 0) for s in shards)


def every_split(num_layers: int, parts: int):
    """Every way to cut ``num_layers`` into ``parts`` contiguous non-empty shards."""
    for cuts in itertools.combinations(range(1, num_layers), parts - 1):
        bounds = (0, *cuts, num_layers)
        yield [Shard(a, b - 1, num_layers) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("num_layers,parts", [(6, 2), (24, 2), (24, 3), (30, 4), (7, 7)])
def test_ends_that_hold_nothing_more_split_evenly(num_layers, parts):
    assert balanced_split(num_layers, parts, 50.0) == even_split(num_layers, parts)
    sizes = [s.size for s in balanced_split(num_layers, parts, 50.0, 3.0, 3.0)]  # less than a layer more
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == num_layers


def test_a_tied_1_7b_tail_gives_a_layer_to_the_head():
    """The 1.7B shape of bench/models.py: 24 layers, a tokenizer at the head (~18 MiB), an int8
    lm_head at the tail (96 MiB). The even split's tail is the largest node; moving a layer
    makes the largest smaller."""
    shards = balanced_split(24, 2, 64.0, 18.0, 96.0)
    assert [str(s) for s in shards] == ["0-12", "13-23"]
    assert largest(shards, 64.0, 18.0, 96.0) < largest(even_split(24, 2), 64.0, 18.0, 96.0)
    three = balanced_split(24, 3, 64.0, 18.0, 96.0)
    assert three[-1].size < 8 and sum(s.size for s in three) == 24


@pytest.mark.parametrize("num_layers,parts,first,last", [(9, 2, 0, 40), (9, 3, 25, 40), (10, 3, 70, 0),
                                                         (8, 4, 10, 10), (12, 3, 5, 150)])
def test_no_split_has_a_smaller_largest_node(num_layers, parts, first, last):
    shards = balanced_split(num_layers, parts, 10.0, first, last)
    assert [s.start for s in shards][0] == 0 and shards[-1].end == num_layers - 1
    assert all(a.end + 1 == b.start for a, b in zip(shards, shards[1:]))  # contiguous, every layer once
    best = min(largest(s, 10.0, first, last) for s in every_split(num_layers, parts))
    assert largest(shards, 10.0, first, last) == best


def test_end_bytes_count_what_each_end_holds():
    """A GGUF head reads embedding rows from the file (nothing whole); a directory's loads it;
    the tail's lm_head is int8 under a scheme, else in the dtype."""
    import types

    import torch

    from fabric.cli.memory_plan import TOKENIZER_BYTES_PER_TOKEN, end_bytes

    config = types.SimpleNamespace(vocab_size=1000, hidden_size=64)
    tokenizer = 1000 * TOKENIZER_BYTES_PER_TOKEN
    assert end_bytes(config, True, torch.bfloat16, "gguf") == (tokenizer, 64_000)
    assert end_bytes(config, False, torch.float32, None) == (tokenizer + 256_000, 256_000)
