"""The web UI's configuration, resolved once at the entry point (``meshnet webui``)."""
from __future__ import annotations

from dataclasses import dataclass

from fabric.wire.liveness import DEFAULT_PUB, DEFAULT_TRACKER


@dataclass(frozen=True)
class WebUIConfig:
    """Everything the web UI needs to know; nothing else reads the environment."""

    # The tracker's ROUTER endpoint; the fabric client asks it for models and routes.
    tracker: str = DEFAULT_TRACKER
    # The tracker's PUB endpoint (plans, stats, events) behind the dashboard's live view;
    # None or "" turns the feed off (the dashboard then polls /api/status).
    pub: str | None = DEFAULT_PUB
    # Address and port the HTTP server binds.
    host: str = "127.0.0.1"
    port: int = 8000
    # Accepted ``Authorization: Bearer`` keys for /v1/*; empty means no authentication.
    api_keys: frozenset[str] = frozenset()
    # Longest prompt accepted, in characters (sum of message contents); longer gets 400.
    max_prompt_chars: int = 32_000
    # max_tokens used when a request names none.
    default_max_tokens: int = 256
    # Largest max_tokens a request may ask for.
    max_tokens_limit: int = 4096
    # temperature used when a request names none (OpenAI's default is 1).
    default_temperature: float = 1.0
    # Seconds the fabric client waits for the tracker or a head before giving up.
    client_timeout: float = 30.0
    # Request bodies larger than this many bytes are refused with 413.
    max_body_bytes: int = 4 << 20
    # Seconds between keep-alive comments on a quiet /api/events stream.
    sse_keepalive: float = 15.0
    # Seconds without news after which an in-flight request leaves the Call wall as "lost".
    call_idle_timeout: float = 120.0
    # CurveZMQ keys (fabric.net.security.Security) for the tracker and nodes; None: plaintext.
    security: object | None = None
    # Origins whose web pages may read /v1's answers (webui/cors.py), beside this machine's
    # loopback names (localhost, 127.0.0.1, [::1], any port), which always may; "*" for any.
    cors_origins: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", frozenset(self.api_keys))
        object.__setattr__(self, "cors_origins", frozenset(self.cors_origins))
        object.__setattr__(self, "pub", self.pub or None)
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is out of range")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens must be in [1, max_tokens_limit]")
        if not 0.0 <= self.default_temperature <= 2.0:
            raise ValueError("default_temperature must be in [0, 2]")
        for name in ("max_prompt_chars", "client_timeout", "max_body_bytes", "sse_keepalive",
                     "call_idle_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
