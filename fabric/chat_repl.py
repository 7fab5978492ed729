"""``meshnet chat``: one prompt and its reply, or a conversation at a ``>>> `` prompt.

Which one follows ``ollama run``:

- stdin is not a terminal (a pipe, a file): the whole of stdin is the prompt, followed by
  the PROMPT words if any, joined by a space; one reply, then exit;
- a PROMPT on the command line and stdin a terminal: that prompt, one reply;
- neither: a chat that keeps the conversation. ``/bye`` or Ctrl-D ends it, ``/clear``
  forgets it; Ctrl-C during a reply cancels it on every node and returns to the prompt;
  Ctrl-C at the prompt ends the chat.

Replies stream to stdout token by token; a refusal is one ``meshnet: error:`` line.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import TextIO

from .client import Client, FabricError, GenerateArgs
from .flags import CommandError, error_line, refuse_absent_tracker
from .net.security import Security
from .wire.protocol import Sampling

PROMPT = ">>> "
HELP = """Available commands:
  /clear   forget the conversation so far
  /bye     exit (as Ctrl-D)
  /?       this help
Ctrl-C stops a reply; at the prompt it exits."""


@dataclass(frozen=True)
class ChatConfig:
    """``meshnet chat``'s flags, resolved once."""

    tracker: str  # the tracker's endpoint, which names the route
    security: Security | None  # CurveZMQ keys of a secured swarm (--keys); None: plaintext
    model: str  # the model id to chat with
    system: str | None  # a system message that starts every conversation; None: none
    max_tokens: int  # the most tokens of one reply
    sampling: Sampling  # temperature, top_k, top_p, seed
    stop: tuple[str, ...]  # a reply ends before the first of these

    @classmethod
    def from_args(cls, args, security: Security | None) -> ChatConfig:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        return cls(args.tracker, security, args.model, args.system, args.max_tokens, sampling,
                   tuple(args.stop or ()))

    def opening(self) -> list[dict]:
        """The messages a conversation starts with."""
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def request(self, messages: list[dict]) -> dict:
        """``Client.generate`` keyword arguments for a reply to ``messages``."""
        return {"messages": messages, "max_tokens": self.max_tokens, "sampling": self.sampling, "stop": self.stop}

    def check(self) -> None:
        """Refuse a flag value the fabric would refuse, before any prompt: CommandError (2)."""
        try:
            GenerateArgs.of(self.model, **self.request([*self.opening(), {"role": "user", "content": "-"}]))
        except FabricError as exc:
            raise CommandError(f"{exc.message} (see `meshnet chat --help`)") from None


def run(config: ChatConfig, words: list[str], stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """``meshnet chat [PROMPT...]``: the exit status."""
    config.check()
    interactive = stdin.isatty() and not words
    prompt = None if interactive else one_prompt(words, stdin)
    refuse_absent_tracker(config.tracker)  # after the usage errors: a refused port answers at once
    with Client(config.tracker, security=config.security) as client:
        if interactive:
            return Conversation(client, config, stdout).loop()
        return one_shot(client, config, prompt, stdout)


def one_prompt(words: list[str], stdin: TextIO) -> str:
    """stdin (when it is not a terminal) and then the PROMPT words, joined by a space as
    ``ollama run`` joins them; stdin's trailing newline and spaces are dropped."""
    parts = [] if stdin.isatty() else [stdin.read().rstrip()]
    prompt = " ".join(part for part in [*parts, *words] if part)
    if not prompt.strip():
        raise CommandError("no prompt: give one as an argument, pipe it on stdin, or run `meshnet chat` "
                           "in a terminal for a conversation")
    return prompt


def one_shot(client: Client, config: ChatConfig, prompt: str, out: TextIO) -> int:
    """One reply to ``prompt``; a fabric refusal is CommandError (1)."""
    reply = Reply(out)
    try:
        reply.stream(client, config, [*config.opening(), {"role": "user", "content": prompt}])
    except FabricError as exc:
        reply.end_line()
        raise CommandError(str(exc), 1) from None
    except KeyboardInterrupt:  # the request is cancelled on every node already
        reply.end_line()
        return 130
    out.write("\n")
    return 0


class Reply:
    """One reply, written to ``out`` token by token as it streams."""

    def __init__(self, out: TextIO):
        self.out = out
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def stream(self, client: Client, config: ChatConfig, messages: list[dict]) -> str:
        """Stream the reply to ``messages``; its text. On any exception (Ctrl-C's
        KeyboardInterrupt too) the request is cancelled on every node before it propagates."""
        with contextlib.closing(client.generate(config.model, **config.request(messages))) as events:
            for event in events:
                if event.event == "token" and event.text:
                    self.out.write(event.text)
                    self.out.flush()
                    self.parts.append(event.text)
        return self.text

    def end_line(self) -> None:
        """Finish a line the reply left open, so what follows starts on its own."""
        if self.parts:
            self.out.write("\n")
            self.out.flush()


class Conversation:
    """The interactive chat: each turn sends the whole conversation so far."""

    def __init__(self, client: Client, config: ChatConfig, out: TextIO):
        self.client = client
        self.config = config
        self.out = out
        self.messages = config.opening()  # the conversation so far: system, then user and assistant turns

    def loop(self) -> int:
        _line_editing()
        while True:
            try:
                line = input(PROMPT)
            except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt
                self.out.write("\n")
                return 0
            if line.strip() == "/bye":
                return 0
            self.handle(line)

    def handle(self, line: str) -> None:
        """One line typed at the prompt: a command, or the next user message."""
        command = line.strip().split(maxsplit=1)[0] if line.strip() else ""
        if not command:
            return
        if command == "/clear":
            self.messages = self.config.opening()
            print("Cleared the conversation.", file=self.out)
        elif command in ("/?", "/help"):
            print(HELP, file=self.out)
        elif command.startswith("/"):
            print(f"Unknown command '{command}'. Type /? for help.", file=self.out)
        else:
            self.turn(line)

    def turn(self, text: str) -> None:
        """Send ``text`` with the conversation; keep the turn only when its reply completes."""
        asked = [*self.messages, {"role": "user", "content": text}]
        reply = Reply(self.out)
        try:
            answer = reply.stream(self.client, self.config, asked)
        except KeyboardInterrupt:  # cancelled on every node; the turn is forgotten
            reply.end_line()
            self.out.write("\n")
            return
        except FabricError as exc:
            reply.end_line()
            error_line(str(exc))
            return
        self.out.write("\n\n")
        self.messages = [*asked, {"role": "assistant", "content": answer}]


def _line_editing() -> None:
    """Arrow keys and history at the prompt, where the readline module exists."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (importing it is what turns it on for input())
