"""Weights from peers: a machine without the model file fetches only its layers from the nodes
that hold it, verified against the manifest the fingerprint is made of, resumably, into a
partial GGUF that loads as the whole file does.

The process tests run real `meshnet` processes on loopback; the fetching side has its own
XDG_CACHE_HOME (its own home: no copy of the file, and it never reads the other's path).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq

from fabric.compute.gguf_info import read_header
from fabric.compute.gguf_manifest import (
    KV_NAME,
    compute_manifest,
    fingerprint_of,
    manifest_for,
)
from fabric.compute.gguf_partial import PEERS_DIR, PartialFile, layout, partial_name
from fabric.compute.model_store import format_inventory, inventory
from fabric.compute.models import fingerprint, load_config, load_shard, resolve
from fabric.node.share import WeightShare
from fabric.wire import protocol as p
from fabric.wire.shard import Shard
from tests.cluster import ROOT
from tests.gguf_models import write_gguf
from tests.support import cli, wait_for
from tests.tiny_models import assert_clear_lead

MODEL = "tiny"  # the model id the swarm lists: the file's stem
LAYERS = 6
RAW_PROMPT = "the quick brown fox jumps over"
NEW_TOKENS = 10
EXACT = ("--quant", "none", "--dtype", "float32")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return write_gguf("llama", tmp_path_factory.mktemp("holder"), "Q8_0", num_layers=LAYERS, name=f"{MODEL}.gguf")


def copy_partial(source: Path, shard: Shard, target: Path, flip: str = "", manifest=None) -> PartialFile:
    """A partial copy of ``shard`` made from ``source`` on this machine (tensor ``flip`` with one bit
    flipped; ``manifest`` where it is not the source's own)."""
    part = PartialFile(target, layout(manifest or compute_manifest(source), shard, MODEL))
    part.open()
    offsets = {t.name: t.offset for t in read_header(source).tensors}
    with open(source, "rb") as f:
        for slot in part.plan.slots:
            f.seek(24 if slot.name == KV_NAME else offsets[slot.name])
            data = bytearray(f.read(slot.nbytes))
            if slot.name == flip:
                data[0] ^= 1
            part.write(slot, 0, data)
    return part


# --------------------------------------------------------------------------- the partial file


def test_a_partial_copy_loads_as_the_whole_file_does_and_registers_its_fingerprint(model_file, tmp_path):
    shard = Shard(3, 5, LAYERS)
    (tmp_path / "models" / PEERS_DIR).mkdir(parents=True)
    part = copy_partial(model_file, shard, tmp_path / "models" / PEERS_DIR / partial_name(MODEL, "0" * 8, shard))
    assert all(part.verify(s) for s in part.plan.slots)
    path = part.finish()
    listed = format_inventory(inventory(tmp_path / "models"))
    assert re.search(rf"^{MODEL} +3-5 of 6 .*{re.escape(str(path))}$", listed, re.MULTILINE), listed
    assert path.stat().st_size < 0.7 * model_file.stat().st_size
    whole, partial = resolve(str(model_file)), resolve(str(path), MODEL)
    a = load_shard(whole, shard, progress=False, cache_root=tmp_path / "cache")
    b = load_shard(partial, shard, progress=False, cache_root=tmp_path / "cache")
    for i in range(3, 6):
        for (name, x), (_, y) in zip(a.layers[i].state_dict().items(), b.layers[i].state_dict().items()):
            assert torch.equal(x, y), name
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and torch.equal(a.norm.weight, b.norm.weight)
    config = load_config(whole, tmp_path / "cache")
    assert fingerprint(whole, config) == fingerprint(partial, config) == fingerprint_of(manifest_for(model_file).digest)


def test_a_flipped_bit_fails_its_tensors_check_and_a_changed_file_changes_the_fingerprint(model_file, tmp_path):
    shard = Shard(0, 2, LAYERS)
    part = copy_partial(model_file, shard, tmp_path / "head.gguf", flip="blk.1.ffn_up.weight")
    bad = [s.name for s in part.plan.slots if not part.verify(s)]
    assert bad == ["blk.1.ffn_up.weight"]
    other = write_gguf("llama", tmp_path / "other", "Q8_0", num_layers=LAYERS, seed=1, name=f"{MODEL}.gguf")
    assert compute_manifest(other).digest != compute_manifest(model_file).digest


def test_an_interrupted_layout_resumes_only_what_verifies(model_file, tmp_path):
    shard = Shard(3, 5, LAYERS)
    part = copy_partial(model_file, shard, tmp_path / "tail.gguf")
    good = part.plan.slots[:4]
    for slot in good:
        part.mark_done(slot)
    part.close()
    with open(part.journal, "a") as f:
        f.write(part.plan.slots[5].name + "\n")  # journaled, but its bytes are damaged below
    with open(part.part, "r+b") as f:
        f.seek(part.plan.slots[5].offset)
        f.write(b"\xff\xff")
    again = PartialFile(part.target, part.plan)
    assert again.open() == sum(s.nbytes for s in good)
    assert {s.name for s in again.missing()} == {s.name for s in part.plan.slots[4:]}



def test_a_copy_renamed_before_its_bytes_reached_the_disk_is_hashed_again_before_it_is_trusted(model_file,
                                                                                               tmp_path):
    """A node's fetch renames the finished file at once and syncs it on a thread, a marker beside
    it until then; a copy found with the marker (the process ended first) is taken back as a
    ``.part`` and only its items that still verify are kept."""
    from fabric.compute.gguf_partial import find_partial, unsynced_marker

    shard = Shard(3, 5, LAYERS)
    peers = tmp_path / "models" / PEERS_DIR
    peers.mkdir(parents=True)
    target = peers / partial_name(MODEL, "0" * 8, shard)
    part = copy_partial(model_file, shard, target)
    for slot in part.plan.slots:
        part.mark_done(slot)
    assert part.finish(durable=False) == target and target.is_file() and not part.part.exists()
    part.wait_synced()
    assert not unsynced_marker(target).exists() and find_partial(peers, MODEL, 3, 5) == target

    unsynced_marker(target).write_text("".join(f"{s.name}\n" for s in part.plan.slots))  # as after a crash
    damaged = part.plan.slots[3]
    with open(target, "r+b") as f:
        f.seek(damaged.offset)
        f.write(b"\0\0\0\0")
    assert find_partial(peers, MODEL, 3, 5) is None  # not trusted as it stands
    assert "hashed again before use" in format_inventory(inventory(tmp_path / "models"))
    again = PartialFile(target, part.plan)
    assert again.open() == sum(s.nbytes for s in part.plan.slots if s is not damaged)
    assert [s.name for s in again.missing()] == [damaged.name]
    assert again.part.is_file() and not target.exists() and not unsynced_marker(target).exists()
    again.close()


def test_a_copy_an_older_meshnet_made_is_listed_as_such_never_loaded_and_fetched_again(model_file, tmp_path):
    """Format 1 of the manifest named each item's sha256; a copy carrying one cannot prove the
    fingerprint today's nodes register, so it is passed over (and its layers fetched again),
    named as outdated by ``meshnet models``, and loading it directly says what to do; a peer
    still serving such a manifest is left out of a fetch, with that reason."""
    import hashlib
    import json

    import blake3

    from fabric.compute.gguf_manifest import MANIFEST_KEY
    from fabric.compute.gguf_partial import find_partial
    from fabric.compute.model_ref import ModelError

    manifest = compute_manifest(model_file)
    tensor = read_header(model_file).tensors[0]
    with open(model_file, "rb") as f:
        f.seek(tensor.offset)
        data = f.read(tensor.nbytes)
    assert manifest.find(tensor.name).blake3 == blake3.blake3(data).hexdigest()  # the format PROTOCOL.md names

    shard, peers = Shard(3, 5, LAYERS), tmp_path / "models" / PEERS_DIR
    peers.mkdir(parents=True)
    old = manifest.to_json() | {"format": "meshnet-gguf-manifest/1", "kv_sha256": hashlib.sha256(b"kv").hexdigest()}
    del old["kv_blake3"]
    old["tensors"] = [{k: v for k, v in t.items() if k != "blake3"} | {"sha256": t["blake3"]} for t in old["tensors"]]
    manifest.__dict__["_canonical"] = json.dumps(old, sort_keys=True).encode()  # as format 1 wrote it
    target = peers / partial_name(MODEL, "0" * 8, shard)
    copy_partial(model_file, shard, target, manifest=manifest).finish()
    assert json.loads(read_header(target).metadata[MANIFEST_KEY])["format"] == "meshnet-gguf-manifest/1"

    assert find_partial(peers, MODEL, 3, 5) is None
    assert "made by an older meshnet" in format_inventory(inventory(tmp_path / "models"))
    with pytest.raises(ModelError, match="fetched by an older meshnet .*fetch its layers again"):
        manifest_for(target)

    from fabric.fetch import fetcher as fm
    from fabric.fetch.holders import Holder

    raw = manifest.canonical()  # a peer that still runs format 1: its manifest hashes to what it registered
    digest = hashlib.sha256(raw).hexdigest()
    peer = fm.Peer(Holder("old", "tcp://x", "", fingerprint_of(digest), (0, LAYERS - 1)), None)
    answer = p.encode(p.Manifest(MODEL, digest, 0, LAYERS - 1, "old", tensors=(p.TensorSpec("uint8", (len(raw),)),)),
                      [raw])
    fetcher = fm.Fetcher(MODEL, [], None)
    try:
        assert fetcher._manifest_of(peer, answer) is None
    finally:
        fetcher.close()
    assert "older meshnet" in peer.gone, peer.gone


def test_a_new_partial_file_holds_its_blocks_before_a_byte_arrives(model_file, tmp_path):
    """The ``.part`` is allocated whole when it is made (a disk too small fails then), not sparse."""
    import ctypes
    import errno

    from fabric.compute import gguf_partial

    probe = os.open(tmp_path / "probe", os.O_CREAT | os.O_RDWR)
    call = gguf_partial.fallocate()
    unsupported = call is None or (call(probe, 0, 0, 1 << 20) != 0 and ctypes.get_errno() == errno.EOPNOTSUPP)
    os.close(probe)
    if unsupported:
        pytest.skip("this file system allocates as writes come")
    part = PartialFile(tmp_path / "tail.gguf", layout(compute_manifest(model_file), Shard(3, 5, LAYERS), MODEL))
    part.open()
    try:
        assert os.fstat(part.fd).st_blocks * 512 >= part.plan.size
    finally:
        part.close()


def test_a_disk_too_small_is_named_before_the_fetch_and_leaves_no_part_file(model_file, tmp_path, monkeypatch):
    import errno

    from fabric.compute import gguf_partial
    from fabric.fetch import fetcher as fm
    from fabric.fetch.holders import FetchError, Holder

    def full(fd, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf_partial, "_reserve", full)
    manifest, shard = compute_manifest(model_file), Shard(3, 5, LAYERS)
    fetcher = fm.Fetcher(MODEL, [], None)
    fetcher.peers.append(fm.Peer(Holder("a", "tcp://x", "", "", (0, LAYERS - 1)), None, held=(0, LAYERS - 1)))
    with pytest.raises(FetchError, match=r"not enough disk space in .* for layers 3-5 of tiny: the copy takes .* MiB "
                                         r"are free"):
        fetcher.start(tmp_path / "tail.gguf", layout(manifest, shard, MODEL), shard, manifest)
    assert list(tmp_path.iterdir()) == []


def test_the_store_writes_in_the_order_handed_so_a_replaced_peers_bytes_never_stand(model_file, tmp_path):
    """A bad peer's chunks of a tensor, handed to the store before the tensor was asked again of
    another peer, are written first: the bytes left in the file are the good ones, and the verdicts
    name the bad item false and the good one true (the item given up on is never marked done)."""
    import threading

    from fabric.fetch.store import Item, Store

    shard = Shard(3, 5, LAYERS)
    part = PartialFile(tmp_path / "tail.gguf", layout(compute_manifest(model_file), shard, MODEL))
    part.open()
    slot = max(part.plan.slots, key=lambda s: s.nbytes)
    with open(model_file, "rb") as f:
        f.seek({t.name: t.offset for t in read_header(model_file).tensors}[slot.name])
        good = f.read(slot.nbytes)
    store = Store(part, threads=2)
    try:
        hold = threading.Event()  # the slot's thread waits here, so that both items queue before any is written
        store.put(_Held(slot, hold), 0, b"")
        bad, replacement = Item(slot, "bad"), Item(slot, "good")
        half = slot.nbytes // 2
        for item, data in ((bad, bytes(x ^ 0xFF for x in good[:16]) + good[16:]), (replacement, good)):
            store.put(item, 0, data[:half])
            store.put(item, half, data[half:])
            store.judge(item)
        hold.set()
        verdicts = []
        assert wait_for(lambda: verdicts.extend(store.judged()) or len(verdicts) == 2, 30, 0.01)
        assert [(v[0].peer, v[1]) for v in verdicts] == [("bad", False), ("good", True)]
        assert os.pread(part.fd, slot.nbytes, slot.offset) == good
    finally:
        store.close()
        part.close()


def test_a_fetch_asks_the_largest_items_first_and_the_small_ones_beside_them(model_file, tmp_path, monkeypatch):
    """Requests (a fake peer's socket keeps them): the largest items first, then small whole items
    riding in a request beside its first part, at most 8 parts and CHUNK_BYTES in all, each item
    asked once and whole."""
    from fabric.fetch import fetcher as fm
    from fabric.fetch.holders import Holder

    class Sock:
        asked: list = []

        def send_multipart(self, frames):
            self.asked.append(p.decode(frames)[0])

        def close(self, linger=None):
            pass

    manifest = compute_manifest(model_file)
    shard = Shard(3, LAYERS - 1, LAYERS)
    monkeypatch.setattr(fm, "CHUNK_BYTES", max(t.nbytes for t in manifest.tensors) * 2)  # all fit in 4 MiB here
    monkeypatch.setattr(fm, "FIRST_CHUNK", fm.CHUNK_BYTES)  # as though it had answered at loopback's rate
    fetcher = fm.Fetcher(MODEL, [], None)
    peer = fm.Peer(Holder("a", "tcp://x", "", "", (0, LAYERS - 1)), Sock(), held=(0, LAYERS - 1))
    fetcher.peers.append(peer)
    try:
        fetcher.start(tmp_path / "tail.gguf", layout(manifest, shard, MODEL), shard, manifest)
        slots = {s.name: s for s in fetcher.queue}
        while fetcher.queue:
            fetcher._fill(peer, 0.0)
            peer.inflight.clear()
        asked = [(m.name, m.offset, m.length, m.more) for m in Sock.asked]
        parts = [n for name, _, _, more in asked for n in (name, *more)]
        assert sorted(parts) == sorted(slots) and all(o == 0 for _, o, _, _ in asked)
        assert all(n == slots[name].nbytes for name, _, n, _ in asked)
        assert len(asked) < len(slots) / 3  # a layer's tensors in a few requests, not one each
        assert all(len(more) < p.MAX_CHUNK_PARTS and n + sum(slots[m].nbytes for m in more) <= fm.CHUNK_BYTES
                   for _, _, n, more in asked)
        assert slots[asked[0][0]].nbytes == max(s.nbytes for s in slots.values())
    finally:
        Sock.asked.clear()
        fetcher.close()


def test_the_store_gives_the_largest_item_a_thread_and_the_rest_the_other(model_file, tmp_path):
    import threading

    from fabric.fetch.store import Item, Store

    shard = Shard(3, LAYERS - 1, LAYERS)
    part = PartialFile(tmp_path / "tail.gguf", layout(compute_manifest(model_file), shard, MODEL))
    part.open()
    store, hold = Store(part, threads=2), threading.Event()
    try:
        big = max(part.plan.slots, key=lambda s: s.nbytes)
        small = [s for s in part.plan.slots if s is not big][:7]
        store.put(_Held(big, hold), 0, bytes(big.nbytes))  # its thread is busy with it until released
        for slot in small:
            store.put(Item(slot, "peer"), 0, bytes(min(slot.nbytes, big.nbytes // 8)))
        hold.set()
    finally:
        store.close()
        part.close()
    assert store.lanes[big.name] == 0 and {store.lanes[s.name] for s in small} == {1}


class _Held:
    """A job of ``slot``'s that holds its store thread until ``event`` is set."""

    def __init__(self, slot, event):
        self.slot, self.event = slot, event

    def store(self, part, offset, data):
        self.event.wait(30)


# --------------------------------------------------------------------------- the wire


def test_chunk_requests_are_bounded_and_uint8_travels_only_as_bytes():
    digest = "a" * 64
    with pytest.raises(p.ProtocolError, match="length"):
        p.decode(p.encode(p.ChunkRequest(digest, "x", 0, p.MAX_CHUNK_BYTES + 1)))
    with pytest.raises(p.ProtocolError, match="sha256"):
        p.decode(p.encode(p.ChunkRequest("A" * 64, "x", 0, 1)))
    with pytest.raises(p.ProtocolError, match="at most 8 parts"):
        p.decode(p.encode(p.ChunkRequest(digest, "x", 0, 1, more=("y",) * p.MAX_CHUNK_PARTS)))
    assert p.decode(p.encode(p.ChunkRequest(digest, "x", 0, 1, more=("y",) * 7)))[0].more == ("y",) * 7
    spec = p.TensorSpec("float32", (1,))
    with pytest.raises(p.ProtocolError, match="uint8"):
        p.decode(p.encode(p.Chunk(1, "x", 0, tensors=(spec,)), [bytes(4)]))
    half = p.MAX_CHUNK_BYTES // 2 + 1
    with pytest.raises(p.ProtocolError, match="in all"):  # each buffer fits, not both: one answer is bounded
        p.decode(p.encode(p.Chunk(1, "x", 0, tensors=(p.TensorSpec("uint8", (half,)),) * 2), [bytes(half)] * 2))
    ids = p.TensorSpec("uint8", (1, 2))
    with pytest.raises(p.ProtocolError, match="int64 input_ids"):
        p.decode(p.encode(p.Forward("s", 0, 0, 0, 2, (), "r", tensors=(ids,)), [bytes(2)]))


# --------------------------------------------------------------------------- processes


def float32_greedy(path: Path, cache: Path) -> list[int]:
    """transformers' own float32 greedy tokens of the whole file for RAW_PROMPT, as a head tokenizes it."""
    from transformers import AutoModelForCausalLM

    from fabric.compute.models import load_tokenizer

    ids = load_tokenizer(resolve(str(path)), cache)(RAW_PROMPT, add_special_tokens=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(prompt),
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    assert_clear_lead(torch.stack(out.scores)[:, 0])  # a near-tie is refused, never compared
    return out.sequences[0, len(ids):].tolist()


def home(tmp_path: Path, name: str) -> dict:
    """Another machine's cache and data directories."""
    return {"XDG_CACHE_HOME": str(tmp_path / name / "cache"), "XDG_DATA_HOME": str(tmp_path / name / "data")}


def peer_copies(env: dict) -> list[Path]:
    return sorted((Path(env["XDG_CACHE_HOME"]) / "meshnet" / "models" / "peers").glob("*.gguf"))


def pull(cluster, env: dict, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fabric.cli", "--log-level", "info", "pull", MODEL, "--layers", "3-5",
                           "--tracker", cluster.endpoint, "--no-progress", *extra], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, check=False)


def test_a_node_without_the_file_fetches_its_layers_and_answers_as_the_reference(process_cluster, model_file,
                                                                                  tmp_path):
    b = home(tmp_path, "b")
    want = float32_greedy(model_file, process_cluster.cache / "meshnet")
    process_cluster.start_node("a", str(model_file), "0-2", None, *EXACT)
    assert wait_for(lambda: _listed(process_cluster, "a"), 120, 0.2), process_cluster.logs()
    process_cluster.start_node("b", MODEL, "3-5", None, *EXACT, env=b)
    status = process_cluster.wait_nodes(["a", "b"], MODEL)
    assert len({n["fingerprint"] for n in status["nodes"]}) == 1
    with process_cluster.client() as client:
        events = list(client.generate(MODEL, prompt=RAW_PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [t for e in events for t in e.token_ids] == want, process_cluster.logs()
    (copy,) = peer_copies(b)
    assert copy.stat().st_size < 0.7 * model_file.stat().st_size
    assert not list(Path(b["XDG_CACHE_HOME"]).rglob(model_file.name))  # only the partial copy is on B's disk


def test_a_node_without_the_file_or_layers_fetches_the_span_the_tracker_assigns(process_cluster, model_file,
                                                                                 tmp_path):
    """No --layers: the tracker assigns the least-covered span that --memory holds (A serves 0-2, so
    3 layers go to 3-5), and only that span is fetched, as with --layers 3-5. No --node-id either:
    the fetch is shown under the id the node then serves as."""
    import math

    manifest = manifest_for(model_file)
    layer = max(sum(math.prod(t.shape) for t in manifest.tensors if t.layer == i) for i in range(LAYERS))
    memory = 3.5 * layer * 4 / (1 << 30)  # three float32 layers fit (EXACT: --quant none --dtype float32)
    b = home(tmp_path, "b")
    want = float32_greedy(model_file, process_cluster.cache / "meshnet")
    process_cluster.start_node("a", str(model_file), "0-2", None, *EXACT)
    assert wait_for(lambda: _listed(process_cluster, "a"), 120, 0.2), process_cluster.logs()
    process_cluster.start_node("b", MODEL, None, None, *EXACT, "--memory", f"{memory:.9f}", env=b)
    assert wait_for(lambda: len(_node_ids(process_cluster)) == 2, 180, 0.2), process_cluster.logs()
    (b_id,) = _node_ids(process_cluster) - {"a"}
    status = process_cluster.wait_nodes(["a", b_id], MODEL)
    assert {n["id"]: n["layers"] for n in status["nodes"]} == {"a": [0, 2], b_id: [3, 5]}, status["nodes"]
    (fetch,) = status["fetches"]
    assert b_id.startswith("node-") and fetch["node"] == b_id and fetch["state"] == "done", fetch
    assert [e["node"] for e in status["events"] if e.get("code") == "fetched"] == [b_id], status["events"]
    with process_cluster.client() as client:
        events = list(client.generate(MODEL, prompt=RAW_PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [t for e in events for t in e.token_ids] == want, process_cluster.logs()
    (copy,) = peer_copies(b)
    assert copy.name.endswith(".layers-3-5.gguf") and copy.stat().st_size < 0.7 * model_file.stat().st_size


def _node_ids(cluster) -> set[str]:
    try:
        with cluster.client() as c:
            c.timeout = 2
            return {n["id"] for n in c.status()["nodes"]}
    except Exception:  # noqa: BLE001 -- the tracker is still starting
        return set()


def _listed(cluster, name: str) -> bool:
    return name in _node_ids(cluster)


def ask(endpoint: str, message: p.Message) -> tuple[p.Message, list[bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        sock.send_multipart(p.encode(message))
        assert sock.poll(30_000), "no answer"
        msg, buffers = p.decode(sock.recv_multipart())
        return msg, [bytes(b) for b in buffers]
    finally:
        sock.close()


def test_a_request_outside_the_file_gets_an_error_and_the_node_serves_on(process_cluster, model_file):
    endpoint = process_cluster.start_node("a", str(model_file), "0-5", None, *EXACT)
    assert wait_for(lambda: _listed(process_cluster, "a"), 120, 0.2), process_cluster.logs()
    digest = manifest_for(model_file).digest
    embed = manifest_for(model_file).find("token_embd.weight")
    for request, match in ((p.ChunkRequest(digest, "token_embd.weight", embed.nbytes - 10, 100), "outside"),
                           (p.ChunkRequest(digest, "no.such.tensor", 0, 10), "does not hold"),
                           (p.ChunkRequest("b" * 64, "token_embd.weight", 0, 10), "manifest")):
        answer, _ = ask(endpoint, request)
        assert isinstance(answer, p.Error) and answer.code == p.ErrorCode.BAD_REQUEST, answer
        assert match in answer.message
    answer, (data,) = ask(endpoint, p.ChunkRequest(digest, "token_embd.weight", embed.nbytes - 10, 10, ref=7))
    assert isinstance(answer, p.Chunk) and answer.ref == 7
    with open(model_file, "rb") as f:
        f.seek(read_header(model_file).find("token_embd.weight").offset + embed.nbytes - 10)
        assert data == f.read(10)


def test_one_chunk_request_takes_several_whole_tensors_and_each_part_is_checked(process_cluster, model_file):
    endpoint = process_cluster.start_node("a", str(model_file), "0-5", None, *EXACT)
    assert wait_for(lambda: _listed(process_cluster, "a"), 120, 0.2), process_cluster.logs()
    manifest, header = manifest_for(model_file), read_header(model_file)
    more = ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "blk.1.attn_q.weight")
    answer, data = ask(endpoint, p.ChunkRequest(manifest.digest, "blk.0.attn_k.weight", 4, 8, ref=3, more=more))
    assert isinstance(answer, p.Chunk) and (answer.ref, answer.name, answer.offset) == (3, "blk.0.attn_k.weight", 4)
    with open(model_file, "rb") as f:
        def read(name: str, at: int = 0, n: int | None = None) -> bytes:
            f.seek(header.find(name).offset + at)
            return f.read(manifest.find(name).nbytes if n is None else n)
        assert data == [read("blk.0.attn_k.weight", 4, 8), *(read(name) for name in more)]
    answer, _ = ask(endpoint, p.ChunkRequest(manifest.digest, "blk.0.attn_k.weight", 0, 8, more=("no.such",)))
    assert isinstance(answer, p.Error) and answer.code == p.ErrorCode.BAD_REQUEST, answer
    assert "does not hold tensor 'no.such'" in answer.message


def test_a_sharing_node_shares_its_cap_among_its_askers_by_bytes_and_bounds_each(model_file):
    """The askers share the cap by bytes: a fetch that asks while another's window waits hears
    its first answer after one of the other's chunks (behind a cap of 20 Mbps, 16 chunks of 4
    MiB are 27 s: it would give the node up as silent), and an asker of small chunks gets as
    many bytes as one of large chunks. One asker holds at most MAX_WAITING_EACH places of the
    queue; another still gets in."""
    from fabric.node import share as sh

    share = WeightShare(resolve(str(model_file)), MODEL, "a", LAYERS, 0, None)
    try:
        def ask(identity: bytes, ref: int) -> p.Error | None:
            return share.request(identity, p.ChunkRequest(share.manifest.digest, "blk.1.attn_q.weight", 0, 64, ref))
        assert all(ask(b"a", ref) is None for ref in range(1, 6))
        assert all(ask(b"b", ref) is None for ref in (1, 2))
        sent = []
        assert share.pump(0.0, lambda identity, msg, data: sent.append((identity, msg.ref))) == 7 * 64
        assert sent == [(b"a", 1), (b"b", 1), (b"a", 2), (b"b", 2), (b"a", 3), (b"a", 4), (b"a", 5)]
        assert share.wait(0.0) is None and not share.waiting
        big = p.ChunkRequest(share.manifest.digest, "blk.1.attn_q.weight", 0, 256, 1)
        assert share.request(b"a", big) is None and share.request(b"a", big) is None
        assert all(ask(b"b", ref) is None for ref in range(1, 9))  # shared by bytes: four of b's to one of a's
        sent.clear()
        share.pump(0.0, lambda identity, msg, data: sent.append(identity))
        assert sent == [b"a"] + [b"b"] * 4 + [b"a"] + [b"b"] * 4, sent
        assert all(ask(b"a", ref) is None for ref in range(sh.MAX_WAITING_EACH))
        busy = ask(b"a", 99)
        assert isinstance(busy, p.Error) and busy.code == p.ErrorCode.BUSY, busy
        assert ask(b"b", 1) is None and share.queued == sh.MAX_WAITING_EACH + 1
    finally:
        share.close()


def test_the_parts_of_one_chunk_request_are_bounded_in_all(model_file, monkeypatch):
    share = WeightShare(resolve(str(model_file)), MODEL, "a", LAYERS, 0, None)
    try:
        q = manifest_for(model_file).find("blk.1.attn_q.weight").nbytes
        monkeypatch.setattr(p, "MAX_CHUNK_BYTES", 3 * q)  # this small file's tensors all fit in 4 MiB together
        ask_for = lambda *more: p.ChunkRequest(share.manifest.digest, "blk.1.attn_q.weight", 0, q, more=more)
        assert share.request(b"x", ask_for("blk.2.attn_q.weight", "blk.3.attn_q.weight")) is None
        refusal = share.request(b"x", ask_for("blk.2.attn_q.weight", "blk.3.attn_q.weight", "blk.0.attn_norm.weight"))
        assert isinstance(refusal, p.Error) and "more than" in refusal.message
        sent = []
        assert share.pump(0.0, lambda identity, msg, data: sent.append((msg, [bytes(d) for d in data]))) == 3 * q
        assert [len(d) for d in sent[0][1]] == [q] * 3
    finally:
        share.close()


def test_a_peer_that_sends_bad_bytes_is_named_and_the_fetch_finishes_from_another(process_cluster, model_file,
                                                                                   tmp_path):
    # the honest peer at 8 Mbps: the corrupt one's items are done (and judged) long before the
    # honest one has nothing left and could take them over (fabric.fetch.fetcher.Fetcher._take_over)
    process_cluster.start_node("honest", str(model_file), "0-5", None, *EXACT, "--share-mbps", "8")
    process_cluster.start_node("corrupt", str(model_file), "0-5", None, *EXACT,
                               entry=(str(ROOT / "tests" / "corrupt_share_node.py"),))
    assert wait_for(lambda: _listed(process_cluster, "honest") and _listed(process_cluster, "corrupt"), 120, 0.2)
    b = home(tmp_path, "b")
    done = pull(process_cluster, b)
    assert done.returncode == 0, done.stderr
    assert re.search(r"leaving out peer corrupt .*it sent bad bytes", done.stderr), done.stderr
    assert "leaving out peer honest" not in done.stderr
    (copy,) = peer_copies(b)
    assert manifest_for(copy).digest == manifest_for(model_file).digest
    part = PartialFile(copy, layout(manifest_for(model_file), Shard(3, 5, LAYERS), MODEL))
    part.fd = os.open(copy, os.O_RDONLY)
    assert all(part.verify(s) for s in part.plan.slots)
    part.close()
    with process_cluster.client() as client:  # the tracker heard it: status and the events name the bad peer
        status = client.status()
    (fetch,) = status["fetches"]
    assert fetch["bad_peers"] == ["corrupt"] and fetch["state"] == "done" and fetch["done"] == fetch["total"], fetch
    rows = {n["id"]: n for n in status["nodes"]}
    assert rows["corrupt"].get("bad_bytes") == 1 and "bad_bytes" not in rows["honest"], rows
    events = [e for e in status["events"] if e["kind"] == "fetch"]
    assert [(e["code"], e["node"]) for e in events] == [("bad_bytes", "corrupt"), ("fetched", "")], events
    shown = subprocess.run([sys.executable, "-m", "fabric.cli", "status", "--tracker", process_cluster.endpoint],
                           capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    assert re.search(r"^corrupt .* SENT BAD BYTES to 1 fetch", shown, re.M), shown
    assert re.search(r"fetched layers 3-5: .* MiB; bad bytes from corrupt \(left out\)", shown), shown


def pull_from_a_slow_holder(cluster, model_file: Path, tmp_path: Path, **popen) -> tuple[subprocess.Popen, dict, Path]:
    """A `meshnet pull` of layers 3-5 running on machine b from the one holder, at 1 Mbps, as at a
    terminal (a SIGINT is a Ctrl-C): (the process, b's environment, b's directory of peer copies)."""
    cluster.start_node("slow", str(model_file), "0-5", None, *EXACT, "--share-mbps", "1")
    assert wait_for(lambda: _listed(cluster, "slow"), 120, 0.2), cluster.logs()
    b = home(tmp_path, "b")
    running = subprocess.Popen([*cli(interruptible=True), "pull", MODEL, "--layers", "3-5", "--tracker",
                                cluster.endpoint, "--no-progress"], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT), **b}, **popen)
    return running, b, Path(b["XDG_CACHE_HOME"]) / "meshnet" / "models" / "peers"


def test_an_interrupted_fetch_resumes_without_fetching_again_what_it_verified(process_cluster, model_file,
                                                                             tmp_path):
    first, b, peers = pull_from_a_slow_holder(process_cluster, model_file, tmp_path, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)

    def journal() -> Path | None:
        return next(iter(peers.glob("*.part.done")), None)
    assert wait_for(lambda: journal() is not None and len(journal().read_text().split()) >= 4, 60, 0.05)
    def fetching() -> dict | None:  # the fetch shows in status as it goes (reported each second): bytes done of total
        with process_cluster.client() as client:
            rows = client.status()["fetches"]
        return rows[0] if rows and rows[0]["done"] > 0 else None
    assert wait_for(fetching, 30, 0.2), process_cluster.logs()
    fetch = fetching()
    assert fetch["state"] == "fetching" and 0 < fetch["done"] < fetch["total"] and fetch["layers"] == [3, 5], fetch
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    kept = len(journal().read_text().split())
    again = pull(process_cluster, b)
    assert again.returncode == 0, again.stderr
    have = int(re.search(r"\(([\d,]+) bytes verified here already\)", again.stdout).group(1).replace(",", ""))
    total = sum(s.nbytes for s in layout(manifest_for(model_file), Shard(3, 5, LAYERS), MODEL).slots)
    fetched = int(re.search(r"; ([\d,]+) bytes from peers in this run", again.stdout).group(1).replace(",", ""))
    assert kept >= 4 and have > 0 and fetched == total - have, again.stdout
    (copy,) = peer_copies(b)
    assert manifest_for(copy).digest == manifest_for(model_file).digest


def test_a_peer_behind_a_low_cap_is_asked_for_chunks_it_sends_in_time_and_serves_the_whole_fetch(
        process_cluster, model_file, tmp_path, monkeypatch):
    """A peer whose cap needs longer than CHUNK_TIMEOUT for a full request (here 2 s, and a
    request of up to 4 MiB at 3 Mbps takes 11) is asked for what it sends in a fraction of it,
    at the rate measured from its answers, and is never left out as silent: it serves the whole
    fetch. (It was left out, with its first request of ~1 MB, 3 s, and the fetch failed.)"""
    from fabric.fetch import fetcher as fm
    from fabric.fetch.pull import fetch_layers

    process_cluster.start_node("capped", str(model_file), "0-5", None, *EXACT, "--share-mbps", "3")
    assert wait_for(lambda: _listed(process_cluster, "capped"), 120, 0.2), process_cluster.logs()
    monkeypatch.setattr(fm, "CHUNK_TIMEOUT", 2.0)
    asked, room = [], fm.Peer.room
    monkeypatch.setattr(fm.Peer, "room", lambda peer, now: asked.append(room(peer, now)) or asked[-1])
    path = fetch_layers(MODEL, "3-5", process_cluster.endpoint, None, tmp_path / "b", progress=False,
                        say=lambda _: None)
    assert manifest_for(path).digest == manifest_for(model_file).digest
    cap = 3 * 125_000 * fm.CHUNK_TIMEOUT  # bytes the cap lets through in CHUNK_TIMEOUT
    assert asked[0] == fm.FIRST_CHUNK and max(asked) < cap / 2 and len(set(asked)) > 1, asked


def test_a_fetch_from_a_fast_and_a_slow_peer_ends_at_the_fast_ones_pace(process_cluster, model_file, tmp_path,
                                                                          monkeypatch):
    """The slow peer (0.1 Mbps: a second chunk waits 5 s behind its first) is asked for its first
    items as the fast one is; once the fast one has nothing else to fetch, it takes those items
    over and fetches them whole, and the fetch ends without waiting for the slow one (which
    would take some 80 s for the 16 requests asked of it)."""
    from fabric.fetch import fetcher as fm
    from fabric.fetch.pull import fetch_layers

    process_cluster.start_node("fast", str(model_file), "0-5", None, *EXACT, "--share-mbps", "0")
    process_cluster.start_node("slow", str(model_file), "0-5", None, *EXACT, "--share-mbps", "0.1")
    assert wait_for(lambda: _listed(process_cluster, "fast") and _listed(process_cluster, "slow"), 120, 0.2), \
        process_cluster.logs()
    sent, close = {}, fm.Fetcher.close

    def closing(fetcher):
        sent.update({peer.name: peer.bytes for peer in fetcher.peers})
        close(fetcher)
    monkeypatch.setattr(fm.Fetcher, "close", closing)
    path = fetch_layers(MODEL, "3-5", process_cluster.endpoint, None, tmp_path / "b", progress=False,
                        say=lambda _: None)
    assert manifest_for(path).digest == manifest_for(model_file).digest
    total = sum(s.nbytes for s in layout(manifest_for(model_file), Shard(3, 5, LAYERS), MODEL).slots)
    assert set(sent) == {"fast", "slow"} and sent["slow"] <= 2 * fm.FIRST_CHUNK, sent
    assert sent["fast"] + sent["slow"] >= total, sent


def test_two_fetches_from_one_capped_peer_both_finish_when_the_second_starts_behind_the_first(
        process_cluster, model_file, tmp_path, monkeypatch):
    """The second fetch asks while the first's window of requests waits behind the cap (3 Mbps,
    CHUNK_TIMEOUT 2 s here: the first's queue holds some 4 s). The node shares its cap by bytes, so
    the second hears its first answer after one of the first's chunks, and neither gives the
    node up as silent."""
    import threading
    import time

    from fabric.fetch import fetcher as fm
    from fabric.fetch.pull import fetch_layers

    process_cluster.start_node("capped", str(model_file), "0-5", None, *EXACT, "--share-mbps", "3")
    assert wait_for(lambda: _listed(process_cluster, "capped"), 120, 0.2), process_cluster.logs()
    monkeypatch.setattr(fm, "CHUNK_TIMEOUT", 2.0)
    done: dict[str, object] = {}

    def fetch(name: str) -> None:
        try:
            done[name] = fetch_layers(MODEL, "3-5", process_cluster.endpoint, None, tmp_path / name, progress=False,
                                      say=lambda _: None)
        except Exception as exc:  # noqa: BLE001 -- the assertion names it
            done[name] = exc
    first = threading.Thread(target=fetch, args=("first",))
    first.start()
    time.sleep(0.5)  # the first's requests, sized to the cap by now, wait at the node
    fetch("second")
    first.join(60)
    digest = manifest_for(model_file).digest
    assert all(isinstance(path, Path) and manifest_for(path).digest == digest for path in done.values()), done
    assert set(done) == {"first", "second"}


def test_a_peers_rate_sizes_its_requests_between_the_least_and_a_whole_chunk():
    """The rule itself: what a peer delivers in CHUNK_TIMEOUT / PACE, measured over its answers
    (a burst of answers read at once counts the time the peer worked on them, not the burst)."""
    from fabric.fetch import fetcher as fm
    from fabric.fetch.holders import Holder

    peer = fm.Peer(Holder("a", "tcp://x", "", "", (0, 1)), None)
    assert peer.room(peer.since) == fm.FIRST_CHUNK
    rooms = []
    while peer.room(peer.since) < fm.CHUNK_BYTES:  # loopback: the whole chunk, once twice the bytes answered allow
        rooms.append(peer.room(peer.since))
        peer.answered(rooms[-1], peer.since + 0.001)
    assert rooms[0] == fm.FIRST_CHUNK and all(r == 2 * sum(rooms[:n]) for n, r in enumerate(rooms[1:], 1)), rooms
    assert len(rooms) == 5, rooms
    for _ in range(100):  # 100 KB a second
        peer.answered(100_000, peer.since + 1.0)
    assert peer.room(peer.since) == pytest.approx(100_000 * fm.CHUNK_TIMEOUT / fm.PACE, rel=0.01)
    for _ in range(100):  # answers read two at once, after 0.1 s more of work each time
        peer.answered(100_000, peer.since + 0.1)
        peer.answered(100_000, peer.since)
    assert peer.room(peer.since) == pytest.approx(2_000_000 * fm.CHUNK_TIMEOUT / fm.PACE, rel=0.02)
    for _ in range(40):  # a peer that crawls: the least
        peer.answered(1_000, peer.since + 1.0)
    assert peer.room(peer.since) == fm.MIN_CHUNK


def test_ctrl_c_stops_a_pull_which_says_how_to_resume_and_the_tracker_hears_the_fetch_ended(process_cluster,
                                                                                         model_file, tmp_path):
    """Ctrl-C during `meshnet pull`: status 130 and a line saying that the same command fetches
    only the rest; the items verified stay; the tracker hears the fetch ended (its last report,
    which the reporter's thread sends as the process ends)."""
    running, _, peers = pull_from_a_slow_holder(process_cluster, model_file, tmp_path, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True)

    def verified() -> int:  # items the .part's journal names as verified
        journal = next(iter(peers.glob("*.part.done")), None)
        return 0 if journal is None else len(journal.read_text().split())
    # at 1 Mbps a request asks for what the node sends in 1.9 s (fabric.fetch.fetcher.Peer.room), so
    # items verify one by one through the fetch's 15 s, and the interrupt finds it mid-way
    assert wait_for(lambda: verified() >= 2, 60, 0.02), process_cluster.logs()
    running.send_signal(signal.SIGINT)
    out, err = running.communicate(timeout=60)
    assert running.returncode == 130, (out, err)
    assert "interrupted: the layers verified so far stay in" in err and "fetches only the rest" in err, err
    assert verified() >= 2
    with process_cluster.client() as client:
        (fetch,) = client.status()["fetches"]
    assert fetch["state"] == "failed" and fetch["error"] == "KeyboardInterrupt", fetch
    assert 0 < fetch["done"] < fetch["total"], fetch


def test_a_fetch_faster_than_its_disk_holds_a_bounded_backlog_in_memory(process_cluster, model_file, tmp_path,
                                                                        monkeypatch):
    """Bytes received wait for the store's threads to hash and write them; where those are slower
    than the network, the fetch stops asking for chunks once BACKLOG bytes wait, instead of
    holding the difference in memory. On top of the bound: the answers in flight, and the chunk
    being handed over when the last request went (a request goes before its answer is stored)."""
    import time

    from fabric.fetch import fetcher as fm
    from fabric.fetch import store as st
    from fabric.fetch.pull import fetch_layers

    process_cluster.start_node("a", str(model_file), "0-5", None, *EXACT)
    assert wait_for(lambda: _listed(process_cluster, "a"), 120, 0.2), process_cluster.logs()
    monkeypatch.setattr(fm, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(fm, "WINDOW", 4)
    monkeypatch.setattr(st, "BACKLOG", 64 << 10)
    waiting, put, store = [], st.Store.put, st.Item.store

    def counted(self, item, offset, data):
        put(self, item, offset, data)
        waiting.append(self.backlog())

    def slow(self, part, offset, data):  # a disk slower than loopback
        time.sleep(0.002)
        store(self, part, offset, data)
    monkeypatch.setattr(st.Store, "put", counted)
    monkeypatch.setattr(st.Item, "store", slow)
    path = fetch_layers(MODEL, "3-5", process_cluster.endpoint, None, tmp_path / "b", progress=False,
                        say=lambda _: None)
    assert manifest_for(path).digest == manifest_for(model_file).digest
    total = sum(s.nbytes for s in layout(manifest_for(model_file), Shard(3, 5, LAYERS), MODEL).slots)
    bound = st.BACKLOG + (fm.WINDOW + 1) * fm.CHUNK_BYTES
    assert total > 10 * bound
    assert 0 < max(waiting) <= bound, max(waiting)


def test_in_a_secured_swarm_the_fetch_travels_under_curve_and_a_stranger_gets_nothing(process_cluster, model_file,
                                                                                       tmp_path):
    process_cluster.secure()
    process_cluster.start_node("a", str(model_file), "0-5", None, *EXACT)
    assert wait_for(lambda: _listed(process_cluster, "a"), 120, 0.2), process_cluster.logs()
    b = home(tmp_path, "b")
    done = pull(process_cluster, b, "--keys", str(process_cluster.keys))
    assert done.returncode == 0, done.stderr
    (copy,) = peer_copies(b)
    assert manifest_for(copy).digest == manifest_for(model_file).digest
    plain = pull(process_cluster, home(tmp_path, "stranger"), timeout=60)  # no keys: the tracker does not answer
    assert plain.returncode == 1 and "cannot ask the tracker" in plain.stderr, plain.stderr


def test_a_fetch_asks_the_tracker_again_while_it_lists_no_holder_then_names_what_it_lists(monkeypatch):
    """A holder that missed heartbeats on a busy machine (expired, registered again) or that starts
    beside this node is found; with none after HOLDERS_WAIT, one line names what the tracker lists."""
    from fabric.fetch import pull
    from fabric.fetch.holders import NoHolders

    holder = {"id": "a", "model": MODEL, "endpoint": "tcp://10.0.0.1:6000", "layers": [0, 14]}
    answers = [{"nodes": []}, {"nodes": [{"model": "other", "endpoint": "tcp://x:1"}]}, {"nodes": [holder]}]
    monkeypatch.setattr(pull, "_status", lambda *args: answers.pop(0))
    monkeypatch.setattr(pull, "HOLDERS_POLL", 0.0)
    said = []
    assert [h.node for h in pull._holders(MODEL, "tcp://t:5555", None, said.append)] == ["a"] and not answers
    assert len(said) == 1 and "no node serves tiny yet" in said[0]

    now = [0.0]
    monkeypatch.setattr(pull, "_status", lambda *args: {"nodes": [{"model": "other", "endpoint": "tcp://x:1"}]})
    monkeypatch.setattr(pull.time, "sleep", lambda s: now.__setitem__(0, now[0] + 1.0))
    with pytest.raises(NoHolders, match=r"no node serves tiny \(the tracker at tcp://t:5555 lists: other\)"):
        pull._holders(MODEL, "tcp://t:5555", None, said.append, clock=lambda: now[0])
    assert now[0] == pull.HOLDERS_WAIT  # it asked for the whole wait, no longer
