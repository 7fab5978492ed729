"""The fabric across hosts: each process in its own network namespace, links with delay.

Hosts, links and processes come from tests/netbed.py; the delay proxy that adds delay
where the kernel has no netem is tested here on loopback too.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests import netbed
from tests.delay_proxy import Delays
from tests.support.areas import skip_area
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.tiny_models import reference_greedy

DELAY = 0.002  # one way, on every host's link: a path between two hosts takes 2 * DELAY
TOKENS = 48
FAILOVER_TOKENS = 150
NODES = {"head": "0-1", "mid": "2-3", "tail1": "4-5", "tail2": "4-5"}  # tail2: the spare


@pytest.fixture(scope="module")
def bed(tmp_path_factory, xdg_cache, tiny_models):
    """A tracker, a 3-hop route with a spare tail and a web UI, each on its own host;
    the test drives it from a client host."""
    if reason := netbed.unavailable():
        skip_area("namespaces", reason)
    model = tiny_models("llama")
    with netbed.Netbed(tmp_path_factory.mktemp("netbed"), xdg_cache) as bed:
        for host in ("tracker", *NODES, "client"):
            bed.add_host(host, delay=DELAY)
        bed.start_tracker("tracker")
        for host, layers in NODES.items():
            bed.start_node(host, model, layers)
        bed.url = bed.start_webui("tracker")
        with bed.client("client") as client:
            client.wait_nodes(list(NODES), model.name, procs=bed.procs)
            bed.agent, bed.model = client, model
            yield bed


def token_ids(events) -> list[int]:
    return [t for e in events if e["event"] == "token" for t in e["ids"]]


def test_three_hosts_produce_the_single_process_tokens(bed):
    model = bed.model
    expected = reference_greedy(model, prompt_ids(model), TOKENS)
    events = list(bed.agent.generate(model.name, MESSAGES, TOKENS))
    route = events[0]["route"]
    assert [h["node"] for h in route][:2] == ["head", "mid"] and route[2]["node"] in ("tail1", "tail2")
    for hop in route:  # peers dial each other on the bed's switch, never on loopback
        assert hop["endpoint"].startswith(f"tcp://{bed.hosts[hop['node']].ip}:")
    assert token_ids(events) == expected
    # a decode step goes head -> mid -> tail -> head: three paths of 2 * DELAY one way
    times = [e["t"] for e in events if e["event"] == "token"]
    assert (times[-1] - times[0]) / (len(times) - 1) >= 3 * 2 * DELAY


def test_dead_tail_host_is_replaced_and_output_is_unchanged(bed):
    model = bed.model
    expected = reference_greedy(model, prompt_ids(model), FAILOVER_TOKENS)
    got, victim = [], None
    for event in bed.agent.generate(model.name, MESSAGES, FAILOVER_TOKENS):
        if event["event"] == "start":
            victim = event["route"][-1]["node"]
        got.extend(event["ids"])
        if len(got) >= 5 and victim in bed.procs:
            bed.kill(victim)  # kill -9 the tail's process; its host stays up
    assert victim in ("tail1", "tail2") and victim not in bed.procs  # killed mid-stream
    assert got == expected


def test_web_ui_on_another_host_answers_with_the_route_text(bed):
    model = bed.model
    direct = "".join(e["text"] for e in bed.agent.generate(model.name, MESSAGES, TOKENS) if e["event"] == "token")
    status, body = bed.agent.http("POST", f"{bed.url}/v1/chat/completions",
                                  {"model": model.name, "messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == direct


def test_link_delay_sets_round_trips_and_can_change(bed):
    head = bed.hosts["head"]
    endpoint = f"tcp://{head.ip}:{netbed.NODE_PORT}"
    assert min(bed.agent.ping(endpoint, 5)) >= 2 * (DELAY + DELAY)
    bed.set_link("client", delay=0.030)
    try:
        assert min(bed.agent.ping(endpoint, 3)) >= 2 * (0.030 + DELAY)
    finally:
        bed.set_link("client", delay=DELAY)


def test_host_without_inbound_dials_out_but_nobody_reaches_it(bed):
    nat = bed.add_host("nat", delay=DELAY, inbound=False)
    web = bed.spawn("nat", "nat-web", ["-m", "http.server", "7100", "--bind", nat.ip])
    url = f"http://{nat.ip}:7100/"
    try:
        with bed.client("nat") as inside:
            assert netbed.wait_until(lambda: _get(inside, url) == 200, 15)  # its own processes reach it
            assert inside.status()["nodes"]  # it dials the tracker on another host
        with pytest.raises(netbed.AgentError, match="timed out"):
            bed.agent.http("GET", url, timeout=2)  # another host cannot connect
    finally:
        bed.kill("nat-web", 15)
    assert web.returncode is not None


def test_rate_limit_holds_a_bulk_transfer_to_the_link_rate(bed, tmp_path):
    (tmp_path / "blob").write_text(os.urandom(150_000).hex())  # 300 kB
    host = bed.add_host("bulk", rate="2mbit")
    bed.spawn("bulk", "bulk-web", ["-m", "http.server", "7100", "--bind", host.ip, "--directory", str(tmp_path)])
    try:
        assert netbed.wait_until(lambda: _get(bed.agent, f"http://{host.ip}:7100/") == 200, 15)
        start = time.monotonic()
        status, body = bed.agent.http("GET", f"http://{host.ip}:7100/blob", timeout=30)
        elapsed = time.monotonic() - start
    finally:
        bed.kill("bulk-web", 15)
    assert status == 200 and len(body) == 300_000
    assert elapsed >= (300_000 - (64 << 10)) * 8 / 2e6 * 0.9  # all but one burst at 2 Mbit/s


def test_unplugged_host_goes_silent_and_comes_back(bed, tmp_path):
    host = bed.add_host("cut")
    bed.spawn("cut", "cut-web", ["-m", "http.server", "7100", "--bind", host.ip, "--directory", str(tmp_path)])
    url = f"http://{host.ip}:7100/"
    try:
        assert netbed.wait_until(lambda: _get(bed.agent, url) == 200, 15)
        bed.set_link("cut", up=False)
        with pytest.raises(netbed.AgentError, match="timed out"):
            bed.agent.http("GET", url, timeout=1)
        bed.set_link("cut", up=True)
        assert netbed.wait_until(lambda: _get(bed.agent, url) == 200, 15)
    finally:
        bed.kill("cut-web", 15)


def _get(agent, url):
    try:
        return agent.http("GET", url, timeout=1)[0]
    except netbed.AgentError:
        return None


# --------------------------------------------------------------------------- the delay proxy


class Echo:
    """A TCP echo server on loopback, one thread per connection."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def close(self):
        self.listener.close()


@pytest.fixture
def proxy(tmp_path):
    """A delay proxy process (20 ms +- 5 ms each way) in front of an echo server."""
    echo = Echo()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "tests.delay_proxy",
                             "--map", f"127.0.0.1:{port}=127.0.0.1:{echo.port}",
                             "--delay", "0.02", "--jitter", "0.005", "--ready-file", str(ready)],
                            cwd=netbed.ROOT, env={**os.environ, "PYTHONPATH": str(netbed.ROOT)})
    try:
        assert netbed.wait_until(ready.exists, 15)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        echo.close()


def _recv_exactly(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "the proxy closed the connection early"
        buf += chunk
    return bytes(buf)


def test_delay_proxy_round_trip_is_at_least_the_configured_delay(proxy):
    with socket.create_connection(("127.0.0.1", proxy)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for i in range(10):
            start = time.monotonic()
            sock.sendall(b"ping %d" % i)
            assert _recv_exactly(sock, len(b"ping %d" % i)) == b"ping %d" % i
            rtts.append(time.monotonic() - start)
    assert min(rtts) >= 2 * (0.02 - 0.005)
    assert max(rtts) < 1.0


def test_delay_proxy_keeps_data_intact_and_in_order_both_ways(proxy):
    data = random.Random(7).randbytes(3 << 20)  # many chunks, each with its own jittered delay
    got = bytearray()
    with socket.create_connection(("127.0.0.1", proxy)) as sock:
        reader = threading.Thread(target=lambda: got.extend(_recv_exactly(sock, len(data))))
        reader.start()
        for i in range(0, len(data), 50_000):
            sock.sendall(data[i:i + 50_000])
        reader.join(60)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # end of stream comes back through the proxy too
    assert bytes(got) == data


def test_delay_of_a_path_adds_both_links_and_skips_local_traffic():
    delays = Delays(delay=0.001, me="10.77.0.2", links={"10.77.0.2": (0.002, 0.0), "10.77.0.3": (0.030, 0.0)})
    assert delays.sample("10.77.0.3") == pytest.approx(0.033)
    assert delays.sample("10.77.0.9") == pytest.approx(0.003)  # a host with no link entry
    assert delays.sample("10.77.0.2") == delays.sample("127.0.0.1") == pytest.approx(0.001)
