from __future__ import annotations

import os

import pytest
import torch
import zmq

from tests.cluster import ProcessCluster, ThreadCluster
from tests.support.areas import REQUIRE_ENV, skip_area, skipped_areas
from tests.tiny_models import make_model

# One compute thread in the test process. Its models are tiny (hidden sizes of 64 to 256): a
# second OpenMP thread gains nothing on them and spins on a core that the nodes, the tracker and
# the other processes of a test need; on a 2-core machine under load it made the in-process
# GGUF family checks six times as costly in CPU. Node processes keep their own --threads. A run
# that names its thread count (OMP_NUM_THREADS=2 python -m pytest ...: the exactness checks on
# other thread counts) keeps it.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def cache_root(xdg_cache):
    """meshnet's cache under the session's XDG cache (``default_cache_root`` of its processes):
    an in-process load given it keeps a GGUF's parsed metadata there, as a node does."""
    return xdg_cache / "meshnet"


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
        skip_area("namespaces", reason)
    with Netbed(tmp_path / "netbed", xdg_cache) as bed:
        yield bed


@pytest.fixture(params=["sync", "async"])
def shell(request):
    """Makes a client of each shell in turn (``Client``, then ``AsyncClient`` behind the same
    blocking calls: tests/support/shells.py), so that a client test taking it runs against
    both: ``with shell(endpoint, timeout=5) as client``."""
    from tests.support.shells import SHELLS

    return SHELLS[request.param]


@pytest.fixture
def ctx():
    """A ZeroMQ context of the test's own, destroyed with every socket left in it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=["llama", "qwen3"])
def tiny_split(request, thread_cluster, tiny_models):
    """A tiny model of two families split over two real nodes on loopback, a head (layers 0-2)
    and a tail (3-5): (cluster, model dir, the route's hops)."""
    from fabric.wire.protocol import Hop

    model_dir = tiny_models(request.param)
    head = thread_cluster.add_node(model_dir, 0, 2, 6, "head")
    tail = thread_cluster.add_node(model_dir, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model_dir.name, 2)
    return thread_cluster, model_dir, (Hop("head", head.endpoint, 0, 2), Hop("tail", tail.endpoint, 3, 5))


@pytest.fixture
def split(tiny_models):
    """A tiny llama's two shard executors in this process, no sockets (tests/test_route_session.py
    and tests/test_handover.py drive a RouteSession over them): (model dir, executors by node,
    tokenizer, route). Modules that split over real nodes define a ``split`` of their own."""
    from fabric.compute.executor import ShardExecutor
    from fabric.compute.kv import KVStore
    from fabric.compute.models import load_shard, load_tokenizer, resolve
    from fabric.wire.protocol import Hop
    from fabric.wire.shard import Shard

    model_dir = tiny_models("llama")
    source = resolve(str(model_dir))
    executors = {name: ShardExecutor(load_shard(source, Shard(a, b, 6), progress=False), KVStore())
                 for name, (a, b) in {"h": (0, 2), "t": (3, 5)}.items()}
    route = (Hop("h", "inproc://h", 0, 2), Hop("t", "inproc://t", 3, 5))
    return model_dir, executors, load_tokenizer(source), route


@pytest.fixture
def browser():
    """Debian's chromium under Playwright, headless; skips (as an area, see the run's summary)
    where either is missing."""
    from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, chromium_missing

    if reason := chromium_missing():
        skip_area("browser", reason)
    from playwright import sync_api

    try:
        with sync_api.sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            yield chromium
            chromium.close()
    except sync_api.Error as exc:
        if "Executable doesn't exist" in str(exc):
            skip_area("browser", f"chromium could not start: {exc}")
        raise


# --------------------------------------------------------------------------- areas the run did not cover


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One loud line naming each area that skipped (tests/support/areas.py), so that a green
    run on a machine without chromium, root or the model never passes for a full one."""
    areas = skipped_areas(terminalreporter.stats.get("skipped", []))
    if areas:
        said = "; ".join(f"{area} ({why})" for area, why in sorted(areas.items()))
        fails = " -- this run FAILS (MESHNET_REQUIRE_ALL_AREAS=1)" if _required() else ""
        terminalreporter.write_line(f"AREAS NOT TESTED: {said}{fails}", red=True, bold=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Under MESHNET_REQUIRE_ALL_AREAS=1 (.ci/run) a skipped area fails an otherwise green run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if _required() and reporter is not None and exitstatus == pytest.ExitCode.OK:
        if skipped_areas(reporter.stats.get("skipped", [])):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


@pytest.fixture
def split_every_call(monkeypatch):
    """Our C kernels split even the smallest call over every torch thread (a node gives each
    thread at least ``native.WORK_PER_THREAD``, and times middling calls on one thread against
    all: ``fabric.compute.splits``), so that a test's thread count is what runs."""
    from fabric.compute import native, splits

    monkeypatch.setattr(native, "WORK_PER_THREAD", 1)
    monkeypatch.setattr(splits, "LEARN_BELOW", 0)


@pytest.fixture
def torchs_kernels(monkeypatch):
    """A GGUF's default mode on torch's weight-only kernels, not q8dot (``MESHNET_Q8DOT=0``): for
    tests of those modules themselves."""
    monkeypatch.setenv("MESHNET_Q8DOT", "0")


@pytest.fixture
def two_threads():
    """torch on two threads within the test (a node's threads on a 2-core machine), as before after."""
    from fabric.node.hops import on_threads

    with on_threads(2):
        yield
