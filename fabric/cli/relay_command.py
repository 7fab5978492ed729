"""``meshnet relay``: frames passed both ways for nodes that cannot accept inbound
connections; also run in a thread of the tracker (``meshnet tracker --relay``)."""
from __future__ import annotations

import contextlib
import threading

from ..flags import CommandError, endpoint, positive_count, seconds
from .options import keys_flag, load_security, metrics_flag, serve_metrics
from .ports import listening, refuse_ports_in_use

DEFAULT_RELAY = "tcp://127.0.0.1:5557"


def add_parser(sub) -> None:
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
    metrics_flag(p)
    keys_flag(p)
    p.set_defaults(func=cmd_relay)


def relay_config(args, bind: str, advertise: str | None, ports: str | None, front: str | None = None,
                  flags: str = "--"):
    """The RelayConfig; CommandError naming the flag (``flags``: their prefix, "--relay-" in the tracker)."""
    from ..net.relay import RelayConfig, endpoint_host

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
                       security=load_security(args, tracker_key_file=None))


def cmd_relay(args) -> int:
    from ..net.relay import Relay, serve_relay

    config = relay_config(args, args.bind, args.advertise_host, args.front_ports, args.front_host)
    refuse_ports_in_use({"the relay, --bind": args.bind}, "relay")
    relay = Relay(config)
    serve_metrics(args, relay.metrics)
    with listening("--bind"):
        serve_relay(config, relay)
    return 0


@contextlib.contextmanager
def relay_thread(args):
    """``meshnet tracker --relay ENDPOINT``: a relay in a thread of the tracker process."""
    if not args.relay:
        yield
        return
    from ..net.relay import Relay

    relay = Relay(relay_config(args, args.relay, args.relay_advertise_host, args.relay_front_ports,
                                flags="--relay-"))
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), name="relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
