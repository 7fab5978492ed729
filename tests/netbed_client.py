"""The client end of a test-bed host: a process that drives the fabric from inside a namespace.

``tests/netbed.py`` starts it with ``ip netns exec NS python3 -m tests.netbed_client
--tracker ENDPOINT`` so that the test's own requests travel the bed's links like any
other host's. It reads one JSON request per line on stdin and answers JSON lines on
stdout, each tagged with the request's ``id``:

    {"id", "op": "status"}                           -> {"id", "ok", "status"}
    {"id", "op": "generate", "model", "messages"
     (or "prompt"), "max_tokens", "ignore_eos"?}     -> one {"id", "event", "ids", "text",
                                                        "route", "finish_reason", "t"} per
                                                        event, then {"id", "ok", "end"}
    {"id", "op": "ping", "endpoint", "count"}        -> {"id", "ok", "rtts": [seconds...]}
    {"id", "op": "http", "method", "url", "body"}    -> {"id", "ok", "status", "body"}

Any request may carry ``"timeout"``: seconds to wait for the tracker or the head's next
event (default ``--timeout``). A failure answers ``{"id", "ok": false, "error": "..."}``. ``t`` is time.monotonic() in
this process when the event arrived. End of stdin ends the process.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

import zmq

from fabric import Client
from fabric.wire import protocol as p


def _emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def generate(client: Client, rid, req: dict) -> None:
    text = {"prompt": req["prompt"]} if req.get("prompt") is not None else {"messages": req["messages"]}
    for e in client.generate(req["model"], **text, max_tokens=req["max_tokens"],
                             ignore_eos=bool(req.get("ignore_eos"))):
        _emit(id=rid, event=e.event, ids=list(e.token_ids), text=e.text, finish_reason=e.finish_reason,
              route=[{"node": h.node, "endpoint": h.endpoint, "start_layer": h.start_layer,
                      "end_layer": h.end_layer} for h in e.route], t=time.monotonic())
    _emit(id=rid, ok=True, end=True)


def ping(endpoint: str, count: int, timeout: float = 5.0) -> list[float]:
    """Round trips of PING/PONG to a node over one DEALER (the first one also connects)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    rtts = []
    try:
        for nonce in range(count + 1):
            start = time.monotonic()
            sock.send_multipart(p.encode(p.Ping(nonce)))
            if not sock.poll(timeout * 1000):
                raise TimeoutError(f"no PONG from {endpoint} in {timeout}s")
            sock.recv_multipart()
            if nonce:  # the first round trip includes the TCP and ZMTP handshakes
                rtts.append(time.monotonic() - start)
    finally:
        sock.close()
    return rtts


def http(method: str, url: str, body, timeout: float) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def handle(client: Client, req: dict, timeout: float) -> None:
    rid = req.get("id")
    client.timeout = req.get("timeout", timeout)
    try:
        match req["op"]:
            case "status":
                _emit(id=rid, ok=True, status=client.status())
            case "generate":
                generate(client, rid, req)
            case "ping":
                _emit(id=rid, ok=True, rtts=ping(req["endpoint"], req.get("count", 1)))
            case "http":
                status, body = http(req.get("method", "GET"), req["url"], req.get("body"), client.timeout)
                _emit(id=rid, ok=True, status=status, body=body)
            case op:
                _emit(id=rid, ok=False, error=f"unknown op {op!r}")
    except Exception as exc:  # reported to the test, which decides
        _emit(id=rid, ok=False, error=f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netbed_client")
    parser.add_argument("--tracker", required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the tracker or the head")
    args = parser.parse_args(argv)
    with Client(args.tracker, timeout=args.timeout) as client:
        for line in sys.stdin:
            if line.strip():
                handle(client, json.loads(line), args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
