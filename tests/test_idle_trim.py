"""A node's memory housekeeping: it hands the heap its requests freed back to the OS once idle
(once per idle spell, never while work is queued, and not before it has been idle for
IDLE_TRIM_S), and it keeps what it loaded out of the garbage collector's walks."""
from __future__ import annotations

from fabric.node.idle_trim import IdleTrim
from tests.support import wait_for


def test_trims_once_after_work_once_idle_long_enough():
    trims: list[float] = []
    idle = IdleTrim(lambda: trims.append(1), idle_s=2.0)
    assert not idle.tick(100.0, busy=False)  # nothing ran yet: nothing to hand back
    idle.worked(100.0)
    assert not idle.tick(101.9, busy=False)  # a stream between its steps
    assert not idle.tick(103.0, busy=True)  # work queued: it runs first
    assert idle.tick(103.0, busy=False) and trims == [1]
    assert not idle.tick(200.0, busy=False) and trims == [1]  # once per idle spell
    idle.worked(201.0)  # the next request
    assert idle.tick(203.5, busy=False) and trims == [1, 1]


def test_both_nodes_of_a_split_trim_once_a_request_has_ended(tiny_split, monkeypatch):
    """Real nodes on loopback: each hands its freed heap back once the request has ended (how
    often, on a clock, is the test above: here a slow step could pass for an idle spell)."""
    cluster, model_dir, _ = tiny_split
    trims: dict[str, int] = {}
    for name, node in cluster.nodes.items():
        node.idle_trim.idle_s = 0.3
        node.idle_trim.trim = lambda name=name: trims.__setitem__(name, trims.get(name, 0) + 1)
    with cluster.client() as client:
        tokens = [t for e in client.generate(model_dir.name, prompt="hello there", max_tokens=6, ignore_eos=True)
                  for t in e.token_ids]
    assert len(tokens) == 6
    assert wait_for(lambda: trims.get("head", 0) >= 1 and trims.get("tail", 0) >= 1), trims


def test_what_a_node_loaded_is_out_of_the_collectors_sight(tiny_split):
    """A node freezes what it loaded (gc.freeze): a full collection would otherwise walk every
    module, parameter and tokenizer object (140-170 ms for SmolLM2's node), a stall in some
    stream's next token whenever the collector's third generation came due."""
    import gc

    cluster, _, _ = tiny_split
    for node in cluster.nodes.values():
        layer = next(iter(node.executor.w.layers.values()))
        assert gc.get_freeze_count() > 0
        assert not any(o is layer for o in gc.get_objects(generation=2)), "a loaded layer is still collected"
