"""Every attack of tests/adversary/attacks.py, by a rogue process, while honest clients
stream: none gets through, and every honest stream is what it was with no attacker."""
from __future__ import annotations

import pytest

from fabric.client import FabricError
from tests.adversary.arena import Arena
from tests.adversary.attacks import ATTACKS
from tests.cluster import wait_for


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    arena = Arena(tmp_path_factory.mktemp("arena"))
    yield arena
    arena.close()


@pytest.mark.parametrize("name", sorted(ATTACKS, key=lambda n: n == "session_flood"))
def test_attack_fails_and_honest_streams_are_unchanged(arena, name):
    outcome = arena.attack(name)
    assert not outcome.won, outcome.detail
    assert outcome.harmed == 0, outcome.detail


def test_the_same_tenant_does_start_from_kept_kv(arena):
    """The control of cross_tenant_prefix: the request it sends, under the honest clients' own
    (absent) API key, is served from their kept KV; under another key it is not."""
    from tests.adversary.arena import PROMPTS

    def hits() -> int:
        return sum(n.kv.retained.stats["hits"] for n in arena.cluster.nodes.values())

    def ask(api_key):
        with arena.cluster.client() as client:
            list(client.generate(arena.model.name, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=2,
                                 api_key=api_key))

    def routable() -> bool:  # the session flood's slots free at the tail's idle timeout
        try:
            ask(None)  # whatever the attacks left: the honest tenant's request is kept again
            return True
        except FabricError:
            return False

    assert wait_for(routable, 60, 0.5)
    before = hits()
    ask("another tenant")
    assert hits() == before
    ask(None)
    assert hits() > before
