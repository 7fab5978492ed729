"""A hop that dies mid-generation is replaced, and the answer is the same answer."""
from __future__ import annotations

import asyncio
import signal

import pytest

from fabric.client import AsyncClient, HeadDied
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.tiny_models import reference_greedy

TOKENS = 150


def stream_and_kill(process_cluster, model, victim_of, after: int = 5) -> tuple[list[int], str]:
    """Stream a greedy request; after ``after`` tokens kill -9 the node ``victim_of(route)`` names."""
    got, victim = [], None
    with process_cluster.client() as client:
        for event in client.generate(model.name, messages=MESSAGES, max_tokens=TOKENS):
            if event.event == "start":
                victim = victim_of(event.route)
            got.extend(event.token_ids)
            if len(got) == after:
                process_cluster.kill(victim, signal.SIGKILL)
    return got, victim


@pytest.mark.parametrize("secured", [False, True])
def test_dead_tail_is_replaced_and_output_is_unchanged(process_cluster, tiny_models, secured):
    if secured:
        process_cluster.secure()
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), TOKENS)
    process_cluster.start_node("head", str(model), "0-2")
    process_cluster.start_node("tail1", str(model), "3-5")
    process_cluster.start_node("tail2", str(model), "3-5")
    process_cluster.wait_nodes(["head", "tail1", "tail2"], model.name)
    got, victim = stream_and_kill(process_cluster, model, lambda route: route[-1].node)
    assert victim in ("tail1", "tail2")
    assert got == expected


def test_dead_middle_hop_of_three_is_replaced(process_cluster, tiny_models):
    model = tiny_models("qwen3")
    expected = reference_greedy(model, prompt_ids(model), TOKENS)
    process_cluster.start_node("head", str(model), "0-1")
    process_cluster.start_node("mid1", str(model), "2-3")
    process_cluster.start_node("mid2", str(model), "2-3")
    process_cluster.start_node("tail", str(model), "4-5")
    process_cluster.wait_nodes(["head", "mid1", "mid2", "tail"], model.name)
    got, victim = stream_and_kill(process_cluster, model, lambda route: route[1].node)
    assert victim in ("mid1", "mid2")
    assert got == expected


def test_dead_head_without_a_replica_fails_its_stream_with_a_clear_error(process_cluster, tiny_models):
    """No other head holds layer 0: the request cannot go on (tests/test_handover.py: with one, it does)."""
    model = tiny_models("llama")
    process_cluster.start_node("head", str(model), "0-2")
    process_cluster.start_node("tail", str(model), "3-5")
    process_cluster.wait_nodes(["head", "tail"], model.name)
    got = []
    with process_cluster.client() as client:
        with pytest.raises(HeadDied, match="the head head .* died, and no other head could take the request over"):
            for event in client.generate(model.name, messages=MESSAGES, max_tokens=TOKENS):
                got.extend(event.token_ids)
                if len(got) == 3:
                    process_cluster.kill("head", signal.SIGKILL)
    assert len(got) >= 3


def test_request_resubmitted_when_the_head_dies_before_any_token(process_cluster, tiny_models):
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 12)
    process_cluster.start_node("head1", str(model), "0-5")
    process_cluster.start_node("head2", str(model), "0-5")
    process_cluster.wait_nodes(["head1", "head2"], model.name)
    with process_cluster.client() as client:
        events = client.generate(model.name, messages=MESSAGES, max_tokens=12)  # route chosen now
        first = client.route(model.name)[0].node
        process_cluster.kill(first, signal.SIGKILL)  # dies before it saw the request
        ids = [t for e in events for t in e.token_ids]
    assert ids == expected


def test_async_client_resubmits_when_the_head_dies_before_any_token(process_cluster, tiny_models):
    """The web UI's path: AsyncClient asks for its route at the first event, finds that head
    dead, and goes again around it."""
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 12)
    process_cluster.start_node("head1", str(model), "0-5")
    process_cluster.start_node("head2", str(model), "0-5")
    process_cluster.wait_nodes(["head1", "head2"], model.name)

    async def generate() -> tuple[list[int], str, str]:
        client = AsyncClient(process_cluster.endpoint, timeout=30)
        try:
            first = (await client.route(model.name))[0].node
            process_cluster.kill(first, signal.SIGKILL)  # the tracker still plans on it for a while
            ids, served = [], ""
            async for event in client.generate(model.name, messages=MESSAGES, max_tokens=12):
                served = served or event.route[0].node
                ids.extend(event.token_ids)
            return ids, first, served
        finally:
            await client.close()

    ids, dead, served = asyncio.run(generate())
    assert ids == expected
    assert served != dead
