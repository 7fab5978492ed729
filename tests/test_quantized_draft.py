"""A 4-bit draft for an exact route (``--draft-quant``): a draft never changes the text, so it
runs on the fastest kernels whatever the node's own ``--quant``. A node computing a Q4_1 file
exactly (``--quant none``, float32) drafts from the same file on the int8-activation kernel in
bfloat16; ``meshnet up`` hands the choice to its head; and on a loopback cluster of tiny
random GGUF models of two families, that exact route with its 4-bit draft gives the greedy
tokens of transformers' float32 load of the file."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fabric import cli
from fabric.cli import node_command, up_command
from fabric.compute.models import load_tokenizer, resolve
from fabric.flags import CommandError
from fabric.node.node import draft_model
from fabric.node.speculation import SpeculationConfig
from tests.gguf_models import write_gguf
from tests.support import free_port, wait_for
from tests.tiny_models import assert_clear_lead

TOKENS = 24
PROMPTS = ["the quick brown fox jumps", "hello world, how are", "meshnet splits a model", "the lazy dog",
           "how are you today? the fox", "a model across nodes"]


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    """family -> a tiny random model written as a Q4_1 GGUF file (4 layers)."""
    made = {}

    def make(family: str):
        if family not in made:
            made[family] = write_gguf(family, tmp_path_factory.mktemp(f"q4-{family}"), "Q4_1")
        return made[family]
    return make


def linears(executor) -> set[tuple[str, torch.dtype | None]]:
    """(kernel, weight dtype: torch's Linear only) of an executor's decoder-layer linears."""
    return {(type(m).__name__, m.weight.dtype if type(m) is torch.nn.Linear else None)
            for layer in executor.w.layers.values() for m in layer.modules() if "Linear" in type(m).__name__}


def node_config(path, *flags: str):
    args = cli.build_parser().parse_args(["node", "--model", str(path), "--layers", "0-1", "--no-progress",
                                          "--draft", str(path), *flags])
    return node_command._node_config(args, None)


def test_an_exact_node_drafts_on_the_fast_kernels_unless_told(q4_file, tmp_path, monkeypatch):
    """``--quant none``: the route's layers in float32, the draft on the file's grid on the
    int8-activation kernel (DotLinear) in bfloat16; ``--draft-quant none``: the draft in
    ``--dtype`` on torch's own linears, as the node's draft was before the flag."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = q4_file("llama")
    tokenizer = load_tokenizer(resolve(str(path)))
    config = node_config(path, "--quant", "none")
    assert (config.quant, config.dtype) == (None, torch.float32)
    assert (config.draft_quant, config.draft_dtype) == ("int4", torch.bfloat16)
    assert linears(draft_model(config, tokenizer, 320).executor) == {("DotLinear", None)}
    config = node_config(path, "--quant", "none", "--draft-quant", "none")
    assert (config.draft_quant, config.draft_dtype) == (None, torch.float32)
    assert linears(draft_model(config, tokenizer, 320).executor) == {("Linear", torch.float32)}
    config = node_config(path, "--draft-quant", "none", "--dtype", "bfloat16")
    assert (config.quant, config.draft_quant, config.draft_dtype) == ("int4", None, torch.bfloat16)
    with pytest.raises(CommandError, match="--draft-quant int4 runs on the CPU"):
        node_command.check_draft_device("cuda", "int4")
    node_command.check_draft_device("cuda", "auto")  # auto picks torch's kernels there


def test_up_hands_the_draft_s_kernels_to_its_head_alone(q4_file, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = q4_file("llama")
    started = []
    monkeypatch.setattr(up_command, "supervise", lambda commands, **_: started.append(commands) or 0)
    ports = ["--tracker", f"tcp://127.0.0.1:{free_port()}", "--pub", f"tcp://127.0.0.1:{free_port()}",
             "--port", str(free_port())]
    for extra, draft_quant in (((), "auto"), (("--draft-quant", "none"), "none")):
        args = cli.build_parser().parse_args(["up", "--model", str(path), "--quant", "none", "--draft", str(path),
                                              *ports, *extra])
        assert args.func(args) == 0
        head, tail = [c for c in started.pop() if "node" in c]
        assert head[head.index("--draft-quant") + 1] == draft_quant and head[head.index("--quant") + 1] == "none"
        assert "--draft" not in tail and "--draft-quant" not in tail


def float32_greedy(path, ids: list[int]) -> list[int] | None:
    """transformers' float32 greedy continuation of ``ids`` from the GGUF file (end of
    sequence ignored); None where a token does not lead clearly (a near-tie is never compared)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    out = model.generate(prompt, max_new_tokens=TOKENS, do_sample=False, attention_mask=torch.ones_like(prompt),
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    try:
        assert_clear_lead(torch.stack(out.scores)[:, 0])  # (steps, vocab)
    except AssertionError:
        return None
    return out.sequences[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_exact_route_with_a_4_bit_draft_gives_transformers_float32_tokens(thread_cluster, q4_file, family):
    """Head and tail compute the Q4_1 file in float32; the head drafts from the same file on
    the 4-bit kernel, every step (not adaptive). The tokens are transformers' float32 greedy
    tokens, and the draft's were mostly kept."""
    path = q4_file(family)
    source = resolve(str(path))
    head = thread_cluster.add_node(path, 0, 1, 4, f"head-{family}", dtype=torch.float32, draft=source,
                                   draft_quant="int4", draft_dtype=torch.bfloat16)
    tail = thread_cluster.add_node(path, 2, 3, 4, f"tail-{family}", dtype=torch.float32)
    thread_cluster.wait_routable(source.model_id, 2)
    assert linears(head.head.draft.executor) == {("DotLinear", None)}
    assert linears(head.executor) | linears(tail.executor) == {("Linear", torch.float32)}
    head.head.config = dataclasses.replace(head.head.config, speculation=SpeculationConfig(adaptive=False))
    tokenizer = load_tokenizer(source)
    expected = {p: want for p in PROMPTS if (want := float32_greedy(path, tokenizer(p)["input_ids"]))}
    assert len(expected) >= 2, "too few prompts with a clear greedy lead: change PROMPTS"
    with thread_cluster.client() as client:
        got = {p: [t for e in client.generate(source.model_id, prompt=p, max_tokens=TOKENS, ignore_eos=True)
                   for t in e.token_ids] for p in expected}
    assert got == expected
    assert wait_for(lambda: not head.head.sessions, 5)
    c = head.counters
    assert c["spec_drafted"] > 0 and c["spec_kept"] > c["spec_drafted"] / 2
