"""Every mistake a first run makes gets one line, `meshnet: error: …`, naming the value and the
fix: status 2 for a usage error, 1 for a runtime one, never a traceback. Each goes through the
real command line in a subprocess, and stops before any weights load."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fabric import config
from fabric.cli import build_parser
from fabric.flags import ENDPOINT_FORM, endpoint
from tests.cluster import ROOT, free_port


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """No config file, data under the test's own directory, and --help unwrapped (COLUMNS)."""
    base = {k: v for k, v in os.environ.items() if k != config.ENV_VAR}
    return {**base, "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data"),
            "XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": "1000"}


@pytest.fixture
def meshnet(env):
    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:  # a loaded machine starts slowly
        return subprocess.run([sys.executable, "-m", "fabric.cli", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=env)
    return run


def refused(out: subprocess.CompletedProcess, status: int, *named: str) -> str:
    """The one line ``out`` failed with, checked: its status, its form, the values it names."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == status, out.stderr
    assert "Traceback" not in out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("meshnet: error: "), lines[0]
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port():
    """A loopback port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def loopback() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


# ----------------------------------------------------------------- 4: one line, not a traceback


def test_a_tracker_on_a_port_in_use_is_one_line(meshnet, taken_port):
    out = meshnet("tracker", "--bind", f"tcp://127.0.0.1:{taken_port}", "--pub", loopback())
    refused(out, 2, f"port {taken_port} (the tracker, --bind)", "Is another tracker running?", "--bind and --pub")
    out = meshnet("tracker", "--pub", f"127.0.0.1:{taken_port}", "--bind", loopback())
    refused(out, 2, f"port {taken_port} (its feed, --pub)")


def test_a_web_ui_on_a_port_in_use_is_one_line(meshnet, taken_port):
    out = meshnet("webui", "--port", str(taken_port), "--tracker", loopback(), "--pub", loopback())
    refused(out, 2, f"port {taken_port} (the web UI, --port)", "another port with --port")


def test_an_address_that_cannot_be_bound_while_starting_is_a_runtime_error(meshnet):
    # 192.0.2.1 (TEST-NET-1) is on no machine: the port check passes, the bind itself fails
    out = meshnet("--log-level", "error", "tracker", "--bind", "tcp://192.0.2.1:5555", "--pub", loopback(),
                  "--db", ":memory:")
    refused(out, 1, "cannot listen", "192.0.2.1:5555", "choose another --bind")
    out = meshnet("webui", "--log-level", "error", "--host", "192.0.2.1", "--port", str(free_port()),
                  "--tracker", loopback(), "--pub", loopback())
    refused(out, 1, "cannot listen on 192.0.2.1:", "choose another --host or --port")


@pytest.mark.parametrize("command", ["webui", "up"])
def test_a_missing_api_keys_file_is_one_line(meshnet, tmp_path, command):
    missing = tmp_path / "missing.keys"
    refused(meshnet(command, "--api-keys", str(missing)), 2, f"--api-keys {missing}", "No such file",
            "one API key per line")


def test_a_key_directory_that_cannot_be_made_is_one_line(meshnet):
    refused(meshnet("keys", "/proc/nope"), 1, "cannot write a key pair to /proc/nope", "choose a directory")


def test_an_existing_key_pair_is_not_overwritten(meshnet, tmp_path):
    assert meshnet("keys", str(tmp_path / "k")).returncode == 0
    refused(meshnet("keys", str(tmp_path / "k")), 2, "already holds a key pair")


@pytest.mark.parametrize("args, flag", [
    (["tracker", "--bind", "garbage"], "--bind"),
    (["tracker", "--pub", "http://127.0.0.1:80"], "--pub"),
    (["node", "--model", "m", "--bind", "garbage"], "--bind"),
    (["node", "--model", "m", "--advertise", "127.0.0.1"], "--advertise"),
    (["node", "--model", "m", "--relay", "tcp://:1"], "--relay"),
    (["relay", "--bind", "garbage"], "--bind"),
    (["status", "--tracker", "127.0.0.1:99999"], "--tracker"),
    (["up", "--tracker", "garbage"], "--tracker"),
])
def test_a_garbage_endpoint_is_refused_at_parse_time_with_the_expected_form(meshnet, args, flag):
    line = refused(meshnet(*args), 2, f"argument {flag}: {args[-1]!r} is not an endpoint", ENDPOINT_FORM)
    assert f"meshnet {args[0]} --help" in line


@pytest.mark.parametrize("args, message", [
    (["tracker", "--heartbeat", "0"], "argument --heartbeat: '0' is not a number of seconds above 0"),
    (["node", "--model", "m", "--heartbeat", "-1"], "argument --heartbeat: '-1' is not a number of seconds"),
    (["node", "--model", "m", "--threads", "-2"], "argument --threads: '-2' is not a whole number of 0 or more"),
    (["node", "--model", "m", "--max-sessions", "0"], "argument --max-sessions: '0' is not a whole number of 1"),
    (["node", "--model", "m", "--memory", "nan"], "argument --memory: 'nan' is not a number of 0 or more"),
    (["webui", "--port", "70000"], "argument --port: '70000' is not a TCP port"),
    (["up", "--nodes", "0"], "argument --nodes: '0' is not a whole number of 1 or more"),
    (["relay", "--node-timeout", "0"], "argument --node-timeout: '0' is not a number of seconds above 0"),
])
def test_a_number_out_of_range_is_refused_at_parse_time(meshnet, args, message):
    refused(meshnet(*args), 2, message)


def test_no_command_is_one_line(meshnet):
    refused(meshnet(), 2, "the following arguments are required: COMMAND", "`meshnet --help`")


def test_status_takes_host_port_and_says_the_tracker_did_not_answer(meshnet):
    port = free_port()
    out = meshnet("status", "--tracker", f"127.0.0.1:{port}")
    refused(out, 1, f"tracker_unavailable: tracker at tcp://127.0.0.1:{port} did not answer")


def test_every_endpoint_flag_takes_host_port_and_means_tcp(env):
    assert endpoint("127.0.0.1:5555") == endpoint("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert endpoint("*:0") == "tcp://*:0" and endpoint("[::1]:7") == "tcp://[::1]:7"
    assert endpoint("ipc:///tmp/x") == "ipc:///tmp/x"
    argv = {"tracker": ["--bind", "h:1", "--pub", "h:2", "--relay", "h:3"],
            "node": ["--model", "m", "--tracker", "h:1", "--bind", "h:2", "--advertise", "h:3", "--relay", "h:4",
                     "--relay-fallback", "h:5"],
            "webui": ["--tracker", "h:1", "--pub", "h:2"], "status": ["--tracker", "h:1"],
            "up": ["--tracker", "h:1", "--pub", "h:2"], "relay": ["--bind", "h:1"]}
    for command, flags in argv.items():
        args = vars(build_parser().parse_args([command, *flags]))
        given = [v for f, v in zip(flags, flags[1:]) if f.startswith("--") and v.startswith("h:")]
        assert sorted(v for v in args.values() if isinstance(v, str) and v.startswith("tcp://h:")) \
            == sorted(f"tcp://{v}" for v in given), command


# ----------------------------------------------------------------- 5: --version; --config, --log-level anywhere


def test_version(meshnet):
    from importlib.metadata import version

    out = meshnet("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"meshnet {version('meshnet')}"


def test_config_and_log_level_work_after_the_command_too(meshnet, tmp_path, env):
    missing = tmp_path / "nope.toml"
    refused(meshnet("status", "--config", str(missing)), 2, f"config file {missing} (from --config) does not exist")
    refused(meshnet("status", "--log-level", "loud"), 2, "argument --log-level: invalid choice: 'loud'")
    path = tmp_path / "m.toml"
    path.write_text('log-level = "warning"\n[webui]\nport = 8123\n')
    for argv in (["--config", str(path), "webui"], ["webui", "--config", str(path)], ["webui", f"--config={path}"]):
        parser = build_parser()
        config.apply(parser, argv, env)
        args = parser.parse_args(argv)
        assert (args.port, args.log_level, args.config) == (8123, "warning", str(path)), argv
    argv = ["--log-level", "error", "node", "--model", "m", "--log-level", "debug"]
    assert build_parser().parse_args(argv).log_level == "debug"  # after the command wins
    assert build_parser().parse_args(["--log-level", "error", "node", "--model", "m"]).log_level == "error"


# ----------------------------------------------------------------- 6: flags that would be ignored


def test_node_refuses_memory_with_layers(meshnet):
    out = meshnet("node", "--model", "no-such-model", "--layers", "0-3", "--memory", "2")
    refused(out, 2, "--memory 2 with --layers 0-3", "give one of them")


def test_node_refuses_a_relay_key_without_keys_or_relay(meshnet, tmp_path):
    out = meshnet("node", "--model", "no-such-model", "--relay", loopback(), "--relay-key", "K" * 40)
    refused(out, 2, f"--relay-key {'K' * 40} without --keys", "add --keys DIR, or leave out --relay-key")
    assert meshnet("keys", str(tmp_path / "k"), "--tracker").returncode == 0
    out = meshnet("node", "--model", "no-such-model", "--keys", str(tmp_path / "k"), "--relay-key", "K" * 40)
    refused(out, 2, "without --relay or --relay-fallback")


def test_tracker_refuses_relay_settings_without_a_relay(meshnet):
    refused(meshnet("tracker", "--relay-front-ports", "41000-41010"), 2, "--relay-front-ports", "add --relay")


@pytest.mark.parametrize("text", ["", "\n\n", "# keys go here\n   \n"])
def test_webui_refuses_an_api_keys_file_without_keys(meshnet, tmp_path, text):
    keys = tmp_path / "api.keys"
    keys.write_text(text)
    refused(meshnet("webui", "--api-keys", str(keys)), 2, f"--api-keys {keys} holds no keys",
            "leave out --api-keys to serve without authentication")


# ----------------------------------------------------------------- 8: tracker_unavailable; a missing tracker.key


def test_a_silent_tracker_has_its_own_code_and_is_a_503():
    from fabric.wire.protocol import ErrorCode
    from webui.errors import from_fabric

    error = from_fabric(ErrorCode.TRACKER_UNAVAILABLE, "tracker at tcp://x:1 did not answer")
    assert (error.status, error.code, error.type) == (503, "tracker_unavailable", "server_error")


@pytest.mark.parametrize("command", [["node", "--model", "no-such-model", "--layers", "0-1"], ["status"],
                                     ["webui"], ["up", "--model", "no-such-model"]])
def test_a_secured_swarm_without_the_trackers_key_says_which_file_to_copy(meshnet, tmp_path, command):
    keys = tmp_path / "k"
    assert meshnet("keys", str(keys)).returncode == 0  # not the tracker's: no allowed/tracker.key
    target = keys / "allowed" / "tracker.key"
    # the unknown model shows the check comes first, before any model (let alone weights) loads
    line = refused(meshnet(*command, "--keys", str(keys), "--tracker", loopback()), 2, f"{target} is missing",
                   f"to {target}")
    source = f"{keys}/id.key" if command[0] == "up" else "the tracker's id.key"
    assert f"copy {source}" in line


# ----------------------------------------------------------------- 9: --help shows every default


def _commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return parser, sub.choices


def test_every_flag_has_help_and_shows_its_default():
    parser, commands = _commands()
    for name, command in [("", parser), *commands.items()]:
        if name == "chat":
            continue  # its flags are being reworked with the command
        text = command.format_help()
        for action in command._actions:
            if not action.option_strings or action.dest in ("help", "version") or action.nargs == 0:
                continue
            assert action.help, f"meshnet {name} {action.option_strings[0]} has no help"
            shown = command._get_formatter()._expand_help(action) if action.help else ""
            assert "default" in shown or action.required, f"meshnet {name} {action.option_strings[0]}: {shown}"
        assert "%(default)" not in text


def test_help_shows_the_defaults_a_config_file_sets(meshnet, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('log-level = "warning"\n[webui]\nport = 8123\nhost = "0.0.0.0"\n')
    out = meshnet("webui", "--help", "--config", str(path))
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "port the web server listens on (default 8123) (set in" in text and "[webui] port)" in text
    assert "[webui] host)" in text and "(default 0.0.0.0)" in text
    assert "how much to log, as `meshnet --log-level` (set in" in text and "log-level: warning)" in text
    assert f"(in use: {path})" in text
    plain = " ".join(meshnet("webui", "--help").stdout.split())
    assert "port the web server listens on (default 8000)" in plain and "(default: info)" in plain


def test_unknown_flag_is_one_line(meshnet):
    refused(meshnet("tracker", "--hartbeat", "2"), 2, "unrecognized arguments: --hartbeat 2")


def test_the_package_version_matches_setup_cfg():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(Path(ROOT) / "setup.cfg")
    from fabric.flags import version

    assert version() == cfg.get("metadata", "version")
