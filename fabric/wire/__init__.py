"""The wire: message kinds, typed messages, encode/decode and shard records. No torch, no sockets."""
