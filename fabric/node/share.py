"""A node hands the bytes of its model file to peers that fetch their layers (MANIFEST_REQUEST,
CHUNK_REQUEST; see docs/PROTOCOL.md, "Weights from peers").

It serves only the file it loaded its own layers from, only tensors that file holds, only
ranges inside them, and no faster than its cap (``--share-mbps``, a token bucket): serving
tokens comes first. Chunks are read and sent by the node's own loop between compute steps
(:meth:`WeightShare.pump`), never inside one; a request the cap holds back waits in a bounded
queue, and past that bound the asker hears BUSY and asks again later.

The queue shares the cap among its askers by bytes (start-time fair queueing: each request is
tagged with the bytes its asker has waiting before it, counted from the tag of the request
sent last, and the lowest tag goes next). A fetch that starts while another has its window of
requests waiting hears its first answer after one of the other's chunks, not after all of
them (at a cap of 20 Mbps, 16 requests of 4 MiB wait 27 s, and the newcomer would give this
node up as silent), and then gets as many bytes a second as the other, whatever its chunks'
size. One asker can hold at most MAX_WAITING_EACH of the places.

A chunk goes out as a view of the file mapped into memory (ZeroMQ sends it from the page
cache, zero copy): no read into a fresh buffer per chunk, which cost as much as the send
(a 4 MiB allocation faults in every page). A file whose size changed since the node opened
it is not served (a mapping read past a shortened file would kill the process).
"""
from __future__ import annotations

import logging
import mmap
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..compute.gguf_info import read_header
from ..compute.gguf_manifest import KV_NAME, KV_START, held_layers, manifest_for
from ..compute.models import ModelError, ModelSource
from ..wire import protocol as p

log = logging.getLogger(__name__)

MAX_WAITING = 64  # chunk requests queued behind the cap; more are answered BUSY
MAX_WAITING_EACH = 32  # of those, one asker's (a fetch keeps 16 in flight)
BURST_SECONDS = 0.05  # the bucket holds this many seconds of the cap; a larger chunk waits for a full bucket
# and leaves it owing the rest, so the cap holds over any few chunks


@dataclass
class TokenBucket:
    """Bytes per second, with a burst of ``burst`` bytes; ``rate`` 0: no cap."""

    rate: float
    burst: float
    tokens: float = 0.0
    at: float = 0.0

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def wait(self, n: int, now: float) -> float:
        """Seconds until ``n`` bytes may go (0: now)."""
        if self.rate <= 0:
            return 0.0
        self._refill(now)
        need = min(n, self.burst) - self.tokens
        return max(0.0, need / self.rate)

    def take(self, n: int) -> None:
        if self.rate > 0:
            self.tokens -= n  # may go below zero by a chunk past the burst: the next wait pays it back


@dataclass(frozen=True)
class _Waiting:
    identity: bytes
    msg: p.ChunkRequest
    parts: tuple[tuple[int, int], ...]  # (offset in this node's file, length) of each part asked for
    start: float = 0.0  # its fair-queueing tag: the queue's bytes sent, as its asker's turn counts them
    order: int = 0  # ties go to the request that came first

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.parts)


class WeightShare:
    """The MANIFEST and CHUNK answers of one node's model file."""

    def __init__(self, source: ModelSource, model_id: str, node_id: str, num_layers: int,
                 share_bytes_per_s: float, cache_root: Path | None):
        self.model_id, self.node_id = model_id, node_id
        self.path = source.path if source.kind == "gguf" else None
        self.bucket = TokenBucket(share_bytes_per_s, max(1.0, share_bytes_per_s * BURST_SECONDS))
        self.waiting: dict[bytes, deque[_Waiting]] = {}  # each asker's queue
        self.vtime = 0.0  # the tag of the request sent last
        self.arrivals = 0
        self.fd, self.map = -1, None
        if self.path is None:
            return
        self.manifest = manifest_for(self.path, cache_root)  # cached: the fingerprint computed it
        self.manifest_bytes = self.manifest.canonical()
        self.held = held_layers(self.path) or (0, num_layers - 1)
        sizes = {t.name: t.nbytes for t in self.manifest.tensors}
        self.spans = {KV_NAME: (KV_START, self.manifest.kv_bytes)}
        self.spans |= {t.name: (t.offset, sizes[t.name]) for t in read_header(self.path).tensors if t.name in sizes}
        self.fd = os.open(self.path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if self.size else None

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a chunk ZeroMQ has not let go of yet holds a view: the collector closes it
                pass
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def manifest_answer(self, msg: p.ManifestRequest) -> tuple[p.Message, list]:
        """MANIFEST, or ERROR where this node serves another model or holds no GGUF file."""
        if msg.model != self.model_id:
            return p.Error(p.ErrorCode.UNKNOWN_MODEL, f"this node serves {self.model_id!r}, not {msg.model!r}",
                           node=self.node_id), []
        if self.path is None:
            return p.Error(p.ErrorCode.BAD_REQUEST, f"{self.model_id} is served from a Hugging Face directory "
                           "here; only GGUF files are shared with peers", node=self.node_id), []
        spec = p.TensorSpec("uint8", (len(self.manifest_bytes),))
        answer = p.Manifest(self.model_id, self.manifest.digest, self.held[0], self.held[1], self.node_id,
                            tensors=(spec,))
        return answer, [self.manifest_bytes]

    def request(self, identity: bytes, msg: p.ChunkRequest) -> p.Error | None:
        """Queue a chunk to send (``pump`` sends it); an ERROR for one this node cannot or will not send."""
        refusal = self._refusal(msg)
        if refusal is not None:
            return p.Error(p.ErrorCode.BAD_REQUEST, refusal, node=self.node_id)
        mine = self.waiting.setdefault(identity, deque())
        if self.queued >= MAX_WAITING or len(mine) >= MAX_WAITING_EACH:
            if not mine:
                del self.waiting[identity]
            return p.Error(p.ErrorCode.BUSY, f"{MAX_WAITING} chunk requests wait here already, or "
                           f"{MAX_WAITING_EACH} of yours; ask again later", node=self.node_id)
        parts = ((self.spans[msg.name][0] + msg.offset, msg.length),) + tuple(self.spans[name] for name in msg.more)
        start = max(self.vtime, mine[-1].start + mine[-1].nbytes) if mine else self.vtime
        waiting = _Waiting(identity, msg, parts, start, self.arrivals)
        self.arrivals += 1
        mine.append(waiting)
        return None

    def _refusal(self, msg: p.ChunkRequest) -> str | None:
        if self.path is None:
            return f"{self.model_id} is served from a Hugging Face directory here; only GGUF files are shared"
        if msg.digest != self.manifest.digest:
            return f"this node's file has manifest {self.manifest.digest[:16]}, not {msg.digest[:16]}"
        missing = [name for name in (msg.name, *msg.more) if name not in self.spans]
        if missing:
            return f"this node's file does not hold tensor {missing[0]!r}"
        span = self.spans[msg.name]
        if msg.offset + msg.length > span[1]:
            return (f"bytes {msg.offset}-{msg.offset + msg.length - 1} lie outside {msg.name!r}, "
                    f"which has {span[1]} bytes")
        if msg.length + sum(self.spans[name][1] for name in msg.more) > p.MAX_CHUNK_BYTES:
            return f"the parts asked for come to more than {p.MAX_CHUNK_BYTES} bytes"
        return None

    @property
    def queued(self) -> int:
        """Requests waiting, every asker's (at most MAX_WAITING)."""
        return sum(len(mine) for mine in self.waiting.values())

    def _next(self) -> _Waiting | None:
        """The chunk whose turn it is: of each asker's first, the lowest tag."""
        return min((mine[0] for mine in self.waiting.values()), key=lambda w: (w.start, w.order), default=None)

    def _take(self, item: _Waiting) -> None:
        """Take ``item``, the next chunk (an asker's queue goes once empty: asking again, it starts
        from the queue's tag, so what this node holds is bounded by the requests waiting)."""
        mine = self.waiting[item.identity]
        mine.popleft()
        if not mine:
            del self.waiting[item.identity]
        self.vtime = item.start

    def wait(self, now: float) -> float | None:
        """Seconds until the next queued chunk may go (None: none waits)."""
        item = self._next()
        return None if item is None else self.bucket.wait(item.nbytes, now)

    def pump(self, now: float, send: Callable[[bytes, p.Message, list], None]) -> int:
        """Send the queued chunks the cap allows now, the askers sharing it by bytes; the bytes sent."""
        sent = 0
        while (item := self._next()) is not None and self.bucket.wait(item.nbytes, now) <= 0:
            self._take(item)
            try:
                data = [self.read(offset, length) for offset, length in item.parts]
            except (OSError, ModelError) as exc:
                send(item.identity, p.Error(p.ErrorCode.INTERNAL, f"could not read {item.msg.name}: {exc}",
                                            node=self.node_id), [])
                continue
            self.bucket.take(item.nbytes)
            specs = tuple(p.TensorSpec("uint8", (len(d),)) for d in data)
            send(item.identity, p.Chunk(item.msg.ref, item.msg.name, item.msg.offset, tensors=specs), data)
            sent += item.nbytes
        return sent

    def read(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset``: a view of the mapped file, valid while the node runs."""
        size = os.fstat(self.fd).st_size
        if size != self.size or self.map is None or offset + length > size:
            raise ModelError(f"{self.path.name} changed size since this node opened it ({self.size:,} bytes, now "
                             f"{size:,}); restart the node to serve it again")
        return memoryview(self.map)[offset:offset + length]
