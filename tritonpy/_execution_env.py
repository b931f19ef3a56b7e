"""Triton's EXECUTION_ENV_PATH: the Python environment a model's stubs run in, a directory or
an archive (such as conda-pack makes), which is unpacked once, cached by its hash under
``~/.cache/tritonpy/envs``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import zlib
from typing import TYPE_CHECKING

from ._errors import InvalidArgumentError
from ._stubproc import env_launcher
from .repository import file_hexdigest

if TYPE_CHECKING:
    from ._model import ModelRuntime

log = logging.getLogger("tritonpy.repository")


class ExecutionEnvs:
    """The environments of one server's models, the archives among them unpacked once."""

    def __init__(self) -> None:
        self._env_cache: dict[str, str] = {}  # archive digest -> its unpacked folder
        self._env_lock = threading.Lock()

    def command(self, rt: ModelRuntime) -> list[str] | None:
        """The command that starts the Python of the model's EXECUTION_ENV_PATH (an archive is
        unpacked and cached by its hash); see :func:`env_launcher`."""
        p = rt.config.parameters.get("EXECUTION_ENV_PATH")
        if p is None or not p.string_value:
            return None
        path = p.string_value.replace("$$TRITON_MODEL_DIRECTORY", rt.model_dir)
        if os.path.isdir(path):
            env_dir = path
        elif os.path.isfile(path):
            digest = _file_digest(path)
            with self._env_lock:  # models loading in parallel may share one archive
                env_dir = self._env_cache.get(digest, "")
                # (unpacked again if its copy was removed meanwhile: a cache clean-up)
                if not env_dir or not os.path.isdir(env_dir):
                    try:
                        env_dir = self._env_cache[digest] = _unpack_env(path, digest)
                    except (OSError, EOFError, tarfile.TarError, zlib.error) as exc:
                        raise InvalidArgumentError(
                            f"EXECUTION_ENV_PATH '{path}' could not be unpacked: {exc}") from None
        else:
            raise InvalidArgumentError(f"EXECUTION_ENV_PATH '{path}' does not exist")
        launcher = env_launcher(env_dir)
        if launcher is None:
            raise InvalidArgumentError(f"EXECUTION_ENV_PATH '{path}' has neither bin/activate "
                                       "nor bin/python3")
        return launcher


def _file_digest(path: str) -> str:
    """The start of the SHA-256 of a file (an environment archive)."""
    return file_hexdigest(path, hashlib.sha256())[:16]


def _env_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's ``data`` filter (nothing lands outside ``dest``, nothing is written through a
    link that leads out), but for symbolic links to an absolute path, and relative ones that
    stay inside (even where they lead on to such a link), which are kept: every virtualenv's
    ``bin/python3.X`` is one, and ``bin/python3`` a link to it (as Triton 2.51 does, measured;
    an entry written under such a link is still refused, its real path being outside)."""
    try:
        return tarfile.data_filter(member, dest)
    except (tarfile.AbsoluteLinkError, tarfile.LinkOutsideDestinationError):
        if not member.issym():
            raise
        if not os.path.isabs(member.linkname):  # read as written, links not followed
            root = os.path.abspath(dest)
            target = os.path.normpath(os.path.join(root, os.path.dirname(member.name),
                                                   member.linkname))
            if os.path.commonpath([root, target]) != root:
                raise
        return tarfile.tar_filter(member, dest)


def _unpack_env(archive: str, digest: str) -> str:
    """The directory of an unpacked EXECUTION_ENV_PATH archive, unpacking it the first time.

    Unpacked beside the cache entry and renamed into place, so that another process unpacking
    the same archive at the same time never sees half an environment.
    """
    cache = os.path.join(os.path.expanduser("~"), ".cache", "tritonpy", "envs", digest)
    if os.path.isdir(cache):
        return cache
    log.info("Extracting Python execution env %s", archive)  # Triton's words
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{digest}.partial-", dir=os.path.dirname(cache))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter=_env_member)
        os.replace(tmp, cache)
    except OSError:
        if not os.path.isdir(cache):  # not another process that got there first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache
