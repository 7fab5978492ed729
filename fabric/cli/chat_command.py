"""``meshnet chat``: a prompt or a conversation in the terminal (the loop is fabric.chat_repl)."""
from __future__ import annotations

from .options import load_security, tracker_flag


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal: one prompt, or a conversation",
                       description="Without PROMPT and with stdin a terminal: a conversation at a >>> prompt "
                                   "(/bye or Ctrl-D ends it; Ctrl-C stops a reply). Piped stdin is the prompt, "
                                   "followed by PROMPT if given, joined by a space (as `ollama run`).")
    tracker_flag(p)
    p.add_argument("--model", default="smollm2-135m", help="the model id to chat with, as `meshnet status` lists it")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message first (default: none)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="the most tokens of a reply")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature, 0 is greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest tokens, 0 for all")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass, 1 for all")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="make sampling repeatable (default: none, a random seed per reply)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end a reply before this text; repeat for several (default: none)")
    p.add_argument("prompt", nargs="*", metavar="PROMPT", help="the user message (its words are joined by a space)")
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from ..chat_repl import ChatConfig
    from ..chat_repl import run as chat

    return chat(ChatConfig.from_args(args, load_security(args)), args.prompt)
