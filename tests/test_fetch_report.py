"""A fetch's reports to the tracker (fabric/fetch/report.py) go from a thread of their own: the
fetch never waits for the tracker, which is never in the data path."""
from __future__ import annotations

import zmq

from fabric.fetch.report import FetchReporter
from fabric.wire import protocol as p
from fabric.wire.shard import Shard


def test_a_fetch_never_waits_for_the_tracker_and_its_last_report_still_arrives():
    """Every report is made before the tracker answers any: none of the calls waits for it (the
    ACK of a report once took a round trip of the fetch's loop, and a tracker that sat on one
    cost the fetch REPORT_WAIT, then every later report). Reports not sent yet give way to the
    newest, which names the bad peer too; the last is sent after the fetch returned."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    reporter = FetchReporter(f"tcp://127.0.0.1:{port}", None, "tiny", node="b")
    try:
        reporter.begin(Shard(3, 5, 6), 100, 0)
        for done in (10, 20, 30, 40):
            reporter.progress(done, ["c"] if done >= 20 else [], force=True)
        reporter.end(100, ["c"])
        assert not reporter.silent
        got: list[p.FetchReport] = []
        while not (got and got[-1].final):
            assert router.poll(10_000), f"the last report never came ({len(got)} came)"
            identity, *frames = router.recv_multipart()
            got.append(p.decode(frames)[0])
            router.send_multipart([identity, *p.encode(p.Ack())])
        reporter.thread.join(10)
        assert not reporter.thread.is_alive()
    finally:
        router.close(linger=0)
    last = got[-1]
    assert (last.done, last.total, last.bad_peers, last.node, last.start_layer, last.end_layer) == (100, 100, ("c",), "b", 3, 5)
    assert {r.fetch for r in got} == {last.fetch}
    # the one the thread took first waited for its ACK; the five made meanwhile gave way to the last
    assert len(got) <= 2, [(r.done, r.final) for r in got]
