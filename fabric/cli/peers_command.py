"""Weights from peers on the command line: ``meshnet pull MODEL --tracker T`` fetches a layer
range from the swarm, and ``meshnet node --model MODEL --layers A-B`` on a machine without the
model file fetches (or finds, from an earlier fetch) a partial copy before anything loads."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..flags import CommandError, endpoint, refuse_absent_tracker
from .options import keys_flag, load_security

log = logging.getLogger("meshnet")


def add_flags(pull: argparse.ArgumentParser) -> None:
    """``meshnet pull``'s flags for fetching from peers instead of the hub."""
    pull.add_argument("--tracker", default=None, type=endpoint, metavar="ENDPOINT",
                      help="fetch MODEL (the id the swarm lists: `meshnet status`) from the nodes that serve it, "
                           "through this tracker, instead of the hub: only --layers A-B (every layer without it), "
                           "each tensor checked against the manifest the model's fingerprint is made of, into "
                           "~/.cache/meshnet/models/peers; an interrupted pull resumes (default: the hub)")
    keys_flag(pull)
    pull.add_argument("--no-progress", action="store_true", help="no progress bar while fetching from peers")
    hub = pull.get_default("func")
    pull.set_defaults(func=lambda args: cmd_pull(args, hub))


def peers_dir() -> Path:
    from ..compute.gguf_partial import PEERS_DIR
    from ..compute.model_ref import default_models_root

    return default_models_root() / PEERS_DIR


def cmd_pull(args, hub) -> int:
    if args.tracker is None:
        return hub(args)
    from ..fetch.holders import FetchError
    from ..fetch.pull import fetch_layers

    try:
        fetch_layers(args.model, args.layers, args.tracker, load_security(args), peers_dir(),
                     progress=not args.no_progress)
    except FetchError as exc:
        raise CommandError(str(exc), 1) from None
    except KeyboardInterrupt:
        print(f"\ninterrupted: the layers verified so far stay in {peers_dir()}; the same command fetches "
              "only the rest", file=sys.stderr)
        return 130
    return 0


def from_peers(args) -> None:
    """A ``--model`` this machine does not have, with ``--layers``: point ``args`` at a partial
    copy of those layers, found here or fetched from the nodes the tracker lists for it."""
    from ..compute.model_ref import ModelError, resolve

    if "/" in args.model or Path(args.model).expanduser().exists():
        return  # a path or a hub repository (peers share GGUF files, named by model id): _node_config says
    try:
        resolve(args.model)
        return
    except ModelError as exc:
        why = str(exc)
    from ..fetch.holders import FetchError, NoHolders
    from ..fetch.pull import fetch_layers

    security = load_security(args)
    refuse_absent_tracker(args.tracker, f"{why}; nor does a peer serve it: ", 2)
    assign = None if args.layers else (lambda manifest: _assign(args, security, manifest))
    try:
        path = fetch_layers(args.model, args.layers, args.tracker, security, peers_dir(),
                            progress=not args.no_progress, say=log.info, node=lambda shard: _node_id(args, shard),
                            assign=assign, durable=False)  # it serves from the page cache while the disk catches up
    except NoHolders as exc:  # as unknown as before: a usage error
        raise CommandError(f"{why}; nor does a peer serve it: {exc}", 2) from None
    except FetchError as exc:
        raise CommandError(f"{why}; and fetching it from peers failed: {exc}", 1) from None
    args.model_id = args.model_id or args.model
    args.model = str(path)


def _node_id(args, shard) -> str:
    """The id the node will serve ``shard`` under (``--node-id``, else the one it is otherwise
    given, kept in ``args`` so that a node bound to any free port keeps the same fresh id): its
    fetch is shown under it."""
    from ..compute.model_ref import default_data_root
    from ..net.node_id import stable_node_id

    args.node_id = args.node_id or stable_node_id(default_data_root(), args.model_id or args.model, shard, args.bind)
    return args.node_id


def _assign(args, security, manifest) -> str:
    """No --layers: the tracker's least-covered span of as many layers as --memory holds (every
    layer without it), as a node with the file asks; ``args.layers`` becomes that span."""
    from .memory_plan import layers_that_fit_manifest

    try:
        fit = layers_that_fit_manifest(manifest, args.memory, args.quant, args.dtype)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    shard = assigned_shard(args.tracker, args.model, manifest.num_layers, fit, security)
    args.layers = f"{shard.start}-{shard.end}"
    return args.layers


def assigned_shard(tracker: str, model_id: str, num_layers: int, max_layers: int, security=None):
    """The span the tracker assigns a node of ``model_id`` that holds at most ``max_layers`` (0: all)."""
    from ..client import Client, FabricError
    from ..wire import protocol as p
    from ..wire.shard import Shard

    with Client(tracker, timeout=10.0, security=security) as client:
        try:
            reply = client.ask(p.AssignRequest(model_id, num_layers, max_layers))
        except FabricError as exc:
            raise CommandError(f"no --layers given and the tracker could not assign any: {exc}", 1) from None
    if not isinstance(reply, p.Assign):
        raise CommandError(f"no --layers given and the tracker gave no layer assignment: {reply}", 1)
    log.info("tracker assigned layers %d-%d", reply.start_layer, reply.end_layer)
    return Shard(reply.start_layer, reply.end_layer, num_layers)
