"""The scripting API over ZeroMQ: ask the tracker for a route, stream a head's events."""
from .core import AsyncClient, Client, FabricError, GenerateArgs, HeadDied, wait_for

__all__ = ["AsyncClient", "Client", "FabricError", "GenerateArgs", "HeadDied", "wait_for"]
