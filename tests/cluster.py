"""Clusters for tests: a tracker and nodes on loopback, in threads or in real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from fabric import Client, FabricError
from fabric.compute.models import resolve
from fabric.node import Node, NodeConfig
from fabric.wire import protocol as p
from fabric.wire.shard import Shard
from fabric.cli.supervision import stop_processes
from tests.support import at_once, free_port, wait_for
from tests.zygote import SCRIPTS, ZYGOTE

ROOT = Path(__file__).resolve().parent.parent


def ping(endpoint: str, timeout: float = 5.0) -> p.Pong | None:
    """PING a node; its PONG says how many sessions it holds KV for."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(p.encode(p.Ping(1)))
        if not sock.poll(timeout * 1000):
            return None
        reply = p.decode(sock.recv_multipart())[0]
        return reply if isinstance(reply, p.Pong) else None
    finally:
        sock.close()


class ThreadCluster:
    """A tracker and nodes in threads of this process, on real loopback sockets."""

    def __init__(self, heartbeat: float = 0.2, security=None):
        from tracker.service import Tracker, TrackerConfig

        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.security = security  # fabric.net.security.Security shared by the tracker and the test's client
        self.tracker = Tracker(TrackerConfig(bind="tcp://127.0.0.1:*", pub="tcp://127.0.0.1:*", db=":memory:",
                                             heartbeat_interval=heartbeat, security=security))
        self._start(self.tracker.run)
        self.tracker.ready.wait(10)
        self.endpoint = self.tracker.endpoint
        self.nodes: dict[str, Node] = {}
        self.heartbeat = heartbeat

    def _start(self, target) -> None:
        t = threading.Thread(target=target, args=(self.stop,), daemon=True)
        t.start()
        self.threads.append(t)

    def add_node(self, model_dir: Path, start: int, end: int, num_layers: int, node_id: str, **kw) -> Node:
        """A node in a thread. Its head audits no request unless ``audit_rate`` says so: a
        random 5% of requests replayed on replicas would make any count of hops a matter of chance."""
        kw.setdefault("audit_rate", 0.0)
        config = NodeConfig.build(resolve(str(model_dir)), Shard(start, end, num_layers), tracker=self.endpoint,
                            node_id=node_id, progress=False, heartbeat_interval=self.heartbeat, **kw)
        node = Node(config)
        self._start(node.run)
        node.ready.wait(10)
        self.nodes[node_id] = node
        return node

    def client(self, security=None) -> Client:
        return Client(self.endpoint, timeout=30, security=security or self.security)

    def stream_all(self, model: str, prompts: list[str], max_tokens: int) -> dict[int, list[int]]:
        """Greedy chat streams of every prompt at once (started together); token ids by index."""
        def stream(i: int) -> list[int]:
            with self.client() as client:
                events = client.generate(model, messages=[{"role": "user", "content": prompts[i]}],
                                         max_tokens=max_tokens)
                return [t for e in events for t in e.token_ids]

        return at_once(stream, len(prompts))

    def wait_routable(self, model: str, nodes: int, timeout: float = 30.0) -> dict:
        def ready() -> bool:
            try:
                with self.client() as c:
                    c.timeout = 5
                    status = c.status()
            except FabricError:  # a busy machine: ask again
                return False
            return len(status["nodes"]) >= nodes and bool(status["plans"].get(model))
        assert wait_for(ready, timeout, 0.1)
        with self.client() as c:
            return c.status()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


class ProcessCluster:
    """``meshnet tracker`` and ``meshnet node`` as real processes, driven by the CLI."""

    def __init__(self, tmp: Path, cache: Path, heartbeat: float = 0.3):
        self.tmp = tmp
        self.keys: Path | None = None  # a key directory (meshnet keys --tracker) secures every process
        self.cache = cache  # XDG cache shared by the test session: GGUF metadata parsed once
        self.heartbeat = heartbeat
        # this cluster's runtime directory, as one machine's: its nodes share the default compute lock there
        self.runtime_dir = tmp / "run"
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub = f"tcp://127.0.0.1:{free_port()}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.node_endpoints: dict[str, str] = {}
        self.start_tracker()

    def _spawn(self, name: str, *args: str, entry: tuple[str, ...] = ("-m", "fabric.cli"),
               env: dict | None = None) -> subprocess.Popen:
        """Start ``meshnet ARGS`` (or the script ``entry`` names with them, such as tests/liar_node.py);
        ``env`` overrides the environment (another machine's XDG_CACHE_HOME, say)."""
        log = open(self.tmp / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(self.cache),
               "XDG_DATA_HOME": str(self.tmp / "data"), "XDG_RUNTIME_DIR": str(self.runtime_dir), **(env or {})}
        keys = ["--keys", str(self.keys)] if self.keys else []
        argv = ["--log-level", "info", *args, *keys]
        forked = None
        if self._forks(entry, args):
            script = None if entry[0] == "-m" else Path(entry[0])
            forked = ZYGOTE.spawn([*entry[1:], *argv] if script else argv, env, ROOT, log.fileno(), log.fileno(),
                                  script)
        proc = forked or subprocess.Popen([sys.executable, *entry, *argv], stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=ROOT)
        log.close()
        self.procs[name] = proc
        return proc

    @staticmethod
    def _forks(entry: tuple[str, ...], args: tuple[str, ...]) -> bool:
        """Whether a process is a ``meshnet node``, plain or patched by a test script (a liar),
        which the test zygote forks, already imported, instead of starting an interpreter that
        imports torch again (tests/zygote.py)."""
        plain = entry == ("-m", "fabric.cli") or (entry and Path(entry[0]) in SCRIPTS)
        return bool(plain) and args[:1] == ("node",)

    def secure(self) -> None:
        """Restart the tracker with a fresh swarm key set; start nodes after this."""
        from fabric.net.security import create_keys

        self.keys = self.tmp / "keys"
        create_keys(self.keys, "swarm", tracker=True)
        self.kill("tracker")
        self.start_tracker()

    def start_tracker(self) -> None:
        self._spawn("tracker", "tracker", "--bind", self.endpoint, "--pub", self.pub,
                    "--db", str(self.tmp / "ledger.sqlite3"), "--heartbeat", str(self.heartbeat))

    def start_node(self, name: str, model: str, layers: str | None, port: int | None = None, *extra: str,
                   liar: bool | str = False, entry: tuple[str, ...] | None = None, env: dict | None = None) -> str:
        """Start a node; ``layers`` None lets the tracker assign them (pass --memory in extra);
        ``liar``: one whose every output is wrong, or "decode": only its decode steps' (tests/liar_node.py);
        ``entry``: another script to run it with (tests/corrupt_share_node.py); ``env``: as ``_spawn``'s."""
        endpoint = f"tcp://127.0.0.1:{port or free_port()}"
        self._spawn(name, "node", "--model", model, *(["--layers", layers, "--node-id", name] if layers else []),
                    "--tracker", self.endpoint, "--bind", endpoint, "--threads", "1", "--no-progress",
                    "--heartbeat", str(self.heartbeat), *extra,
                    entry=entry or ((str(ROOT / "tests" / "liar_node.py"), "--lie", "all" if liar is True else liar)
                                    if liar else ("-m", "fabric.cli")), env=env)
        self.node_endpoints[name] = endpoint
        return endpoint

    def start_relay(self, name: str = "relay", port: int | None = None, *extra: str) -> str:
        """``meshnet relay`` on loopback; returns its control endpoint (nodes take --relay it)."""
        endpoint = f"tcp://127.0.0.1:{port or free_port()}"
        self._spawn(name, "relay", "--bind", endpoint, "--node-timeout", "2", *extra)
        return endpoint

    def start_webui(self, *extra: str, entry: tuple[str, ...] = ("-m", "fabric.cli")) -> str:
        """``meshnet webui`` on a free port (run by ``entry``, as ``_spawn`` runs it); returns its
        base URL once it answers."""
        import urllib.request

        port = free_port()
        self._spawn("webui", "webui", "--tracker", self.endpoint, "--pub", self.pub, "--port", str(port), *extra,
                    entry=entry)
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return urllib.request.urlopen(url + "/", timeout=1).status == 200
            except OSError:
                return False
        assert wait_for(up, 30, 0.1), self.logs()
        return url

    def split(self, model: Path, names: tuple[str, str] = ("a", "b")) -> dict:
        """Two nodes of a 6-layer tiny model, layers 0-2 and 3-5; returns the status."""
        self.start_node(names[0], str(model), "0-2")
        self.start_node(names[1], str(model), "3-5")
        return self.wait_nodes(list(names), model.name)

    def past_warmup(self, timeout: float = 30.0) -> None:
        """Wait until the tracker is past its start-up grace (HEARTBEAT_LIVENESS heartbeats): before
        it, a model nobody serves is answered "the tracker started N s ago: nodes register" (503),
        not unknown (404). A fast machine gets through a whole test on tiny models within it."""
        from fabric.wire.liveness import HEARTBEAT_LIVENESS

        def past():
            with self.client() as c:
                return c.status()["tracker"]["uptime_s"] > self.heartbeat * HEARTBEAT_LIVENESS
        assert wait_for(past, timeout), "the tracker never got past its start-up grace"

    def kill(self, name: str, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(wait)

    def client(self) -> Client:
        from fabric.net.security import load

        return Client(self.endpoint, timeout=60, security=load(self.keys) if self.keys else None)

    def wait_nodes(self, names: list[str], model: str, timeout: float = 120.0) -> dict:
        def ready():
            try:
                with self.client() as c:
                    c.timeout = 2
                    status = c.status()
            except Exception:
                return False
            ids = {n["id"] for n in status["nodes"]}
            return set(names) <= ids and bool(status["plans"].get(model))
        assert wait_for(ready, timeout, 0.2), self.logs()
        with self.client() as c:
            return c.status()

    def logs(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.tmp.glob("*.log")))

    def close(self) -> None:
        stop_processes(list(self.procs.values()))
        self.procs.clear()


def node_counters(port: int, prefix: str = "") -> dict[str, float]:
    """A node's counters from its /metrics (``meshnet node --metrics-port``), by name without
    ``meshnet_node_`` and ``_total``; those whose name starts with ``prefix``."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(r"^meshnet_node_(\w+)_total\{[^}]*\} (\S+)$", text, re.M)
    return {name: float(value) for name, value in found if name.startswith(prefix)}


def wait_sessions_zero(endpoints: list[str], timeout: float = 1.0) -> float:
    """Seconds until every node reports zero sessions (or raises after ``timeout``)."""
    start = time.monotonic()
    while True:
        counts = [getattr(ping(e, 1.0), "sessions", None) for e in endpoints]
        if all(c == 0 for c in counts):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"sessions still held after {timeout}s: {counts}")
        time.sleep(0.02)
