"""CurveZMQ for the whole swarm: every process has a key pair, and a ZAP handler admits
only the public keys on an allow-list.

A key directory (``--keys DIR``) holds:

    DIR/id.key, DIR/id.key_secret   this process's key pair (``meshnet keys DIR``)
    DIR/allowed/*.key               public keys of every member of the swarm
    DIR/allowed/tracker.key         the tracker's public key (clients and nodes dial it)

Every ROUTER is a CURVE server with its process's key; every DEALER is a CURVE client
with the same key pair and the server key of the peer it dials (the tracker's from the
allow-list, a node's from the route plan, which carries each hop's key).
"""
from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

KEY_NAME = "id"
TRACKER_KEY = "tracker.key"


class SecurityError(Exception):
    """The key directory is incomplete; the message says how to fix it."""


@dataclass(frozen=True)
class Security:
    directory: Path
    public: bytes  # z85, this process's public key
    secret: bytes  # z85, this process's secret key
    tracker_key: bytes | None  # z85, the tracker's public key (None when unknown)

    @property
    def allowed(self) -> Path:
        return self.directory / "allowed"

    @property
    def public_text(self) -> str:
        return self.public.decode()


def create_keys(directory: Path, name: str, tracker: bool = False) -> Path:
    """Make this process's key pair in ``directory`` and allow-list it under ``name``.

    With ``tracker`` the public key is also saved as the tracker's key. Returns the
    public key file to copy into the other members' ``allowed/`` folders.
    """
    directory = Path(directory)
    allowed = directory / "allowed"
    allowed.mkdir(parents=True, exist_ok=True)
    if (directory / f"{KEY_NAME}.key_secret").exists():
        raise SecurityError(f"{directory} already holds a key pair; refusing to overwrite it")
    public, _ = zmq.auth.create_certificates(str(directory), KEY_NAME)
    (directory / f"{KEY_NAME}.key_secret").chmod(0o600)
    shutil.copy(public, allowed / (TRACKER_KEY if tracker else f"{name}.key"))
    return Path(public)


def load(directory: Path) -> Security:
    directory = Path(directory)
    secret_file = directory / f"{KEY_NAME}.key_secret"
    if not secret_file.is_file():
        raise SecurityError(f"no key pair in {directory}: create one with `meshnet keys {directory}`")
    public, secret = zmq.auth.load_certificate(str(secret_file))
    tracker_file = directory / "allowed" / TRACKER_KEY
    tracker_key = zmq.auth.load_certificate(str(tracker_file))[0] if tracker_file.is_file() else None
    return Security(directory, public, secret, tracker_key)


def require_tracker_key(security: Security | None, tracker_key_file: str = "the tracker's id.key") -> None:
    """Refuse, before anything starts, a secured process that will dial the tracker without
    knowing its public key: the handshake would fail without a word."""
    if security is not None and security.tracker_key is None:
        target = security.allowed / TRACKER_KEY
        raise SecurityError(f"{target} is missing: copy {tracker_key_file} to {target} (the tracker's key "
                            f"directory is made with `meshnet keys DIR --tracker`)")


def start_authenticator(ctx: zmq.Context, security: Security) -> ThreadAuthenticator:
    """A ZAP handler on ``ctx`` admitting only the allow-listed public keys."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(security.allowed))
    return auth


def serve_securely(sock: zmq.Socket, security: Security | None) -> None:
    """Make ``sock`` (before bind) a CURVE server; no-op without security."""
    if security is not None:
        sock.curve_secretkey = security.secret
        sock.curve_publickey = security.public
        sock.curve_server = True


def dial_securely(sock: zmq.Socket, security: Security | None, server_key: str | bytes | None) -> None:
    """Make ``sock`` (before connect) a CURVE client of the server with ``server_key``."""
    if security is None:
        return
    if not server_key:
        raise SecurityError("security is on but the peer's public key is unknown")
    sock.curve_secretkey = security.secret
    sock.curve_publickey = security.public
    sock.curve_serverkey = server_key.encode() if isinstance(server_key, str) else server_key


def dial(ctx: zmq.Context, endpoint: str, security: Security | None, server_key: str | bytes | None, *,
         sndhwm: int | None = 10000) -> zmq.Socket:
    """A DEALER connected to ``endpoint``, a CURVE client of ``server_key`` when ``security``
    is on, closing at once (linger 0). ``sndhwm``: frames queued before sends would block.
    A bad endpoint or a missing key raises, with no socket left open."""
    sock = _dealer(ctx, security, server_key, sndhwm)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def dial_watched(ctx: zmq.Context, endpoint: str, security: Security | None, server_key: str | bytes | None,
                 events: int, *, sndhwm: int | None = 10000) -> tuple[zmq.Socket, zmq.Socket]:
    """``dial``, and a monitor of the DEALER's ``events`` (a PAIR to read them from), attached
    before the connection starts: a handshake that fails at once is not missed."""
    sock = _dealer(ctx, security, server_key, sndhwm)
    monitor = sock.get_monitor_socket(events)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        raise
    return sock, monitor


def _dealer(ctx: zmq.Context, security: Security | None, server_key: str | bytes | None,
            sndhwm: int | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A routing id of its own, unguessable and kept across reconnects: the ROUTER it dials
    # binds the sessions this socket opens to it (fabric/node/owners.py). libzmq's own ids
    # count up from a predictable start, and change when the link drops.
    sock.setsockopt(zmq.ROUTING_ID, routing_id())
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    try:
        dial_securely(sock, security, server_key)
    except SecurityError:
        sock.close(linger=0)
        raise
    return sock


def routing_id() -> bytes:
    """16 random bytes behind a marker byte (ids that start with a zero byte are libzmq's own)."""
    return b"m" + secrets.token_bytes(16)


def peer_key(frame: zmq.Frame) -> str | None:
    """The CURVE public key (z85) the peer that sent ``frame`` authenticated with."""
    try:
        return frame.get("User-Id") or None
    except zmq.ZMQError:
        return None


RELAY_KEY = "relay.key"


def relay_key(directory: Path | None, value: str | None = None) -> str:
    """The public key (z85) to dial a relay with: ``value`` (z85 text or a key file), else
    ``DIR/allowed/relay.key``, else "" (a relay run inside the tracker: the tracker's key)."""
    if value:
        if Path(value).is_file():
            return zmq.auth.load_certificate(value)[0].decode()
        if len(value) != 40:
            raise SecurityError(f"--relay-key {value!r} is neither a key file nor a 40-character z85 key")
        return value
    if directory is not None and (Path(directory) / "allowed" / RELAY_KEY).is_file():
        return zmq.auth.load_certificate(str(Path(directory) / "allowed" / RELAY_KEY))[0].decode()
    return ""
