"""meshnet's node fabric: wire protocol, shard execution, node daemon and client.

A script needs only what this module exports::

    from fabric import Client, FabricError
    with Client("tcp://127.0.0.1:5555") as client:
        print(client.chat("smollm2-135m", "Hi", temperature=0.7, seed=1))
"""
from .client import AsyncClient, Client, FabricError, HeadDied, HeadGone
from .wire.protocol import ErrorCode, Event, Sampling

__all__ = ["AsyncClient", "Client", "ErrorCode", "Event", "FabricError", "HeadDied", "HeadGone", "Sampling"]
