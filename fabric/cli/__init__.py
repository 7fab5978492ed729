"""``meshnet`` command line: every flag is resolved here, once, into config dataclasses.

One module per command (``up_command``, ``node_command``, …: its parser, and its flags turned
into a config); the pieces several share beside them: ``options`` (shared flags, the key pair),
``ports`` (refusing a taken port), ``supervision`` (starting and stopping a group of processes,
which the tests and bench/ use too), ``status_view``, ``torch_env`` (OpenMP and torch settings
made before torch loads) and ``memory_plan`` (device, quantization scheme, layers that fit)."""
from __future__ import annotations

import argparse
import logging
import sys

from ..compute import model_store
from ..flags import CommandError, HelpFormatter, Parser, error_line, version
from . import (
    chat_command,
    keys_command,
    node_command,
    peers_command,
    relay_command,
    status_command,
    tracker_command,
    up_command,
    webui_command,
)


def main(argv: list[str] | None = None) -> int:
    from ..config import ConfigError, apply

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        apply(parser, argv)  # the config file's values become the flags' defaults
    except ConfigError as exc:
        error_line(str(exc))
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; a refusal is one ``meshnet: error:`` line and its status."""
    from ..net.security import SecurityError

    try:
        return args.func(args) or 0
    except CommandError as exc:
        error_line(str(exc))
        return exc.status
    except SecurityError as exc:
        error_line(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130


LOG_LEVELS = ["debug", "info", "warning", "error"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="meshnet", formatter_class=HelpFormatter,
                    description="Run one language model across several machines over a ZeroMQ fabric.")
    parser.add_argument("--version", action="version", version=f"meshnet {version()}")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="how much to log")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML file whose keys set any flag: top-level keys for every command, a [node], [up], "
                             "[tracker]… table per command; flags typed here win (default: $MESHNET_CONFIG, else "
                             "~/.config/meshnet/config.toml if it exists)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up_command.add_parser(sub)
    tracker_command.add_parser(sub)
    node_command.add_parser(sub)
    webui_command.add_parser(sub)
    chat_command.add_parser(sub)
    status_command.add_parser(sub)
    keys_command.add_parser(sub)
    relay_command.add_parser(sub)
    model_store.add_parsers(sub)  # models, pull
    peers_command.add_flags(sub.choices["pull"])  # pull --tracker: from peers
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
        _shared_flags(command, parser)
    return parser


def _shared_flags(p: argparse.ArgumentParser, meshnet: argparse.ArgumentParser) -> None:
    """meshnet's own flags, also after the command (``meshnet up --config FILE``); typed
    there they win, left out they keep the value given before the command."""
    own = {a.dest: a for a in meshnet._actions}
    level = p.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                           help="how much to log, as `meshnet --log-level`")
    config = p.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE",
                            help="the config file, as `meshnet --config FILE` (default: $MESHNET_CONFIG, else "
                                 "~/.config/meshnet/config.toml if it exists)")
    level.same_as, config.same_as = own["log_level"], own["config"]  # whose default --help shows
