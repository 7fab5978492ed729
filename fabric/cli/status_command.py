"""``meshnet status``: ask the tracker, print the view (or JSON)."""
from __future__ import annotations

import json

from ..flags import CommandError, refuse_absent_tracker
from .options import load_security, tracker_flag
from .status_view import format_status


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="nodes, coverage and current route plans")
    tracker_flag(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    from ..client import Client, FabricError

    security = load_security(args)  # a key directory that cannot work says so first
    refuse_absent_tracker(args.tracker)
    with Client(args.tracker, timeout=5.0, security=security) as client:
        try:
            status = client.status()
        except FabricError as exc:
            raise CommandError(str(exc), 1) from None
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
