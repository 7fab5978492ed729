"""Fetch one layer range of a model from the nodes that hold it, verified, into a partial GGUF.

The steps: ask the tracker who serves the model; ask each of them for its MANIFEST and keep
those whose manifest hashes to the fingerprint they registered; lay out the partial file
(``fabric.compute.gguf_partial``); then fetch the items it still lacks (the metadata section
and each tensor the range needs), the largest first, in CHUNKs of at most 4 MiB from several
peers at once, a window of requests in flight on each. A request asks for what its peer
delivers in a fraction of CHUNK_TIMEOUT, at the rate measured from its answers so far: a peer
behind a low ``--share-mbps`` gets small chunks and answers often, never so seldom that it
looks gone (the first requests, before any answer, are small). A peer with nothing left to
fetch takes over a slower peer's item where it fetches it whole sooner, so a fetch from a
fast and a slow peer ends at the fast one's pace. Small items ride whole in a request
beside its first part (``CHUNK_REQUEST.more``: a layer's norms and small projections in one
round trip). Each item comes whole from one peer, so that an item
whose BLAKE3 digest differs from the manifest's names the peer that sent it: that peer is left out
(a log line names it, and so does the fetch's report to the tracker: ``fabric.fetch.report``)
and the item is asked of another. A peer that stops answering is left out the same way.
Interrupted, the fetch resumes from the ``.part`` file.

This loop only receives: each chunk goes, as the frame it came in, to the store's threads
(``fabric.fetch.store``), which hash and write it and judge each finished item while the loop
refills the peer's window and receives the next.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import zmq

from ..compute.gguf_manifest import FileManifest, fingerprint_of
from ..compute.gguf_partial import Layout, PartialFile, Slot, layout
from ..compute.model_ref import ModelError
from ..net.security import Security, SecurityError, dial
from ..wire import protocol as p
from ..wire.shard import Shard
from .holders import FetchError, Holder, can_serve, missing_line
from .report import FetchReporter
from .store import Item, Store

log = logging.getLogger(__name__)

WINDOW = 16  # chunk requests in flight on each peer (within the node's queue of 64: fetching from a node's
# queue keeps it busy between round trips, and four fetchers fit)
CHUNK_BYTES = p.MAX_CHUNK_BYTES
CHUNK_TIMEOUT = 15.0  # seconds a peer with chunks asked of it may go without answering any before it counts as
# gone (progress, not a deadline per chunk: a peer behind a low --share-mbps answers slowly but steadily)
FIRST_CHUNK = 64 << 10  # bytes a request asks of a peer before any answer has shown its rate
MIN_CHUNK = 16 << 10  # the least a request asks for (where the item has as much left)
PACE = 8  # a request asks for what its peer delivers in CHUNK_TIMEOUT / PACE seconds at its measured rate
RATE_MEMORY = 2.0  # seconds: the weight of what a peer delivered falls by e each RATE_MEMORY seconds since
TAKEOVER_GAIN = 0.5  # seconds a peer with nothing left to fetch must save to take a slower peer's item over
MANIFEST_TIMEOUT = 5.0  # seconds to wait for the holders' manifests
BUSY_PAUSE = 0.2  # seconds before asking a peer that answered BUSY again
MAX_PEERS = 16  # peers fetched from at once


@dataclass
class Peer:
    holder: Holder
    sock: zmq.Socket
    held: tuple[int, int] = (0, 0)  # the layers its file holds (its MANIFEST)
    # ref -> ((item, offset, length) of each part asked for, sent at)
    inflight: dict[int, tuple[tuple[tuple[str, int, int], ...], float]] = field(default_factory=dict)
    gone: str = ""  # why it is left out ("" while it serves)
    pause_until: float = 0.0
    heard: float = 0.0  # when it last answered, or was first asked since it had nothing to answer
    bytes: int = 0
    since: float = 0.0  # when it began on its next answer: its last CHUNK, or when asked with nothing in flight
    busy: tuple[float, float] = (0.0, 0.0)  # (bytes, seconds) of its answers, the older faded (RATE_MEMORY)
    answered_bytes: int = 0  # bytes of all its CHUNKs

    @property
    def name(self) -> str:
        return self.holder.node

    def _busy_after(self, worked: float) -> tuple[float, float]:
        """``busy`` with ``worked`` more seconds on it, the older answers faded by them."""
        got, took = self.busy
        fade = math.exp(-worked / RATE_MEMORY)
        return got * fade, took * fade + worked

    def answered(self, nbytes: int, now: float) -> None:
        """Count a CHUNK of ``nbytes`` into the measured rate: the seconds since ``since`` are the
        time it worked on this one. Summed over answers, the seconds telescope to the time it was
        busy, so a burst of answers read at once measures what the peer delivered, not the burst."""
        got, took = self._busy_after(max(0.0, now - self.since))
        self.busy = (got + nbytes, took)
        self.since = now
        self.answered_bytes += nbytes

    def rate(self, now: float) -> float | None:
        """Bytes a second it delivers: its answers, and the wait for the next one so far (a peer that
        goes quiet slows as it stays quiet); None before any answer."""
        if not self.busy[0]:
            return None
        got, took = self._busy_after(max(0.0, now - self.since) if self.inflight else 0.0)
        return got / max(took, 1e-9)

    def seconds_for(self, nbytes: int, now: float) -> float:
        """How long it takes to send ``nbytes`` at its rate. Before any answer: none while it was
        asked less than TAKEOVER_GAIN ago, else forever."""
        rate = self.rate(now)
        if rate is None:
            return math.inf if self.inflight and now - self.since > TAKEOVER_GAIN else 0.0
        return nbytes / rate

    def room(self, now: float) -> int:
        """The bytes one request asks of this peer: what it delivers in CHUNK_TIMEOUT / PACE, and at
        most twice the bytes it has answered in all (its first answers may come at its cap's burst,
        or from what it had buffered: the rate they show is trusted as they add up)."""
        rate = self.rate(now)
        if rate is None:
            return min(FIRST_CHUNK, CHUNK_BYTES)
        paced = rate * CHUNK_TIMEOUT / PACE
        return int(min(CHUNK_BYTES, max(MIN_CHUNK, min(paced, max(FIRST_CHUNK, 2 * self.answered_bytes)))))


class Fetcher:
    """One fetch: its peers' sockets, the partial file, and what is in flight where."""

    def __init__(self, model: str, holders: list[Holder], security: Security | None, progress=None,
                 durable: bool = True):
        self.model, self.security = model, security
        self.durable = durable  # the finished file's bytes on disk before ``run`` returns (else after)
        self.ctx = zmq.Context.instance()
        self.poller = zmq.Poller()
        self.peers: list[Peer] = []
        for h in holders[:MAX_PEERS]:
            try:
                sock = dial(self.ctx, h.endpoint, security, h.key or None, sndhwm=None)
            except (zmq.ZMQError, SecurityError) as exc:
                log.warning("cannot dial %s at %s: %s", h.node, h.endpoint, exc)
                continue
            self.peers.append(Peer(h, sock))
            self.poller.register(sock, zmq.POLLIN)
        self.refs = count(1)
        self.progress = progress  # a tqdm-like bar (update(n)), or None
        self.manifest: FileManifest | None = None
        self.part: PartialFile | None = None
        self.store: Store | None = None  # hashes and writes what arrives, on a thread of its own
        self.queue: deque[Slot] = deque()
        self.active: dict[str, Item] = {}
        self.reporter: FetchReporter | None = None  # tells the tracker how the fetch goes
        self.bad: list[str] = []  # peers caught sending bad bytes (or a manifest that fails), first caught first
        self.verified = 0  # bytes of the partial copy verified, here before or fetched now
        self.overtaken: set[str] = set()  # peers whose items a faster one took over

    def close(self) -> None:
        for peer in self.peers:
            peer.sock.close(linger=0)
        if self.store is not None:
            self.store.close()
        if self.part is not None:
            self.part.close()

    # -- manifests ----------------------------------------------------------------------

    def manifests(self) -> FileManifest:
        """Ask every peer for its manifest; keep those that hash to the fingerprint they
        registered, of the manifest most of them hold."""
        for peer in self.peers:
            peer.sock.send_multipart(p.encode(p.ManifestRequest(self.model)))
        answers: dict[str, tuple[Peer, FileManifest]] = {}
        deadline = time.monotonic() + MANIFEST_TIMEOUT
        while len(answers) < len(self.peers) and (left := deadline - time.monotonic()) > 0:
            for sock, _ in self.poller.poll(left * 1000):
                peer = next(x for x in self.peers if x.sock is sock)
                got = self._manifest_of(peer, sock.recv_multipart(copy=False))
                if got is not None:
                    answers[peer.name] = (peer, got)
        for peer in self.peers:
            if peer.name not in answers and not peer.gone:
                self._leave_out(peer, "it sent no manifest")
        if not answers:
            raise FetchError(f"no node serving {self.model} answered with a manifest of its file "
                             f"({len(self.peers)} asked)")
        votes: dict[str, list[Peer]] = {}
        for peer, manifest in answers.values():
            votes.setdefault(manifest.digest, []).append(peer)
        digest = max(votes, key=lambda d: len(votes[d]))
        for other, peers in votes.items():
            if other != digest:
                for peer in peers:
                    self._leave_out(peer, f"its file differs (manifest {other[:12]}, most hold {digest[:12]})")
        return next(m for _, m in answers.values() if m.digest == digest)

    def _manifest_of(self, peer: Peer, frames) -> FileManifest | None:
        try:
            msg, buffers = p.decode(frames, p.MAX_MANIFEST_BYTES)
        except p.ProtocolError as exc:
            self._leave_out(peer, f"it sent a bad frame ({exc})")
            return None
        if not isinstance(msg, p.Manifest):
            self._leave_out(peer, f"it answered {msg}")
            return None
        raw = bytes(buffers[0])
        digest = hashlib.sha256(raw).hexdigest()
        if digest != msg.digest or fingerprint_of(digest) != peer.holder.weights_print:
            self._leave_out(peer, "its manifest does not hash to the fingerprint it registered", bad=True)
            return None
        try:
            manifest = FileManifest.from_json(json.loads(raw))
        except (ValueError, ModelError) as exc:
            self._leave_out(peer, f"its manifest is not valid ({exc})")
            return None
        peer.held = (msg.start_layer, msg.end_layer)
        return manifest

    def _leave_out(self, peer: Peer, why: str, bad: bool = False) -> None:
        """Fetch nothing more from ``peer``; ``bad``: it sent bytes that fail a check (named to the tracker)."""
        if bad and peer.name not in self.bad:  # also one left out before (gone silent) whose bytes then failed
            self.bad.append(peer.name)
        if peer.gone:
            return
        peer.gone = why
        log.warning("fetch of %s: leaving out peer %s (%s): %s", self.model, peer.name, peer.holder.endpoint, why)
        peer.inflight.clear()
        for name, item in list(self.active.items()):
            if item.peer is peer:
                del self.active[name]
                self.queue.appendleft(item.slot)

    # -- the fetch ------------------------------------------------------------------------

    def start(self, target: Path, plan: Layout, shard: Shard, manifest: FileManifest) -> int:
        """Open the ``.part`` file; the bytes it already holds, verified."""
        self.manifest = manifest
        held = {peer.name: peer.held for peer in self.peers if not peer.gone}
        line = missing_line(self.model, shard, manifest, list(plan.slots), held)
        if line:
            raise FetchError(line)
        self.part = PartialFile(target, plan)
        try:
            have = self.part.open()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            free = shutil.disk_usage(target.parent).free
            raise FetchError(f"not enough disk space in {target.parent} for layers {shard} of {self.model}: the copy "
                             f"takes {plan.size / (1 << 20):,.0f} MiB, {free / (1 << 20):,.0f} MiB are free") from None
        self.store = Store(self.part, write_back=self.durable)
        self.poller.register(self.store.wake, zmq.POLLIN)
        # the largest first: its hash, taken in order on one store thread, runs beside all the rest
        self.queue.extend(sorted(self.part.missing(), key=lambda slot: -slot.nbytes))
        self.verified = have
        return have

    def run(self) -> Path:
        """Fetch every missing slot; the finished file's path."""
        while self.queue or self.active:
            now = time.monotonic()
            self._ask(now)
            self._check_timeouts(now)
            if not any(peer.inflight for peer in self.peers) and self.queue and not self._anyone_for(self.queue[0]):
                raise FetchError(self._stranded())
            for sock, _ in self.poller.poll(100):
                if sock == self.store.wake:
                    self._judged()
                else:
                    self._drain(next(x for x in self.peers if x.sock is sock))
            if self.reporter is not None:
                self.reporter.progress(self.verified, self.bad)
        self.store.close()  # every item was judged: nothing is left to write
        return self.part.finish(self.durable)

    def _drain(self, peer: Peer) -> None:
        """Every answer waiting from ``peer`` (its socket may close meanwhile: left out)."""
        while not peer.gone:
            try:
                frames = peer.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._received(peer, frames)

    def _stranded(self) -> str:
        gone = "; ".join(f"{p_.name}: {p_.gone}" for p_ in self.peers if p_.gone) or "none left out"
        return f"no peer left to fetch {self.queue[0].name} of {self.model} from ({gone})"

    def _anyone_for(self, slot: Slot) -> bool:
        return any(self._serves(peer, slot) for peer in self.peers)

    def _serves(self, peer: Peer, slot: Slot) -> bool:
        return not peer.gone and can_serve(peer.held, slot.name, self.manifest.num_layers, self.manifest.tied)

    def _ask(self, now: float) -> None:
        for peer in self.peers:
            self._fill(peer, now)

    def _fill(self, peer: Peer, now: float) -> None:
        """Keep WINDOW chunk requests in flight on ``peer`` (called again after each answer, before
        its bytes are written: the node reads the next chunk while this side hashes and writes)."""
        while not peer.gone and peer.pause_until <= now and len(peer.inflight) < WINDOW and not self.store.full():
            parts = self._parts(peer, now)
            if not parts:
                return
            if not peer.inflight:
                peer.heard = peer.since = now
            ref = next(self.refs)
            (name, offset, length), more = parts[0], tuple(name for name, _, _ in parts[1:])
            peer.sock.send_multipart(p.encode(p.ChunkRequest(self.manifest.digest, name, offset, length, ref,
                                                             more=more)))
            peer.inflight[ref] = (parts, now)

    def _parts(self, peer: Peer, now: float) -> tuple[tuple[str, int, int], ...]:
        """The next request's parts: the next chunk of an item of ``peer``'s, then queued items it
        holds that fit beside it whole (a layer's small tensors: one round trip, not one each)."""
        item = self._next_item(peer, now)
        if item is None:
            return ()
        room = peer.room(now)
        parts = [self._asked(item, room)]
        while len(parts) < p.MAX_CHUNK_PARTS and (room := room - parts[-1][2]) > 0:
            slot = next((s for s in self.queue if s.nbytes <= room and self._serves(peer, s)), None)
            if slot is None:
                break
            parts.append(self._asked(self._activate(slot, peer), room))
        return tuple(parts)

    @staticmethod
    def _asked(item: Item, most: int) -> tuple[str, int, int]:
        """The next part of ``item`` (at most ``most`` bytes), counted as asked for."""
        part = (item.slot.name, item.next_offset, min(most, item.slot.nbytes - item.next_offset))
        item.next_offset += part[2]
        return part

    def _activate(self, slot: Slot, peer: Peer) -> Item:
        self.queue.remove(slot)
        item = self.active[slot.name] = Item(slot, peer)
        return item

    def _next_item(self, peer: Peer, now: float) -> Item | None:
        """An item of ``peer``'s with chunks not asked for yet, else the next queued item it holds,
        else a slower peer's item it takes over."""
        for item in self.active.values():
            if item.peer is peer and item.next_offset < item.slot.nbytes:
                return item
        slot = next((s for s in self.queue if self._serves(peer, s)), None)
        return self._take_over(peer, now) if slot is None else self._activate(slot, peer)

    def _take_over(self, peer: Peer, now: float) -> Item | None:
        """The item of another peer's that ``peer`` fetches whole sooner than that peer sends the
        rest (in half the time and TAKEOVER_GAIN sooner at least, at the rates so far), the one
        it saves most on; None where there is none. The other peer's answers for it are dropped
        as they come (the store writes those handed over before this peer's: the bytes that
        stand are those judged). A fetch from a fast and a slow peer then ends at the fast one's
        pace, not when the slow one has sent what it was asked for first."""
        others = [item for item in self.active.values() if item.peer is not peer]
        rate = peer.rate(now) if others else None  # alone (the common case) it is asked nothing more
        best, most = None, TAKEOVER_GAIN
        for item in others if rate else ():
            mine = item.slot.nbytes / rate
            theirs = item.peer.seconds_for(item.slot.nbytes - item.received, now)
            if theirs > 2 * mine and theirs - mine > most and self._serves(peer, item.slot):
                best, most = item, theirs - mine
        if best is None:
            return None
        first = best.peer.name not in self.overtaken  # one line a slow peer; the rest at debug level
        self.overtaken.add(best.peer.name)
        log.log(logging.INFO if first else logging.DEBUG, "fetch of %s: %s fetches %s instead of %s (%.1f s sooner "
                "at the rates so far)%s", self.model, peer.name, best.slot.name, best.peer.name, most,
                f"; from now on any item {best.peer.name} owes goes to a peer that fetches it sooner (logged at "
                "debug level)" if first else "")
        item = self.active[best.slot.name] = Item(best.slot, peer)
        return item

    def _check_timeouts(self, now: float) -> None:
        for peer in self.peers:
            if peer.inflight and now - peer.heard > CHUNK_TIMEOUT:
                self._leave_out(peer, f"it answered none of {len(peer.inflight)} chunks for {CHUNK_TIMEOUT:g} s")

    def _received(self, peer: Peer, frames) -> None:
        now = time.monotonic()
        try:
            msg, buffers = p.decode(frames, CHUNK_BYTES)
        except p.ProtocolError as exc:
            self._leave_out(peer, f"it sent a bad frame ({exc})")
            return
        if isinstance(msg, p.Error):
            peer.heard = now
            self._refused(peer, msg)
            return
        if not isinstance(msg, p.Chunk) or msg.ref not in peer.inflight:
            return  # an answer to a request given up on, or a stray: nothing waits for it, nor is it an answer
        peer.heard = now  # only an answer shows the peer at work: strays would keep one that sends no chunk
        parts, _ = peer.inflight.pop(msg.ref)
        peer.answered(sum(n for _, _, n in parts), now)
        if (msg.name, msg.offset) != parts[0][:2] or [len(b) for b in buffers] != [n for _, _, n in parts]:
            self._leave_out(peer, f"it answered chunk {msg.ref} with other bytes than asked", bad=True)
            return
        self._fill(peer, now)
        for (name, offset, length), data in zip(parts, buffers):
            item = self.active.get(name)
            if item is None or item.peer is not peer:
                continue
            self.store.put(item, offset, data)
            item.received += length
            peer.bytes += length
            if item.received == item.slot.nbytes:
                self.store.judge(item)

    def _refused(self, peer: Peer, msg: p.Error) -> None:
        """An ERROR: BUSY means ask again soon (the chunks it held go back); anything else leaves it out."""
        if msg.code != p.ErrorCode.BUSY:
            self._leave_out(peer, f"it refused a chunk: {msg.code}: {msg.message}")
            return
        peer.pause_until = time.monotonic() + BUSY_PAUSE
        for parts, _ in peer.inflight.values():
            for name, offset, _ in parts:
                item = self.active.get(name)
                if item is not None and item.peer is peer:
                    item.next_offset = min(item.next_offset, offset)
        # every unanswered chunk is asked again: received bytes are rewritten, the same bytes
        for item in self.active.values():
            if item.peer is peer:
                item.received = min(item.received, item.next_offset)
        peer.inflight.clear()

    def _judged(self) -> None:
        """Act on the store's verdicts (one for an item given up on meanwhile is dropped)."""
        try:
            for item, verdict in self.store.judged():
                if isinstance(verdict, OSError):
                    raise verdict
                if self.active.get(item.slot.name) is item:
                    self._complete(item, verdict)
        finally:
            self.part.flush_journal()  # once for the verdicts read together, not once an item

    def _complete(self, item: Item, ok: bool) -> None:
        del self.active[item.slot.name]
        if not ok:
            self.queue.appendleft(item.slot)
            self._leave_out(item.peer, f"it sent bad bytes: {item.slot.name} does not match the manifest's digest",
                            bad=True)
            return
        self.part.mark_done(item.slot)
        self.verified += item.slot.nbytes
        if self.progress is not None:
            self.progress.update(item.slot.nbytes)


def fetch_plan(manifest: FileManifest, layers: str | None, model: str) -> tuple[Shard, Layout]:
    """The shard ``layers`` names of this manifest's model (all of it: None), laid out."""
    from ..wire.shard import parse_layers

    try:
        shard = parse_layers(layers, manifest.num_layers) if layers else Shard(0, manifest.num_layers - 1,
                                                                              manifest.num_layers)
    except ValueError as exc:
        raise FetchError(f"{exc} ({model} has {manifest.num_layers} layers)") from None
    return shard, layout(manifest, shard, model)
