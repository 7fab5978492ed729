"""``meshnet up``: a tracker, N nodes splitting the model's layers evenly, and the web UI, on
this machine, supervised together."""
from __future__ import annotations

import functools
import logging
import sys
import threading

from ..flags import CommandError, count, endpoint, port, positive_count
from ..wire.liveness import DEFAULT_PUB, DEFAULT_TRACKER
from .memory_plan import balanced_shards, check_device_flags, picked_quant
from .node_command import check_draft_device, check_runnable, checked_draft, draft_quant_flag
from .options import device_flags, keys_flag, load_security, quant_flag
from .ports import refuse_ports_in_use
from .supervision import supervise
from .webui_command import api_keys_flag, cors_flag, read_api_keys

log = logging.getLogger("meshnet")


def add_parser(sub) -> None:
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
    device_flags(p, "each node's", "; plain cuda deals the nodes out over every GPU")
    p.add_argument("--threads", type=count, default=0,
                   help="torch threads per node, 0 for all cores; the nodes compute one at a time, "
                        "except that with 0 on CPU their decode passes run at once, each node's on its share "
                        "of the cores (default %(default)s)")
    quant_flag(p)
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="a small model sharing the model's tokenizer that drafts beside the text lookup, loaded "
                        "whole on the node that holds layer 0 (the head of every request); see `meshnet node "
                        "--help` (default: none)")
    draft_quant_flag(p, "each node's")
    keys_flag(p)
    api_keys_flag(p)
    cors_flag(p)
    p.set_defaults(func=cmd_up)


def up_shards(model: str, nodes: int, dtype_name: str, quant: str) -> list:
    """``nodes`` shards of ``model``'s layers, balanced by the memory each node will hold (the
    ends of the model hold more: ``memory_plan.balanced_shards``); CommandError for an unknown model."""
    import torch

    from ..compute.models import ModelError, default_cache_root, load_config, resolve

    quant = None if quant == "none" else quant
    dtype = torch.bfloat16 if quant or dtype_name == "bfloat16" else torch.float32  # as each node computes
    try:
        source = resolve(model)
        return balanced_shards(source, load_config(source, default_cache_root()), nodes, dtype, quant)
    except (ModelError, ValueError) as exc:
        raise CommandError(str(exc)) from None


def cmd_up(args) -> int:
    if args.device != "cpu":  # a device not here is said first, as `meshnet node` says it (the CPU runs every scheme)
        check_device_flags(args.device, args.quant)
    # checked here, so a bad key directory fails before anything starts; up's tracker runs with DIR's key pair
    security = load_security(args, f"{args.keys}/id.key (the key pair `meshnet up` runs its tracker with)")
    if args.api_keys:
        read_api_keys(args.api_keys)  # a file that cannot be read, or holds no key: one line, before anything starts
    check_runnable(args.model)  # a model that names nothing, a port taken: one line, before torch loads
    refuse_ports_in_use({"the tracker, --tracker": args.tracker, "its feed, --pub": args.pub,
                          "the web UI, --port": f"tcp://{args.host}:{args.port}"},
                         "`meshnet up` (or a tracker or web UI)")
    args.quant = picked_quant(args.quant, args.model, args.device)  # every node gets the one answer
    log.info("%s: sizing its layers for %d nodes (this loads torch: up to a minute on a slow machine)…", args.model,
             args.nodes)
    shards = up_shards(args.model, args.nodes, args.dtype, args.quant)
    if args.draft:
        checked_draft(args.draft, args.model)  # refused in one line before anything starts
        check_draft_device(args.device, args.draft_quant)
    devices = node_devices(args.device, len(shards), _cuda_count(args.device))
    log.info("starting a tracker, %d nodes (layers %s on %s; nodes of one device compute one at a time, "
             "%s torch threads each) and the web UI; loading weights…", len(shards), ", ".join(map(str, shards)),
             ", ".join(devices), args.threads or "all")
    me = [sys.executable, "-m", "fabric.cli", "--log-level", args.log_level,
          *(["--config", args.config] if args.config else [])]  # nodes read its [node] table too
    keys = ["--keys", args.keys] if args.keys else []
    commands = [[*me, "tracker", "--bind", args.tracker, "--pub", args.pub, *keys]]
    commands += node_commands(args, shards, devices, [*me, "node"], keys)
    commands.append(webui_command(args, me, keys))
    url = f"http://{args.host}:{args.port}"
    return supervise(commands, announce=functools.partial(_announce_when_ready, args.tracker, len(shards), url,
                                                          security))


def webui_command(args, me: list[str], keys: list[str]) -> list[str]:
    """The web UI's command line, with ``up``'s flags for it."""
    cors = ["--cors-origins", ",".join(sorted(args.cors_origins))] if args.cors_origins else []
    api_keys = ["--api-keys", args.api_keys] if args.api_keys else []
    return [*me, "webui", "--tracker", args.tracker, "--pub", args.pub, "--host", args.host, "--port", str(args.port),
            *keys, *api_keys, *cors]


def node_commands(args, shards: list, devices: list[str], node: list[str], keys: list[str]) -> list[list[str]]:
    """Each node's command line. Nodes on one device (this machine's cores, or one GPU) compute one
    at a time, each with all of it: every node locks its device's default compute lock, as nodes
    started by hand on this machine do, and on CPU cores the quantized ones decode at once, each on
    its share (``hops.decodes_at_once``). ``--draft`` goes to the node holding layer 0 alone: it
    heads every request."""
    threads = ["--threads", str(args.threads)] if args.threads else []
    return [[*node, "--model", args.model, "--layers", str(s), "--tracker", args.tracker, *threads,
             "--device", device, "--dtype", args.dtype, "--quant", args.quant, "--no-progress", *keys,
             *(["--draft", args.draft, "--draft-quant", args.draft_quant] if args.draft and s.start == 0 else [])]
            for s, device in zip(shards, devices)]


def node_devices(device: str, nodes: int, gpus: int) -> list[str]:
    """The device of each of ``up``'s nodes: plain ``cuda`` on a machine with several GPUs
    deals the nodes out over them in turn; anything else is every node's."""
    if device != "cuda" or gpus < 2:
        return [device] * nodes
    return [f"cuda:{i % gpus}" for i in range(nodes)]


def _cuda_count(device: str) -> int:
    import torch

    return torch.cuda.device_count() if device == "cuda" else 0


def _announce_when_ready(tracker: str, nodes: int, url: str, security, stop: threading.Event, procs) -> None:
    """Say where the dashboard is once ``nodes`` nodes serve a route (or stop when asked, or
    when a process died: supervise reports that)."""
    from ..client import Client, FabricError

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
