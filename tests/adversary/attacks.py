"""Every attack the rogue knows. Each sends real frames and returns what came back, and
``won`` where the rogue itself can see that it got what it should not have (a hop computed
for it from a session or kept KV not its own, a request past a bound started). Harm to the
honest clients' streams is judged by the arena, which knows what they should have been.
"""
from __future__ import annotations

import torch

from fabric.wire import protocol as p

from .rogue import Rogue, new_id

GREEDY = p.Sampling()


def _route_from(hops: list[p.Hop], i: int) -> tuple[p.Hop, ...]:
    return tuple(hops[i + 1:])


def _input(hop: p.Hop, cmd: dict, tokens: int = 4) -> torch.Tensor:
    """What ``hop`` takes: token ids at layer 0, else hidden states of the model's size."""
    if hop.start_layer == 0:
        return torch.ones((1, tokens), dtype=torch.int64)
    return torch.zeros((1, tokens, cmd.get("hidden", 64)), dtype=torch.float32)


def _forward(rogue: Rogue, hops: list[p.Hop], i: int, cmd: dict, **fields) -> None:
    rogue.send(hops[i].endpoint, *_forward_message(rogue, hops, i, cmd, **fields))


def _forward_message(rogue: Rogue, hops: list[p.Hop], i: int, cmd: dict, **fields) -> tuple[p.Forward, tuple]:
    hop, tokens = hops[i], fields.pop("tokens", 4)
    msg = p.Forward(step=fields.pop("step", 0), start_layer=hop.start_layer, end_layer=hop.end_layer,
                    route=_route_from(hops, i), reply_to=rogue.endpoint, sampling=GREEDY, **fields)
    return msg, (_input(hop, cmd, tokens),)


def _computed_for_rogue(answers: list[dict]) -> bool:
    """A hop ran the rogue's frame: a token, or a step's progress, came back to its router."""
    return any(a["kind"] in ("Token", "Progress") for a in answers)


def _refused(answers: list[dict], code: str = p.ErrorCode.BAD_REQUEST) -> int:
    return sum(a["kind"] == "Error" and a.get("code") == code for a in answers)


# -- a stranger with the public feed -------------------------------------------------------

def cancel_feed_key_head(rogue: Rogue, cmd: dict) -> dict:
    key, hops = rogue.victim()
    rogue.send(hops[0].endpoint, p.Cancel(session=key, route=tuple(hops[1:])))
    return {"answers": rogue.listen()}


def cancel_feed_key_hops(rogue: Rogue, cmd: dict) -> dict:
    key, hops = rogue.victim()
    for i, hop in enumerate(hops):
        rogue.send(hop.endpoint, p.Cancel(session=key, route=_route_from(hops, i)))
    return {"answers": rogue.listen()}


def close_feed_key_hops(rogue: Rogue, cmd: dict) -> dict:
    key, hops = rogue.victim()
    for i, hop in enumerate(hops):
        rogue.send(hop.endpoint, p.Close(session=key, route=_route_from(hops, i)))
    return {"answers": rogue.listen()}


def token_feed_key(rogue: Rogue, cmd: dict) -> dict:
    """TOKENs for every step a stream of this length could be at, as if from the tail."""
    key, hops = rogue.victim()
    for step in range(96):
        rogue.send(hops[0].endpoint, p.Token(session=key, step=step, token=3, pos=step + 8))
    return {"answers": rogue.listen()}


def error_feed_key(rogue: Rogue, cmd: dict) -> dict:
    key, hops = rogue.victim()
    for step in range(96):
        rogue.send(hops[0].endpoint, p.Error(p.ErrorCode.HOP_FAILED, "rogue", session=key, step=step,
                                             node=hops[-1].node))
    return {"answers": rogue.listen()}


def generate_same_id(rogue: Rogue, cmd: dict) -> dict:
    """A request of the rogue's own under the victim's request id (the feed's key)."""
    key, hops = rogue.victim()
    rogue.send(hops[0].endpoint, p.Generate(request_id=key, route=tuple(hops), prompt="hello", max_tokens=2))
    return {"answers": rogue.listen(1.0)}


# -- a member who knows a live session's id ---------------------------------------------------

def cancel_leaked_hops(rogue: Rogue, cmd: dict) -> dict:
    _, hops = rogue.victim()
    for i, hop in enumerate(hops):
        rogue.send(hop.endpoint, p.Cancel(session=cmd["leaked"], route=_route_from(hops, i)))
    return {"answers": rogue.listen()}


def close_leaked_hops(rogue: Rogue, cmd: dict) -> dict:
    _, hops = rogue.victim()
    for i, hop in enumerate(hops):
        rogue.send(hop.endpoint, p.Close(session=cmd["leaked"], route=_route_from(hops, i)))
    return {"answers": rogue.listen()}


def forward_pos0_leaked(rogue: Rogue, cmd: dict) -> dict:
    """Start the live session over, with the rogue's input, at every hop."""
    _, hops = rogue.victim()
    for i in range(len(hops)):
        _forward(rogue, hops, i, cmd, session=cmd["leaked"], pos=0)
    answers = rogue.listen()
    return {"answers": answers, "won": _computed_for_rogue(answers)}


def forward_step_leaked(rogue: Rogue, cmd: dict) -> dict:
    """Steps of the live session at positions it may be at, with the rogue's input."""
    _, hops = rogue.victim()
    for i in range(len(hops)):
        for pos in range(cmd["pos"], cmd["pos"] + 48):
            _forward(rogue, hops, i, cmd, session=cmd["leaked"], pos=pos, tokens=1)
    answers = rogue.listen()
    return {"answers": answers, "won": _computed_for_rogue(answers)}


def reuse_kept(rogue: Rogue, cmd: dict) -> dict:
    """A session of the rogue's own, started from KV a hop keeps for another's ended one."""
    _, hops = rogue.victim()
    for i in range(len(hops)):
        _forward(rogue, hops, i, cmd, session=new_id(), pos=cmd.get("kept_tokens", 8), reuse=cmd["kept"], tokens=1)
    answers = rogue.listen()
    return {"answers": answers, "won": _computed_for_rogue(answers)}


# -- the same, as one BATCH (what a node sends a peer for a pass): each message judged alone --

def token_feed_key_batched(rogue: Rogue, cmd: dict) -> dict:
    """token_feed_key's TOKENs as BATCHes, as a tail sends a pass's tokens to its head."""
    key, hops = rogue.victim()
    rogue.send_batch(hops[0].endpoint, [(p.Token(session=key, step=step, token=3, pos=step + 8), ())
                                        for step in range(96)])
    return {"answers": rogue.listen()}


def cancel_leaked_batched(rogue: Rogue, cmd: dict) -> dict:
    """A PING, which any member may send, then a CANCEL of the live session, in one BATCH to every hop."""
    _, hops = rogue.victim()
    for i, hop in enumerate(hops):
        rogue.send_batch(hop.endpoint, [(p.Ping(nonce=i + 1), ()),
                                        (p.Cancel(session=cmd["leaked"], route=_route_from(hops, i)), ())])
    return {"answers": rogue.listen()}


def forward_step_leaked_batched(rogue: Rogue, cmd: dict) -> dict:
    """forward_step_leaked's steps as one BATCH to each hop, as the hop before would send a pass's."""
    _, hops = rogue.victim()
    for i in range(len(hops)):
        rogue.send_batch(hops[i].endpoint, [_forward_message(rogue, hops, i, cmd, session=cmd["leaked"], pos=pos,
                                                             tokens=1)
                                            for pos in range(cmd["pos"], cmd["pos"] + 48)])
    answers = rogue.listen()
    return {"answers": answers, "won": _computed_for_rogue(answers)}


# -- bounds ----------------------------------------------------------------------------------

def bad_token_id(rogue: Rogue, cmd: dict) -> dict:
    """A prompt whose token id is past the vocabulary, into the head's layers."""
    _, hops = rogue.victim()
    msg = p.Forward(session=new_id(), step=0, pos=0, start_layer=0, end_layer=hops[0].end_layer,
                    route=_route_from(hops, 0), reply_to=rogue.endpoint, sampling=GREEDY)
    rogue.send(hops[0].endpoint, msg, (torch.tensor([[1, cmd["vocab"] + 7, 2]], dtype=torch.int64),))
    answers = rogue.listen()
    return {"answers": answers, "won": not _refused(answers)}


def oversized_generate(rogue: Rogue, cmd: dict) -> dict:
    """A prompt plus max_tokens past the model's context."""
    _, hops = rogue.victim()
    rogue.send(hops[0].endpoint, p.Generate(request_id=new_id(), route=tuple(hops), prompt="hello world",
                                            max_tokens=cmd["context"]))
    answers = rogue.listen(1.0)
    return {"answers": answers, "won": any(a.get("event") == "start" for a in answers)}


def resume_flood(rogue: Rogue, cmd: dict) -> dict:
    """65,536 resumed token ids: a prefill far past the prompt limit and the context."""
    _, hops = rogue.victim()
    rogue.send(hops[0].endpoint, p.Generate(request_id=new_id(), route=tuple(hops), prompt="hello",
                                            max_tokens=p.MAX_RESUME, resume=(5,) * p.MAX_RESUME))
    answers = rogue.listen(1.0)
    return {"answers": answers, "won": any(a.get("event") == "start" for a in answers)}


def megabyte_prompt(rogue: Rogue, cmd: dict) -> dict:
    """A prompt of a megabyte, which the head would have to tokenize in its loop to refuse."""
    _, hops = rogue.victim()
    rogue.send(hops[0].endpoint, p.Generate(request_id=new_id(), route=tuple(hops), prompt="lorem ipsum " * 87_000,
                                            max_tokens=2))
    answers = rogue.listen(1.0)
    refused = any(a.get("error_code") == p.ErrorCode.PROMPT_TOO_LONG and "characters" in a.get("text", "")
                  for a in answers)
    return {"answers": answers, "won": not refused}


def forward_past_context(rogue: Rogue, cmd: dict) -> dict:
    _, hops = rogue.victim()
    for i in range(len(hops)):
        _forward(rogue, hops, i, cmd, session=new_id(), pos=cmd["context"] - 2, tokens=8)
    answers = rogue.listen()
    return {"answers": answers, "won": _refused(answers) < len(hops)}


def session_flood(rogue: Rogue, cmd: dict) -> dict:
    """More new sessions at the tail than it may hold: the ones past its limit must be refused."""
    _, hops = rogue.victim()
    sent = cmd["limit"] + 24
    for _ in range(sent):
        _forward(rogue, hops, len(hops) - 1, cmd, session=new_id(), pos=0, tokens=2)
    answers = rogue.listen(2.0)
    busy = _refused(answers, p.ErrorCode.BUSY)
    return {"answers": answers[:8], "busy": busy, "won": busy < sent - cmd["limit"]}


def cross_tenant_prefix(rogue: Rogue, cmd: dict) -> dict:
    """The victim's own prompt under another API key: served from the victim's kept KV, its
    first token would come early and tell the rogue what the victim asked (judged by the
    arena from the hops' reuse counts)."""
    _, hops = rogue.victim()
    rogue.send(hops[0].endpoint, p.Generate(request_id=new_id(), route=tuple(hops), messages=tuple(cmd["messages"]),
                                            max_tokens=2, api_key="rogue-key"))
    return {"answers": rogue.listen(3.0)}


ATTACKS = {f.__name__: f for f in (
    cancel_feed_key_head, cancel_feed_key_hops, close_feed_key_hops, token_feed_key, error_feed_key,
    generate_same_id, cancel_leaked_hops, close_leaked_hops, forward_pos0_leaked, forward_step_leaked,
    token_feed_key_batched, cancel_leaked_batched, forward_step_leaked_batched, reuse_kept, bad_token_id,
    oversized_generate, resume_flood, megabyte_prompt, forward_past_context, session_flood, cross_tenant_prefix)}
