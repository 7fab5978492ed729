"""``meshnet node`` with timing hooks: the diagnostic nodes of ``bench/fabric_bench.py``.

    MESHNET_BENCH_TRACE=/tmp/n.jsonl python bench/trace_node.py node --model ... --layers 0-14 ...

Everything after the script name is handed to ``fabric.cli.main`` unchanged, so the node
parses the same flags and runs the same code as ``python -m fabric.cli node``. Before
that, a few methods of the node are wrapped to record CLOCK_MONOTONIC timestamps (the
clock is system-wide, so timestamps from different node processes can be compared):

- ``run``      ShardExecutor.run: layer compute for one hop (session, pos, q, t0, t1)
- ``pass``     HopRunner.run: one forward pass, each hop of it as [session, pos, tokens, decode] (t0, t1)
- ``gc``       a garbage collection: generation, objects collected (t0, t1)
- ``inbound``  Node.inbound: a frame from the ROUTER, decode + dispatch (t0, t1)
- ``dispatch`` Node._dispatch: entered after decode (message kind, t0)
- ``forward``  Node.forward: hand a hop to the next node or the local queue (local?, t0, t1)
- ``sample``   tail sampling (t0, t1)
- ``reply``    Node.reply: an event or error to a client (t0, t1)
- ``on_token`` RouteSession.on_token at the head, incl. detokenization (t0, t1)
- ``after``    Node._after_hop: what one hop of a pass sends on (session, t0, t1)
- ``split``    at exit: each kind of kernel call's learnt thread count (fabric/compute/splits.py)

The records are kept in memory (a tuple append per event) and written as JSON lines
when the node exits (SIGTERM/SIGINT stop it cleanly). With ``MESHNET_BENCH_PROFILE=FILE``
the whole node runs under cProfile instead and the stats are dumped to FILE at exit (``{pid}`` in
FILE: the node's process id, so that every node of a cluster keeps its own).
Hooks that no longer match the fabric's code are skipped with a note on stderr.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_now = time.monotonic_ns  # CLOCK_MONOTONIC on Linux, shared by all processes
EVENTS: list[tuple] = []


def _wrap(owner, name: str, make) -> None:
    original = getattr(owner, name, None)
    if original is None:
        print(f"trace_node: {owner.__name__}.{name} not found; not traced", file=sys.stderr)
        return
    setattr(owner, name, make(original))


def _timed(kind: str, fields=lambda *args, **kwargs: ()):
    """A hook: the call, recorded as ``(kind, *fields(its arguments), t0, t1)``."""
    def make(orig):
        def wrapper(*args, **kwargs):
            t0 = _now()
            try:
                return orig(*args, **kwargs)
            finally:
                EVENTS.append((kind, *fields(*args, **kwargs), t0, _now()))
        return wrapper
    return make


def _dispatched(orig):
    """A hook on ``Node._dispatch``: its entry only (what came, when)."""
    def wrapper(self, identity, msg, buffers):
        EVENTS.append(("dispatch", type(msg).__name__, getattr(msg, "session", None), getattr(msg, "pos", None),
                       bool(identity), _now()))
        return orig(self, identity, msg, buffers)
    return wrapper


def _collected(phase: str, info: dict) -> None:
    """A garbage collection, from gc's callbacks."""
    if phase == "start":
        _collected.t0 = _now()
    else:
        EVENTS.append(("gc", info["generation"], info["collected"], _collected.t0, _now()))


def install() -> None:
    import fabric.node.asks as asks_mod
    import fabric.node.node as node_mod
    from fabric.compute.executor import ShardExecutor
    from fabric.node.hops import HopRunner
    from fabric.node.route_session import RouteSession

    gc.callbacks.append(_collected)
    _wrap(ShardExecutor, "run", _timed("run", lambda self, session, start, end, inputs, pos, **kw: (
        session, pos, int(inputs.shape[1]), start, end)))
    _wrap(HopRunner, "run", _timed("pass", lambda self, batch: (
        [[w.session, w.msg.pos, w.tokens, w.decode] for w in batch],)))
    _wrap(node_mod.Node, "inbound", _timed("inbound"))
    _wrap(node_mod.Node, "_dispatch", _dispatched)
    _wrap(node_mod.Node, "forward", _timed("forward", lambda self, hop, message, tensor: (
        message.session, message.pos, hop.endpoint == self.endpoint)))
    _wrap(node_mod.Node, "_after_hop", _timed("after", lambda self, work, result: (work.session,)))
    _wrap(node_mod.Node, "reply", _timed("reply", lambda self, identity, message, buffers=(): (
        type(message).__name__,)))
    _wrap(asks_mod, "sample", _timed("sample"))
    _wrap(RouteSession, "on_token", _timed("on_token", lambda self, msg: (self.session, getattr(msg, "pos", None))))


def _dump(path: str) -> None:
    tmp = path + ".tmp"
    from fabric.compute import splits

    chosen = [("split", repr(key), threads) for key, (threads, _) in splits.SPLITS.chosen.items()]
    with open(tmp, "w") as fh:
        for event in [*EVENTS, *chosen]:
            fh.write(json.dumps(event) + "\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    from fabric.cli import main as cli_main

    profile_path = os.environ.get("MESHNET_BENCH_PROFILE", "").replace("{pid}", str(os.getpid()))
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        atexit.register(lambda: profiler.dump_stats(profile_path))
        return profiler.runcall(cli_main, argv)
    trace_path = os.environ.get("MESHNET_BENCH_TRACE")
    if trace_path:
        install()
        atexit.register(_dump, trace_path)
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
