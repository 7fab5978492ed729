"""``meshnet webui``: the dashboard and the OpenAI-compatible API."""
from __future__ import annotations

from ..flags import CommandError, endpoint, origins, port
from ..wire.liveness import DEFAULT_PUB
from .options import load_security, tracker_flag
from .ports import listening, refuse_ports_in_use


def add_parser(sub) -> None:
    p = sub.add_parser("webui", help="serve the dashboard and the OpenAI-compatible API")
    tracker_flag(p)
    p.add_argument("--pub", default=DEFAULT_PUB, type=endpoint, metavar="ENDPOINT",
                   help="tracker PUB endpoint for live events (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface the web server listens on; 0.0.0.0 for every one (default %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="port the web server listens on (default %(default)s)")
    api_keys_flag(p)
    cors_flag(p)
    p.set_defaults(func=cmd_webui)


def api_keys_flag(p) -> None:
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="file with one API key per line; requests to the API (/v1) and the dashboard's /api must "
                        "then carry one (default: no authentication)")


def cors_flag(p) -> None:
    p.add_argument("--cors-origins", type=origins, default=frozenset(), metavar="ORIGINS",
                   help="web origins whose pages may call the API (/v1) and read its answers, comma-separated "
                        "(http://HOST:PORT), or * for any; pages of this machine's localhost, 127.0.0.1 and "
                        "[::1] (any port) always may (default: no others)")


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
    keys = read_api_keys(args.api_keys) if args.api_keys else frozenset()
    security = load_security(args)
    refuse_ports_in_use({"the web UI, --port": f"tcp://{args.host}:{args.port}"}, "web UI")
    from webui.app import WebUIConfig, serve  # after the checks: a refused flag answers before the web stack loads

    with listening("--host or --port", f"{args.host}:{args.port}"):
        serve(WebUIConfig(tracker=args.tracker, pub=args.pub, host=args.host, port=args.port, api_keys=keys,
                          security=security, cors_origins=args.cors_origins))
    return 0
