"""Both clients' ``generate`` takes OpenAI's sampling fields by name, against a real tracker
and nodes on loopback: seeded sampling repeats, ``top_k=1`` is greedy, stop strings end the
reply, and a wrong value is a FabricError naming the field before any socket is used."""
from __future__ import annotations


import pytest

from fabric import FabricError, HeadDied, Sampling
from fabric.client import core
from fabric.wire import protocol as p

MESSAGES = [{"role": "user", "content": "hello world, how are you today?"}]
TOKENS = 24


@pytest.fixture
def split(thread_cluster, tiny_models):
    """A tiny llama split over two nodes; yields (cluster, model id)."""
    model = tiny_models("llama")
    thread_cluster.add_node(model, 0, 2, 6, "head")
    thread_cluster.add_node(model, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model.name, 2)
    return thread_cluster, model.name


def run(client, model: str, **kw) -> tuple[list[int], str, str]:
    """Token ids, text and finish reason of one request."""
    events = list(client.generate(model, messages=MESSAGES, max_tokens=TOKENS, **kw))
    ids = [t for e in events if e.event == "token" for t in e.token_ids]
    text = "".join(e.text for e in events if e.event == "token")
    return ids, text, events[-1].finish_reason


def test_fabric_exports_what_a_script_needs():
    import fabric

    assert {"Client", "AsyncClient", "FabricError", "HeadDied", "Sampling"} <= set(fabric.__all__)
    assert issubclass(HeadDied, FabricError) and Sampling().temperature == 0.0


def test_seeded_sampling_repeats_and_top_k_1_is_greedy(split, shell):
    cluster, model = split
    with shell(cluster.endpoint, timeout=30) as client:
        greedy, _, _ = run(client, model)
        hot = dict(temperature=2.0, top_k=4, seed=7)
        first, _, _ = run(client, model, **hot)
        assert run(client, model, **hot)[0] == first
        assert first != greedy, "temperature 5 over 24 tokens should leave the greedy path"
        assert run(client, model, temperature=2.0, top_k=4, seed=8)[0] != first
        assert run(client, model, temperature=2.0, top_k=1, seed=7)[0] == greedy
        assert run(client, model, sampling=Sampling(temperature=2.0, top_k=4, seed=7))[0] == first
        assert run(client, model, sampling=Sampling(temperature=2.0, top_k=4, seed=99), seed=7)[0] == first


def test_a_stop_string_ends_the_reply_before_it(split, shell):
    cluster, model = split
    with shell(cluster.endpoint, timeout=30) as client:
        _, full, reason = run(client, model)
        assert reason == "length" and len(full) > 8, full
        stop = full[len(full) // 2:len(full) // 2 + 3]
        for given in (stop, [stop], ("never there", stop)):
            _, text, reason = run(client, model, stop=given)
            assert (text, reason) == (full[:full.find(stop)], "stop")


BAD = [
    (dict(temperature=500), "temperature must be in [0, 2]"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_k=-1), "top_k must be in [0, 2**20]"),
    (dict(top_k=1.5), "top_k must be an int"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(seed=-1), "seed must be in [0, 2**63)"),
    (dict(seed=2**70), "seed must be in [0, 2**63)"),
    (dict(stop=[""]), "stop takes at most 4 non-empty strings"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(stop=[object()]), "stop cannot be sent"),
    (dict(ignore_eos="yes"), "ignore_eos must be a bool"),
    (dict(max_tokens="8"), "max_tokens must be an int"),
]


@pytest.mark.parametrize("kw, words", BAD, ids=[f"{k}={v!r:.12}" for kw, _ in BAD for k, v in kw.items()])
def test_a_bad_value_is_refused_by_name_before_any_socket(kw, words, monkeypatch, shell):
    """Every socket either client makes comes from ``core.dealer``; here it only records the
    endpoint, so a refusal that came after dialling shows as a dial, whatever the clock says."""
    dialled = []
    monkeypatch.setattr(core, "dealer", lambda ctx, endpoint, *a, **k: dialled.append(endpoint))
    silent = "tcp://127.0.0.1:1"  # nothing answers there either
    with shell(silent, timeout=5) as client, pytest.raises(FabricError) as refused:
        client.generate("m", messages=MESSAGES, **kw)  # at the call, not at the first event
    assert refused.value.code == p.ErrorCode.BAD_REQUEST and words in str(refused.value)
    assert dialled == []
