"""One ``generate`` call's events, across the heads that serve it in turn: when a head
dies, goes silent or leaves, the request goes on at another (``Continuation``). Socket-free
decisions only: ``RequestStream`` is driven by a client shell, which does the I/O it asks for
(``core.Call``).
"""
from __future__ import annotations

import dataclasses
import logging

import zmq

from ..net.security import Security
from ..wire import protocol as p
from . import core
from .core import (
    Call,
    ClientCore,
    FabricError,
    GenerateArgs,
    HeadDied,
    HeadGone,
    HeadLeaving,
    HeadSilent,
    Program,
)

log = logging.getLogger(__name__)

# the link to the head dropped, or it refuses connections: its process is gone
HEAD_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


MAX_HANDOVERS = 3  # heads one request may lose and still go on


def stranded(died: HeadGone, why: FabricError) -> HeadGone:
    """``died``, saying why no other head took its request over."""
    died.message = f"{died.message}, and no other head could take the request over ({why})"
    died.args = (f"{died.code}: {died.message}",)
    return died


class Continuation:
    """One request's stream across the heads that serve it in turn, seen by the caller as one.

    When a head dies (or refuses the request because it leaves), the request goes on at another
    head that holds layer 0: the same GENERATE with the token ids streamed so far (``resume``)
    and the sampling seed the first head used (its start event names it). Sampling depends only
    on (seed, position), so the new head goes on as the first would have. The caller sees one
    start event, each token once and one end. ``RequestStream`` streams ``msg``, passes on the
    events ``passes`` lets through, and after a HeadGone asks for a route around ``around``'s nodes.
    """

    def __init__(self, msg: p.Generate, fixed_route: bool):
        self.msg = msg  # the GENERATE to send next
        self.fixed_route = fixed_route  # the caller chose the route: no other head to go to
        self.ids: list[int] = []  # the token ids streamed so far
        self.started = False  # a start event was passed on
        self.flushed = False  # the last flush of held-back text was passed on (only the end follows it)
        self.lost: list[str] = []  # heads that died or left under this request

    def passes(self, event: p.Event) -> bool:
        """Whether the caller sees ``event``: not a later head's start, nor a flush it had."""
        if event.event == p.EventKind.START:
            seen, self.started = self.started, True
            if not seen and event.seed is not None:  # unseeded sampling, too, goes on the same
                self.msg = dataclasses.replace(self.msg, sampling=dataclasses.replace(self.msg.sampling,
                                                                                      seed=event.seed))
            return not seen
        if event.event == p.EventKind.TOKEN and not event.token_ids:
            seen, self.flushed = self.flushed, True
            return not seen
        self.ids.extend(event.token_ids)
        return True

    def around(self, died: HeadGone) -> list[tuple[str, ...]]:
        """The heads to go around after ``died``, best first: every head this request lost, then
        only the one just lost (an earlier one may be back, restarted under its name). Raises
        ``died`` itself when the request cannot go on (a route the caller chose, or too many
        heads lost)."""
        if self.fixed_route or len(self.lost) >= MAX_HANDOVERS:
            raise died
        self.lost.append(died.head.node)
        return [tuple(self.lost)] + ([(died.head.node,)] if len(self.lost) > 1 else [])

    def go_on(self, died: HeadGone, route: tuple[p.Hop, ...]) -> None:
        """Send the request to ``route``'s head next, after the tokens so far. The hops of the
        dead head's route free its session themselves: only the connection that opened a
        session may end it (fabric/node/owners.py), and that one died with the head."""
        log.warning("%s after %d tokens; request %s goes on at %s", died.message, len(self.ids),
                    self.msg.request_id, route[0].node)
        self.msg = dataclasses.replace(self.msg, route=tuple(route), resume=tuple(self.ids))


class HeadLink:
    """One GENERATE on its way to one head: a DEALER to the head, a monitor of its link, and
    what the events read so far say. ``RequestStream`` has its shell send, poll and receive."""

    def __init__(self, ctx, msg: p.Generate, security: Security | None, poller):
        self.msg = msg
        self.sock, self.monitor = core.dealer(ctx, msg.route[0].endpoint, security, msg.route[0].key,
                                              watch=HEAD_DOWN)
        self.poller = poller
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        self.tokens = 0  # tokens this head streamed
        self.done = False

    @property
    def request(self) -> list:
        return p.encode(self.msg)

    @property
    def cancel(self) -> list:
        return p.encode(p.Cancel(self.msg.request_id))

    def check(self, ready: dict) -> None:
        """Raise when the poll says the head died (link down, nothing to read) or went silent."""
        if self.monitor in ready and self.sock not in ready:
            raise HeadDied(self.msg.route[0])
        if not ready:
            raise HeadSilent(self.msg.route[0])

    def take(self, frames) -> p.Event:
        """The head's next event (an error raises as a FabricError; a leaving head's refusal
        before any token as HeadLeaving, so that the request goes to another head)."""
        try:
            event = core.event_of(frames)
        except FabricError as exc:
            if exc.code == p.ErrorCode.LEAVING and not self.tokens:
                raise HeadLeaving(self.msg.route[0], exc.message) from None
            raise
        self.tokens += event.event == p.EventKind.TOKEN
        self.done = event.event == p.EventKind.DONE
        return event

    def close(self) -> None:
        # the monitor stops before its reader closes: an event with no reader would block the
        # context's I/O thread, and with it every socket of this process
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=100 if not self.done else 0)


class RequestStream:
    """One ``generate`` call as programs its shell drives: ``next_event`` gives the next event
    the caller sees (None after the last), ``end`` cancels the request at its head unless the
    head is done, and closes the link. The route is asked for at the first event, in both
    shells (an async generator can do nothing at the call), and the shells call ``end`` on
    every way out (a break, an error, a Ctrl-C)."""

    def __init__(self, client: ClientCore, args: GenerateArgs, route: tuple[p.Hop, ...] | None):
        self.client = client
        self.args = args
        self.route = route  # the caller's route, or None: the tracker's
        self.stream: Continuation | None = None  # made at the first event, once the route is known
        self.head: HeadLink | None = None  # the link to the head now serving the request
        self.over = False  # the head said done: nothing more comes

    def next_event(self) -> Program[p.Event | None]:
        if self.stream is None:
            route = self.route or (yield from self.client._route_program(self.args.model))
            self.stream = Continuation(self.args.message(route), fixed_route=self.route is not None)
        while not self.over:
            try:
                event = yield from self._read()
            except HeadGone as gone:
                yield from self.end()
                self.stream.go_on(gone, (yield from self._route_around(gone)))
                continue
            if self.stream.passes(event):
                return event
        return None

    def end(self) -> Program[None]:
        head, self.head = self.head, None
        if head is None:
            return
        try:
            if not head.done:
                yield Call(head.sock, "send_multipart", (head.cancel,))
        finally:
            head.close()

    def _read(self) -> Program[p.Event]:
        """The head's next event, the request sent first if no head has it yet."""
        if self.head is None:
            self.head = HeadLink(self.client.ctx, self.stream.msg, self.client.security, self.client.poller())
            yield Call(self.head.sock, "send_multipart", (self.head.request,))
        head = self.head
        head.check(dict((yield Call(head.poller, "poll", (self.client.timeout * 1000,)))))
        event = head.take((yield Call(head.sock, "recv_multipart")))
        if head.done:
            self.over = True
            yield from self.end()
        return event

    def _route_around(self, gone: HeadGone) -> Program[tuple[p.Hop, ...]]:
        """A route for the rest of the request, around the heads it lost (``Continuation.around``);
        the gone head is booked in the client's routes as dead or as leaving."""
        for exclude in self._around(gone):
            try:
                return (yield from self.client._route_program(self.args.model, exclude))
            except FabricError as exc:
                why = exc
        raise stranded(gone, why) from None

    def _around(self, gone: HeadGone) -> list[tuple[str, ...]]:
        """The heads to go around after ``gone``, best first (``Continuation.around``); ``gone``
        is booked in the client's routes as what it is (dead, or leaving)."""
        gone.book(self.client.routes)
        return self.stream.around(gone)
