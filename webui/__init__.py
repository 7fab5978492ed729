"""meshnet's web UI: the OpenAI-compatible API and the dashboard, over the fabric client."""
from .app import create_app, serve
from .config import WebUIConfig

__all__ = ["WebUIConfig", "create_app", "serve"]
