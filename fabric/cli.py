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
import tempfile
import threading
import time
from pathlib import Path

from . import model_store

DEFAULT_TRACKER = "tcp://127.0.0.1:5555"
DEFAULT_PUB = "tcp://127.0.0.1:5556"

log = logging.getLogger("meshnet")


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError, apply

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        apply(parser, argv)  # the config file's values become the flags' defaults
    except ConfigError as exc:
        print(f"meshnet: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from .security import SecurityError

    try:
        return args.func(args) or 0
    except SecurityError as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnet", description="Run one language model across several machines over a ZeroMQ fabric.")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML file whose keys set any flag: top-level keys for every command, a [node], "
                             "[up], [tracker]… table per command; flags typed here win (default: $MESHNET_CONFIG, "
                             "else ~/.config/meshnet/config.toml if it exists)")
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
    return parser


def _tracker_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracker", default=DEFAULT_TRACKER, help="tracker endpoint (default %(default)s)")
    _keys_flag(p)


def _keys_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="secure the swarm with CurveZMQ: this process's key pair and the allow-list "
                        "(made by `meshnet keys DIR`); default: plaintext, for a trusted LAN")


def _quant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantized layers, computed in bfloat16 on the CPU (default: none, exact)")


def _metrics_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")


def _serve_metrics(args, sample) -> None:
    if args.metrics_port:
        from .metrics import serve

        serve(args.metrics_port, sample)


def _security(args):
    """The Security for ``--keys`` (None without it); SecurityError says what is missing."""
    from .security import load

    return load(args.keys) if getattr(args, "keys", None) else None


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
                   help=f"{whose} compute dtype (default %(default)s, exact; bfloat16 halves the memory, "
                        "and suits --device cuda)")


def _up_parser(sub) -> None:
    p = sub.add_parser("up", help="start a whole local cluster: tracker, nodes and web UI",
                       description="Start a tracker, N nodes splitting the model's layers evenly, and the web "
                                   "UI, on this machine. Ctrl-C stops them all.")
    p.add_argument("--model", default="smollm2-135m", help="model reference (default %(default)s)")
    p.add_argument("--nodes", type=int, default=2, help="how many nodes split the layers (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="web UI port (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="web UI host (default %(default)s)")
    p.add_argument("--tracker", default=DEFAULT_TRACKER, help="tracker bind endpoint (default %(default)s)")
    p.add_argument("--pub", default=DEFAULT_PUB, help="tracker PUB endpoint (default %(default)s)")
    _device_flags(p, "each node's", "; plain cuda deals the nodes out over every GPU")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per node (default: all cores; the nodes compute one at a time)")
    _quant_flag(p)
    _keys_flag(p)
    p.set_defaults(func=cmd_up)


def cmd_up(args) -> int:
    from .models import ModelError, load_config, resolve, default_cache_root
    from .shard import even_split

    if not _device_ready(args.device, args.quant):
        return 2
    try:
        source = resolve(args.model)
        num_layers = load_config(source, default_cache_root()).num_hidden_layers
        shards = even_split(num_layers, args.nodes)
    except (ModelError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    busy = _ports_in_use({"the tracker, --tracker": args.tracker, "its feed, --pub": args.pub,
                          "the web UI, --port": f"tcp://{args.host}:{args.port}"})
    if busy:
        log.error("already in use on this machine: %s. Is another `meshnet up` (or a tracker or web UI) "
                  "running? Stop it, or choose other ports with --tracker, --pub and --port", "; ".join(busy))
        return 2
    threads = ["--threads", str(args.threads)] if args.threads else []
    devices = node_devices(args.device, len(shards), _cuda_count(args.device))
    log.info("starting a tracker, %d nodes (layers %s on %s; nodes of one device compute one at a time, "
             "%s torch threads each) and the web UI; loading weights…", len(shards), ", ".join(map(str, shards)),
             ", ".join(devices), args.threads or "all")
    security = _security(args)  # checked here, so a bad key directory fails before anything starts
    me = [sys.executable, "-m", "fabric.cli", "--log-level", args.log_level,
          *(["--config", args.config] if args.config else [])]  # nodes read its [node] table too
    keys = ["--keys", args.keys] if args.keys else []
    with tempfile.TemporaryDirectory(prefix="meshnet-up-") as run_dir:
        # nodes on one device (this machine's cores, or one GPU) compute one at a time, each with all of it
        commands = [[*me, "tracker", "--bind", args.tracker, "--pub", args.pub, *keys]]
        commands += [[*me, "node", "--model", args.model, "--layers", str(s), "--tracker", args.tracker, *threads,
                      "--compute-lock", str(Path(run_dir) / f"compute-{device.replace(':', '')}.lock"),
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
    for role, endpoint in endpoints.items():
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not endpoint.startswith("tcp://") or not port.isdigit() or int(port) == 0:
            continue  # ipc://, or a port chosen at bind time: nothing to check
        host = "" if host in ("*", "0.0.0.0") else host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ and the web server bind
            try:
                probe.bind((host, int(port)))
            except OSError as exc:  # any other failure (an address not on this machine) is the process's to report
                if exc.errno == errno.EADDRINUSE:
                    busy.append(f"port {port} ({role})")
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
                log.error("the %s process exited with status %s; stopping the cluster", role, dead[0].returncode)
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
    p.add_argument("--bind", default=DEFAULT_TRACKER, help="ROUTER endpoint (default %(default)s)")
    p.add_argument("--pub", default=DEFAULT_PUB, help="PUB endpoint for plans/stats/events (default %(default)s)")
    p.add_argument("--db", default=None, help="SQLite usage ledger (default: under the user data directory)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="node heartbeat interval in seconds")
    p.add_argument("--relay", default=None, metavar="ENDPOINT",
                   help="also run a relay in this process, its control socket at ENDPOINT (see `meshnet relay`)")
    p.add_argument("--relay-advertise-host", default=None, metavar="HOST",
                   help="with --relay: host peers dial the relay's fronts at (as relay --advertise-host)")
    p.add_argument("--relay-front-ports", default=None, metavar="A-B",
                   help="with --relay: port range for the relay's fronts (as relay --front-ports)")
    _metrics_flag(p)
    _keys_flag(p)
    p.set_defaults(func=cmd_tracker)


def cmd_tracker(args) -> int:
    from tracker.service import Tracker, TrackerConfig, serve

    kwargs = dict(bind=args.bind, pub=args.pub, heartbeat_interval=args.heartbeat, security=_security(args))
    if args.db:
        kwargs["db"] = args.db
    tracker = Tracker(TrackerConfig(**kwargs))
    _serve_metrics(args, tracker.metrics)
    with _relay_thread(args):
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
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="ROUTER endpoint; port 0 picks one")
    p.add_argument("--advertise", default=None, help="endpoint peers dial (default: the bound one)")
    p.add_argument("--relay", default=None, metavar="ENDPOINT",
                   help="reach peers through this relay's control endpoint, for a node that cannot accept "
                        "inbound connections; peers then dial the front the relay opens for it")
    p.add_argument("--relay-fallback", default=None, metavar="ENDPOINT",
                   help="serve directly, but switch to this relay if the tracker cannot reach the advertised "
                        "endpoint (NAT)")
    p.add_argument("--relay-key", default=None, metavar="KEY",
                   help="the relay's public key, z85 text or a key file (default: DIR/allowed/relay.key, "
                        "else the tracker's key); only with --keys")
    _device_flags(p, "the")
    _quant_flag(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    p.add_argument("--compute-lock", default=None, metavar="FILE",
                   help="nodes on one machine given the same file compute one at a time, each with every "
                        "thread (`meshnet up` does this)")
    p.add_argument("--max-sessions", type=int, default=64, help="sessions this node keeps KV for")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="longest prompt the head accepts")
    p.add_argument("--prefill-slice-ms", type=float, default=0.0, metavar="MS",
                   help="while other streams decode here, run a long prompt's prefill in slices of about this "
                        "many milliseconds between their decode steps (default: as long as one decode step)")
    p.add_argument("--wire-dtype", default="", choices=["", "float32", "float16", "bfloat16"],
                   help="dtype of hidden states between the hops of routes this node heads (default: each "
                        "node's compute dtype; bfloat16 halves the bytes of a float32 route, not bit-exact)")
    p.add_argument("--node-id", default=None,
                   help="id in the swarm (default: made once and kept in a key file, so restarts keep it)")
    p.add_argument("--memory", type=float, default=0.0,
                   help="GiB of weights this node may hold; without --layers the tracker assigns a span that fits")
    p.add_argument("--hop-timeout", type=float, default=30.0,
                   help="seconds the head waits for a step's reply before re-sending it (default %(default)s)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats to the tracker")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    _metrics_flag(p)
    p.set_defaults(func=cmd_node)


def _omp_workers_nap() -> None:
    """Before torch loads: idle OpenMP workers spin only briefly (GOMP_SPINCOUNT=10000), then sleep.

    libgomp's default spins ~300 000 times after every parallel region: nodes share hosts (with
    each other, the web UI, anything) and that spinning takes the cores a busy node needs
    (3-7x slower decode steps measured on a loaded 2-core machine). Sleeping at once
    (OMP_WAIT_POLICY=PASSIVE) costs ~25% inside a forward pass, whose regions follow each
    other within microseconds; a short spin keeps most of that. Either variable set wins.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "10000"


def _grouped_kv_attention() -> None:
    """Let torch's attention read grouped KV heads as they are.

    For a query longer than one token with a mask, transformers expands the KV heads of
    grouped-query models (``repeat_kv``) before calling SDPA on the CPU: a copy of the whole
    cache per layer. A prefill slice late in a long prompt spent ~14 of its ~55 ms there.
    SDPA's own ``enable_gqa`` gives the same numbers without the copy.
    """
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


def _device_ready(device: str, quant: str) -> bool:
    """False, with the reason logged, when ``device`` cannot compute here (with ``quant``):
    the check ``load_shard`` makes, before anything starts."""
    from .models import ModelError, check_device

    try:
        check_device(device, quant)
    except ModelError as exc:
        log.error("%s", exc)
        return False
    return True


def cmd_node(args) -> int:
    _omp_workers_nap()
    _grouped_kv_attention()
    import torch

    from .models import ModelError, default_cache_root, default_data_root, load_config, resolve
    from .node import Node, NodeConfig, stable_node_id
    from .security import relay_key
    from .shard import parse_layers

    if not _device_ready(args.device, args.quant):
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        source = resolve(args.model, args.model_id)
        model_config = load_config(source, default_cache_root())
        num_layers = model_config.num_hidden_layers
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        shard = (parse_layers(args.layers, num_layers) if args.layers
                 else _assigned_shard(args.tracker, source.model_id, num_layers,
                                      _layers_that_fit(model_config, dtype, args.memory), _security(args)))
    except (ModelError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    node_id = args.node_id or stable_node_id(default_data_root(), source.model_id, shard, args.bind)
    config = NodeConfig(source=source, shard=shard, bind=args.bind, advertise=args.advertise,
                        tracker=args.tracker, device=args.device,
                        dtype=dtype, node_id=node_id, quant=None if args.quant == "none" else args.quant,
                        max_sessions=args.max_sessions, max_prompt_tokens=args.max_prompt_tokens,
                        prefill_slice=max(0.0, args.prefill_slice_ms) / 1000, wire_dtype=args.wire_dtype,
                        compute_lock=args.compute_lock,
                        hop_timeout=args.hop_timeout, heartbeat_interval=args.heartbeat,
                        cache_root=default_cache_root(), progress=not args.no_progress,
                        security=_security(args), relay=args.relay, relay_fallback=args.relay_fallback,
                        relay_key=relay_key(args.keys, args.relay_key) if args.keys else "")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    node = Node(config)
    _serve_metrics(args, node.metrics)
    node.run(stop)
    log.info("node stopped")
    return 0


def _layers_that_fit(model_config, dtype, memory_gib: float) -> int:
    """How many layers fit ``memory_gib`` of weights (0: no budget given)."""
    if memory_gib <= 0:
        return 0
    from .models import layer_bytes

    fit = int(memory_gib * (1 << 30) // layer_bytes(model_config, dtype))
    if fit < 1:
        raise ValueError(f"--memory {memory_gib} GiB does not hold even one layer of this model")
    return fit


def _assigned_shard(tracker: str, model_id: str, num_layers: int, max_layers: int, security=None):
    from . import protocol as p
    from .client import Client, FabricError
    from .shard import Shard

    with Client(tracker, timeout=10.0, security=security) as client:
        try:
            reply = client.ask(p.AssignRequest(model_id, num_layers, max_layers))
        except FabricError as exc:
            raise ValueError(f"no --layers given and the tracker could not assign any: {exc}") from None
    if not isinstance(reply, p.Assign):
        raise ValueError(f"the tracker gave no layer assignment: {reply}")
    log.info("tracker assigned layers %d-%d", reply.start_layer, reply.end_layer)
    return Shard(reply.start_layer, reply.end_layer, num_layers)


# --------------------------------------------------------------------------- webui


def _webui_parser(sub) -> None:
    p = sub.add_parser("webui", help="serve the dashboard and the OpenAI-compatible API")
    _tracker_flag(p)
    p.add_argument("--pub", default=DEFAULT_PUB, help="tracker PUB endpoint for live events")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", default=None, help="file with one API key per line (default: no auth)")
    p.set_defaults(func=cmd_webui)


def cmd_webui(args) -> int:
    from webui.app import WebUIConfig, serve

    keys: frozenset[str] = frozenset()
    if args.api_keys:
        with open(args.api_keys) as fh:
            keys = frozenset(line.strip() for line in fh if line.strip() and not line.startswith("#"))
    serve(WebUIConfig(tracker=args.tracker, pub=args.pub, host=args.host, port=args.port, api_keys=keys,
                      security=_security(args)))
    return 0


# --------------------------------------------------------------------------- chat / status


def _chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="send one prompt and stream the reply to the terminal")
    _tracker_flag(p)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("prompt", help="the user message")
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from .client import Client, FabricError
    from .protocol import Sampling

    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    with Client(args.tracker, security=_security(args)) as client:
        try:
            for event in client.generate(args.model, messages=[{"role": "user", "content": args.prompt}],
                                         max_tokens=args.max_tokens, sampling=sampling):
                if event.event == "token":
                    print(event.text, end="", flush=True)
        except FabricError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
    print()
    return 0


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
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def format_status(status: dict) -> str:
    """A readable view: nodes, a coverage map per model, the plans, recent events."""
    nodes = status.get("nodes", [])
    lines = [f"{'NODE':<20} {'MODEL':<18} {'LAYERS':<9} {'SESSIONS':>8} {'LAYER-STEPS/S':>14}  ENDPOINT"]
    for n in nodes:
        a, b = n["layers"]
        rate = n.get("layer_steps_per_s") or n.get("benchmark") or 0
        via = f" (relayed via {n['relay']})" if n.get("relay") else ""
        lines.append(f"{n['id']:<20} {n['model']:<18} {f'{a}-{b}':<9} {n.get('sessions', 0):>8} {rate:>14.0f}"
                     f"  {n['endpoint']}{via}")
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


def weights_differ_lines(groups: list[dict]) -> list[str]:
    """Nodes that claim one model with different weights: they never share a route."""
    if len(groups) < 2:
        return []
    lines = ["  weights differ: these nodes claim this model but hold different weights, so they never chain:"]
    for g in groups:
        held = ", ".join(f"{n['id']} [{n['layers'][0]}-{n['layers'][1]}]" for n in g["nodes"])
        lines.append(f"    fingerprint {g['fingerprint'][:8]} ({g['num_layers']} layers): {held}")
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
    p.add_argument("--tracker", action="store_true", help="this key pair is the tracker's")
    p.set_defaults(func=cmd_keys)


def cmd_keys(args) -> int:
    import socket

    from .security import create_keys

    public = create_keys(Path(args.dir), args.name or socket.gethostname(), tracker=args.tracker)
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
    p.add_argument("--bind", default=DEFAULT_RELAY, help="control endpoint relayed nodes dial (default %(default)s)")
    p.add_argument("--front-host", default=None, help="interface the fronts bind on (default: the --bind host)")
    p.add_argument("--advertise-host", default=None,
                   help="host peers dial the fronts at (default: the front host; needed when it is 0.0.0.0)")
    p.add_argument("--front-ports", default=None, metavar="A-B",
                   help="inclusive port range the fronts bind in, one port per node (default: any free port)")
    p.add_argument("--node-timeout", type=float, default=5.0,
                   help="close a node's front after it sent nothing for this many seconds (default %(default)s)")
    p.add_argument("--max-fronts", type=int, default=256, help="nodes served at most (default %(default)s)")
    _metrics_flag(p)
    _keys_flag(p)
    p.set_defaults(func=cmd_relay)


def _relay_config(args, bind: str, advertise: str | None, ports: str | None, front: str | None = None):
    from .relay import RelayConfig, endpoint_host

    front = front or endpoint_host(bind)
    advertise = advertise or front
    if advertise in ("0.0.0.0", "*", "::", "[::]"):
        raise ValueError(f"fronts bind on all interfaces ({front}): say which host peers dial them at "
                         "(--advertise-host)")
    if ports:
        a, _, b = ports.partition("-")
        if not (a.isdigit() and b.isdigit() and 0 < int(a) <= int(b) < 65536):
            raise ValueError(f"--front-ports {ports!r}: give an inclusive range such as 41000-41099")
        ports = (int(a), int(b))
    return RelayConfig(bind=bind, front_host=front, advertise_host=advertise, front_ports=ports,
                       node_timeout=getattr(args, "node_timeout", 5.0), max_fronts=getattr(args, "max_fronts", 256),
                       security=_security(args))


def cmd_relay(args) -> int:
    from .relay import Relay, serve_relay

    try:
        config = _relay_config(args, args.bind, args.advertise_host, args.front_ports, args.front_host)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    relay = Relay(config)
    _serve_metrics(args, relay.metrics)
    serve_relay(config, relay)
    return 0


@contextlib.contextmanager
def _relay_thread(args):
    """``meshnet tracker --relay ENDPOINT``: a relay in a thread of the tracker process."""
    if not args.relay:
        yield
        return
    from .relay import Relay

    try:
        relay = Relay(_relay_config(args, args.relay, args.relay_advertise_host, args.relay_front_ports))
    except ValueError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
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
