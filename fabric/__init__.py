"""meshnet's node fabric: wire protocol, shard execution, node daemon and client."""
from .client import AsyncClient, Client, FabricError

__all__ = ["AsyncClient", "Client", "FabricError"]
