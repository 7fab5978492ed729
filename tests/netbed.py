"""A multi-host test bed on one Linux machine: network namespaces joined by veth pairs.

Every host is a network namespace with one veth ``eth0`` (address ``10.77.0.N/24``) whose
other end sits on a bridge in a hub namespace: hosts on one switch, each behind its own
link. Processes run in their host with ``ip netns exec NS python3 -m ...``: real
``meshnet tracker`` / ``node`` / ``webui`` processes, and a client agent
(``tests/netbed_client.py``) through which the test drives the fabric, so that test
traffic never leaves the namespaces the bed made. Each host has its own HOME (its keys,
caches and node ids live there, as on separate machines); ``add_host(name, venv=True)``
also gives it a virtual environment of its own with the default model installed again,
and ``bed.shell(host, "meshnet ...")`` runs a command line there as a person would.
``add_host(name, hide=("a",))`` makes host ``a``'s HOME an empty directory for every process
of the new host (a mount namespace of its own: even root there reads nothing of ``a``'s
files), as when the two are separate machines::

    with Netbed(tmp_path, xdg_cache) as bed:
        for name in ("t", "a", "b", "c"):
            bed.add_host(name, delay=0.002)         # 2 ms one way on each host's link
        bed.add_host("far", delay=0.030, rate="100mbit")
        bed.add_host("natted", inbound=False)       # reachable by nobody; can dial out
        bed.start_tracker("t")
        bed.start_node("a", model_dir, "0-2")
        bed.start_node("b", model_dir, "3-5")
        with bed.client("c") as client:             # a process in host c
            client.wait_nodes(["a", "b"], model_dir.name)
            events = list(client.generate(model_dir.name, MESSAGES, max_tokens=24))

Link knobs (``add_host`` and, at any time, ``set_link``):

- ``delay`` / ``jitter``: seconds of one-way delay on the host's link, each direction,
  +- jitter (uniform). A path from host A to host B crosses both links: one way it takes
  delay(A) + delay(B), a round trip twice that. Traffic inside one host is not delayed.
- ``rate``: a ``tbf`` rate limit (``"100mbit"``, ``"512kbit"`` or bits/s) on both ends
  of the host's link, so uploads and downloads are each limited.
- ``up`` (``set_link`` only): ``False`` unplugs the host from the switch, so its packets
  are lost and no connection is closed (a dead machine or network, unlike a killed
  process); ``True`` plugs it back.
- ``inbound=False`` (``add_host`` only): no TCP connection can be opened *to* the host
  from another host, as behind a NAT; it can still dial out, and its own processes reach
  each other. Policy routing in the host's namespace blackholes TCP arriving on ``eth0``
  for ports 1-39999 (where every bed service listens), and the namespace's ephemeral
  ports move to 40000-60999 so replies to its own connections still get in. (No
  iptables/nft is needed.) A service bound to a port >= 40000 there stays reachable.

How delay is made: with the ``netem`` qdisc on both ends of every host's veth when the
kernel has it (detected at set-up), else with delay proxies (``tests/delay_proxy.py``):
a service binds ``127.0.0.1:PORT`` in its host and a proxy process listens on
``HOST_IP:PORT``, holding each chunk delay(dialler) + delay(host) each way, order kept.
Both ways peers dial the same ``tcp://HOST_IP:PORT``; nodes ``--advertise`` it. Under
proxies only TCP to an exposed service is delayed (every fabric connection is).
``Netbed(delay_mode="proxy")`` forces proxies, ``"netem"`` requires netem.

Other services (a relay, say) are exposed the same way: ``svc = bed.expose(host, port)``
gives ``svc.bind`` to bind and ``svc.endpoint`` to advertise, and ``bed.spawn_cli(host,
name, "relay", "--bind", svc.bind, ...)`` runs ``python3 -m fabric.cli relay ...`` there.
``start_node(..., advertise=...)`` and ``*extra`` pass anything else to a node.

Clean-up: ``close()`` (also ``__exit__``, the fixture's finaliser, ``atexit``, and SIGTERM
while a bed is open, which becomes KeyboardInterrupt) stops every process it started
(SIGINT, then SIGKILL), kills whatever is left inside its namespaces and deletes them.
Processes die with the process that started them (PDEATHSIG) even if it is killed -9;
so start them from a thread that outlives them (the main thread). Namespace names carry
the owner's pid (``mn<pid>x<n>-<host>``) and a lock file held while the bed lives
(``/run/meshnet-netbed``); the next bed deletes namespaces whose owner has gone.

Needs root, ``ip`` (iproute2) with netns, veth and bridge support; rates need ``tbf``.
``unavailable()`` says why a bed cannot be made here ("" when it can).
"""
from __future__ import annotations

import atexit
import ctypes
import fcntl
import itertools
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from fabric.cli.supervision import stop_processes

ROOT = Path(__file__).resolve().parent.parent
LOCKS = Path("/run/meshnet-netbed")  # one lock file per live bed, held by its owner
NAME = re.compile(r"^mn(\d+)x(\d+)-")
SERVICE_PORTS = 40000  # services listen below this; an inbound=False host dials out from above
TRACKER_PORT, PUB_PORT, NODE_PORT, WEBUI_PORT = 5555, 5556, 7000, 8000

_libc = ctypes.CDLL(None, use_errno=True)
_counter = itertools.count()
_open_beds: set["Netbed"] = set()
_previous_sigterm = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode:
        raise NetbedError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
    if check and proc.returncode:
        raise NetbedError(f"tc -n {ns} {' '.join(args)}: {proc.stderr.strip()}")
    return proc


class NetbedError(RuntimeError):
    pass


_unavailable: str | None = None


def unavailable() -> str:
    """Why no bed can be made here, or "" when one can (checked once per process)."""
    global _unavailable
    if _unavailable is None:
        _unavailable = _probe()
    return _unavailable


def _probe() -> str:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    ns = f"mn{os.getpid()}probe"
    try:
        _ip("netns", "add", ns)
    except NetbedError as exc:
        return f"`ip netns add` does not work here: {exc}"
    try:
        _ip("-n", ns, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1")
        _ip("-n", ns, "link", "add", "br0", "type", "bridge")
    except NetbedError as exc:
        return f"veth pairs or bridges are not available: {exc}"
    finally:
        _ip("netns", "del", ns, check=False)
    return ""


def netem_works(ns: str) -> bool:
    """Whether ``tc qdisc add ... netem`` works (tried on the loopback of namespace ``ns``)."""
    if _tc(ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False).returncode:
        return False
    _tc(ns, "qdisc", "del", "dev", "lo", "root", check=False)
    return True


def rate_bits(rate: str | int | float) -> float:
    """``"100mbit"`` -> 1e8 bits/s (tc's units: bit, kbit, mbit, gbit; a number is bits/s)."""
    if isinstance(rate, (int, float)):
        return float(rate)
    m = re.fullmatch(r"\s*([\d.]+)\s*(bit|kbit|mbit|gbit)?\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use a number of bits/s or NUMBER(bit|kbit|mbit|gbit)")
    return float(m[1]) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m[2] or "bit"]


@dataclass
class Link:
    """A host's link to the switch. Both directions get the same shaping."""

    delay: float = 0.0  # one-way seconds added on this link
    jitter: float = 0.0  # +- seconds, uniform
    rate: str | int | float | None = None  # tbf rate limit; None: unlimited


@dataclass
class Host:
    name: str
    ns: str  # network namespace
    ip: str  # address on the bed's switch
    port: str  # the hub's end of this host's veth
    link: Link
    inbound: bool = True  # False: other hosts cannot open TCP connections to it
    next_port: int = NODE_PORT  # next free service port
    home: Path | None = None  # its own HOME, as each machine has (keys, caches, node ids under it)
    bin: Path | None = None  # put first on PATH: a venv's bin, with its own `meshnet`
    hidden: tuple[Path, ...] = ()  # directories its processes see empty (another machine's disk)

    def exec_prefix(self) -> list[str]:
        """``ip netns exec`` into this host; where it hides directories, in a mount namespace of
        its own whose empty read-only tmpfs covers each of them (root in the host reads nothing
        under them: as on another machine, not merely another user)."""
        prefix = ["ip", "netns", "exec", self.ns]
        if not self.hidden:
            return prefix
        mounts = " && ".join(f"mount -t tmpfs -o ro,size=4k,mode=0 hidden {shlex.quote(str(d))}" for d in self.hidden)
        return [*prefix, "unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "hide"]


@dataclass(frozen=True)
class Service:
    """A port a host serves: bind ``bind`` in the host, advertise ``endpoint`` to peers."""

    host: str
    port: int
    bind: str  # tcp://127.0.0.1:PORT behind a delay proxy, else tcp://HOST_IP:PORT
    endpoint: str  # tcp://HOST_IP:PORT, what every other host dials

    @property
    def address(self) -> str:  # "IP:PORT" of the bind, for non-ZeroMQ servers
        return self.bind.removeprefix("tcp://")


@dataclass(eq=False)  # one bed is one bed: hashed and compared by identity
class Netbed:
    tmp: Path  # logs, the links table, proxies' ready files
    cache: Path | None = None  # XDG cache shared by processes (parsed model metadata)
    delay_mode: str = "auto"  # "auto": netem when the kernel has it, else proxies; "netem"; "proxy"
    subnet: str = "10.77.0"  # hosts get SUBNET.1, SUBNET.2, ...
    heartbeat: float = 0.3  # tracker and node heartbeat interval, seconds
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # name -> process
    proxies: list[subprocess.Popen] = field(default_factory=list)
    tracker: str | None = None  # the tracker's endpoint, once started
    pub: str | None = None

    def __post_init__(self) -> None:
        reason = unavailable()
        if reason:
            raise NetbedError(reason)
        self.tmp = Path(self.tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.prefix = f"mn{os.getpid()}x{next(_counter)}"
        self.hub = f"{self.prefix}-hub"
        self._agents: list[Agent] = []
        self._closed = False
        reap_stale()
        self._lock = _hold_lock(self.prefix)
        _opened(self)
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            if self.delay_mode not in ("auto", "netem", "proxy"):
                raise ValueError(f"delay_mode {self.delay_mode!r}: auto, netem or proxy")
            netem = self.delay_mode != "proxy" and netem_works(self.hub)
            if self.delay_mode == "netem" and not netem:
                raise NetbedError("delay_mode='netem' but this kernel has no netem qdisc")
            self.netem = netem  # delay by qdisc; False: by delay proxies
        except BaseException:
            self.close()
            raise

    # -- hosts and links -----------------------------------------------------------------

    def add_host(self, name: str, delay: float = 0.0, jitter: float = 0.0, rate=None,
                 inbound: bool = True, venv: bool = False, hide: tuple[str, ...] = ()) -> Host:
        """A namespace on the switch, with its own HOME; see the module docstring for the
        knobs. ``venv``: the host runs a virtual environment of its own, where the default
        model is installed again (another install path than this Python's). ``hide``: names of
        hosts added before whose HOMEs this host's processes find empty (their files are on
        another machine)."""
        if name in self.hosts or not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,30}", name):
            raise ValueError(f"host name {name!r}: taken, or not [a-z0-9_-]")
        index = len(self.hosts) + 1
        host = Host(name, f"{self.prefix}-{name}", f"{self.subnet}.{index}", f"h{index}", Link(delay, jitter, rate),
                    inbound, home=self.tmp / f"home-{name}", hidden=tuple(self.hosts[o].home for o in hide))
        host.home.mkdir(parents=True, exist_ok=True)
        if venv:
            host.bin = make_venv(self.tmp / f"venv-{name}")
        self.hosts[name] = host
        _ip("netns", "add", host.ns)
        _ip("-n", host.ns, "link", "set", "lo", "up")
        _ip("link", "add", "name", "eth0", "netns", host.ns, "type", "veth",
            "peer", "name", host.port, "netns", self.hub)
        _ip("-n", self.hub, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        if not inbound:
            self._refuse_inbound(host)
        self._shape(host)
        return host

    def set_link(self, name: str, delay: float | None = None, jitter: float | None = None, rate=...,
                 up: bool | None = None) -> None:
        """Change a host's link now (``rate=None`` lifts the limit; omitted: unchanged).
        ``up=False`` unplugs the host from the switch: its packets are lost, nothing is
        closed, as when a machine or its network dies; ``up=True`` plugs it back."""
        host = self.hosts[name]
        link = host.link
        link.delay = link.delay if delay is None else delay
        link.jitter = link.jitter if jitter is None else jitter
        link.rate = link.rate if rate is ... else rate
        self._shape(host)
        if up is not None:
            _ip("-n", self.hub, "link", "set", host.port, "nomaster" if not up else "master", *(["br0"] if up else []))

    def _refuse_inbound(self, host: Host) -> None:
        subprocess.run(["ip", "netns", "exec", host.ns, "sysctl", "-qw",
                        f"net.ipv4.ip_local_port_range={SERVICE_PORTS} 60999"], check=True)
        _ip("-n", host.ns, "rule", "add", "pref", "10", "iif", "eth0", "ipproto", "tcp",
            "dport", f"1-{SERVICE_PORTS - 1}", "blackhole")
        _ip("-n", host.ns, "rule", "add", "pref", "100", "lookup", "local")  # after the blackhole
        _ip("-n", host.ns, "rule", "del", "pref", "0")

    def _shape(self, host: Host) -> None:
        """Qdiscs on both ends of the host's veth; under proxies, the proxies' delay table."""
        link = host.link
        for ns, dev in ((host.ns, "eth0"), (self.hub, host.port)):
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
            parent = ["root"]
            if self.netem and (link.delay or link.jitter):
                _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                    f"{link.delay * 1e6:.0f}us", f"{link.jitter * 1e6:.0f}us")
                parent = ["parent", "1:1"]
            if link.rate:
                bits = rate_bits(link.rate)
                burst = max(64 << 10, int(bits / 8 * 0.005))  # >= a GSO packet, ~5 ms of traffic
                _tc(ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", f"{bits:.0f}bit",
                    "burst", str(burst), "latency", "100ms")
        if not self.netem:
            self._write_links()

    def _write_links(self) -> None:
        table = {h.ip: [h.link.delay, h.link.jitter] for h in self.hosts.values()}
        tmp = self.tmp / "links.json.tmp"
        tmp.write_text(json.dumps(table))
        tmp.replace(self.links_file)
        for proxy in self.proxies:
            if proxy.poll() is None:
                proxy.send_signal(signal.SIGHUP)

    @property
    def links_file(self) -> Path:
        return self.tmp / "links.json"

    # -- services and processes ----------------------------------------------------------

    def expose(self, host: str, *ports: int) -> list[Service]:
        """Ports a host will serve; under proxies starts one proxy in front of them."""
        h = self.hosts[host]
        ports = ports or (self._port(h),)
        if self.netem:
            return [Service(host, port, f"tcp://{h.ip}:{port}", f"tcp://{h.ip}:{port}") for port in ports]
        ready = self.tmp / f"proxy-{host}-{ports[0]}.ready"
        maps = [a for port in ports for a in ("--map", f"{h.ip}:{port}=127.0.0.1:{port}")]
        proc = self._popen(h, f"proxy-{host}-{ports[0]}",
                           ["-m", "tests.delay_proxy", *maps, "--links", str(self.links_file), "--self", h.ip,
                            "--ready-file", str(ready)])
        self.proxies.append(proc)
        wait_until(lambda: ready.exists() or proc.poll() is not None, 15)
        if not ready.exists():
            raise NetbedError(f"the delay proxy in {host} did not start:\n{self.logs()}")
        return [Service(host, port, f"tcp://127.0.0.1:{port}", f"tcp://{h.ip}:{port}") for port in ports]

    def _port(self, h: Host) -> int:
        h.next_port += 1
        return h.next_port - 1

    def spawn(self, host: str, name: str, argv: list[str], **popen) -> subprocess.Popen:
        """``python3 ARGV`` in ``host``'s namespace, logged to TMP/NAME.log."""
        if name in self.procs:
            raise ValueError(f"a process named {name!r} is already running")
        proc = self.procs[name] = self._popen(self.hosts[host], name, argv, **popen)
        return proc

    def spawn_cli(self, host: str, name: str, *args: str) -> subprocess.Popen:
        """``python3 -m fabric.cli --log-level info ARGS`` in ``host``."""
        return self.spawn(host, name, ["-m", "fabric.cli", "--log-level", "info", *args])

    def _popen(self, h: Host, name: str, argv: list[str], **popen) -> subprocess.Popen:
        python = str(h.bin / "python") if h.bin else sys.executable
        log = open(self.tmp / f"{name}.log", "ab")
        popen.setdefault("stdout", log)
        try:
            return subprocess.Popen([*h.exec_prefix(), python, *argv], stderr=log, env=self.env(h),
                                    cwd=ROOT, preexec_fn=_die_with_parent, **popen)
        finally:
            log.close()

    def env(self, h: Host) -> dict[str, str]:
        """A process's environment in host ``h``: its HOME, runtime directory (its nodes' default
        compute lock: each host's cores are its own) and PATH; the bed's shared cache of parsed
        model metadata where one was given."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
        env.update(PYTHONPATH=str(ROOT), HOME=str(h.home), XDG_RUNTIME_DIR=str(h.home / "run"),
                   PATH=os.pathsep.join([*([str(h.bin)] if h.bin else []), env.get("PATH", "")]))
        return {**env, **({"XDG_CACHE_HOME": str(self.cache)} if self.cache else {})}

    def shell(self, host: str, command: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run ``command`` with bash in ``host``, as a person at that machine would; waits."""
        h = self.hosts[host]
        return subprocess.run([*h.exec_prefix(), "bash", "-c", command], env=self.env(h),
                              cwd=h.home, capture_output=True, text=True, timeout=timeout)

    def spawn_shell(self, host: str, name: str, command: str) -> subprocess.Popen:
        """``command`` with bash in ``host``, in the background, logged to TMP/NAME.log."""
        if name in self.procs:
            raise ValueError(f"a process named {name!r} is already running")
        h = self.hosts[host]
        log = open(self.tmp / f"{name}.log", "ab")
        try:
            self.procs[name] = subprocess.Popen([*h.exec_prefix(), "bash", "-c", f"exec {command}"],
                                                stdout=log, stderr=log, env=self.env(h), cwd=h.home,
                                                preexec_fn=_die_with_parent)
        finally:
            log.close()
        return self.procs[name]

    def start_tracker(self, host: str) -> str:
        """``meshnet tracker`` in ``host``; returns its endpoint (also ``self.tracker``)."""
        router, pub = self.expose(host, TRACKER_PORT, PUB_PORT)
        self.spawn_cli(host, "tracker", "tracker", "--bind", router.bind, "--pub", pub.bind,
                       "--db", str(self.tmp / "ledger.sqlite3"), "--heartbeat", str(self.heartbeat))
        self.tracker, self.pub = router.endpoint, pub.endpoint
        return self.tracker

    def start_node(self, host: str, model, layers: str | None, *extra: str, name: str | None = None,
                   port: int | None = None, advertise: str | None = None, threads: int = 1) -> str:
        """``meshnet node`` in ``host`` with node id ``name`` (default: the host's name);
        returns the endpoint it advertises."""
        name = name or host
        svc = self.expose(host, *([port] if port else []))[0]
        advertise = advertise or svc.endpoint
        self.spawn_cli(host, name, "node", "--model", str(model), *(["--layers", layers] if layers else []),
                       "--node-id", name, "--tracker", self._tracker(), "--bind", svc.bind,
                       "--advertise", advertise, "--threads", str(threads), "--no-progress",
                       "--heartbeat", str(self.heartbeat), *extra)
        return advertise

    def start_webui(self, host: str, port: int = WEBUI_PORT) -> str:
        """``meshnet webui`` in ``host``; returns its base URL (reachable from other hosts)."""
        svc = self.expose(host, port)[0]
        ip, _, p = svc.address.rpartition(":")
        self.spawn_cli(host, "webui", "webui", "--tracker", self._tracker(), "--pub", self.pub,
                       "--host", ip, "--port", p)
        return f"http://{self.hosts[host].ip}:{port}"

    def _tracker(self) -> str:
        if self.tracker is None:
            raise NetbedError("start_tracker() first")
        return self.tracker

    def client(self, host: str, timeout: float = 60.0) -> "Agent":
        """A client agent process in ``host`` (see tests/netbed_client.py)."""
        name = f"client-{host}-{len(self._agents)}"
        proc = self.spawn(host, name, ["-m", "tests.netbed_client", "--tracker", self._tracker(),
                                       "--timeout", str(timeout)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        agent = Agent(proc, self.logs)
        self._agents.append(agent)
        return agent

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(10)

    def pids(self, host: str) -> list[int]:
        """Every process in ``host``'s namespace."""
        out = _ip("netns", "pids", self.hosts[host].ns, check=False).stdout
        return [int(x) for x in out.split()]

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text(errors='replace')[-tail:]}"
                         for f in sorted(self.tmp.glob("*.log")))

    # -- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for agent in self._agents:
            agent.close()
        stop_processes(list(self.procs.values()) + self.proxies, grace=5.0)
        self.procs.clear()
        self.proxies.clear()
        _delete(self.prefix, [h.ns for h in self.hosts.values()] + [self.hub])
        _release_lock(self._lock, self.prefix)
        _closed(self)

    def __enter__(self) -> "Netbed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- a host's own Python


def make_venv(target: Path) -> Path:
    """A virtual environment seeing this Python's packages, with the default model installed
    in it again (so its path differs) and a ``meshnet`` command; returns its bin folder."""
    import venv

    from fabric.compute.models import ALIASES, alias_path

    venv.create(target, system_site_packages=True, with_pip=False, symlinks=True)
    bin_dir = target / "bin"
    site = next(target.glob("lib/python*/site-packages"))
    model = alias_path(ALIASES["smollm2-135m"])
    if model is not None:
        shutil.copytree(model.parent, site / model.parent.name)
    meshnet = bin_dir / "meshnet"
    meshnet.write_text(f'#!/bin/sh\nexec "{bin_dir / "python"}" -m fabric.cli "$@"\n')
    meshnet.chmod(0o755)
    return bin_dir


# --------------------------------------------------------------------------- the client agent


class AgentError(RuntimeError):
    pass


class Agent:
    """Drives a ``tests.netbed_client`` process: JSON requests in, JSON lines out."""

    def __init__(self, proc: subprocess.Popen, logs=lambda: ""):
        self.proc = proc
        self._logs = logs
        self._lines: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def _send(self, op: str, **kw) -> int:
        rid = next(self._ids)
        self.proc.stdin.write((json.dumps({"id": rid, "op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        return rid

    def _next(self, rid: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AgentError(f"no answer from the client agent in {timeout}s\n{self._logs()}") from None
            if msg is None:
                raise AgentError(f"the client agent exited\n{self._logs()}")
            if msg.get("id") != rid:
                continue  # the rest of an abandoned stream
            if msg.get("ok") is False:
                raise AgentError(msg["error"])
            return msg

    def request(self, op: str, timeout: float = 60.0, **kw) -> dict:
        return self._next(self._send(op, timeout=timeout, **kw), timeout + 5)

    def status(self, timeout: float = 5.0) -> dict:
        return self.request("status", timeout)["status"]

    def wait_nodes(self, names, model: str, timeout: float = 120.0, procs=None) -> dict:
        """Poll the tracker until nodes ``names`` are registered and ``model`` has a plan;
        fail at once if one of ``procs`` (name -> Popen; a Netbed's ``procs``) has exited."""
        deadline = time.monotonic() + timeout
        while True:
            dead = [name for name, proc in (procs or {}).items() if proc.poll() is not None]
            if dead:
                raise AgentError(f"{', '.join(dead)} exited before the nodes were routable\n{self._logs()}")
            try:
                status = self.status(timeout=2.0)
                if set(names) <= {n["id"] for n in status["nodes"]} and status["plans"].get(model):
                    return status
            except AgentError:
                pass
            if time.monotonic() > deadline:
                raise AgentError(f"nodes {sorted(names)} not routable for {model} in {timeout}s\n{self._logs()}")
            time.sleep(0.2)

    def generate(self, model: str, messages, max_tokens: int, timeout: float = 60.0, prompt: str | None = None,
                 ignore_eos: bool = False) -> Iterator[dict]:
        """The head's events as dicts: event, ids, text, route, finish_reason, t (agent clock).
        ``prompt``: a raw prompt instead of ``messages`` (None then)."""
        rid = self._send("generate", model=model, messages=messages, max_tokens=max_tokens, timeout=timeout,
                         prompt=prompt, ignore_eos=ignore_eos)
        while not (msg := self._next(rid, timeout + 5)).get("end"):
            yield msg

    def ping(self, endpoint: str, count: int = 10, timeout: float = 5.0) -> list[float]:
        """PING/PONG round trips to a node, in seconds (the connecting one left out)."""
        return self.request("ping", timeout + count * timeout, endpoint=endpoint, count=count)["rtts"]

    def http(self, method: str, url: str, body=None, timeout: float = 60.0) -> tuple[int, str]:
        msg = self.request("http", timeout, method=method, url=url, body=body)
        return msg["status"], msg["body"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- clean-up


def wait_until(cond, timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def _delete(prefix: str, namespaces: list[str]) -> None:
    """Kill what still runs in a bed's namespaces (they are its own), then delete them."""
    for ns in namespaces:
        if not ns.startswith(prefix + "-"):
            continue
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)


def _hold_lock(prefix: str):
    LOCKS.mkdir(parents=True, exist_ok=True)
    fh = open(LOCKS / prefix, "w")
    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _release_lock(fh, prefix: str) -> None:
    (LOCKS / prefix).unlink(missing_ok=True)
    fh.close()


def reap_stale() -> None:
    """Delete namespaces of beds whose owner died without cleaning up (its lock is free)."""
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    for prefix in sorted({m[0][:-1] for n in names if (m := NAME.match(n))}):
        lock = LOCKS / prefix
        if not lock.exists():
            continue  # not made by this module's locking scheme: leave it alone
        with open(lock) as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives
            _delete(prefix, [n for n in names if n.startswith(prefix + "-")])
            lock.unlink(missing_ok=True)


def _opened(bed: Netbed) -> None:
    global _previous_sigterm
    if not _open_beds and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    _open_beds.add(bed)


def _closed(bed: Netbed) -> None:
    global _previous_sigterm
    _open_beds.discard(bed)
    if not _open_beds and _previous_sigterm is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _previous_sigterm)
        _previous_sigterm = None


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")  # unwinds through every bed's close()


@atexit.register
def _close_all() -> None:
    for bed in list(_open_beds):
        bed.close()
