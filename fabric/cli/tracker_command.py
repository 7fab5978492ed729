"""``meshnet tracker``: the registry, route plans, stats and usage ledger, and optionally a
relay in the same process."""
from __future__ import annotations

from ..flags import CommandError, endpoint, seconds
from ..wire.liveness import DEFAULT_PUB, DEFAULT_TRACKER
from .options import keys_flag, load_security, metrics_flag, serve_metrics
from .ports import listening, refuse_ports_in_use
from .relay_command import relay_thread


def add_parser(sub) -> None:
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
    metrics_flag(p)
    keys_flag(p)
    p.set_defaults(func=cmd_tracker)


def cmd_tracker(args) -> int:
    from tracker.service import Tracker, TrackerConfig, serve

    if not args.relay and (args.relay_advertise_host or args.relay_front_ports):
        given = "--relay-advertise-host" if args.relay_advertise_host else "--relay-front-ports"
        raise CommandError(f"{given} configures the relay that --relay ENDPOINT runs in the tracker; "
                           f"add --relay, or leave out {given}")
    refuse_ports_in_use({"the tracker, --bind": args.bind, "its feed, --pub": args.pub,
                          **({"its relay, --relay": args.relay} if args.relay else {})}, "tracker")
    kwargs = dict(bind=args.bind, pub=args.pub, heartbeat_interval=args.heartbeat,
                  security=load_security(args, tracker_key_file=None))
    if args.db:
        kwargs["db"] = args.db
    tracker = Tracker(TrackerConfig(**kwargs))
    serve_metrics(args, tracker.metrics)
    with listening("--bind, --pub or --relay"), relay_thread(args):
        serve(tracker.config, tracker)
    return 0
