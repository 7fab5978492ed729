"""Usage ledger: idempotent per request id, billing guard, restart survival."""
from __future__ import annotations

import pytest

from fabric.wire.protocol import Hop, ProtocolError, Report
from tracker.ledger import (
    BILLED,
    HELD,
    VOID,
    Ledger,
    billing_verdict,
    default_ledger_path,
    key_id,
)

ONE = (Hop("full", "tcp://f:1", 0, 39),)
TWO = (Hop("gpu", "tcp://g:1", 0, 21), Hop("cpu", "tcp://c:1", 22, 39))


def report(rid: str = "r1", out: int = 50, route=TWO, reason: str | None = "stop",
           key: str | None = "sk-alice", max_tokens: int = 256, prompt: int = 12, ref: str = "",
           resumed: int = 0) -> Report:
    return Report(request_id=rid, node_id=route[0].node if route else "head", model="m",
                  route=route, prompt_tokens=prompt, completion_tokens=out, elapsed=2.0,
                  final=True, finish_reason=reason, api_key=key, max_tokens=max_tokens, ref=ref, resumed=resumed)


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        yield led


def test_a_resent_report_never_bills_twice(ledger):
    entry, new = ledger.record(report())
    assert new and entry.status == BILLED
    again, new = ledger.record(report(out=999))  # a retry, even with different numbers
    assert not new and again == entry
    assert ledger.usage_by_key() == {key_id("sk-alice"): {
        "requests": 1, "prompt_tokens": 12, "completion_tokens": 50}}
    assert ledger.totals()[BILLED]["requests"] == 1


def test_a_request_that_failed_at_one_head_and_ended_at_another_is_billed_as_it_ended(ledger):
    ledger.record(report(out=17, reason="error", ref="a"))
    entry, new = ledger.record(report(out=40, reason="length", route=ONE, ref="b", resumed=17))  # it went on
    assert new and ledger.get("b") == entry and entry.completion_tokens == 40 and entry.head_node == "full"
    assert not ledger.record(report(out=40, reason="error", ref="a"))[1]  # each attempt is recorded once
    assert not ledger.record(report(out=41, reason="stop", ref="b"))[1]
    assert set(ledger.usage_by_node()) == {"full"} and ledger.usage_by_node()["full"]["completion_tokens"] == 40
    assert ledger.totals()[BILLED]["requests"] == 1


@pytest.mark.parametrize("continued_first", [False, True])
def test_a_request_cancelled_at_one_head_and_continued_at_another_is_billed_once(ledger, continued_first):
    """The first head's cancelled report (its client went on elsewhere) may come before or after
    the report of the head that continued: either way only the continuation bills."""
    first, going_on = report(out=9, reason="cancelled", ref="a"), report(out=30, route=ONE, ref="b", resumed=9)
    for r in ([going_on, first] if continued_first else [first, going_on]):
        ledger.record(r)
    assert ledger.get("a").status == VOID and ledger.get("b").status == BILLED
    assert ledger.usage_by_key()[key_id("sk-alice")]["completion_tokens"] == 30


def test_a_request_id_used_again_is_billed_again(ledger):
    """Rows are keyed by the id each head issues, not by the client's: a reused id bills each request."""
    assert ledger.record(report(ref="a"))[1] and ledger.record(report(out=20, ref="b"))[1]
    assert ledger.usage_by_key()[key_id("sk-alice")] == {"requests": 2, "prompt_tokens": 24, "completion_tokens": 70}
    # a fresh request under the same id, cancelled, is billed too: only a continuation voids it
    assert ledger.record(report(out=6, reason="cancelled", ref="c"))[0].status == BILLED


def test_a_ledger_of_the_first_schema_is_migrated(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    # the tables as version 1 wrote them
    db.executescript("""
        CREATE TABLE completions (request_id TEXT PRIMARY KEY, recorded_at REAL NOT NULL, model TEXT NOT NULL,
            head_node TEXT NOT NULL, api_key_id TEXT, prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL, max_tokens INTEGER NOT NULL, elapsed REAL NOT NULL,
            finish_reason TEXT, route TEXT NOT NULL, hops INTEGER NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL);
        CREATE TABLE served (request_id TEXT NOT NULL, node_id TEXT NOT NULL, start_layer INTEGER NOT NULL,
            end_layer INTEGER NOT NULL, PRIMARY KEY (request_id, node_id, start_layer));
        INSERT INTO completions VALUES ('old', 1.0, 'm', 'full', NULL, 3, 4, 8, 1.0, 'stop', '[]', 1, 'billed', '');
        INSERT INTO served VALUES ('old', 'full', 0, 39);
        PRAGMA user_version=1;""")
    db.close()
    with Ledger(path) as led:
        assert led.get("old").request_id == "old" and led.usage_by_node()["full"]["completion_tokens"] == 4
        assert led.record(report(ref="new"))[1]


def test_usage_per_key_and_per_serving_node(ledger):
    ledger.record(report("r1"))
    ledger.record(report("r2", out=10, route=ONE, key="sk-bob"))
    ledger.record(report("r3", out=5, route=ONE, key=None))
    by_key = ledger.usage_by_key()
    assert by_key[key_id("sk-bob")]["completion_tokens"] == 10
    assert by_key["anonymous"] == {"requests": 1, "prompt_tokens": 12, "completion_tokens": 5}
    assert ledger.usage_by_node() == {
        "cpu": {"requests": 1, "prompt_tokens": 12, "completion_tokens": 50},
        "gpu": {"requests": 1, "prompt_tokens": 12, "completion_tokens": 50},
        "full": {"requests": 2, "prompt_tokens": 24, "completion_tokens": 15},
    }


def test_api_keys_are_not_stored_in_clear(ledger, tmp_path):
    ledger.record(report(key="sk-very-secret"))
    ledger.close()
    assert b"sk-very-secret" not in b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert key_id(None) is None and key_id("x").startswith("sha256:")


@pytest.mark.parametrize("kwargs, status", [
    (dict(reason="error", out=40), VOID),  # errored: never billed
    (dict(reason="cancelled", out=0), VOID),  # cancelled before the first token
    (dict(reason="cancel", out=0, route=ONE), VOID),
    (dict(reason="cancelled", out=7), BILLED),  # cancelled after tokens: pay for them
    (dict(reason="stop", out=1), HELD),  # 1 token from a 2-hop route: a broken route?
    (dict(reason="stop", out=3), HELD),
    (dict(reason="stop", out=0), HELD),
    (dict(reason="stop", out=4), BILLED),
    (dict(reason="stop", out=1, route=ONE), BILLED),  # short answers are fine on one node
    (dict(reason="length", out=2, max_tokens=2), BILLED),  # the client asked for 2 tokens
    (dict(reason="length", out=2, max_tokens=0), BILLED),  # max_tokens unknown: trust length
    (dict(reason="length", out=2, max_tokens=100), HELD),  # "length" but not the client's cut
])
def test_billing_guard(ledger, kwargs, status):
    verdict = billing_verdict(report(**kwargs))
    assert verdict.status == status
    assert bool(verdict.reason) == (status != BILLED)
    entry, _ = ledger.record(report(**kwargs))
    assert (entry.status, entry.reason) == (verdict.status, verdict.reason)
    billed = ledger.usage_by_key()
    assert (key_id("sk-alice") in billed) == (status == BILLED)


def test_held_completions_are_listed_with_a_reason(ledger):
    ledger.record(report("r1", out=1))
    ledger.record(report("r2", out=50))
    (held,) = ledger.held()
    assert held.request_id == "r1" and "2-hop" in held.reason
    assert ledger.totals()[HELD] == {"requests": 1, "prompt_tokens": 12, "completion_tokens": 1}
    assert ledger.get("nope") is None


def test_the_ledger_survives_a_restart(tmp_path):
    path = tmp_path / "deep" / "dir" / "ledger.sqlite3"
    with Ledger(path) as led:
        led.record(report("r1"))
    with Ledger(path) as led:
        assert led.get("r1").status == BILLED
        assert led.record(report("r1"))[1] is False
        assert led.totals()[BILLED]["requests"] == 1


@pytest.mark.parametrize("bad", [
    dict(request_id=""), dict(completion_tokens=-1), dict(elapsed=-0.5),
    dict(route=(Hop("a", "tcp://a:1", 0, 9), Hop("b", "tcp://b:1", 0, 39))),  # b from its shard start
    dict(route=(Hop("a", "tcp://a:1", 5, 39),)),
])
def test_malformed_reports_are_refused(ledger, bad):
    fields = dict(request_id="r", node_id="n", model="m", final=True, finish_reason="stop")
    with pytest.raises(ProtocolError) as info:
        ledger.record(Report(**{**fields, **bad}))
    assert info.value.code == "bad_request"
    assert ledger.totals()[BILLED]["requests"] == 0


def test_default_path_honours_xdg_data_home(tmp_path):
    assert default_ledger_path({"XDG_DATA_HOME": "/x"}).as_posix() == "/x/meshnet/ledger.sqlite3"
    assert default_ledger_path({"HOME": "/home/u"}).as_posix() == \
        "/home/u/.local/share/meshnet/ledger.sqlite3"
