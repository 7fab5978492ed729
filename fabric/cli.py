"""``meshnet`` command line: every flag is resolved here, once, into config dataclasses."""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .compute import model_store
from .compute.compute_lock import default_path as default_lock
from .flags import (
    CommandError,
    HelpFormatter,
    Parser,
    count,
    endpoint,
    error_line,
    non_negative,
    port,
    positive_count,
    seconds,
    share,
    version,
)
from .wire.liveness import AUDIT_RATE, AUDIT_TOLERANCE, DEFAULT_PUB, DEFAULT_TRACKER


log = logging.getLogger("meshnet")


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError, apply

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        apply(parser, argv)  # the config file's values become the flags' defaults
    except ConfigError as exc:
        error_line(str(exc))
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; a refusal is one ``meshnet: error:`` line and its status."""
    from .net.security import SecurityError

    try:
        return args.func(args) or 0
    except CommandError as exc:
        error_line(str(exc))
        return exc.status
    except SecurityError as exc:
        error_line(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130


LOG_LEVELS = ["debug", "info", "warning", "error"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="meshnet", formatter_class=HelpFormatter,
                    description="Run one language model across several machines over a ZeroMQ fabric.")
    parser.add_argument("--version", action="version", version=f"meshnet {version()}")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="how much to log")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML file whose keys set any flag: top-level keys for every command, a [node], [up], "
                             "[tracker]… table per command; flags typed here win (default: $MESHNET_CONFIG, else "
                             "~/.config/meshnet/config.toml if it exists)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _up_parser(sub)
    _tracker_parser(sub)
    _node_parser(sub)
    _webui_parser(sub)
    _chat_parser(sub)
    _status_parser(sub)
    _keys_parser(sub)
    _relay_parser(sub)
    model_store.add_parsers(sub)  # models, pull
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
        _shared_flags(command, parser)
    return parser


def _shared_flags(p: argparse.ArgumentParser, meshnet: argparse.ArgumentParser) -> None:
    """meshnet's own flags, also after the command (``meshnet up --config FILE``); typed
    there they win, left out they keep the value given before the command."""
    own = {a.dest: a for a in meshnet._actions}
    level = p.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                           help="how much to log, as `meshnet --log-level`")
    config = p.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE",
                            help="the config file, as `meshnet --config FILE` (default: $MESHNET_CONFIG, else "
                                 "~/.config/meshnet/config.toml if it exists)")
    level.same_as, config.same_as = own["log_level"], own["config"]  # whose default --help shows


def _tracker_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracker", default=DEFAULT_TRACKER, type=endpoint, metavar="ENDPOINT",
                   help="tracker endpoint, tcp://HOST:PORT or HOST:PORT (default %(default)s)")
    _keys_flag(p)


def _keys_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="secure the swarm with CurveZMQ: this process's key pair and the allow-list "
                        "(made by `meshnet keys DIR`); default: plaintext, for a trusted LAN")


def _quant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                   help="weight-only quantized layers, computed in bfloat16 on the CPU. auto (default): a GGUF on "
                        "its own grid (gguf: Q4_0/Q4_1/Q4_K layers on the int4 kernels with the file's codes, "
                        "Q5_*/Q6_K/Q8_0 re-rounded onto int8, float16 in bfloat16; a float32 file, other weights, "
                        "a GPU: none); none: every layer in --dtype (with --dtype float32: exact, the tokens "
                        "of transformers in float32); int8, int4: every linear onto that kernel")


def _metrics_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=port, default=0,
                   help="serve Prometheus /metrics on this port, 0 for none (default %(default)s)")


def _serve_metrics(args, sample) -> None:
    if args.metrics_port:
        from .metrics import serve

        serve(args.metrics_port, sample)


TRACKER_ID_KEY = "the tracker's id.key"


def _security(args, tracker_key_file: str | None = TRACKER_ID_KEY):
    """The Security for ``--keys`` (None without it); SecurityError says what is missing. A
    process that dials the tracker needs DIR/allowed/tracker.key (``tracker_key_file``: the
    file to copy there; None for the tracker and the relay, which do not dial it)."""
    from .net.security import load, require_tracker_key

    security = load(args.keys) if getattr(args, "keys", None) else None
    if tracker_key_file:
        require_tracker_key(security, tracker_key_file)
    return security


def _refuse_ports_in_use(endpoints: dict[str, str], who: str) -> None:
    """CommandError when a port these endpoints (by role, "the tracker, --bind") name is taken."""
    busy = _ports_in_use(endpoints)
    if busy:
        flags = [role.rpartition(", ")[2] for role in endpoints]
        named = f"other ports with {', '.join(flags[:-1])} and {flags[-1]}" if len(flags) > 1 \
            else f"another port with {flags[0]}"
        raise CommandError(f"already in use on this machine: {'; '.join(busy)}. Is another {who} running? "
                           f"Stop it, or choose {named}")


# --------------------------------------------------------------------------- up


def _device(text: str) -> str:
    """cpu, cuda, or cuda:N (one GPU of several)."""
    kind, _, index = text.partition(":")
    if text == "cpu" or (kind == "cuda" and (not index or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")


def _device_flags(p: argparse.ArgumentParser, whose: str, more: str = "") -> None:
    p.add_argument("--device", default="cpu", type=_device, metavar="{cpu,cuda,cuda:N}",
                   help=f"where {whose} layers compute (default %(default)s; cuda needs a CUDA build of torch, "
                        f"cuda:N picks one GPU of several{more})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help=f"{whose} compute dtype for layers that --quant leaves as they are (default %(default)s, "
                        "exact; bfloat16 halves the memory, and suits --device cuda); quantized layers compute "
                        "in bfloat16")


def _up_parser(sub) -> None:
    p = sub.add_parser("up", help="start a whole local cluster: tracker, nodes and web UI",
                       description="Start a tracker, N nodes splitting the model's layers evenly, and the web "
                                   "UI, on this machine. Ctrl-C stops them all.")
    p.add_argument("--model", default="smollm2-135m", help="model reference (default %(default)s)")
    p.add_argument("--nodes", type=positive_count, default=2,
                   help="how many nodes split the layers (default %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="web UI port (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="web UI host (default %(default)s)")
    p.add_argument("--tracker", default=DEFAULT_TRACKER, type=endpoint, metavar="ENDPOINT",
                   help="tracker bind endpoint (default %(default)s)")
    p.add_argument("--pub", default=DEFAULT_PUB, type=endpoint, metavar="ENDPOINT",
                   help="tracker PUB endpoint (default %(default)s)")
    _device_flags(p, "each node's", "; plain cuda deals the nodes out over every GPU")
    p.add_argument("--threads", type=count, default=0,
                   help="torch threads per node, 0 for all cores; the nodes compute one at a time "
                        "(default %(default)s)")
    _quant_flag(p)
    _keys_flag(p)
    p.set_defaults(func=cmd_up)


def _even_shards(model: str, nodes: int) -> list:
    """``nodes`` shards splitting ``model``'s layers evenly; CommandError for an unknown model."""
    from .compute.models import ModelError, default_cache_root, load_config, resolve
    from .wire.shard import even_split

    try:
        num_layers = load_config(resolve(model), default_cache_root()).num_hidden_layers
        return even_split(num_layers, nodes)
    except (ModelError, ValueError) as exc:
        raise CommandError(str(exc)) from None


def cmd_up(args) -> int:
    _check_device(args.device, args.quant)
    # checked here, so a bad key directory fails before anything starts; up's tracker runs with DIR's key pair
    security = _security(args, f"{args.keys}/id.key (the key pair `meshnet up` runs its tracker with)")
    shards = _even_shards(args.model, args.nodes)
    _refuse_ports_in_use({"the tracker, --tracker": args.tracker, "its feed, --pub": args.pub,
                          "the web UI, --port": f"tcp://{args.host}:{args.port}"},
                         "`meshnet up` (or a tracker or web UI)")
    args.quant = _picked_quant(args.quant, args.model, args.device)  # every node gets the one answer
    threads = ["--threads", str(args.threads)] if args.threads else []
    devices = node_devices(args.device, len(shards), _cuda_count(args.device))
    log.info("starting a tracker, %d nodes (layers %s on %s; nodes of one device compute one at a time, "
             "%s torch threads each) and the web UI; loading weights…", len(shards), ", ".join(map(str, shards)),
             ", ".join(devices), args.threads or "all")
    me = [sys.executable, "-m", "fabric.cli", "--log-level", args.log_level,
          *(["--config", args.config] if args.config else [])]  # nodes read its [node] table too
    keys = ["--keys", args.keys] if args.keys else []
    # nodes on one device (this machine's cores, or one GPU) compute one at a time, each with all of it: every
    # node locks its device's default compute lock, as nodes started by hand on this machine do
    commands = [[*me, "tracker", "--bind", args.tracker, "--pub", args.pub, *keys]]
    commands += [[*me, "node", "--model", args.model, "--layers", str(s), "--tracker", args.tracker, *threads,
                  "--device", device, "--dtype", args.dtype, "--quant", args.quant, "--no-progress", *keys]
                 for s, device in zip(shards, devices)]
    commands.append([*me, "webui", "--tracker", args.tracker, "--pub", args.pub, "--host", args.host,
                     "--port", str(args.port), *keys])
    return supervise(commands, url=f"http://{args.host}:{args.port}", tracker=args.tracker, nodes=len(shards),
                     security=security)


def _ports_in_use(endpoints: dict[str, str]) -> list[str]:
    """Which of these TCP endpoints ("tcp://host:port", by role) something already listens
    on: ``up`` would start every other process and then lose the one that cannot bind (and
    its nodes would join the other cluster's tracker meanwhile)."""
    busy = []
    for role, address in endpoints.items():
        host, _, number = address.removeprefix("tcp://").rpartition(":")
        if not address.startswith("tcp://") or not number.isdigit() or int(number) == 0:
            continue  # ipc://, or a port chosen at bind time: nothing to check
        host = "" if host in ("*", "0.0.0.0") else host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ and the web server bind
            try:
                probe.bind((host, int(number)))
            except OSError as exc:  # any other failure (an address not on this machine) is the process's to report
                if exc.errno == errno.EADDRINUSE:
                    busy.append(f"port {number} ({role})")
    return busy


def node_devices(device: str, nodes: int, gpus: int) -> list[str]:
    """The device of each of ``up``'s nodes: plain ``cuda`` on a machine with several GPUs
    deals the nodes out over them in turn; anything else is every node's."""
    if device != "cuda" or gpus < 2:
        return [device] * nodes
    return [f"cuda:{i % gpus}" for i in range(nodes)]


def _cuda_count(device: str) -> int:
    import torch

    return torch.cuda.device_count() if device == "cuda" else 0


def supervise(commands: list[list[str]], url: str, tracker: str, nodes: int, security=None) -> int:
    """Run every command; stop them all on Ctrl-C or when any one dies."""
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell may start us with it ignored
        signal.signal(sig, lambda *_: stop.set())
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(cmd))
        _announce_when_ready(tracker, nodes, url, stop, procs, security)
        while not stop.is_set():
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                role = next((a for a in dead[0].args if a in ("tracker", "node", "webui")), dead[0].args[-1])
                error_line(f"the {role} process exited with status {dead[0].returncode}; stopping the cluster")
                return 1
            stop.wait(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        stop_processes(procs)


def _announce_when_ready(tracker: str, nodes: int, url: str, stop: threading.Event, procs, security) -> None:
    from .client import Client, FabricError

    with Client(tracker, timeout=2.0, security=security) as client:
        while not stop.is_set() and all(p.poll() is None for p in procs):
            try:
                status = client.status()
                if len(status.get("nodes", [])) >= nodes and any(status.get("plans", {}).values()):
                    print(f"\nmeshnet is up: {nodes} nodes serving. Dashboard and API at {url}\n"
                          f"Press Ctrl-C to stop.\n", flush=True)
                    return
            except FabricError:
                pass
            stop.wait(0.5)


def stop_processes(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGINT every live process (last started first), wait up to ``grace`` s, then kill."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- tracker


def _tracker_parser(sub) -> None:
    p = sub.add_parser("tracker", help="run the tracker (registry, route plans, stats, usage ledger)")
    p.add_argument("--bind", default=DEFAULT_TRACKER, type=endpoint, metavar="ENDPOINT",
                   help="ROUTER endpoint (default %(default)s)")
    p.add_argument("--pub", default=DEFAULT_PUB, type=endpoint, metavar="ENDPOINT",
                   help="PUB endpoint for plans/stats/events (default %(default)s)")
    p.add_argument("--db", default=None, metavar="FILE",
                   help="SQLite usage ledger (default: under the user data directory)")
    p.add_argument("--heartbeat", type=seconds, default=1.0, metavar="SECONDS",
                   help="node heartbeat interval (default %(default)s)")
    p.add_argument("--relay", default=None, type=endpoint, metavar="ENDPOINT",
                   help="also run a relay in this process, its control socket at ENDPOINT (see `meshnet relay`; "
                        "default: no relay)")
    p.add_argument("--relay-advertise-host", default=None, metavar="HOST",
                   help="with --relay: host peers dial the relay's fronts at (as relay --advertise-host; "
                        "default: the front host)")
    p.add_argument("--relay-front-ports", default=None, metavar="A-B",
                   help="with --relay: port range for the relay's fronts (as relay --front-ports; "
                        "default: any free port)")
    _metrics_flag(p)
    _keys_flag(p)
    p.set_defaults(func=cmd_tracker)


BIND_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


@contextlib.contextmanager
def _listening(flags: str, where: str = ""):
    """A socket that cannot bind (taken since the ports were checked, or an address not on
    this machine) as one line naming the address (ZeroMQ's errors name it themselves) and the
    ``flags`` to change; status 1: found while running."""
    import zmq

    try:
        yield
    except (OSError, zmq.ZMQError) as exc:
        if exc.errno not in BIND_ERRORS:
            raise
        raise CommandError(f"cannot listen{where and f' on {where}'}: {exc.strerror}; choose another {flags}",
                           1) from None


def cmd_tracker(args) -> int:
    from tracker.service import Tracker, TrackerConfig, serve

    if not args.relay and (args.relay_advertise_host or args.relay_front_ports):
        given = "--relay-advertise-host" if args.relay_advertise_host else "--relay-front-ports"
        raise CommandError(f"{given} configures the relay that --relay ENDPOINT runs in the tracker; "
                           f"add --relay, or leave out {given}")
    _refuse_ports_in_use({"the tracker, --bind": args.bind, "its feed, --pub": args.pub,
                          **({"its relay, --relay": args.relay} if args.relay else {})}, "tracker")
    kwargs = dict(bind=args.bind, pub=args.pub, heartbeat_interval=args.heartbeat,
                  security=_security(args, tracker_key_file=None))
    if args.db:
        kwargs["db"] = args.db
    tracker = Tracker(TrackerConfig(**kwargs))
    _serve_metrics(args, tracker.metrics)
    with _listening("--bind, --pub or --relay"), _relay_thread(args):
        serve(tracker.config, tracker)
    return 0


# --------------------------------------------------------------------------- node


def _node_parser(sub) -> None:
    p = sub.add_parser("node", help="serve a range of a model's layers",
                       description="Load a contiguous range of a model's layers and serve them on the fabric.")
    p.add_argument("--model", required=True,
                   help="a Hugging Face directory, a .gguf file, an alias such as smollm2-135m, or ORG/NAME "
                        "fetched by `meshnet pull` (`meshnet models` lists them)")
    p.add_argument("--model-id", default=None, help="id clients use for this model (default: alias or file name)")
    p.add_argument("--layers", default=None, help="inclusive range such as 0-14 (default: ask the tracker)")
    _tracker_flag(p)
    p.add_argument("--bind", default="tcp://127.0.0.1:0", type=endpoint, metavar="ENDPOINT",
                   help="ROUTER endpoint; port 0 picks one (default %(default)s)")
    p.add_argument("--advertise", default=None, type=endpoint, metavar="ENDPOINT",
                   help="endpoint peers dial (default: the bound one)")
    _node_relay_flags(p)
    _device_flags(p, "the")
    _quant_flag(p)
    p.add_argument("--threads", type=count, default=0, help="torch threads, 0 for all cores (default %(default)s)")
    p.add_argument("--compute-lock", default=None, metavar="FILE",
                   help="nodes on one machine that lock the same file compute one at a time, each with every "
                        "thread; `none`: compute whenever this node likes (default: one file per device for "
                        f"this user, {default_lock('DEVICE', os.environ)}, so nodes started one by one on a "
                        "machine take turns)")
    p.add_argument("--max-sessions", type=positive_count, default=64, help="sessions this node keeps KV for")
    p.add_argument("--kv-cache-gib", type=non_negative, default=None, metavar="GIB",
                   help="GiB of ended requests' KV this node keeps, so that a later request sharing their start "
                        "(a chat's earlier turns, a common system prompt) computes only the rest; the least "
                        "recently used goes first; 0 keeps none (default: a tenth of the memory available at "
                        "start, on the node's device)")
    p.add_argument("--max-prompt-tokens", type=positive_count, default=4096, help="longest prompt the head accepts")
    p.add_argument("--prefill-slice-ms", type=non_negative, default=0.0, metavar="MS",
                   help="while other streams decode here, run a long prompt's prefill in slices that add about "
                        "this many milliseconds to their decode steps (a slice rides in their forward pass); 0: as "
                        "long as one decode step (default %(default)s)")
    p.add_argument("--wire-dtype", default="", choices=["", "float32", "float16", "bfloat16"],
                   help="dtype of hidden states between the hops of routes this node heads (default: each "
                        "node's compute dtype; bfloat16 halves the bytes of a float32 route, not bit-exact)")
    p.add_argument("--node-id", default=None,
                   help="id in the swarm (default: made once and kept in a key file, so restarts keep it)")
    p.add_argument("--memory", type=non_negative, default=0.0, metavar="GIB",
                   help="GiB of weights this node may hold, 0 for no limit; instead of --layers: the tracker "
                        "assigns a span that fits (default %(default)s)")
    _node_timing_flags(p)
    _node_audit_flags(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    _metrics_flag(p)
    p.set_defaults(func=cmd_node)


def _node_timing_flags(p: argparse.ArgumentParser) -> None:
    """How long a node waits: for a step's reply, between heartbeats, and when it leaves."""
    p.add_argument("--hop-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="seconds the head waits for a step's reply before re-sending it (default %(default)s)")
    p.add_argument("--heartbeat", type=seconds, default=1.0, metavar="SECONDS",
                   help="seconds between heartbeats to the tracker (default %(default)s)")
    p.add_argument("--drain-timeout", type=non_negative, default=30.0, metavar="SECONDS",
                   help="on SIGTERM the node leaves politely: the tracker drops it from plans, it takes no new "
                        "request, and it exits once the requests it serves end, or after this many seconds, "
                        "when their heads move them to other nodes (default %(default)s; a second SIGTERM or "
                        "Ctrl-C exits at once)")


def _node_audit_flags(p: argparse.ArgumentParser) -> None:
    """How often the requests a node heads are checked on replicas, and how strictly."""
    p.add_argument("--audit-rate", type=share, default=AUDIT_RATE, metavar="SHARE",
                   help="share of the requests this node heads whose steps, prompt and decode steps alike, "
                        "replicas holding the same layers re-run after the request ends, to catch a node that "
                        "returns wrong results; hops sketch every step of every request for it. 0: never, and no "
                        "sketches (default %(default)s)")
    p.add_argument("--audit-tolerance", type=non_negative, default=AUDIT_TOLERANCE, metavar="REL",
                   help="relative distance allowed, at any position, between the sketch of a hop's output and "
                        "of a replica's re-run of it (a replay runs a stretch in one pass where the hop ran it "
                        "step by step: never bit for bit) (default %(default)s)")


def _node_relay_flags(p: argparse.ArgumentParser) -> None:
    """How a node that cannot accept inbound connections is reached."""
    p.add_argument("--relay", default=None, type=endpoint, metavar="ENDPOINT",
                   help="reach peers through this relay's control endpoint, for a node that cannot accept "
                        "inbound connections; peers then dial the front the relay opens for it (default: none)")
    p.add_argument("--relay-fallback", default=None, type=endpoint, metavar="ENDPOINT",
                   help="serve directly, but switch to this relay if the tracker cannot reach the advertised "
                        "endpoint, NAT (default: none)")
    p.add_argument("--relay-key", default=None, metavar="KEY",
                   help="the relay's public key, z85 text or a key file (default: DIR/allowed/relay.key, "
                        "else the tracker's key); only with --keys")


def _omp_workers_nap(weight_only: bool = False) -> None:
    """Before torch loads: idle OpenMP workers spin only briefly (GOMP_SPINCOUNT=10000), then
    sleep; on the weight-only kernels (``weight_only``) they sleep at once (OMP_WAIT_POLICY=PASSIVE).

    libgomp's default spins ~300 000 times after every parallel region: nodes share hosts (with
    each other, the web UI, anything) and that spinning takes the cores a busy node needs
    (3-7x slower decode steps measured on a loaded 2-core machine). Sleeping at once
    (OMP_WAIT_POLICY=PASSIVE) costs ~25% inside a float32 forward pass, whose regions follow each
    other within microseconds; a short spin keeps most of that. The weight-only kernels split
    even a small matrix over every thread, so a token is hundreds of short regions: on the
    loaded 2-core machine a short spin there cost 118-144 CPU ms per int4 token against 20-22
    sleeping at once (19 with one thread; SmolLM2-135M, two nodes). Either variable set wins.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        if weight_only:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            os.environ["GOMP_SPINCOUNT"] = "10000"


def _grouped_kv_attention() -> None:
    """Let torch's attention read grouped KV heads as they are.

    For a query longer than one token with a mask, transformers expands the KV heads of
    grouped-query models (``repeat_kv``) before calling SDPA on the CPU: a copy of the whole
    cache per layer. A prefill slice late in a long prompt spent ~14 of its ~55 ms there.
    SDPA's own ``enable_gqa`` gives the same numbers without the copy.
    """
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


def _check_device(device: str, quant: str) -> None:
    """CommandError when ``device`` cannot compute here (with ``quant``): the check
    ``load_shard`` makes, before anything starts (``auto`` fits any device)."""
    from .compute.models import ModelError, check_device

    try:
        check_device(device, None if quant == "auto" else quant)
    except ModelError as exc:
        raise CommandError(str(exc)) from None


def _runs_weight_only(args) -> bool:
    """Will this node's layers run on the weight-only kernels? Asked before torch loads; a bad
    --model is left for ``_node_config`` to report, after the other flags' checks."""
    from .compute.model_ref import ModelError, pick_quant, resolve

    try:
        auto = args.quant == "auto"
        return pick_quant(args.quant, resolve(args.model) if auto else None, args.device)[0] is not None
    except ModelError:
        return False


def _picked_quant(quant: str, model: str, device: str) -> str:
    """``--quant`` as a scheme for ``model`` on ``device`` (``auto``: a GGUF's own grid), said in
    the log. Torch stays unloaded (see ``cmd_node``)."""
    from .compute.model_ref import ModelError, pick_quant, resolve

    try:
        scheme, why = pick_quant(quant, resolve(model) if quant == "auto" else None, device)
    except ModelError as exc:
        raise CommandError(str(exc)) from None
    if quant == "auto":
        mode = (f"on its own grid, --quant {scheme}: weight-only kernels, bfloat16 compute; for the exact tokens "
                "of transformers use --quant none --dtype float32" if scheme else "--quant none, in --dtype")
        log.info("%s: %s (%s)", model, mode, why)
    return scheme or "none"


def _check_node_flags(args) -> None:
    """Refuse, before anything loads, flags that would be ignored or a port that is taken."""
    if args.memory and args.layers:
        raise CommandError(f"--memory {args.memory:g} with --layers {args.layers}: --memory asks the tracker for "
                           "a span that fits, --layers names the span; give one of them")
    if args.relay_key and not args.keys:
        raise CommandError(f"--relay-key {args.relay_key} without --keys: a relay key is only used in a secured "
                           "swarm; add --keys DIR, or leave out --relay-key")
    if args.relay_key and not (args.relay or args.relay_fallback):
        raise CommandError(f"--relay-key {args.relay_key} without --relay or --relay-fallback: this node dials "
                           "no relay; add one, or leave out --relay-key")
    _refuse_ports_in_use({"this node, --bind": args.bind}, "node")


def cmd_node(args) -> int:
    _omp_workers_nap(weight_only=_runs_weight_only(args))
    _grouped_kv_attention()
    import torch

    from .compute.model_ref import ModelError
    from .node import Node

    _check_device(args.device, args.quant)
    _check_node_flags(args)
    security = _security(args)  # before any weights load: a key directory that cannot work says so now
    if args.threads:
        torch.set_num_threads(args.threads)
    config = _node_config(args, security)
    stop, leave = threading.Event(), threading.Event()  # Ctrl-C stops now; SIGTERM leaves politely, twice stops
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set() if leave.is_set() else leave.set())
    try:
        with _listening("--bind"):
            node = Node(config)
    except ModelError as exc:  # the weights did not load (fabric.compute.models.load_shard)
        name = config.source.path.name
        raise CommandError(str(exc) if name in str(exc) else f"{name}: {exc}", 1) from None
    _serve_metrics(args, node.metrics)
    node.run(stop, leave)
    log.info("node stopped")
    return 0


def _node_config(args, security):
    """The NodeConfig for ``meshnet node``'s flags: the model's config is read, its weights are not."""
    import torch

    from .compute.gguf_info import check_reference
    from .compute.models import (
        ModelError,
        default_cache_root,
        default_data_root,
        load_config,
        resolve,
    )
    from .net.security import relay_key
    from .node import NodeConfig, stable_node_id
    from .wire.shard import parse_layers

    try:
        check_reference(args.model)  # a GGUF file no node can run: one line naming it, before anything is logged
    except ModelError as exc:
        raise CommandError(str(exc)) from None
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    quant = _picked_quant(args.quant, args.model, args.device)
    quant = None if quant == "none" else quant
    try:
        source = resolve(args.model, args.model_id)
        model_config = load_config(source, default_cache_root())
        num_layers = model_config.num_hidden_layers
        shard = (parse_layers(args.layers, num_layers) if args.layers
                 else _assigned_shard(args.tracker, source.model_id, num_layers,
                                      _layers_that_fit(model_config, dtype, args.memory, quant), security))
    except (ModelError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    node_id = args.node_id or stable_node_id(default_data_root(), source.model_id, shard, args.bind)
    return NodeConfig.build(source, shard, bind=args.bind, advertise=args.advertise,
                      tracker=args.tracker, device=args.device,
                      dtype=torch.bfloat16 if quant else dtype, node_id=node_id, quant=quant,
                      max_sessions=args.max_sessions, max_prompt_tokens=args.max_prompt_tokens,
                      kv_cache_bytes=None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30)),
                      prefill_slice=args.prefill_slice_ms / 1000, wire_dtype=args.wire_dtype,
                      compute_lock=_compute_lock(args.compute_lock, args.device),
                      hop_timeout=args.hop_timeout, heartbeat_interval=args.heartbeat,
                      audit_rate=args.audit_rate, audit_tolerance=args.audit_tolerance,
                      drain_timeout=args.drain_timeout,
                      cache_root=default_cache_root(), progress=not args.no_progress,
                      security=security, relay=args.relay, relay_fallback=args.relay_fallback,
                      relay_key=relay_key(args.keys, args.relay_key) if args.keys else "")


def _compute_lock(value: str | None, device: str) -> str | None:
    """--compute-lock: a FILE, ``none``, or by default this user's file for ``device``."""
    from .compute.compute_lock import NO_LOCK, LockDirError, private_dir

    if value == NO_LOCK:
        return None
    if value:
        return value
    path = default_lock(device, os.environ)
    try:
        private_dir(path)
    except LockDirError as exc:
        raise CommandError(f"{exc}; give --compute-lock FILE, or --compute-lock none", 1) from None
    return str(path)


def _layers_that_fit(model_config, dtype, memory_gib: float, quant: str | None = None) -> int:
    """How many layers fit ``memory_gib`` of weights (0: no budget given), quantized by ``quant``."""
    if memory_gib <= 0:
        return 0
    from .compute.models import layer_bytes
    from .compute.quant import quantized_layer_bytes

    held = quantized_layer_bytes(model_config, "int8" if quant == "gguf" else quant) if quant else layer_bytes(
        model_config, dtype)  # gguf: int8 bounds its mix from above (Q4_* take less)
    fit = int(memory_gib * (1 << 30) // held)
    if fit < 1:
        raise ValueError(f"--memory {memory_gib} GiB does not hold even one layer of this model")
    return fit


def _assigned_shard(tracker: str, model_id: str, num_layers: int, max_layers: int, security=None):
    from .client import Client, FabricError
    from .wire import protocol as p
    from .wire.shard import Shard

    with Client(tracker, timeout=10.0, security=security) as client:
        try:
            reply = client.ask(p.AssignRequest(model_id, num_layers, max_layers))
        except FabricError as exc:
            raise CommandError(f"no --layers given and the tracker could not assign any: {exc}", 1) from None
    if not isinstance(reply, p.Assign):
        raise CommandError(f"no --layers given and the tracker gave no layer assignment: {reply}", 1)
    log.info("tracker assigned layers %d-%d", reply.start_layer, reply.end_layer)
    return Shard(reply.start_layer, reply.end_layer, num_layers)


# --------------------------------------------------------------------------- webui


def _webui_parser(sub) -> None:
    p = sub.add_parser("webui", help="serve the dashboard and the OpenAI-compatible API")
    _tracker_flag(p)
    p.add_argument("--pub", default=DEFAULT_PUB, type=endpoint, metavar="ENDPOINT",
                   help="tracker PUB endpoint for live events (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface the web server listens on; 0.0.0.0 for every one (default %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="port the web server listens on (default %(default)s)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="file with one API key per line; requests must then carry one "
                        "(default: no authentication)")
    p.set_defaults(func=cmd_webui)


def read_api_keys(path: str) -> frozenset[str]:
    """The keys in ``path``, one a line (blank lines and # comments skipped); CommandError when
    the file cannot be read or holds none, which would refuse every request."""
    try:
        with open(path) as fh:
            keys = frozenset(line.strip() for line in fh if line.strip() and not line.strip().startswith("#"))
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CommandError(f"--api-keys {path}: {reason}; give a file with one API key per line, or leave out "
                           "--api-keys to serve without authentication") from None
    if not keys:
        raise CommandError(f"--api-keys {path} holds no keys, so every request would be refused; put one key per "
                           "line, or leave out --api-keys to serve without authentication")
    return keys


def cmd_webui(args) -> int:
    from webui.app import WebUIConfig, serve

    keys = read_api_keys(args.api_keys) if args.api_keys else frozenset()
    security = _security(args)
    _refuse_ports_in_use({"the web UI, --port": f"tcp://{args.host}:{args.port}"}, "web UI")
    with _listening("--host or --port", f"{args.host}:{args.port}"):
        serve(WebUIConfig(tracker=args.tracker, pub=args.pub, host=args.host, port=args.port, api_keys=keys,
                          security=security))
    return 0


# --------------------------------------------------------------------------- chat / status


def _chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal: one prompt, or a conversation",
                       description="Without PROMPT and with stdin a terminal: a conversation at a >>> prompt "
                                   "(/bye or Ctrl-D ends it; Ctrl-C stops a reply). Piped stdin is the prompt, "
                                   "followed by PROMPT if given, joined by a space (as `ollama run`).")
    _tracker_flag(p)
    p.add_argument("--model", default="smollm2-135m", help="the model id to chat with, as `meshnet status` lists it")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message first (default: none)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="the most tokens of a reply")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature, 0 is greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest tokens, 0 for all")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass, 1 for all")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="make sampling repeatable (default: none, a random seed per reply)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end a reply before this text; repeat for several (default: none)")
    p.add_argument("prompt", nargs="*", metavar="PROMPT", help="the user message (its words are joined by a space)")
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from .chat_repl import ChatConfig
    from .chat_repl import run as chat

    return chat(ChatConfig.from_args(args, _security(args)), args.prompt)


def _status_parser(sub) -> None:
    p = sub.add_parser("status", help="nodes, coverage and current route plans")
    _tracker_flag(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    from .client import Client, FabricError

    with Client(args.tracker, timeout=5.0, security=_security(args)) as client:
        try:
            status = client.status()
        except FabricError as exc:
            raise CommandError(str(exc), 1) from None
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def format_status(status: dict) -> str:
    """A readable view: nodes, a coverage map per model, the plans, recent events."""
    nodes = status.get("nodes", [])
    lines = [f"{'NODE':<20} {'MODEL':<18} {'LAYERS':<9} {'SESSIONS':>8} {'LAYER-STEPS/S':>14} "
             f"{'KV KEPT (HITS/MISSES)':>22}  ENDPOINT"]
    for n in nodes:
        a, b = n["layers"]
        rate = n.get("layer_steps_per_s") or n.get("benchmark") or 0
        via = f" (relayed via {n['relay']})" if n.get("relay") else ""
        via += " EXCLUDED: an audit caught it returning wrong results" if n.get("excluded") else ""
        lines.append(f"{n['id']:<20} {n['model']:<18} {f'{a}-{b}':<9} {n.get('sessions', 0):>8} {rate:>14.0f} "
                     f"{kv_cache_cell(n.get('kv_cache') or {}):>22}  {n['endpoint']}{via}")
    for model in sorted({n["model"] for n in nodes}):
        lines += ["", f"{model}:", *coverage_map(model, nodes)]
        plans = status.get("plans", {}).get(model) or []
        for rank, plan in enumerate(plans, 1):
            hops = " -> ".join(f"{h['node']}[{h['start_layer']}-{h['end_layer']}]"
                               + (" (relayed)" if h.get("relay") else "") for h in plan["hops"])
            actual = plan.get("actual_tps")
            seen = f", observed {actual:.1f} over {plan.get('samples', 0)} requests" if actual else ""
            lines.append(f"  plan {rank}: {hops}  (~{plan.get('estimated_tps', 0):.1f} tok/s{seen})")
        if not plans:
            gaps = status.get("gaps", {}).get(model)
            lines.append(f"  no complete route{f' (missing layers {gaps})' if gaps else ''}")
        lines += weights_differ_lines(status.get("weights_differ", {}).get(model) or [])
    events = status.get("events", [])[-8:]
    if events:
        lines += ["", "recent events:"]
        lines += [f"  {e.get('kind', ''):<15} {e.get('message', '')}" for e in events]
    return "\n".join(lines)


def kv_cache_cell(kv: dict) -> str:
    """A node's kept KV and how often requests found it there: ``46.1 MiB (4/1)``."""
    return f"{kv.get('bytes', 0) / (1 << 20):.1f} MiB ({kv.get('hits', 0)}/{kv.get('misses', 0)})"


def weights_differ_lines(groups: list[dict]) -> list[str]:
    """Nodes that claim one model with different weights: they never share a route."""
    if len(groups) < 2:
        return []
    lines = ["  weights differ: these nodes claim this model but hold different weights, so they never chain:"]
    for g in groups:
        held = ", ".join(f"{n['id']} [{n['layers'][0]}-{n['layers'][1]}]" for n in g["nodes"])
        lines.append(f"    fingerprint {g['label']} ({g['num_layers']} layers): {held}")
    lines.append("    load the same model file on every node, with the same --quant")
    return lines


def coverage_map(model: str, nodes: list[dict], width: int = 60) -> list[str]:
    """One bar per node over the model's layer axis, e.g. ``node-a  |#####.....|  0-14``."""
    mine = [n for n in nodes if n["model"] == model]
    total = max((n.get("num_layers") or n["layers"][1] + 1) for n in mine)
    scale = min(width, total) / total
    rows = []
    for n in sorted(mine, key=lambda n: n["layers"]):
        a, b = n["layers"]
        lo, hi = int(a * scale), max(int(a * scale) + 1, int((b + 1) * scale))
        bar = "." * lo + "#" * (hi - lo) + "." * (int(total * scale) - hi)
        rows.append(f"  {n['id']:<20} |{bar}| {a}-{b} of {total}")
    return rows


def _keys_parser(sub) -> None:
    p = sub.add_parser("keys", help="make a CurveZMQ key pair for a secured swarm",
                       description="Make this machine's key pair in DIR and allow-list it. Copy DIR/id.key "
                                   "into every other member's DIR/allowed/ (the tracker's as tracker.key), "
                                   "then start every process with --keys DIR.")
    p.add_argument("dir", help="key directory (created if missing)")
    p.add_argument("--name", default=None, help="name of this member in allow-lists (default: host name)")
    p.add_argument("--tracker", action="store_true",
                   help="this key pair is the tracker's: also saved as DIR/allowed/tracker.key")
    p.set_defaults(func=cmd_keys)


def cmd_keys(args) -> int:
    import socket

    from .net.security import create_keys

    try:
        public = create_keys(Path(args.dir), args.name or socket.gethostname(), tracker=args.tracker)
    except OSError as exc:
        raise CommandError(f"cannot write a key pair to {args.dir}: {exc.strerror or exc}; choose a directory "
                           "you can write to", 1) from None
    print(f"key pair written to {args.dir}; public key: {public}\n"
          f"copy {public} into the allowed/ folder of every other member"
          f"{' as tracker.key' if args.tracker else ''}")
    return 0


# --------------------------------------------------------------------------- relay

DEFAULT_RELAY = "tcp://127.0.0.1:5557"


def _relay_parser(sub) -> None:
    p = sub.add_parser("relay", help="relay frames for nodes that cannot accept inbound connections",
                       description="Nodes started with --relay ENDPOINT dial this process; it opens a public "
                                   "socket (a front) for each and passes frames both ways. With --keys every "
                                   "socket is a CURVE server with this process's key: the relay sees "
                                   "plaintext, so it must be a trusted member of the swarm.")
    p.add_argument("--bind", default=DEFAULT_RELAY, type=endpoint, metavar="ENDPOINT",
                   help="control endpoint relayed nodes dial (default %(default)s)")
    p.add_argument("--front-host", default=None, metavar="HOST",
                   help="interface the fronts bind on (default: the --bind host)")
    p.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="host peers dial the fronts at (default: the front host; needed when it is 0.0.0.0)")
    p.add_argument("--front-ports", default=None, metavar="A-B",
                   help="inclusive port range the fronts bind in, one port per node (default: any free port)")
    p.add_argument("--node-timeout", type=seconds, default=5.0, metavar="SECONDS",
                   help="close a node's front after it sent nothing for this many seconds (default %(default)s)")
    p.add_argument("--max-fronts", type=positive_count, default=256,
                   help="nodes served at most (default %(default)s)")
    _metrics_flag(p)
    _keys_flag(p)
    p.set_defaults(func=cmd_relay)


def _relay_config(args, bind: str, advertise: str | None, ports: str | None, front: str | None = None,
                  flags: str = "--"):
    """The RelayConfig; CommandError naming the flag (``flags``: their prefix, "--relay-" in the tracker)."""
    from .net.relay import RelayConfig, endpoint_host

    front = front or endpoint_host(bind)
    advertise = advertise or front
    if advertise in ("0.0.0.0", "*", "::", "[::]"):
        raise CommandError(f"fronts bind on all interfaces ({front}): say which host peers dial them at "
                           f"({flags}advertise-host)")
    if ports:
        a, _, b = ports.partition("-")
        if not (a.isdigit() and b.isdigit() and 0 < int(a) <= int(b) < 65536):
            raise CommandError(f"{flags}front-ports {ports!r}: give an inclusive range such as 41000-41099")
        ports = (int(a), int(b))
    return RelayConfig(bind=bind, front_host=front, advertise_host=advertise, front_ports=ports,
                       node_timeout=getattr(args, "node_timeout", 5.0), max_fronts=getattr(args, "max_fronts", 256),
                       security=_security(args, tracker_key_file=None))


def cmd_relay(args) -> int:
    from .net.relay import Relay, serve_relay

    config = _relay_config(args, args.bind, args.advertise_host, args.front_ports, args.front_host)
    _refuse_ports_in_use({"the relay, --bind": args.bind}, "relay")
    relay = Relay(config)
    _serve_metrics(args, relay.metrics)
    with _listening("--bind"):
        serve_relay(config, relay)
    return 0


@contextlib.contextmanager
def _relay_thread(args):
    """``meshnet tracker --relay ENDPOINT``: a relay in a thread of the tracker process."""
    if not args.relay:
        yield
        return
    from .net.relay import Relay

    relay = Relay(_relay_config(args, args.relay, args.relay_advertise_host, args.relay_front_ports,
                                flags="--relay-"))
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), name="relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


if __name__ == "__main__":
    sys.exit(main())
