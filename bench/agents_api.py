#!/usr/bin/env python
"""The agents' API with the official ``openai`` SDK on a real model: structured output and
tool calls, counted valid or not, concurrently and through a tail killed mid-object.

    python bench/agents_api.py [--model smollm2-135m] [--prompts 20] [--streams 8]

Starts a tracker, a head node (the first half of the layers) and two tail nodes (the second
half, twice), each in the default mode as ``meshnet up`` starts them, and the web UI's app in
this process; the SDK talks to the app. Three parts:

1. ``--prompts`` chat requests with ``response_format`` json_schema (an object with a name, an
   age and a list of up to three hobbies), ``--streams`` at a time: how many parse and validate.
2. The same number with ``tools`` and a named ``tool_choice``: how many come back as exactly one
   call of that function whose ``arguments`` validate (SmolLM2's template knows no tools, so the
   head writes them into the system message and the reply is read as Hermes).
3. One streamed json_schema reply whose tail is killed (``kill -9``) a few tokens in: whether the
   reply still validates, and whether it equals the same request's reply undisturbed.

Prints the counts; the target (issue 27) is every reply valid.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fabric import AsyncClient, Client  # noqa: E402
from fabric.cli.supervision import stop_processes  # noqa: E402
from fabric.compute.models import load_config, resolve  # noqa: E402
from tests.cluster import free_port  # noqa: E402
from tests.support import wait_for  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather in a city",
                                           "parameters": WEATHER}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth", "Accra", "Bern", "Dhaka"]


def person_ok(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age", "hobbies"}
            and isinstance(value["name"], str) and len(value["name"]) <= 20
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and isinstance(value["hobbies"], list) and len(value["hobbies"]) <= 3
            and all(isinstance(h, str) and len(h) <= 16 for h in value["hobbies"]))


def call_ok(choice) -> bool:
    calls = choice.message.tool_calls or []
    if choice.finish_reason != "tool_calls" or len(calls) != 1 or calls[0].function.name != "get_weather":
        return False
    try:
        args = json.loads(calls[0].function.arguments)
    except ValueError:
        return False
    return (isinstance(args, dict) and set(args) == {"city", "unit"} and isinstance(args["city"], str)
            and len(args["city"]) <= 20 and args["unit"] in ("celsius", "fahrenheit"))


class Swarm:
    """A tracker, a head and two tails on loopback, in the default mode; ``tails`` by endpoint."""

    def __init__(self, model: str, tmp: Path):
        self.tracker = f"tcp://127.0.0.1:{free_port()}"
        me = [sys.executable, "-m", "fabric.cli", "--log-level", "warning"]
        self.procs = [subprocess.Popen([*me, "tracker", "--bind", self.tracker, "--pub",
                                        f"tcp://127.0.0.1:{free_port()}", "--db", str(tmp / "ledger.sqlite3")])]
        last = load_config(resolve(model)).num_hidden_layers - 1
        half = last // 2
        self.tails: dict[str, subprocess.Popen] = {}
        for name, layers in (("head", f"0-{half}"), ("tail-a", f"{half + 1}-{last}"), ("tail-b", f"{half + 1}-{last}")):
            bind = f"tcp://127.0.0.1:{free_port()}"
            proc = subprocess.Popen([*me, "node", "--model", model, "--layers", layers, "--node-id", name,
                                     "--bind", bind, "--tracker", self.tracker, "--no-progress",
                                     "--compute-lock", str(tmp / "compute.lock")])
            self.procs.append(proc)
            if name != "head":
                self.tails[bind] = proc
        with Client(self.tracker, timeout=2) as client:
            if not wait_for(lambda: self._ready(client), 300, 0.5):
                raise SystemExit("the swarm did not come up")

    @staticmethod
    def _ready(client) -> bool:
        try:
            status = client.status()
        except Exception:
            return False
        return len(status["nodes"]) == 3 and any(status["plans"].values())

    def stop(self) -> None:
        stop_processes(self.procs)


async def run(args, swarm: Swarm) -> dict:
    import httpx2 as httpx
    import openai

    from webui import WebUIConfig, create_app

    async with AsyncClient(swarm.tracker, timeout=120) as fabric:
        app = create_app(WebUIConfig(tracker=swarm.tracker), fabric)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webui", timeout=600)
        sdk = openai.AsyncOpenAI(base_url="http://webui/v1", api_key="unused", http_client=http, max_retries=0)
        gate = asyncio.Semaphore(args.streams)

        async def person(i: int) -> bool:
            async with gate:
                out = await sdk.chat.completions.create(
                    model=args.model, messages=[{"role": "user", "content": f"Invent a person from {CITIES[i % 10]}."}],
                    response_format=FORMAT, max_tokens=160, temperature=0.7, seed=i)
                return person_ok(out.choices[0].message.content)

        async def weather(i: int) -> bool:
            async with gate:
                out = await sdk.chat.completions.create(
                    model=args.model, messages=[{"role": "user", "content": f"What is the weather in {CITIES[i % 10]}?"}],
                    tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False, max_tokens=80, temperature=0.7, seed=i)
                return call_ok(out.choices[0])

        people = await asyncio.gather(*(person(i) for i in range(args.prompts)))
        calls = await asyncio.gather(*(weather(i) for i in range(args.prompts)))
        failover = await killed_tail(sdk, args.model, swarm)
    return {"json_schema valid": f"{sum(people)}/{len(people)}", "named tool call valid": f"{sum(calls)}/{len(calls)}",
            **failover}


async def killed_tail(sdk, model: str, swarm: Swarm) -> dict:
    """A streamed json_schema reply with its tail killed six chunks in, against the same reply
    undisturbed."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Invent a person who loves the sea."}],
              response_format=FORMAT, max_tokens=160, temperature=0.0, seed=7)
    whole = (await sdk.chat.completions.create(**kw)).choices[0].message.content
    route = await asyncio.to_thread(lambda: Client(swarm.tracker).route(model))
    victim = swarm.tails[route[-1].endpoint]  # the tail the planner puts first: the stream's
    text, chunks = "", 0
    async for chunk in await sdk.chat.completions.create(stream=True, **kw):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        chunks += 1
        if chunks == 6:
            victim.send_signal(signal.SIGKILL)
    return {"killed": f"{route[-1].node} after 6 chunks" if chunks >= 6 else f"nothing: the reply had {chunks} chunks",
            "killed tail mid-object, reply valid": person_ok(text), "equals the undisturbed reply": text == whole,
            "reply": text}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        swarm = Swarm(args.model, Path(tmp))
        try:
            for key, value in asyncio.run(run(args, swarm)).items():
                print(f"{key}: {value}")
        finally:
            swarm.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
