"""``meshnet keys``: a CurveZMQ key pair for a secured swarm."""
from __future__ import annotations

from pathlib import Path

from ..flags import CommandError


def add_parser(sub) -> None:
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

    from ..net.security import create_keys

    try:
        public = create_keys(Path(args.dir), args.name or socket.gethostname(), tracker=args.tracker)
    except OSError as exc:
        raise CommandError(f"cannot write a key pair to {args.dir}: {exc.strerror or exc}; choose a directory "
                           "you can write to", 1) from None
    print(f"key pair written to {args.dir}; public key: {public}\n"
          f"copy {public} into the allowed/ folder of every other member"
          f"{' as tracker.key' if args.tracker else ''}")
    return 0
