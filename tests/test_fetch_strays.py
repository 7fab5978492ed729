"""A peer that answers a fetch's chunk requests with anything but chunks is left out as silent:
only an answer to what was asked shows a peer at work."""
from __future__ import annotations

import threading
import time

import zmq

import fabric.fetch.fetcher as fm
from fabric.compute.gguf_manifest import compute_manifest, fingerprint_of
from fabric.fetch.holders import FetchError, Holder
from fabric.wire import protocol as p
from tests.gguf_models import write_gguf

MODEL = "tiny"


def stray_peer(sock: zmq.Socket, manifest, stop: threading.Event) -> None:
    """Answers a MANIFEST_REQUEST as an honest holder of the whole file does; then sends its
    asker a PONG four times a second, whatever it asks, and never a chunk."""
    canonical, asker = manifest.canonical(), None
    while not stop.is_set():
        if sock.poll(250):
            identity, *body = sock.recv_multipart()
            msg, _ = p.decode(body)
            if isinstance(msg, p.ManifestRequest):
                answer = p.Manifest(MODEL, manifest.digest, 0, manifest.num_layers - 1, node="stray",
                                    tensors=(p.TensorSpec("uint8", (len(canonical),)),))
                sock.send_multipart([identity, *p.encode(answer, [canonical])])
            asker = identity
        if asker is not None:
            sock.send_multipart([asker, *p.encode(p.Pong(1, node="stray"))])


def test_a_peer_that_answers_chunk_requests_with_strays_is_left_out_as_silent(tmp_path, monkeypatch):
    monkeypatch.setattr(fm, "CHUNK_TIMEOUT", 1.5)
    source = write_gguf("llama", tmp_path / "holder", "Q8_0", num_layers=4, name=f"{MODEL}.gguf")
    manifest = compute_manifest(source)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    server = threading.Thread(target=stray_peer, args=(sock, manifest, stop), daemon=True)
    server.start()
    holder = Holder("stray", f"tcp://127.0.0.1:{port}", "", fingerprint_of(manifest.digest), (0, 3))
    fetcher = fm.Fetcher(MODEL, [holder], None)
    outcome: list = []

    def fetch() -> None:
        try:
            got = fetcher.manifests()
            shard, plan = fm.fetch_plan(got, "2-3", MODEL)
            fetcher.start(tmp_path / "copy.gguf", plan, shard, got)
            outcome.append(fetcher.run())
        except FetchError as exc:
            outcome.append(exc)

    try:
        began = time.monotonic()
        runner = threading.Thread(target=fetch, daemon=True)
        runner.start()
        runner.join(20)
        assert not runner.is_alive(), "the fetch still waits on a peer that sends only strays"
        (error,) = outcome
        assert isinstance(error, FetchError), error
        assert "stray: it answered none of" in str(error), error
        assert time.monotonic() - began < 10  # CHUNK_TIMEOUT and the set-up, not 20 s of strays
    finally:
        stop.set()
        server.join(5)
        fetcher.close()
        sock.close()

