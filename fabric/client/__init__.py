"""The scripting API over ZeroMQ: ask the tracker for a route, stream a head's events.

``Client`` blocks; ``AsyncClient`` offers the same calls over asyncio. Both are thin shells
over one core (``core.py``): what a request is, what answers mean, when to go again.
"""
from .aio import AsyncClient
from .core import FabricError, GenerateArgs, HeadDied, HeadGone, HeadLeaving
from .sync import Client

__all__ = ["AsyncClient", "Client", "FabricError", "GenerateArgs", "HeadDied", "HeadGone", "HeadLeaving"]
