"""Who can hand over which bytes of a model: the nodes the tracker lists for it, and what
each one's MANIFEST says its file holds. Pure: no sockets (``fetcher`` asks them)."""
from __future__ import annotations

from dataclasses import dataclass

from ..compute.gguf_manifest import KV_NAME, FileManifest, wanted
from ..compute.gguf_partial import Slot
from ..wire.shard import Shard


class FetchError(Exception):
    """A fetch cannot finish; the message (one line) says why and what to do."""


class NoHolders(FetchError):
    """No node serves the model (or the tracker did not answer): nothing was fetched."""


@dataclass(frozen=True)
class Holder:
    """A node the tracker lists for the model."""

    node: str
    endpoint: str
    key: str  # its CURVE key in a secured swarm ("" in plaintext)
    fingerprint: str  # as it registered: the manifest's part, then ``:quant`` where it quantizes
    layers: tuple[int, int]  # the layers it serves

    @property
    def weights_print(self) -> str:
        return self.fingerprint.partition(":")[0]


def holders_of(status: dict, model: str) -> list[Holder]:
    """The nodes of ``status`` (``meshnet status --json``) that serve ``model``."""
    found = []
    for n in status.get("nodes", []):
        if n.get("model") == model and n.get("endpoint"):
            found.append(Holder(str(n.get("id")), n["endpoint"], n.get("key") or "", str(n.get("fingerprint", "")),
                                tuple(n.get("layers") or (0, 0))))
    return found


def can_serve(held: tuple[int, int], slot_name: str, num_layers: int, tied: bool) -> bool:
    """Does a file holding layers ``held`` (with what those need) hold item ``slot_name``?"""
    if slot_name == KV_NAME:
        return True
    return wanted(slot_name, Shard(held[0], held[1], num_layers), tied)


def ranges(layers: set[int]) -> str:
    """``{3, 4, 5, 9}`` -> ``3-5, 9``."""
    out: list[list[int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in out)


def missing_line(model: str, shard: Shard, manifest: FileManifest, slots: list[Slot],
                 held: dict[str, tuple[int, int]]) -> str | None:
    """One line naming the layers (or tensors) of ``shard`` no holder has, and who holds what;
    None when every slot has a holder."""
    orphans = [s for s in slots if not any(can_serve(h, s.name, manifest.num_layers, manifest.tied)
                                           for h in held.values())]
    if not orphans:
        return None
    layers = {layer for s in orphans if (layer := _layer(manifest, s.name)) is not None}
    others = sorted(s.name for s in orphans if _layer(manifest, s.name) is None)
    what = ", ".join(filter(None, [f"layers {ranges(layers)}" if layers else "", ", ".join(others)]))
    who = "; ".join(f"{node} holds {a}-{b}" for node, (a, b) in sorted(held.items())) or "none answered"
    return f"no peer holds {what} of {model} (needed for layers {shard}): {who}"


def _layer(manifest: FileManifest, name: str) -> int | None:
    record = manifest.find(name)
    return record.layer if record is not None else None
