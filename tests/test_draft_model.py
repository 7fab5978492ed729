"""A draft model at the head (``--draft``): the acceptance rule with the draft's q, the draft
model's KV cut back on rejection, the choice between it and prompt lookup, a vocabulary that
differs refused; and on a loopback cluster of tiny random models of two families, greedy text
identical with and without a draft model whose drafts are partly kept."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from fabric.compute.model_ref import ModelError
from fabric.compute.models import load_tokenizer, resolve
from fabric.compute.sampling import accept, propose
from fabric.node.draft_model import DraftModel
from fabric.node.speculation import MODEL, DraftTiming, Speculation, SpeculationConfig
from fabric.wire import protocol as p
from tests.support import wait_for
from tests.tiny_models import make_draft, reference_greedy, with_other_tokenizer

NOISE = 0.005  # a tiny model's draft: its greedy token is the model's about half the time (measured: 0.5 on llama)
TOKENS = 32


def test_the_acceptance_rule_with_the_draft_s_q_keeps_the_model_s_distribution():
    """Drafts drawn from q (another model's distribution), kept with min(1, p/q), else replaced
    from norm(max(0, p - q)): the tokens are distributed as p, not q, and the share kept is
    sum(min(p, q)), the most any rule keeps. Fixed seeds: the check is the same every run."""
    torch.manual_seed(0)
    vocab, runs = 12, 20000
    p_logits, q_logits = torch.randn(vocab) * 1.5, torch.randn(vocab) * 1.5
    params = [p.Sampling(temperature=0.9, seed=seed) for seed in range(runs)]
    got, kept = Counter(), 0
    for sampling in params:
        draft, q = propose(q_logits, sampling, 7, p.MAX_DRAFT_Q)
        token = accept(p_logits, sampling, 7, draft, q)
        got[token] += 1
        kept += token == draft
    p_probs = torch.softmax(p_logits / 0.9, -1).double()
    q_probs = torch.softmax(q_logits / 0.9, -1).double()
    counts = torch.tensor([got[t] for t in range(vocab)], dtype=torch.float64)
    chi2 = float((((counts - runs * p_probs) ** 2) / (runs * p_probs)).sum())
    assert chi2 < 31.3  # 11 degrees of freedom: p = 0.001
    control = float((((counts - runs * q_probs) ** 2) / (runs * q_probs)).sum())
    assert control > 1000  # the test can fail: q's own distribution is far off
    assert kept / runs == pytest.approx(float(torch.minimum(p_probs, q_probs).sum()), abs=0.015)


def test_a_draft_s_q_travels_in_the_forward_and_a_bad_one_is_refused():
    q = p.DraftDist((5, 9), (0.75, 0.25))
    msg = p.Forward(session="s", step=3, pos=4, start_layer=0, end_layer=2, route=(), reply_to="tcp://h:1",
                    sampling=p.Sampling(temperature=1.0), drafts=(9,), draft_q=(q,),
                    tensors=(p.TensorSpec("int64", (1, 2)),))
    back, _ = p.decode(p.encode(msg, [bytes(16)]))
    assert back == msg and back.draft_q[0].prob(9) == 0.25 and back.draft_q[0].prob(6) == 0.0
    for wrong in [dict(draft_q=(p.DraftDist((5,), (1.0,)),)),  # the draft has q = 0
                  dict(draft_q=(q, q)),  # two distributions for one draft
                  dict(draft_q=(p.DraftDist((9, 9), (0.5, 0.5)),)),  # an id twice
                  dict(draft_q=(p.DraftDist((9, 5), (0.5, 0.2)),))]:  # does not sum to 1
        with pytest.raises(p.ProtocolError):
            p.decode(p.encode(dataclasses.replace(msg, **wrong), [bytes(16)]))


class FakeDrafter:
    """A draft model that proposes ``tokens`` and counts its calls."""

    def __init__(self, tokens):
        self.tokens, self.calls, self.closed = tokens, 0, False

    def propose(self, history, k):
        self.calls += 1
        return list(self.tokens[:k]), []

    def close(self):
        self.closed = True


def test_a_step_takes_the_source_that_pays_most_and_a_useless_draft_model_is_switched_off():
    """Lookup where its 3-gram match has paid (a copy), the draft model elsewhere; a draft model
    whose drafts are never kept stops being asked, but for a probe now and then."""
    config = SpeculationConfig(pause_steps=4, smoothing=0.5)
    drafter = FakeDrafter([7, 7, 7, 7, 7, 7])
    spec = Speculation(config, drafter=drafter)
    spec.yields.first[2] = spec.yields.then[2] = 0.95  # copies after a 3-gram have held
    assert spec.drafts([1, 2, 3, 4, 1, 2, 3], 10)[:2] == [4, 1] and spec.matched == 3 and drafter.calls == 0
    got = spec.drafts([1, 2, 3, 9, 8], 10)  # a 1-gram match ("3"), whose drafts are not trusted yet
    assert got and set(got) == {7} and spec.matched == MODEL and drafter.calls == 1
    spec.answered(len(got), len(got), 0.1)
    assert spec.drafts([1, 2, 3, 9, 8, 7], 10) == [] and drafter.calls == 1  # no plain trip timed yet: one is
    spec.answered(0, 0, 0.1)
    spec.timing.model_s = 0.001  # the model's own time per draft: 1% of a trip
    for _ in range(8):
        spec.drafts([1, 2, 3, 9, 8], 10)
        spec.answered(3, 0, 0.101)  # none kept
    calls = drafter.calls
    assert [spec.drafts([1, 2, 3, 9, 8], 10) for _ in range(4)] == [[], [], [], [7]]  # off, then a probe
    assert drafter.calls == calls + 1 and spec.probing
    spec.answered(1, 1, 0.101)
    spec.timing.model_s = 0.5  # a model as slow as five trips: no draft of it could pay, so none is probed either
    assert [spec.drafts([1, 2, 3, 9, 8], 10) for _ in range(40)] == [[]] * 40 and drafter.calls == calls + 1
    spec.close()
    assert drafter.closed


def test_a_probe_of_the_draft_model_pays_its_catching_up_and_its_times_are_the_head_s():
    """A draft model that sat out the history must be fed what it missed before it drafts. A
    probe pays that alone: with 40 tokens to catch up at 10 ms each (400 ms against a 120 ms
    trip) no probe of a model whose drafts cost half a trip pays, where without the catching
    up's cost (a control: the rule before) it probes. A request that shares its head with
    others never probes: its probe's positions would be theirs to pay. The times are learnt
    into the head's DraftTiming: per draft from a step that follows the model's own, per token
    fed from one that catches up."""
    config = SpeculationConfig(pause_steps=1)
    history = list(range(100, 140))  # 40 tokens, no n-gram in them twice: no lookup

    def spec(streams: int, feed_s: float | None) -> Speculation:
        timing = DraftTiming(model_s=0.06, feed_s=feed_s, plain_s=0.12)  # a draft: half a trip
        s = Speculation(config, drafter=FakeDrafter([7] * 6), timing=timing, streams=streams)
        s.yields.first[MODEL - 1] = s.yields.then[MODEL - 1] = 0.5  # too seldom kept to draft on
        s.trips = 1  # (past its first step)
        return s

    slow = spec(1, 0.01)
    assert [slow.drafts(history, 10) for _ in range(3)] == [[]] * 3 and slow.drafter.calls == 0
    control = spec(1, None)
    assert control.drafts(history, 10) == [7] and control.probing  # a probe, where catching up looks free
    crowd = spec(8, None)
    assert [crowd.drafts(history, 10) for _ in range(3)] == [[]] * 3 and crowd.drafter.calls == 0
    timing = DraftTiming()
    timing.learn(0.06, 1, 40, 1.0)  # a probe: one pass over 40 tokens fed
    assert timing.feed_s == pytest.approx(0.0015) and timing.model_s is None
    timing.learn(0.036, 3, 0, 1.0)  # 3 drafts after the model's own step
    timing.learn(0.084, 3, 40, 1.0)  # 3 drafts after catching up 40 tokens: the first from that pass
    assert timing.model_s == pytest.approx(0.012) and timing.feed_s == pytest.approx(0.0015)
    s = spec(1, None)
    s.timing, s.trips = DraftTiming(), 0
    s.yields.first[MODEL - 1] = s.yields.then[MODEL - 1] = 0.6
    s.drafts(history, 10)  # the first step feeds the prompt: a time per token fed
    assert s.timing.feed_s is not None and s.timing.model_s is None
    s.answered(3, 3, 0.1)
    s.answered(0, 0, 0.1)  # (a plain trip timed)
    s.drafts(history + [7, 7, 7, 9], 10)  # after its own step: a time per draft
    assert s.timing.model_s is not None


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    """(model dir, draft dir, tokenizer) of a tiny llama and its noisy copy."""
    model = tiny_models("llama")
    draft = make_draft(model, tmp_path_factory.mktemp("drafts") / "llama", NOISE)
    return model, draft, load_tokenizer(resolve(str(model)))


def load(directory, tokenizer) -> DraftModel:
    return DraftModel.load(resolve(str(directory)), tokenizer, 320, dtype=torch.float32, device="cpu", quant=None,
                           cache_root=None, progress=False)


def test_the_draft_model_cuts_its_kv_back_to_what_the_tail_kept(pair):
    """The draft model's drafts are its greedy continuation; after a rejection the session's draft
    KV is cut back to the common prefix (in place) and the drafts are those of a fresh start."""
    model, _, tokenizer = pair
    drafter = load(model, tokenizer)  # the model drafting for itself: its drafts are its greedy text
    prompt = list(tokenizer("the quick brown fox jumps")["input_ids"])
    drafts, q = drafter.propose("s", prompt, 6, p.Sampling())
    assert drafts == reference_greedy(model, prompt, 6) and q == []
    kv = drafter.executor.kv.get("s")
    assert kv.length == len(prompt) + 5  # the last draft is not fed
    cache = kv.cache
    taken = prompt + drafts[:2] + [(drafts[2] + 1) % 320]  # two kept, then the tail's own token
    again, _ = drafter.propose("s", taken, 4, p.Sampling())
    assert drafter.executor.rolled_back == 3 and drafter.executor.kv.get("s").cache is cache  # cut, not copied
    assert again == reference_greedy(model, taken, 4)
    drafter.forget("s")
    assert drafter.executor.kv.get("s") is None and not drafter.fed


def test_a_sampling_request_s_drafts_come_with_their_q(pair):
    model, draft, tokenizer = pair
    drafter = load(draft, tokenizer)
    prompt = list(tokenizer("hello world")["input_ids"])
    sampling = p.Sampling(temperature=0.8, top_k=40, seed=5)
    drafts, dists = drafter.propose("s", prompt, 3, sampling)
    assert len(dists) == 3 and all(len(q.ids) <= 40 and q.prob(t) > 0 for t, q in zip(drafts, dists))
    assert drafter.propose("t", prompt, 3, sampling) == (drafts, dists)  # drawn with (seed, position)


def test_a_draft_model_with_another_vocabulary_is_refused(pair, tmp_path):
    model, _, tokenizer = pair
    other = with_other_tokenizer(model, tmp_path / "other")
    with pytest.raises(ModelError) as refused:
        load(other, tokenizer)
    assert "--draft other" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("command", ["node", "up"])
def test_meshnet_node_and_up_refuse_such_a_draft_in_one_line(pair, tmp_path, command):
    import os
    import subprocess
    import sys

    from tests.cluster import ROOT
    from tests.support import free_port

    model, _, _ = pair
    other = with_other_tokenizer(model, tmp_path / "other")
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    where = (["--layers", "0-5", "--compute-lock", "none", "--no-progress"] if command == "node" else
             ["--tracker", f"tcp://127.0.0.1:{free_port()}", "--pub", f"tcp://127.0.0.1:{free_port()}",
              "--port", str(free_port())])
    out = subprocess.run([sys.executable, "-m", "fabric.cli", "--log-level", "error", command, "--model", str(model),
                          "--draft", str(other), *where], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr  # before any load
    assert "--draft other: its tokenizer differs" in lines[0]
    assert "meshnet is up" not in out.stdout


def split(cluster, model, draft, family: str):
    head = cluster.add_node(model, 0, 2, 6, f"head-{family}", dtype=torch.float32, draft=resolve(str(draft)))
    cluster.add_node(model, 3, 5, 6, f"tail-{family}", dtype=torch.float32)
    cluster.wait_routable(model.name, 2)
    return head


def generate(cluster, model, prompt: str, **kw) -> list[int]:
    with cluster.client() as client:
        return [t for e in client.generate(model.name, prompt=prompt, max_tokens=TOKENS, **kw) for t in e.token_ids]


PROMPTS = ["the quick brown fox jumps", "hello world, how are", "meshnet splits a model", "the lazy dog",
           "how are you today? the fox", "a model across nodes"]


def clear(model, ids) -> dict[str, list[int]]:
    """Prompt -> transformers' greedy reply, for the prompts whose every token leads clearly."""
    out = {}
    for prompt in PROMPTS:
        try:
            out[prompt] = reference_greedy(model, ids(prompt), TOKENS)
        except AssertionError:
            continue
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_text_is_the_same_with_and_without_a_draft_model(thread_cluster, tiny_models, tmp_path, family):
    """Exact mode: the text with a draft model (partly kept) is transformers' greedy text; the
    head's counters show drafts sent, some kept and some not."""
    model = tiny_models(family)
    head = split(thread_cluster, model, make_draft(model, tmp_path / "draft", NOISE), family)
    ids = lambda prompt: list(load_tokenizer(resolve(str(model)))(prompt)["input_ids"])  # noqa: E731
    plain = clear(model, ids)
    assert len(plain) >= 2, "too few prompts with a clear greedy lead: change PROMPTS"
    head.head.config = dataclasses.replace(head.head.config, speculation=SpeculationConfig(adaptive=False))
    assert {prompt: generate(thread_cluster, model, prompt) for prompt in plain} == plain
    c = head.counters
    assert wait_for(lambda: not head.head.sessions, 5)
    assert 0 < c["spec_kept"] < c["spec_drafted"]
    rows = {(s.name, s.labels.get("route")): s.value for s in head.metrics()}  # per route, as the tracker's
    route = f"head-{family}>tail-{family}"
    assert rows[("node_route_spec_kept_total", route)] == c["spec_kept"]
    assert 0 < rows[("node_route_spec_acceptance", route)] < 1
    assert rows[("node_route_spec_tokens_per_trip", route)] == pytest.approx(
        (rows[("node_route_spec_trips_total", route)] + c["spec_kept"]) / rows[("node_route_spec_trips_total", route)],
        abs=1e-3)
    assert not head.head.draft.fed and len(head.head.draft.executor.kv) == 0  # every session's draft KV went
    # the draft model drafts on past its own drafts for a step sent ahead of their answer, where it holds
    head.head.config = dataclasses.replace(head.head.config, speculation=SpeculationConfig(adaptive=False, ahead="on"))
    assert {prompt: generate(thread_cluster, model, prompt) for prompt in plain} == plain
    assert wait_for(lambda: not head.head.sessions, 5)
    assert c["spec_ahead"] > c["spec_ahead_held"] > 0


def test_sampling_with_a_draft_model(thread_cluster, tiny_models, tmp_path):
    """A request with its own seed drafts by lookup alone (its text is the text without drafts,
    draw for draw); one without a seed drafts with the draft model, its q on the wire, and
    some of those drafts are kept."""
    model = tiny_models("qwen3")
    head = split(thread_cluster, model, make_draft(model, tmp_path / "draft", NOISE), "qwen3")
    head.head.config = dataclasses.replace(head.head.config, speculation=SpeculationConfig(enabled=False))
    seeded = dict(temperature=0.7, seed=99)
    plain = [generate(thread_cluster, model, prompt, **seeded) for prompt in PROMPTS]
    head.head.config = dataclasses.replace(head.head.config, speculation=SpeculationConfig(adaptive=False))
    assert [generate(thread_cluster, model, prompt, **seeded) for prompt in PROMPTS] == plain
    assert not head.head.draft.executor.rolled_back and not head.head.draft.fed  # never asked
    c = head.counters
    drafted = c["spec_drafted"]
    for prompt in PROMPTS:
        assert len(generate(thread_cluster, model, prompt, temperature=0.5, ignore_eos=True)) == TOKENS
    assert wait_for(lambda: not head.head.sessions, 5)
    assert c["spec_drafted"] > drafted and c["spec_kept"] > 0
