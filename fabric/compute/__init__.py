"""Compute: load a shard's weights, run its layers over a session's KV, sample, and turn
tensors into wire buffers and back. No sockets."""
