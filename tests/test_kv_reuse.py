"""KV reuse across requests: a hop keeps the KV of ended sessions under a byte budget, the
head remembers what it sent where, and a request that shares a start with an ended one
computes only the rest. Greedy tokens are those of transformers with no reuse (float32:
see tests/tiny_models.py), and hit counters show the reuse really happened."""
from __future__ import annotations

import pytest
import torch

from fabric.compute.executor import CacheMissError, ShardExecutor, Step
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.node.prefixes import PrefixIndex, Reuse, common_prefix
from fabric.node.scheduler import Work
from fabric.wire import protocol as p
from fabric.wire.shard import Shard
from tests.tiny_models import reference_greedy

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
ROUTE = (p.Hop("a", "tcp://a:1", 0, 2), p.Hop("b", "tcp://b:1", 3, 5))


def split(model) -> tuple[ShardExecutor, ShardExecutor]:
    source = resolve(str(model))
    return (ShardExecutor(load_shard(source, Shard(0, 2, 6), progress=False), KVStore(retain_bytes=1 << 30)),
            ShardExecutor(load_shard(source, Shard(3, 5, 6), progress=False), KVStore(retain_bytes=1 << 30)))


def greedy(hops: tuple[ShardExecutor, ShardExecutor], session: str, ids: list[int], steps: int, pos: int = 0,
           reuse: str = "") -> list[int]:
    """Greedy tokens of ``session`` through both hops, sending ``ids[pos:]`` first."""
    x, out = torch.tensor([ids[pos:]]), []
    while len(out) < steps:
        hidden = hops[0].run(session, 0, 2, x, pos, reuse=reuse).hidden
        out.append(int(hops[1].run(session, 3, 5, hidden, pos, reuse=reuse).logits.argmax()))
        pos, reuse, x = pos + x.shape[1], "", torch.tensor([[out[-1]]])
    return out


def end(hops, session: str) -> None:
    for hop in hops:
        hop.retain(session)


def test_a_kept_prefix_gives_the_tokens_of_a_full_prefill(tiny_models):
    """Turn 2 continues all of turn 1 (its KV moves to the new session); a prompt that
    shares only a start copies that much and leaves the kept KV for others."""
    model = tiny_models("llama")
    hops = split(model)
    first = greedy(hops, "t1", PROMPT, 8)
    end(hops, "t1")
    held = PROMPT + first[:-1]  # the last token was never fed back
    assert [h.kv.retained.sessions() for h in hops] == [["t1"], ["t1"]] and len(hops[0].kv) == 0
    turn2 = held + [40, 41, 42]
    assert greedy(hops, "t2", turn2, 8, pos=len(held), reuse="t1") == reference_greedy(model, turn2, 8)
    assert all("t1" not in h.kv.retained for h in hops)  # moved, not copied
    end(hops, "t2")
    other = PROMPT[:10] + [60, 61, 62, 63]
    assert greedy(hops, "t3", other, 6, pos=10, reuse="t2") == reference_greedy(model, other, 6)
    assert all("t2" in h.kv.retained for h in hops)  # copied: the longer KV stays kept
    assert [h.kv.retained.stats["hits"] for h in hops] == [2, 2]
    assert hops[0].kv.retained.stats["reused_tokens"] == len(held) + 10


def test_a_hop_without_the_kept_kv_misses(tiny_models):
    hops = split(tiny_models("llama"))
    greedy(hops, "t1", PROMPT, 3)
    end(hops, "t1")
    ex = hops[1]
    hidden = torch.zeros((1, 2, ex.hidden_size))
    with pytest.raises(CacheMissError):
        ex.run("t2", 3, 5, hidden, 30, reuse="t1")  # holds 21 positions, not 30
    with pytest.raises(CacheMissError):
        ex.run("t2", 3, 5, hidden, 5, reuse="ghost")
    with pytest.raises(CacheMissError):
        hops[0].run("t2", 0, 1, torch.tensor([[1]]), 5, reuse="t1")  # another span
    assert ex.kv.retained.stats["misses"] == 2 and "t1" in ex.kv.retained


def test_eviction_under_the_budget_frees_the_least_recently_used(tiny_models):
    source = resolve(str(tiny_models("llama")))
    weights = load_shard(source, Shard(0, 5, 6), progress=False)
    probe = ShardExecutor(weights, KVStore(retain_bytes=1 << 30))
    probe.run("x", 0, 5, torch.tensor([PROMPT]), 0)
    one = probe.kv.get("x").nbytes()
    ex = ShardExecutor(weights, KVStore(retain_bytes=int(2.5 * one)))  # room for two such sessions
    kept = ex.kv.retained
    for name in ("s0", "s1"):
        ex.run(name, 0, 5, torch.tensor([PROMPT]), 0)
        assert ex.retain(name) == []
    assert kept.bytes == 2 * one and kept.sessions() == ["s0", "s1"]
    ex.run("s2", 0, 5, torch.tensor([[50]]), 10, reuse="s0")  # 10 positions of s0 copied: s0 is now most recent
    ex.run("s3", 0, 5, torch.tensor([PROMPT]), 0)
    assert ex.retain("s3") == ["s1"]  # the least recently used goes
    assert kept.sessions() == ["s0", "s3"] and kept.bytes == 2 * one and kept.stats["evictions"] == 1
    assert ex.retain("s2") == ["s0"]  # s2 holds 11 positions: s0 makes room
    assert kept.bytes < 2 * one and kept.sessions() == ["s3", "s2"]
    tiny = ShardExecutor(weights, KVStore(retain_bytes=one // 2))
    tiny.run("big", 0, 5, torch.tensor([PROMPT]), 0)
    assert tiny.retain("big") == ["big"] and tiny.kv.retained.bytes == 0 and len(tiny.kv) == 0
    off = ShardExecutor(weights, KVStore(retain_bytes=0))
    off.run("s", 0, 5, torch.tensor([PROMPT]), 0)
    assert off.retain("s") == [] and len(off.kv.retained) == 0 and len(off.kv) == 0


def test_a_batch_group_row_is_kept_with_its_own_kv(tiny_models):
    """A session that ends while a row of the decode batch comes out of its row first, so
    its kept KV is whole (and no larger than its positions); the row still decoding stays
    where it is and keeps its tokens."""
    model = tiny_models("qwen2")
    ex = ShardExecutor(load_shard(resolve(str(model)), Shard(0, 5, 6), progress=False), KVStore(retain_bytes=1 << 30))
    prompts = [PROMPT, PROMPT[:7] + [70, 71]]
    results = ex.run_prefills([Step(f"b{i}", 0, 5, torch.tensor([q]), 0) for i, q in enumerate(prompts)])
    tokens = [[int(r.logits.argmax())] for r in results]
    pos = [len(q) for q in prompts]

    def step(members):
        out = ex.run_batch([Step(f"b{i}", 0, 5, torch.tensor([[tokens[i][-1]]]), pos[i]) for i in members])
        for i, r in zip(members, out):
            tokens[i].append(int(r.logits.argmax()))
            pos[i] += 1

    for _ in range(4):
        step([0, 1])
    group = ex.group
    ex.retain("b0")
    kept = ex.kv.retained.peek("b0")
    assert group.members() == ["b1"] and kept.length == pos[0] and kept.group is None
    assert kept.nbytes() == 2 * 6 * kept.cache.layers[0].keys[0].numel() * 4  # keys and values of 6 layers, exactly
    turn2 = prompts[0] + tokens[0][:-1] + [80, 81]
    first = ex.run("c", 0, 5, torch.tensor([turn2[pos[0]:]]), pos[0], reuse="b0")
    assert int(first.logits.argmax()) == reference_greedy(model, turn2, 1)[0]
    for _ in range(4):
        step([1])
    assert ex.group is group and tokens[1] == reference_greedy(model, prompts[1], 9)


def test_prefix_index_matches_the_longest_start_on_the_same_route():
    index = PrefixIndex(max_entries=3, min_tokens=4)
    index.add("a", list(range(20)), ROUTE)
    index.add("b", list(range(10)) + [99] * 10, ROUTE)
    index.add("short", [1, 2], ROUTE)  # under min_tokens: not kept
    assert len(index) == 2
    assert index.match(list(range(15)) + [7], ROUTE) == Reuse("a", 15)  # partial: "a" stays
    assert index.match(list(range(10)) + [5], ROUTE[:1]) is None  # other hops hold nothing of it
    assert index.match(list(range(3)) + [8] * 9, ROUTE) is None  # too short a match
    assert index.match(list(range(20)), ROUTE) == Reuse("a", 19)  # one token is always computed
    assert index.match(list(range(20)) + [1, 2], ROUTE) == Reuse("a", 20)  # all of it: "a" leaves
    assert index.match(list(range(20)) + [1, 2], ROUTE, tenant="other key") is None  # another tenant's
    assert index.match(list(range(20)) + [1, 2], ROUTE) == Reuse("b", 10)
    index.discard("b")
    assert len(index) == 0 and index.match(list(range(20)), ROUTE) is None
    for name in "wxyz":
        index.add(name, list(range(8)), ROUTE)
    assert len(index) == 3
    assert PrefixIndex(max_entries=0).match(list(range(20)), ROUTE) is None
    assert common_prefix((1, 2, 3), (1, 2, 4, 5)) == 2 and common_prefix((), (1,)) == 0


class ScanIndex:
    """What PrefixIndex answers, by comparing a request with every entry (least recent first)."""

    def __init__(self, max_entries: int, min_tokens: int):
        self.max_entries, self.min_tokens, self.entries = max_entries, min_tokens, {}

    def add(self, session, ids, route, tenant=""):
        if len(ids) >= self.min_tokens:
            self.entries.pop(session, None)
            self.entries[session] = (tuple(ids), tuple(route), tenant)
            while len(self.entries) > self.max_entries:
                del self.entries[next(iter(self.entries))]

    def match(self, ids, route, tenant=""):
        best = None
        for name, (held, hops, owner) in self.entries.items():
            n = min(common_prefix(held, tuple(ids)), len(ids) - 1)
            if (hops, owner) == (tuple(route), tenant) and n >= self.min_tokens and (best is None or n > best.tokens):
                best = Reuse(name, n)
        if best is not None:
            entry = self.entries.pop(best.session)
            if best.tokens < len(entry[0]):
                self.entries[best.session] = entry
        return best


@pytest.mark.parametrize("same_hash", [False, True])
def test_prefix_index_answers_as_a_scan_of_every_entry(monkeypatch, same_hash):
    """Requests and ended sessions sharing starts of every length (a system prompt, turns of a
    chat, one prompt asked again), on two routes and for two tenants: the index finds the match
    a scan of every entry finds, and leaves the same entries behind. Where every start hashed
    the same, the index still answers right."""
    import random

    if same_hash:
        monkeypatch.setattr(PrefixIndex, "_chain", lambda self, ids, route, tenant: iter([0] * (len(ids) // self.block)))
    rng = random.Random(7)
    index, scan = PrefixIndex(max_entries=24, min_tokens=4), ScanIndex(max_entries=24, min_tokens=4)
    starts = [[rng.randrange(9) for _ in range(rng.randrange(40))] for _ in range(5)]
    routes = [ROUTE, ROUTE[:1]]
    for i in range(400):
        ids = rng.choice(starts) + [rng.randrange(3) for _ in range(rng.randrange(12))]
        route, tenant = rng.choice(routes), rng.choice(["", "key-2"])
        if rng.random() < 0.5:
            index.add(f"s{i}", ids, route, tenant)
            scan.add(f"s{i}", ids, route, tenant)
        else:
            assert index.match(ids, route, tenant) == scan.match(ids, route, tenant)
        assert list(index._entries) == list(scan.entries)


def test_work_that_starts_from_kept_kv_is_a_chunk_and_only_its_first_chunk_takes_it():
    spec = p.TensorSpec("int64", (1, 100))
    msg = p.Forward("s", 0, 40, 0, 2, ROUTE[1:], "tcp://a:1", reuse="old", tensors=(spec,))
    work = Work(msg, torch.zeros((1, 100), dtype=torch.int64))
    first, rest = work.cut(30)
    assert (first.msg.reuse, first.msg.pos, first.msg.more) == ("old", 40, True)
    assert (rest.msg.reuse, rest.msg.pos, rest.tokens) == ("", 70, 70)
    one = Work(p.Forward("s", 0, 40, 0, 2, ROUTE[1:], "tcp://a:1", reuse="old", tensors=(p.TensorSpec(
        "int64", (1, 1)),)), torch.zeros((1, 1), dtype=torch.int64))
    assert not one.decode and not one.short_prompt and one.short_chunk  # it rides, or runs with other chunks


class KeepingTransport:
    """FORWARDs run on in-process executors (with ``reuse``); CLOSE and CANCEL keep the KV."""

    def __init__(self, executors: dict[str, ShardExecutor]):
        self.executors, self.sent, self.replies = executors, [], []

    def forward(self, hop: p.Hop, message: p.Forward, tensor: torch.Tensor) -> None:
        from fabric.compute.sampling import sample

        self.sent.append(message)
        x = tensor
        try:
            for h in (hop, *message.route):
                result = self.executors[h.node].run(message.session, h.start_layer, h.end_layer, x, message.pos,
                                                    reuse=message.reuse)
                x = result.hidden
        except CacheMissError as miss:
            self.replies.append(p.CacheMiss(message.session, message.step, h.node, miss.have))
            return
        pos = message.pos + tensor.shape[1]
        self.replies.append(p.Token(message.session, message.step, sample(result.logits, message.sampling, pos), pos))

    def control(self, hop: p.Hop, message) -> None:
        for h in (hop, *message.route):
            self.executors[h.node].retain(message.session)


def drive(rs, transport, reuse=None, stop_after: int = 0) -> list[int]:
    """Run a RouteSession to its end (or cancel it after ``stop_after`` tokens)."""
    rs.start(reuse)
    while transport.replies and not rs.finished:
        reply = transport.replies.pop(0)
        rs.on_token(reply) if isinstance(reply, p.Token) else rs.on_cache_miss(reply)
        if stop_after and len(rs.generated) == stop_after:
            transport.replies.clear()  # the step in flight ran on every hop, its TOKEN is lost
            rs.cancel()
    return rs.generated


def test_a_route_session_sends_only_the_rest_and_knows_what_the_hops_hold(tiny_models):
    from fabric.node.route_session import RouteSession

    model = tiny_models("llama")
    hops = dict(zip("ht", split(model)))
    transport = KeepingTransport(hops)
    route = (p.Hop("h", "inproc://h", 0, 2), p.Hop("t", "inproc://t", 3, 5))

    def session(name: str, ids: list[int], max_tokens: int = 6) -> RouteSession:
        request = p.Generate(request_id=name, route=route, prompt="x", max_tokens=max_tokens, ignore_eos=True)
        return RouteSession(request, ids, tokenizer=load_tokenizer_for(model), eos=frozenset(), reply_to="inproc://c",
                            transport=transport, seed=0, session=name)

    first = session("r1", PROMPT)
    drive(first, transport, stop_after=3)  # cancelled: the hops hold one step more than the head heard of
    assert first.held_ids == PROMPT + first.generated[:2] and hops["t"].kv.retained.peek("r1").length == len(PROMPT) + 3
    turn2 = first.held_ids + [44, 45]
    second = session("r2", turn2)
    got = drive(second, transport, Reuse("r1", len(first.held_ids)))
    assert transport.sent[-len(got)].pos == len(first.held_ids) and transport.sent[-len(got)].reuse == "r1"
    assert got == reference_greedy(model, turn2, 6)
    assert second.held_ids == second.history and len(second.history) == len(turn2) + 5
    third = session("r3", turn2)
    got = drive(third, transport, Reuse("gone", 20))  # the hops never kept it: a full prefill after the miss
    assert [(m.pos, m.reuse) for m in transport.sent[-len(got) - 1:-len(got) + 1]] == [(20, "gone"), (0, "")]
    assert got == reference_greedy(model, turn2, 6) and third.cache_misses == 1


def load_tokenizer_for(model):
    from fabric.compute.models import load_tokenizer

    return load_tokenizer(resolve(str(model)))
