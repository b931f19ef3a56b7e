"""Model repositories on disk: model directories, version directories, change detection.

Layout, as Triton reads it::

    <repository>/<model_name>/config.pbtxt
    <repository>/<model_name>/<version>/model.py

or, for a model of a Python-based backend (``backend: "<name>"``), one ``model.py`` shared by
its models in the backend directory (Triton's ``--backend-directory``)::

    <backend directory>/<name>/model.py

Nothing here imports model code or starts anything; it only looks at the file system.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
from typing import Any, Callable

from tritonclient.grpc.model_config_pb2 import ModelConfig

from tritonpy._errors import (ConfigError, InvalidArgumentError, NotFoundError, UnsupportedError,
                             version_failed)
from tritonpy.config import DEFAULT_MODEL_FILENAME, ENSEMBLE_PLATFORM, PYTHON_BACKEND

__all__ = [
    "DEFAULT_BACKEND_DIRECTORY",
    "available_versions",
    "repository_problem",
    "backend_dir",
    "file_hexdigest",
    "fingerprint",
    "model_file",
    "model_source",
    "run_repo_agents",
    "scan_repositories",
    "select_versions",
    "version_fingerprints",
]

logger = logging.getLogger(__name__)

#: Triton's default ``--backend-directory``: where Python-based backends are looked for.
DEFAULT_BACKEND_DIRECTORY = "/opt/tritonserver/backends"

# Triton's reason for a name found in two repositories (MODEL_READY_REASON_DUPLICATE).
DUPLICATE_REASON = "model appears in two or more repositories"
# The duplicates logged already, with their folders (each is said once).
_told_duplicates: set[tuple[str, tuple[str, ...]]] = set()

# Subdirectories of a model directory that Triton never takes for versions.
_NOT_VERSIONS = frozenset({"warmup", "initial_state", "configs"})

# Written by Python itself when model.py is imported; counting them would make every load
# look like a change to poll mode and reload the model for ever.
_IGNORED_DIRS = frozenset({"__pycache__"})
_IGNORED_SUFFIXES = (".pyc", ".pyo")


def repository_problem(path: str) -> str | None:
    """What is wrong with ``path`` as a model repository's location before looking at the file
    system, or None: an empty one (a launch line's unset variable would otherwise serve the
    current folder; Triton 2.51 stops, "failed to stat file"), or a cloud storage address,
    which tritonpy does not read (it took ``s3://b/m`` for the folder ``s3:/b/m``)."""
    if not path:
        return "the model repository path is empty"
    scheme, sep, _ = path.partition("://")
    if sep and scheme and scheme.isalnum():
        return (f"model repository '{path}': {scheme}:// locations are not supported; "
                "tritonpy serves model repositories in local folders")
    return None


def scan_repositories(paths: list[str],
                      namespaced: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """Find the models in one or more repositories.

    Args:
        paths: Repository roots. The same root given twice counts once.
        namespaced: Triton's ``--model-namespacing``: each model is keyed by
            ``<root>::<name>`` (:func:`namespaced_key`), and a name in two repositories is two
            models.

    Returns:
        ``(models, errors)``: model key (its name, unless ``namespaced``) → model directory,
        and model name → error message for names that cannot be served (without
        ``namespaced``, a name in two repositories, which Triton shows as UNAVAILABLE and
        never loads). A name is in one of the two dicts, never both.
        Hidden entries (``.name``) and plain files are skipped.

    Raises:
        NotFoundError: A root does not exist or is not a directory.
    """
    found: dict[str, list[str]] = {}
    seen_roots: set[str] = set()
    for root in paths:
        real = os.path.realpath(root)
        if real in seen_roots:
            continue
        seen_roots.add(real)
        if not os.path.isdir(root):
            what = "is not a directory" if os.path.exists(root) else "does not exist"
            raise NotFoundError(f"model repository '{root}' {what}")
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError as exc:
            raise NotFoundError(
                f"model repository '{root}' cannot be read: {exc.strerror or exc}"
            ) from None
        for entry in entries:
            if entry.name.startswith(".") or not _is_dir(entry):
                continue
            found.setdefault(entry.name, []).append(os.path.join(root, entry.name))
    models: dict[str, str] = {}
    errors: dict[str, str] = {}
    for name, dirs in found.items():
        if namespaced:
            for d in dirs:
                models[namespaced_key(os.path.dirname(d), name)] = d
        elif len(dirs) == 1:
            models[name] = dirs[0]
        else:
            # Triton's reason, word for word (its index shows it); the folders go to the log,
            # once per set of them (poll mode scans again and again).
            errors[name] = DUPLICATE_REASON
            if (name, tuple(dirs)) not in _told_duplicates:
                _told_duplicates.add((name, tuple(dirs)))
                logger.error("model '%s' is not served: it appears in two or more repositories "
                             "(%s)", name, ", ".join(dirs))
    return models, errors


def namespaced_key(namespace: str, name: str) -> str:
    """A model's key with ``--model-namespacing``: its repository and name, as Triton writes
    them in its log (``/models/a::add``)."""
    return f"{namespace}::{name}"


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # follows symlinks, as Triton's IsDirectory does
    except OSError:
        return False


def available_versions(model_dir: str) -> list[int]:
    """The version numbers present under a model directory, ascending.

    A version is a subdirectory whose name is a decimal number. As in Triton, names with a
    leading zero (``01``) and the ``warmup``, ``initial_state`` and ``configs`` folders are
    not versions. Unlike Triton (``std::stoll``), ``1abc`` is not version 1.

    Raises:
        NotFoundError: ``model_dir`` does not exist.
    """
    try:
        entries = list(os.scandir(model_dir))
    except FileNotFoundError:
        raise NotFoundError(f"model directory '{model_dir}' does not exist") from None
    except NotADirectoryError:
        raise NotFoundError(f"model directory '{model_dir}' is not a directory") from None
    versions = []
    for entry in entries:
        name = entry.name
        if name in _NOT_VERSIONS:
            continue
        if not name.isascii() or not name.isdigit():
            if not name.startswith(".") and _is_dir(entry):  # Triton's words
                logger.warning("ignore version directory '%s' which fails to convert to "
                               "integral number (model directory '%s')", name, model_dir)
            continue
        if len(name) > 1 and name.startswith("0"):
            logger.warning(
                "ignore version directory '%s' which contains leading zeros in its directory "
                "name (model directory '%s')", name, model_dir,
            )
            continue
        if _is_dir(entry):
            versions.append(int(name))
    return sorted(versions)


def select_versions(cfg: ModelConfig, available: list[int]) -> list[int]:
    """The versions to load under the configuration's ``version_policy``, ascending.

    ``latest {num_versions: N}`` (the default, N=1) takes the N highest; ``all`` takes every
    one; ``specific {versions: [...]}`` takes the listed ones that exist. As in Triton, a
    listed version without a directory is logged and skipped, not fatal.

    Raises:
        ConfigError: No version is left to load.
    """
    name = cfg.name or "<unnamed>"
    if not available:
        raise ConfigError(
            f"model '{name}' has no version directory (a numeric subdirectory such as '1'): "
            f"at least one version must be available under the version policy of model '{name}'"
        )
    present = sorted(set(available))
    policy = cfg.version_policy
    choice = policy.WhichOneof("policy_choice") if cfg.HasField("version_policy") else None
    if choice == "all":
        chosen = present
    elif choice == "specific":
        chosen = []
        for v in sorted(set(policy.specific.versions)):
            if v in present:
                chosen.append(v)
            else:
                logger.error(
                    "version %d is specified for model '%s', but the version directory is not "
                    "present", v, name,
                )
    else:
        n = policy.latest.num_versions if choice == "latest" else 1
        chosen = present[-n:] if n > 0 else []
    if not chosen:
        raise ConfigError(
            f"at least one version must be available under the version policy of model "
            f"'{name}' (version_policy {_policy_text(cfg)}; versions present: "
            + ", ".join(str(v) for v in present) + ")"
        )
    return chosen


def _policy_text(cfg: ModelConfig) -> str:
    policy = cfg.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "specific":
        listed = ", ".join(str(v) for v in policy.specific.versions)
        return f"specific {{ versions: [{listed}] }}"
    if choice == "latest":
        return f"latest {{ num_versions: {policy.latest.num_versions} }}"
    return "all { }" if choice == "all" else "latest { num_versions: 1 }"


def backend_dir(cfg: ModelConfig, backend_directory: str) -> str | None:
    """The folder of the Python-based backend ``cfg`` names (``<backend_directory>/<backend>``),
    or None for a model of the python backend (or an ensemble)."""
    if not cfg.backend or cfg.backend == PYTHON_BACKEND or cfg.platform == ENSEMBLE_PLATFORM:
        return None
    return os.path.join(backend_directory, cfg.backend)


def model_file(cfg: ModelConfig, model_dir: str, version: int,
               backend_directory: str = DEFAULT_BACKEND_DIRECTORY) -> str:
    """The path of a version's model file, ``<model_dir>/<version>/<default_model_filename>``;
    for a model of a Python-based backend, the backend's ``model.py`` in
    ``backend_directory``, whatever the version (as Triton 2.51: its ``runtime`` and
    ``default_model_filename`` are not used, nor a model.py in the version directory).

    Raises:
        ConfigError: The model is an ensemble (it has no model file) or the file is missing;
            the message names the path looked at (for a backend, Triton's words first, as
            the failure of that version).
    """
    if cfg.platform == ENSEMBLE_PLATFORM:
        raise ConfigError(f"model '{cfg.name}' is an ensemble and has no model file")
    folder = backend_dir(cfg, backend_directory)
    if folder is not None:
        path = os.path.join(folder, DEFAULT_MODEL_FILENAME)
        if not os.path.isfile(path):
            raise ConfigError(version_failed(version, InvalidArgumentError(
                f"unable to find backend library for backend '{cfg.backend}', try specifying "
                "runtime on the model configuration. (tritonpy runs the python backend and "
                f"Python-based backends, and found no {path}; the backend directory is "
                "Triton's --backend-directory)")))
        return path
    filename = cfg.default_model_filename or DEFAULT_MODEL_FILENAME
    path = os.path.join(model_dir, str(version), filename)
    if not os.path.isfile(path):
        what = "is not a file" if os.path.lexists(path) else "does not exist"
        raise ConfigError(
            f"{path}: model file {what} (model '{cfg.name}', version {version}; set "
            "'default_model_filename' in config.pbtxt to use another file name)"
        )
    return path


def file_hexdigest(path: str, digest: Any) -> str:
    """``digest`` (a new hashlib object) of a file's content, read a MiB at a time (a file of
    a model, or an environment archive, may be gigabytes)."""
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return str(digest.hexdigest())


#: The repository agents tritonpy runs itself (Triton loads ``libtritonrepoagent_<name>.so``).
REPO_AGENTS = ("checksum",)


def run_repo_agents(cfg: ModelConfig, model_dir: str) -> None:
    """Run the ``model_repository_agents`` a model's configuration names, before its load,
    as Triton does. The ``checksum`` agent is Triton's: each parameter ``MD5:<file>`` (the
    algorithm in any case) gives the MD5 digest, in lower-case hex, that a file of the model
    directory must have, else the load fails in Triton's words ("Mismatched MD5 hash for file
    1/model.py, expect: ..., got: ..."), as do a key without a colon and another algorithm.
    A path that leaves the model directory is refused (Triton reads it). Triton 2.51's wheel
    ships no agent (it refuses any: "unable to find 'libtritonrepoagent_checksum.so'");
    tritonpy has no other agent and refuses the rest, naming them.

    Raises:
        InvalidArgumentError: An agent other than checksum, a key it does not take, a file
            missing or outside the model directory, or a mismatched hash.
        UnsupportedError: An algorithm other than MD5.
    """
    for agent in cfg.model_repository_agents.agents:
        if agent.name not in REPO_AGENTS:
            raise InvalidArgumentError(
                f"unable to find repository agent '{agent.name}' (Triton's "
                f"libtritonrepoagent_{agent.name}.so): tritonpy runs the checksum agent only")
        root = os.path.realpath(model_dir)
        for key, digest in agent.parameters.items():
            algorithm, colon, name = key.partition(":")
            if not colon:
                raise InvalidArgumentError(f"failed to parse key: {key}")
            if algorithm.lower() != "md5":
                raise UnsupportedError(f"Unsupported checksum algorithm: {algorithm}")
            path = os.path.realpath(os.path.join(root, name))
            if os.path.commonpath([root, path]) != root:
                raise InvalidArgumentError(
                    f"checksum repository agent: {name} is not in the model directory")
            if not os.path.isfile(path):
                why = "Is a directory" if os.path.isdir(path) else "No such file or directory"
                raise InvalidArgumentError(f"failed to open text file for read {name}: {why}")
            got = file_hexdigest(path, hashlib.md5(usedforsecurity=False))
            if got != digest:
                raise InvalidArgumentError(
                    f"Mismatched MD5 hash for file {name}, expect: {digest}, got: {got}")


def model_source(cfg: ModelConfig, model_dir: str, version: int, path: str,
                 backend_directory: str) -> dict[str, str]:
    """What a stub imports a version's model from (the ``model_file``, ``version_dir`` and,
    for a Python-based backend, ``backend_dir`` of its INITIALIZE and AUTO_COMPLETE frames):
    ``path`` as :func:`model_file` found it, and the version's own directory, which
    ``pb_utils.get_model_dir()`` answers with in either case (as Triton's)."""
    source = {"model_file": path, "version_dir": os.path.join(model_dir, str(version))}
    folder = backend_dir(cfg, backend_directory)
    if folder is not None:
        source["backend_dir"] = folder
    return source


def fingerprint(model_dir: str) -> str:
    """A cheap digest of every name, size and mtime below a model directory.

    Poll mode compares two fingerprints: editing, adding, removing or renaming any file or
    directory (config.pbtxt included) changes it. Python's own bytecode caches
    (``__pycache__``, ``*.pyc``) are left out, since importing the model writes them.

    Raises:
        NotFoundError: ``model_dir`` does not exist.
    """
    if not os.path.isdir(model_dir):
        raise NotFoundError(f"model directory '{model_dir}' does not exist")
    digest = hashlib.blake2b(digest_size=16)
    _walk_into(digest, model_dir)
    return digest.hexdigest()


def version_fingerprints(model_dir: str) -> dict[int, str]:
    """For each version directory, a digest of its files and of the model's files outside
    any version directory, config.pbtxt excepted: what tells a reload, as Triton's
    per-version modification check does, that a version's files are unchanged."""
    if not os.path.isdir(model_dir):
        return {}
    versions = available_versions(model_dir)
    names = {str(v) for v in versions}
    common = hashlib.blake2b(digest_size=16)
    _walk_into(common, model_dir, lambda rel_top, name: rel_top == "." and (
        name in names or name == "config.pbtxt"))
    out = {}
    for v in versions:
        digest = common.copy()
        _walk_into(digest, os.path.join(model_dir, str(v)))
        out[v] = digest.hexdigest()
    return out


def _walk_into(digest: Any, top_dir: str,
               skip: Callable[[str, str], bool] = lambda rel_top, name: False) -> None:
    """Feed the names, sizes and mtimes below ``top_dir`` into ``digest``, leaving out what
    ``skip(relative directory, name)`` says, and Python's bytecode caches."""
    for top, dirs, files in os.walk(top_dir):
        rel_top = os.path.relpath(top, top_dir)
        dirs[:] = sorted(d for d in dirs if d not in _IGNORED_DIRS and not skip(rel_top, d))
        for d in dirs:
            digest.update(f"D\0{rel_top}/{d}\n".encode("utf-8", "surrogateescape"))
        for f in sorted(files):
            if f.endswith(_IGNORED_SUFFIXES) or skip(rel_top, f):
                continue
            try:
                st = os.stat(os.path.join(top, f))
            except OSError:
                # Vanished or a dangling link: still a name worth noticing.
                size, mtime = -1, -1
            else:
                size = st.st_size if stat.S_ISREG(st.st_mode) else -1
                mtime = st.st_mtime_ns
            digest.update(f"F\0{rel_top}/{f}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
