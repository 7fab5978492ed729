"""``meshnet pull MODEL --layers A-B --tracker T`` and a node started without its model file:
find a finished partial copy here, else fetch one from the swarm."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from ..compute.gguf_manifest import FileManifest
from ..compute.gguf_partial import find_partial, partial_name
from ..net.security import Security
from ..wire.shard import Shard, parse_range
from .fetcher import Fetcher, fetch_plan
from .holders import NoHolders, holders_of
from .report import FetchReporter

log = logging.getLogger(__name__)

TRACKER_WAIT = 5.0  # seconds to wait for the tracker's list of nodes
# seconds to go on asking while the tracker lists no node of the model: one that starts or restarts
# beside this one, or that missed heartbeats on a busy machine and registers again, is listed soon
HOLDERS_WAIT = 10.0
HOLDERS_POLL = 0.5


def local_copy(directory: Path, model: str, layers: str | None) -> Path | None:
    """A finished partial copy of ``model`` holding ``layers`` (None: never, the range is not known)."""
    try:
        start, end = parse_range(layers or "")
    except ValueError:
        return None
    return find_partial(directory, model, start, end)


def fetch_layers(model: str, layers: str | None, tracker: str, security: Security | None, directory: Path,
                 progress: bool = True, say: Callable[[str], None] = print,
                 node: Callable[[Shard], str] = lambda shard: "",
                 assign: Callable[[FileManifest], str] | None = None, durable: bool = True) -> Path:
    """A partial GGUF of ``model`` holding ``layers`` (all: None; ``assign``'s answer from the
    manifest where given) in ``directory``: the one here, or one fetched from the nodes the
    tracker lists for it, reported to the tracker as it goes under ``node``'s answer (the id of
    the node that will serve the shard once its span is known, "" for a pull). FetchError (one
    line; NoHolders where no node serves it) otherwise. ``durable``: the copy's bytes are on
    disk when it returns; else a thread writes them there after (a node serves meanwhile)."""
    found = local_copy(directory, model, layers)
    if found is not None:
        say(f"layers {layers} of {model} are here already: {found}")
        return found
    holders = _holders(model, tracker, security, say)
    fetcher = Fetcher(model, holders, security, durable=durable)
    fetcher.reporter = reporter = FetchReporter(tracker, security, model)
    error = ""
    try:
        manifest = fetcher.manifests()
        if layers is None and assign is not None:
            layers = assign(manifest)  # e.g. the tracker's least-covered span, now that the layer count is known
            found = local_copy(directory, model, layers)
            if found is not None:
                say(f"layers {layers} of {model} are here already: {found}")
                return found
        shard, plan = fetch_plan(manifest, layers, model)
        target = directory / partial_name(model, manifest.digest, shard)
        directory.mkdir(parents=True, exist_ok=True)
        have = fetcher.start(target, plan, shard, manifest)
        total = sum(s.nbytes for s in plan.slots)
        reporter.node = node(shard)
        reporter.begin(shard, total, have)
        peers = sum(1 for peer in fetcher.peers if not peer.gone)
        say(f"fetching layers {shard} of {model} from {peers} peer(s): {_mib(total - have)} of {_mib(total)}"
            + (f" ({have:,} bytes verified here already)" if have else ""))
        fetcher.progress = _bar(total, have, f"fetching layers {shard}", progress)
        path = fetcher.run()
        fetcher.progress.close()
        fetched = sum(peer.bytes for peer in fetcher.peers)
        say(f"fetched layers {shard} of {model}: {path} ({path.stat().st_size:,} bytes; {fetched:,} bytes "
            f"from peers in this run)")
        return path
    except BaseException as exc:  # Ctrl-C too: the tracker hears the fetch ended (it resumes next time)
        error = str(exc) or type(exc).__name__
        raise
    finally:
        reporter.end(fetcher.verified, fetcher.bad, error)
        fetcher.close()


def _holders(model: str, tracker: str, security: Security | None, say: Callable[[str], None] = print,
             clock: Callable[[], float] = time.monotonic):
    """The nodes the tracker lists for ``model``, asked again for up to ``HOLDERS_WAIT`` seconds
    while it lists none; NoHolders (one line: what it lists) after that."""
    deadline, said = clock() + HOLDERS_WAIT, False
    while True:
        status = _status(model, tracker, security)
        holders = holders_of(status, model)
        if holders:
            return holders
        if clock() >= deadline:
            listed = sorted({n.get("model") for n in status.get("nodes", []) if n.get("model")})
            raise NoHolders(f"no node serves {model} (the tracker at {tracker} lists: {', '.join(listed) or 'none'})")
        if not said:
            say(f"no node serves {model} yet; asking the tracker again for up to {HOLDERS_WAIT:.0f} s")
            said = True
        time.sleep(HOLDERS_POLL)


def _status(model: str, tracker: str, security: Security | None) -> dict:
    from ..client import Client, FabricError

    try:
        with Client(tracker, timeout=TRACKER_WAIT, security=security) as client:
            return client.status()
    except FabricError as exc:
        raise NoHolders(f"cannot ask the tracker at {tracker} who serves {model}: {exc}") from None


def _bar(total: int, have: int, what: str, shown: bool):
    """Bytes, rate and ETA, in the style of the loading bar (tqdm)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                disable=not shown)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
