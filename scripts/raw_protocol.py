# raw_protocol.py: ROUTE_REQUEST -> GENERATE -> EVENTs -> CANCEL with pyzmq + msgpack only
#
#   python3 scripts/raw_protocol.py TRACKER MODEL [PROMPT] [--cancel-after N] [--keys DIR]
#
# Asks the tracker for a route, sends GENERATE to the route's head, prints the EVENTs as
# they stream back and, after N tokens, sends CANCEL: the head ends the request with
# EVENT(done, finish_reason="cancelled") and frees the session on every hop.
import argparse
import sys
import uuid

import msgpack
import zmq
import zmq.auth

MAGIC = b"MESH1"
CANCEL, ERROR, GENERATE, EVENT, ROUTE_REQUEST, ROUTE = 4, 6, 10, 11, 22, 23


def send(sock, kind, header):
    """[magic] [kind: 1 byte] [header: msgpack map]; a DEALER sends no envelope."""
    sock.send_multipart([MAGIC, bytes([kind]), msgpack.packb(header)])


def receive(sock, expected, timeout_s):
    """The header of the next message, which must be of kind ``expected``."""
    if not sock.poll(timeout_s * 1000):
        sys.exit("no answer")
    magic, kind, header, *_buffers = sock.recv_multipart()
    if magic != MAGIC:
        sys.exit(f"the peer speaks {magic!r}, this script speaks {MAGIC!r}")
    reply = msgpack.unpackb(header)
    if kind[0] == ERROR:
        sys.exit(f"error {reply['code']}: {reply['message']}")
    if kind[0] != expected:
        sys.exit(f"unexpected reply kind {kind[0]}")
    return reply


def dealer(endpoint, keys=None, server_key=""):
    """A DEALER to ``endpoint``; in a secured swarm a CURVE client of ``server_key``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys:  # the key pair `meshnet keys DIR` made
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(f"{keys}/id.key_secret")
        sock.curve_serverkey = server_key.encode()
    sock.connect(endpoint)
    return sock


def main():
    parser = argparse.ArgumentParser(description="stream a generation, then cancel it")
    parser.add_argument("tracker", help="the tracker's endpoint, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("model", help="a model id the nodes serve, e.g. smollm2-135m")
    parser.add_argument("prompt", nargs="?", default="Tell me a long story about a lighthouse.")
    parser.add_argument("--cancel-after", type=int, default=4, help="tokens to read before CANCEL")
    parser.add_argument("--keys", help="a key directory, in a secured swarm")
    args = parser.parse_args()
    tracker_key = ""
    if args.keys:
        tracker_key = zmq.auth.load_certificate(f"{args.keys}/allowed/tracker.key")[0].decode()

    # 1. ROUTE_REQUEST -> ROUTE: the best route, hops that cover every layer
    tracker = dealer(args.tracker, args.keys, tracker_key)
    send(tracker, ROUTE_REQUEST, {"model": args.model, "exclude": []})
    hops = receive(tracker, ROUTE, 5)["hops"]
    tracker.close()
    print("route:", " -> ".join(f"{h['node']}[{h['start_layer']}-{h['end_layer']}]" for h in hops))

    # 2. GENERATE to the head, hops[0]; fields left out take their defaults
    head = dealer(hops[0]["endpoint"], args.keys, hops[0]["key"])
    request_id = uuid.uuid4().hex
    send(head, GENERATE, {"request_id": request_id, "route": hops, "max_tokens": 256,
                          "messages": [{"role": "user", "content": args.prompt}],
                          "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}})  # greedy

    # 3. EVENTs: start, one token each, then done or error; 4. CANCEL after a few tokens
    tokens = 0
    while True:
        event = receive(head, EVENT, 60)
        if event["event"] == "token":
            tokens += 1
            print(f"token {event['token_ids']} {event['text']!r}", flush=True)
            if tokens == args.cancel_after:
                send(head, CANCEL, {"session": request_id, "route": []})
                print("sent CANCEL", flush=True)
            continue
        print(event["event"], f"finish_reason={event['finish_reason']}", f"error_code={event['error_code']}",
              f"prompt_tokens={event['prompt_tokens']}", f"completion_tokens={event['completion_tokens']}")
        if event["event"] in ("done", "error"):
            break
    head.close()


if __name__ == "__main__":
    main()
