"""``meshnet node``: its flags, resolved once into a NodeConfig, and the process that serves
a range of a model's layers."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from ..compute.compute_lock import default_path as default_lock
from ..flags import (
    CommandError,
    count,
    endpoint,
    non_negative,
    positive_count,
    seconds,
    share,
)
from ..wire.liveness import AUDIT_RATE, AUDIT_TOLERANCE
from ..wire.shard import layer_range
from .memory_plan import (
    check_device_flags,
    layers_that_fit,
    picked_quant,
    runs_weight_only,
)
from .options import (
    device_flags,
    load_security,
    metrics_flag,
    quant_flag,
    serve_metrics,
    tracker_flag,
)
from .peers_command import assigned_shard, from_peers
from .ports import listening, refuse_ports_in_use
from .torch_env import (grouped_kv_attention, leave_out_compiler_and_collectives, leave_out_unused_packages,
                        omp_workers_nap)

log = logging.getLogger("meshnet")


def add_parser(sub) -> None:
    p = sub.add_parser("node", help="serve a range of a model's layers",
                       description="Load a contiguous range of a model's layers and serve them on the fabric.")
    p.add_argument("--model", required=True,
                   help="a Hugging Face directory, a .gguf file, an alias such as smollm2-135m, or ORG/NAME "
                        "fetched by `meshnet pull` (`meshnet models` lists them)")
    p.add_argument("--model-id", default=None, help="id clients use for this model (default: alias or file name)")
    p.add_argument("--layers", default=None, type=layer_range, metavar="A-B",
                   help="inclusive range such as 0-14 (default: ask the tracker)")
    tracker_flag(p)
    p.add_argument("--bind", default="tcp://127.0.0.1:0", type=endpoint, metavar="ENDPOINT",
                   help="ROUTER endpoint; port 0 picks one (default %(default)s)")
    p.add_argument("--advertise", default=None, type=endpoint, metavar="ENDPOINT",
                   help="endpoint peers dial (default: the bound one)")
    _node_relay_flags(p)
    device_flags(p, "the")
    quant_flag(p)
    _node_compute_flags(p)
    p.add_argument("--max-sessions", type=positive_count, default=64, help="sessions this node keeps KV for")
    p.add_argument("--kv-cache-gib", type=non_negative, default=None, metavar="GIB",
                   help="GiB of ended requests' KV this node keeps, so that a later request sharing their start "
                        "(a chat's earlier turns, a common system prompt) computes only the rest; the least "
                        "recently used goes first; 0 keeps none (default: a tenth of the memory available at "
                        "start, on the node's device)")
    p.add_argument("--prefill-slice-ms", type=non_negative, default=0.0, metavar="MS",
                   help="while other streams decode here, run a long prompt's prefill in slices that add about "
                        "this many milliseconds to their decode steps (a slice rides in their forward pass); 0: as "
                        "long as one decode step (default %(default)s)")
    _node_head_flags(p)
    p.add_argument("--node-id", default=None,
                   help="id in the swarm (default: made once and kept in a key file, so restarts keep it)")
    p.add_argument("--memory", type=non_negative, default=0.0, metavar="GIB",
                   help="GiB of weights this node may hold, 0 for no limit; instead of --layers: the tracker "
                        "assigns a span that fits (default %(default)s)")
    _node_timing_flags(p)
    _node_audit_flags(p)
    p.add_argument("--share-mbps", type=non_negative, default=400.0, metavar="MBPS",
                   help="megabits per second of its model file this node hands to peers that fetch their layers "
                        "from it (`meshnet node --model ID --tracker T` without the file); serving tokens comes "
                        "first. 0: no cap (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    metrics_flag(p)
    p.set_defaults(func=cmd_node)


def _node_compute_flags(p: argparse.ArgumentParser) -> None:
    """How a node shares its machine's cores: its threads, its decode passes, the compute lock."""
    p.add_argument("--threads", type=count, default=0,
                   help="torch threads, 0 for all cores, with one-token decode passes on one thread where a "
                        "check at load finds that no slower (default %(default)s)")
    p.add_argument("--decode-threads", type=count, default=None, metavar="N",
                   help="run passes of decode steps alone on N threads without the compute lock, so that nodes "
                        "of one machine decode at once and the streams run as a pipeline of groups through the "
                        "nodes; prompts keep the lock and every thread; 0: every pass under the lock, the streams "
                        "gathered into one batch (default: a quantized CPU node of a split model takes its "
                        "machine's cores over the nodes sharing its compute lock, counted as they come and go; "
                        "others 0)")
    p.add_argument("--compute-lock", default=None, metavar="FILE",
                   help="nodes on one machine that lock the same file compute one at a time, each with every "
                        "thread; `none`: compute whenever this node likes (default: one file per device for "
                        f"this user, {default_lock('DEVICE', os.environ)}, so nodes started one by one on a "
                        "machine take turns)")


def _node_head_flags(p: argparse.ArgumentParser) -> None:
    """How a node heads requests: the prompts it takes, the wire between its route's hops, drafts."""
    p.add_argument("--max-prompt-tokens", type=positive_count, default=4096, help="longest prompt the head accepts")
    p.add_argument("--wire-dtype", default="", choices=["", "float32", "float16", "bfloat16"],
                   help="dtype of hidden states between the hops of routes this node heads (default: each "
                        "node's compute dtype; bfloat16 halves the bytes of a float32 route, not bit-exact)")
    p.add_argument("--speculate", default="on", choices=["on", "off"],
                   help="requests this node heads draft a few tokens by looking up the text so far and send "
                        "them with the last one, so one trip through the hops can yield several tokens; the tail "
                        "keeps only those it would have sampled itself, so the text never changes "
                        "(default %(default)s)")
    p.add_argument("--drafts-ahead", default="auto", choices=["auto", "on", "off"],
                   help="with --speculate on, a request this node heads alone sends its next drafts before the "
                        "last ones are answered, where lookup expects them all kept (copied text, code), so "
                        "the wait for an answer is spent on the next drafts. Drafts that turn out wrong cost the "
                        "hops some compute, never the text. auto: only on routes with a hop on another machine "
                        "(on one machine the hops take turns on its cores and there is no wait to fill) "
                        "(default %(default)s)")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="a small model (a file or directory, as for --model) that drafts beside the text lookup "
                        "on a head: loaded whole on this node's --device, it must share the model's tokenizer "
                        "(e.g. Llama-3.2-1B for Llama-3.1-8B, or the served model's own 4-bit GGUF for a route "
                        "that runs it with --quant none); drafts that do not pay are switched off (default: none, "
                        "the text lookup alone)")
    draft_quant_flag(p)


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
    refuse_ports_in_use({"this node, --bind": args.bind}, "node")


def prepare_process(args) -> None:
    """What a node process sets before torch loads: the OpenMP and attention settings torch and
    transformers read once, and the installed packages the libraries would import for nothing."""
    omp_workers_nap(weight_only=runs_weight_only(args))
    grouped_kv_attention()
    leave_out_unused_packages()


def check_runnable(model: str) -> None:
    """A model that names nothing, or a GGUF file no node can run: one line naming it, before
    torch loads (a second, not five) and before anything is logged."""
    from ..compute.gguf_info import check_reference
    from ..compute.model_ref import ModelError

    try:
        check_reference(model)
    except ModelError as exc:
        raise CommandError(str(exc)) from None


def cmd_node(args) -> int:
    _check_node_flags(args)  # first: a flag error answers at once, not after torch has loaded
    security = load_security(args)  # a key directory that cannot work says so now, too
    if args.device != "cpu":  # a device not here is said before any fetch (OpenMP's settings matter on the CPU)
        prepare_process(args)
        check_device_flags(args.device, args.quant)
    from_peers(args)  # no model file here: its layers from the swarm, before torch loads
    check_runnable(args.model)
    prepare_process(args)
    import torch

    leave_out_compiler_and_collectives()
    from ..compute.model_ref import ModelError
    from ..node import Node

    check_device_flags(args.device, args.quant)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = _node_config(args, security)
    stop, leave = threading.Event(), threading.Event()  # Ctrl-C stops now; SIGTERM leaves politely, twice stops
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set() if leave.is_set() else leave.set())
    try:
        with listening("--bind"):
            node = Node(config)
    except ModelError as exc:  # the weights did not load (fabric.compute.models.load_shard)
        name = config.source.path.name
        raise CommandError(str(exc) if name in str(exc) else f"{name}: {exc}", 1) from None
    serve_metrics(args, node.metrics)
    node.run(stop, leave)
    log.info("node stopped")
    return 0


def _node_config(args, security):
    """The NodeConfig for ``meshnet node``'s flags: the model's config is read, its weights are not."""
    import torch

    from ..compute.models import (
        ModelError,
        default_cache_root,
        default_data_root,
        load_config,
        resolve,
    )
    from ..net.security import relay_key
    from ..node import NodeConfig, stable_node_id
    from ..node.speculation import SpeculationConfig
    from ..wire.shard import parse_layers

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    quant = picked_quant(args.quant, args.model, args.device)
    quant = None if quant == "none" else quant
    try:
        source = resolve(args.model, args.model_id)
        model_config = load_config(source, default_cache_root())
        num_layers = model_config.num_hidden_layers
        shard = (parse_layers(args.layers, num_layers) if args.layers
                 else assigned_shard(args.tracker, source.model_id, num_layers,
                                      layers_that_fit(model_config, dtype, args.memory, quant), security))
    except (ModelError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    node_id = args.node_id or stable_node_id(default_data_root(), source.model_id, shard, args.bind)
    return NodeConfig.build(source, shard, bind=args.bind, advertise=args.advertise,
                      tracker=args.tracker, device=args.device,
                      dtype=torch.bfloat16 if quant else dtype, node_id=node_id, quant=quant,
                      max_sessions=args.max_sessions, max_prompt_tokens=args.max_prompt_tokens,
                      kv_cache_bytes=None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30)),
                      prefill_slice=args.prefill_slice_ms / 1000, wire_dtype=args.wire_dtype,
                      speculation=SpeculationConfig(enabled=args.speculate == "on", ahead=args.drafts_ahead),
                      **_draft_model(args),
                      compute_lock=_compute_lock(args.compute_lock, args.device), decode_threads=args.decode_threads,
                      hop_timeout=args.hop_timeout, heartbeat_interval=args.heartbeat,
                      audit_rate=args.audit_rate, audit_tolerance=args.audit_tolerance,
                      drain_timeout=args.drain_timeout, tune_threads=not args.threads and args.device == "cpu",
                      cache_root=default_cache_root(), progress=not args.no_progress,
                      share_bytes_per_s=args.share_mbps * 125_000,
                      security=security, relay=args.relay, relay_fallback=args.relay_fallback,
                      relay_key=relay_key(args.keys, args.relay_key) if args.keys else "")


def draft_quant_flag(p: argparse.ArgumentParser, whose: str = "this node's") -> None:
    p.add_argument("--draft-quant", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                   help=f"the --draft model's kernels, whatever {whose} --quant: a draft never changes the "
                        "text (the hops keep only the tokens they would have picked themselves), so it takes the "
                        "fastest by default. auto (default): a GGUF on its own grid, computed in bfloat16 (a Q4_* "
                        "file on the int8-activation kernel: several times faster per token than float32 on a "
                        "CPU, while its drafts mostly agree with the float32 model's); none: every layer in "
                        "--dtype; int8, int4, gguf: as --quant")


def _draft_model(args) -> dict:
    """NodeConfig's draft, draft_quant and draft_dtype for ``--draft``: ``--draft-quant`` picked
    for the draft's own file (not the node's ``--quant``), in its kernels' dtype."""
    if not args.draft:
        return {}
    import torch

    from ..compute.model_ref import pick_quant

    source = checked_draft(args.draft, args.model, args.model_id)
    quant, why = pick_quant(args.draft_quant, source, args.device)
    check_draft_device(args.device, quant or "none")
    dtype = torch.bfloat16 if quant or args.dtype == "bfloat16" else torch.float32  # quantized: bfloat16 compute
    log.info("draft %s: --draft-quant %s, computing in %s (%s)", source.model_id, quant or "none",
             str(dtype).removeprefix("torch."), why)
    return {"draft": source, "draft_quant": quant, "draft_dtype": dtype}


def check_draft_device(device: str, draft_quant: str) -> None:
    """CommandError when ``--draft-quant`` names CPU kernels for a draft on another device
    (``auto`` picks none there)."""
    if draft_quant not in ("auto", "none") and device.partition(":")[0] != "cpu":
        raise CommandError(f"--draft-quant {draft_quant} runs on the CPU kernels of torch; use --device cpu, or "
                           "--draft-quant auto")


def checked_draft(draft: str, model: str, model_id: str | None = None):
    """``draft``'s ModelSource, once its tokenizer is known to map every token as ``model``'s
    does (compared before any weights load); CommandError in one line otherwise."""
    from ..compute.gguf_info import check_reference
    from ..compute.models import ModelError, default_cache_root, load_tokenizer, resolve
    from ..node.draft_model import check_vocabulary

    try:
        check_reference(draft)
        source = resolve(draft)
        cache = default_cache_root()
        check_vocabulary(load_tokenizer(source, cache), load_tokenizer(resolve(model, model_id), cache),
                         source.path.name)
    except ModelError as exc:
        raise CommandError(str(exc) if str(exc).startswith("--draft") else f"--draft: {exc}") from None
    return source


def _compute_lock(value: str | None, device: str) -> str | None:
    """--compute-lock: a FILE, ``none``, or by default this user's file for ``device``."""
    from ..compute.compute_lock import NO_LOCK, LockDirError, private_dir

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
