from __future__ import annotations

import pytest
import zmq

from tests.cluster import ProcessCluster, ThreadCluster
from tests.tiny_models import make_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> directory of a 6-layer random model (made once per test session)."""
    root = tmp_path_factory.mktemp("models")
    cache: dict = {}

    def get(family: str = "llama"):
        if family not in cache:
            cache[family] = make_model(family, root / family)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def xdg_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture
def thread_cluster():
    cluster = ThreadCluster()
    yield cluster
    cluster.close()


@pytest.fixture
def process_cluster(tmp_path, xdg_cache):
    cluster = ProcessCluster(tmp_path, xdg_cache)
    yield cluster
    cluster.close()


@pytest.fixture
def netbed(tmp_path, xdg_cache):
    """A multi-host bed of network namespaces (tests/netbed.py), torn down after the test;
    skips where namespaces cannot be made (not root, no ``ip netns``)."""
    from tests.netbed import Netbed, unavailable

    if reason := unavailable():
        pytest.skip(reason)
    with Netbed(tmp_path / "netbed", xdg_cache) as bed:
        yield bed


@pytest.fixture
def ctx():
    """A ZeroMQ context of the test's own, destroyed with every socket left in it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
