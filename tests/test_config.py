"""The TOML config file: every flag settable, typed like the flag, typos rejected with the file named."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabric import config
from fabric.cli import build_parser
from tests.cluster import ROOT, free_port

@pytest.fixture
def env(tmp_path):
    """An environment whose default config path is an empty temp directory."""
    return {"XDG_CONFIG_HOME": str(tmp_path / "xdg-config")}


def write(tmp_path: Path, text: str, name: str = "meshnet.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(argv: list[str], env: dict, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or build_parser()
    config.apply(parser, argv, env)
    return parser.parse_args(argv)


def test_tables_and_top_level_keys_become_typed_defaults(tmp_path, env):
    path = write(tmp_path, """
log-level = "debug"
tracker = "tcp://192.0.2.10:5555"

[node]
model = "smollm2-135m"
max-sessions = 8
hop_timeout = 20
no-progress = true
quant = "int8"
""")
    args = parse(["--config", str(path), "node", "--layers", "0-3"], env)
    assert args.log_level == "debug"
    assert args.tracker == "tcp://192.0.2.10:5555"  # top level reaches the command's flag
    assert args.model == "smollm2-135m"  # a required flag is satisfied by the file
    assert args.max_sessions == 8 and isinstance(args.max_sessions, int)
    assert args.hop_timeout == 20.0 and isinstance(args.hop_timeout, float)  # through the flag's type
    assert args.no_progress is True and args.quant == "int8"
    assert args.layers == "0-3" and args.heartbeat == 1.0  # untouched flags keep their defaults
    assert args.config == str(path)


def test_command_line_wins_over_table_and_table_over_top_level(tmp_path, env):
    path = write(tmp_path, 'tracker = "tcp://10.0.0.1:1"\n[status]\ntracker = "tcp://10.0.0.2:2"\n'
                           '[chat]\nmax-tokens = 5\n')
    assert parse(["--config", str(path), "status"], env).tracker == "tcp://10.0.0.2:2"
    assert parse(["--config", str(path), "status", "--tracker", "tcp://10.0.0.3:3"], env).tracker == "tcp://10.0.0.3:3"
    chat = parse([f"--config={path}", "chat", "--max-tokens", "7", "hi"], env)
    assert chat.tracker == "tcp://10.0.0.1:1" and chat.max_tokens == 7
    assert parse(["--config", str(path), "chat", "hi"], env).max_tokens == 5


def test_top_level_value_skips_a_switch_of_the_same_name(tmp_path, env):
    # `tracker = "tcp://…"` is the endpoint of most commands, but `keys --tracker` is a switch
    path = write(tmp_path, 'tracker = "tcp://10.0.0.1:1"\n')
    assert parse(["--config", str(path), "keys", "some-dir"], env).tracker is False
    path = write(tmp_path, '[keys]\ntracker = true\n', "k.toml")
    assert parse(["--config", str(path), "keys", "some-dir"], env).tracker is True


def test_file_comes_from_flag_then_env_then_default_path(tmp_path, env):
    default = Path(env["XDG_CONFIG_HOME"]) / "meshnet" / "config.toml"
    default.parent.mkdir(parents=True)
    default.write_text("[webui]\nport = 1001\n")
    from_env = write(tmp_path, "[webui]\nport = 1002\n", "env.toml")
    explicit = write(tmp_path, "[webui]\nport = 1003\n", "explicit.toml")
    assert parse(["webui"], env).port == 1001
    assert parse(["webui"], {**env, config.ENV_VAR: str(from_env)}).port == 1002
    assert parse(["--config", str(explicit), "webui"], {**env, config.ENV_VAR: str(from_env)}).port == 1003
    default.unlink()
    assert parse(["webui"], env).port == 8000 and parse(["webui"], env).config is None


@pytest.mark.parametrize("text, message", [
    ("[node]\nmax-session = 3\n", "unknown key 'max-session' in [node]"),
    ("bogus_flag = 1\n", "unknown key 'bogus_flag'"),
    ("[nodes]\nport = 1\n", "[nodes] is not a meshnet command"),
    ("[node]\ndtype = \"float16\"\n", "[node] dtype: 'float16' is not one of float32, bfloat16"),
    ("[node]\nmax-sessions = \"lots\"\n", "[node] max-sessions: 'lots' is not a whole number of 1 or more"),
    ("[node]\nmax-sessions = 2.5\n", "[node] max-sessions: '2.5' is not a whole number of 1 or more"),
    ("[chat]\nmax-tokens = \"lots\"\n", "[chat] max-tokens: invalid int value 'lots'"),
    ("[node]\nheartbeat = 0\n", "[node] heartbeat: '0' is not a number of seconds above 0"),
    ("tracker = \"garbage\"\n", "tracker: 'garbage' is not an endpoint: expected tcp://HOST:PORT"),
    ("[node]\nno-progress = \"yes\"\n", "[node] no-progress: expected true or false"),
    ("[node]\nport = [1, 2]\n", "unknown key 'port' in [node]"),
    ("[webui]\nport = [1, 2]\n", "[webui] port: expected one value"),
    ("[chat]\nprompt = \"hi\"\n", "unknown key 'prompt' in [chat]"),  # positionals are not flags
    ("[node]\nconfig = \"x.toml\"\n", "unknown key 'config' in [node]"),
    ("port = \n", "is not valid TOML"),
])
def test_bad_files_are_rejected_naming_file_and_key(tmp_path, env, text, message):
    path = write(tmp_path, text)
    with pytest.raises(config.ConfigError) as err:
        parse(["--config", str(path), "node", "--model", "m"], env)
    assert message in str(err.value) and str(path) in str(err.value)


def test_tables_are_checked_even_for_other_commands(tmp_path, env):
    path = write(tmp_path, "[tracker]\nhartbeat = 2\n")
    with pytest.raises(config.ConfigError, match="unknown key 'hartbeat' in \\[tracker\\]"):
        parse(["--config", str(path), "status"], env)


def test_missing_explicit_file_is_an_error(tmp_path, env):
    with pytest.raises(config.ConfigError, match="does not exist"):
        parse(["--config", str(tmp_path / "nope.toml"), "status"], env)
    with pytest.raises(config.ConfigError, match=f"from {config.ENV_VAR}"):
        parse(["status"], {**env, config.ENV_VAR: str(tmp_path / "nope.toml")})


def parser_with_a_later_command() -> argparse.ArgumentParser:
    """meshnet's parser plus a command and flags nobody told config.py about."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    later = sub.add_parser("later")
    later.add_argument("--hosts", nargs="+", default=[])
    later.add_argument("--peer", action="append", type=int)
    later.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True)
    later.add_argument("--ratio", type=float, required=True)
    return parser


def test_flags_added_later_are_covered_without_changes(tmp_path, env):
    path = write(tmp_path, '[later]\nhosts = ["a", "b"]\npeer = [1, "2"]\nfast = false\nratio = "0.5"\n')
    args = parse(["--config", str(path), "later"], env, parser_with_a_later_command())
    assert args.hosts == ["a", "b"] and args.peer == [1, 2] and args.fast is False and args.ratio == 0.5
    args = parse(["--config", str(path), "later", "--hosts", "c", "--fast"], env, parser_with_a_later_command())
    assert args.hosts == ["c"] and args.fast is True
    bad = write(tmp_path, '[later]\npeer = ["x"]\n', "bad.toml")
    with pytest.raises(config.ConfigError, match=r"\[later\] peer: invalid int value 'x'"):
        parse(["--config", str(bad), "later", "--ratio", "1"], env, parser_with_a_later_command())


def test_scan_finds_command_past_meshnets_own_flags():
    parser = build_parser()
    assert config._scan(parser, ["--log-level", "debug", "--config", "f.toml", "node", "--model", "x"]) == \
        ("node", "f.toml")
    assert config._scan(parser, ["--config=f.toml", "status"]) == ("status", "f.toml")
    assert config._scan(parser, ["--config", "node", "status"]) == ("status", "node")
    assert config._scan(parser, ["--help"]) == (None, None)


# --------------------------------------------------------------------------- the real command line


def meshnet(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != config.ENV_VAR}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "fabric.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=full)


def test_cli_rejects_a_typo_with_exit_2_and_no_traceback(tmp_path, env):
    path = write(tmp_path, "[node]\nmax-sesions = 8\n")
    out = meshnet("--config", str(path), "node", "--layers", "0-1", env=env)
    assert out.returncode == 2
    assert f"{path}: unknown key 'max-sesions' in [node]" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = meshnet("status", env={**env, config.ENV_VAR: str(path)})  # checked whatever the command
    assert out.returncode == 2 and "max-sesions" in out.stderr and "Traceback" not in out.stderr


def test_cli_help_shows_the_files_values(tmp_path, env):
    path = Path(env["XDG_CONFIG_HOME"]) / "meshnet" / "config.toml"  # the default path
    path.parent.mkdir(parents=True)
    path.write_text("[node]\nhop-timeout = 12.5\n")
    out = meshnet("node", "--help", env=env)
    assert out.returncode == 0 and "(default 12.5)" in " ".join(out.stdout.split())
    assert "--config FILE" in meshnet("--help", env=env).stdout


def test_cli_uses_the_files_tracker(tmp_path, env):
    port = free_port()
    path = write(tmp_path, f'[status]\ntracker = "tcp://127.0.0.1:{port}"\n')
    out = meshnet("--config", str(path), "status", env=env, timeout=30)
    assert out.returncode == 1 and f"tracker at tcp://127.0.0.1:{port} did not answer" in out.stderr


def test_the_readme_example_is_a_valid_file(tmp_path, env):
    readme = (ROOT / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    args = parse(["--config", str(write(tmp_path, example)), "node", "--layers", "0-1"], env)
    assert args.max_sessions == 8 and args.hop_timeout == 20.0 and args.no_progress is True
    assert args.tracker == "tcp://192.0.2.10:5555" and args.keys and args.bind == "tcp://0.0.0.0:6000"
