"""The ``meshnet`` config file: TOML that holds any command-line flag.

Top-level keys apply to every command that has the flag (and to ``meshnet``'s own flags such
as ``log-level``); a table per command applies to that command only::

    log-level = "debug"
    tracker = "tcp://192.0.2.10:5555"

    [node]
    model = "smollm2-135m"
    max-sessions = 8
    hop_timeout = 20

Keys are flag names, with dashes or underscores. A top-level ``true``/``false`` goes to the
switches of that name, any other top-level value to the flags that take a value. The file
only sets defaults: flags typed on the command line win, and a table's key wins over the
same top-level key. Nothing here knows the flags: they are read off the argparse parser, so
every flag (a command added later included) can be set from the file, and each value goes
through the flag's own ``type`` and ``choices``. The file is ``--config FILE``, else
``$MESHNET_CONFIG``, else ``~/.config/meshnet/config.toml`` (``$XDG_CONFIG_HOME``) when it
exists.
"""
from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV_VAR = "MESHNET_CONFIG"
NOT_SETTABLE = {"help", "version", "config"}  # flags the file cannot set


class ConfigError(Exception):
    """The config file is missing, malformed, or names a flag that does not exist."""


def default_path(env: Mapping[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/meshnet/config.toml``, by default under ``~/.config``."""
    base = env.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "meshnet" / "config.toml"


def apply(parser: argparse.ArgumentParser, argv: Sequence[str], env: Mapping[str, str] = os.environ) -> Path | None:
    """Find the config file for ``argv`` and make its values ``parser``'s defaults.

    Returns the file used (None: no file). Raises ConfigError naming the file and the key.
    Call before ``parser.parse_args(argv)``.
    """
    command, explicit = _scan(parser, argv)
    path = find(explicit, env)
    if path is None:
        return None
    data = load(path)
    commands = _commands(parser)
    settings = _check_names(data, parser, commands, path)
    chosen = commands.get(command)
    values: dict[argparse.Action, tuple[object, str]] = {}  # set once each: a table wins over the top level
    for key, value in settings[None].items():  # the top level: meshnet's own flags, then the command's
        for target in (parser, chosen):
            action = _flags(target).get(_key(key)) if target is not None else None
            # `tracker = "tcp://…"` is for the --tracker ENDPOINT flags, not the switch `keys --tracker`
            if action is not None and (action.nargs == 0) == isinstance(value, bool):
                values[action] = (value, key)
    for name, table in settings.items():
        for key, value in (table.items() if name is not None else ()):
            action, where = _table_flags(parser, commands[name])[_key(key)], f"[{name}] {key}"
            if name == command:
                values[action] = (value, where)
            else:  # checked now all the same: a typo shows before the day that command runs
                convert(action, value, f"{path}: {where}")
    for action, (value, where) in values.items():
        action.default = convert(action, value, f"{path}: {where}")
        action.required = False
        action.config_source = f"{path}, {where}"  # --help says where the default comes from
    for action in parser._actions:
        if action.dest == "config":
            action.default = str(path)  # so commands that start others can hand the file on
    return path


def find(explicit: str | None, env: Mapping[str, str]) -> Path | None:
    """The file to read: ``--config``, else ``$MESHNET_CONFIG``, else the default when it exists."""
    for given, origin in ((explicit, "--config"), (env.get(ENV_VAR), ENV_VAR)):
        if given:
            path = Path(given).expanduser()
            if not path.is_file():
                raise ConfigError(f"config file {path} (from {origin}) does not exist")
            return path
    path = default_path(env)
    return path if path.is_file() else None


def load(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None


def _scan(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[str | None, str | None]:
    """(the command argv runs, the value of --config, before or after the command; the last
    one wins, as when parsed) without parsing argv for real."""
    commands = _commands(parser)
    command, config, current, i = None, None, parser, 0
    while i < len(argv) and argv[i] != "--":
        token = argv[i]
        if not token.startswith("-"):
            if command is None:
                if token not in commands:
                    break  # argparse will say so
                command, current = token, commands[token]
            i += 1
            continue
        name, eq, value = token.partition("=")
        action = current._option_string_actions.get(name)
        takes_value = action is not None and action.nargs != 0 and not eq
        if action is not None and action.dest == "config":
            config = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
        i += 2 if takes_value else 1
    return command, config


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Settable flags of one parser by key: dest and long option names, dashes as underscores.
    A flag whose default is SUPPRESS (a command's copy of ``--log-level``) is meshnet's own:
    the file sets that one."""
    flags = {}
    for action in parser._actions:
        if (not action.option_strings or action.dest in NOT_SETTABLE or isinstance(action, argparse._HelpAction)
                or action.default is argparse.SUPPRESS):
            continue
        names = {action.dest} | {o.lstrip("-") for o in action.option_strings if o.startswith("--")}
        for name in names:
            flags[_key(name)] = action
    return flags


def _table_flags(parser: argparse.ArgumentParser, command: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """What a command's table may set: its flags, and meshnet's own (``log-level``)."""
    return {**_flags(parser), **_flags(command)}


def _key(name: str) -> str:
    return name.replace("-", "_")


def _check_names(data: dict, parser, commands: dict, path: Path) -> dict[str | None, dict]:
    """Group the file's keys by command (None: top level), rejecting any that is no flag."""
    every = {k for p in (parser, *commands.values()) for k in _flags(p)}
    settings: dict[str | None, dict] = {None: {}}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in commands:
                raise ConfigError(f"{path}: [{key}] is not a meshnet command; tables: "
                                  f"{', '.join(f'[{c}]' for c in commands)}")
            flags = _table_flags(parser, commands[key])
            for sub_key, sub_value in value.items():
                if _key(sub_key) not in flags:
                    raise ConfigError(f"{path}: unknown key {sub_key!r} in [{key}]: `meshnet {key}` has no "
                                      f"--{sub_key.replace('_', '-')} flag (see meshnet {key} --help)")
            settings[key] = value
        elif _key(key) in every:
            settings[None][key] = value
        else:
            raise ConfigError(f"{path}: unknown key {key!r}: no meshnet command has a "
                              f"--{key.replace('_', '-')} flag")
    return settings


def convert(action: argparse.Action, value, where: str):
    """``value`` from TOML as the flag would have parsed it; ConfigError otherwise."""
    if action.nargs == 0:  # a switch: true means "the flag is given"
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        if isinstance(action, argparse._CountAction):
            return int(value)
        return action.const if value else action.default
    many = action.nargs not in (None, "?") or isinstance(action, argparse._AppendAction)
    if many != isinstance(value, list):
        raise ConfigError(f"{where}: expected {'a list' if many else 'one value'}, got {value!r}")
    if many:
        return [_one(action, v, where) for v in value]
    return _one(action, value, where)


def _one(action: argparse.Action, value, where: str):
    if isinstance(value, (bool, dict, list)) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: expected a value such as on the command line, got {value!r}")
    text = str(value)
    try:
        result = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (TypeError, ValueError):
        kind = getattr(action.type, "__name__", "")
        raise ConfigError(f"{where}: invalid {kind} value {value!r}") from None
    if action.choices is not None and result not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return result
