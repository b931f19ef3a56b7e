"""The files of loads with files (Triton's ``file:<path>`` load parameters): writing them into a
model directory of their own, and the server's ``tritonpy-files-*`` folder that holds those
directories, one folder per load, until nothing uses them any more.

The folders belong to the :class:`~tritonpy._repo_manager.RepositoryManager`, which knows what
still uses one (a model's current files, a version that still serves or finishes its requests);
:class:`FilesFolders` keeps the bookkeeping: which are being written, which may go, and the
janitor's watch on the server's folder.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any, Callable, Iterable, Mapping

from ._errors import InvalidArgumentError, load_cancelled
from .shm import janitor


def write_files(mdir: str, files: Mapping[str, bytes]) -> None:
    """Write a load request's files (``file:<path>`` -> bytes) under the model directory
    ``mdir``; InvalidArgumentError naming the first path that cannot be one of its files."""
    for rel, data in files.items():
        if not isinstance(rel, str):
            raise InvalidArgumentError(f"file path {rel!r} is not a str")
        rel = rel[5:] if rel.startswith("file:") else rel
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"the content of file '{rel}' must be bytes, not "
                                       f"{type(data).__name__}")
        if "\0" in rel:
            raise InvalidArgumentError(f"file path {rel!r} holds a NUL character")
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(
                f"file path {ascii(rel)} holds an unpaired surrogate, which is not "
                "text") from None
        dest = os.path.normpath(os.path.join(mdir, rel))
        if not dest.startswith(mdir + os.sep):
            raise InvalidArgumentError(f"file path '{rel}' escapes the model directory")
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as fh:
                fh.write(data)
        except OSError as exc:  # a name too long, a file where a folder must go, ...
            raise InvalidArgumentError(
                f"file path '{rel}' cannot be written: {exc.strerror}") from None


class FilesFolders:
    """The folders of one server's loads with files.

    ``in_use`` names the folders its models still use; it is called under this object's lock,
    so that a folder made meanwhile (pending, not its model's yet) is never swept.
    """

    def __init__(self, server: Any, in_use: Callable[[], Iterable[str]]) -> None:
        self.server = server
        self._in_use = in_use
        # The folder of the folders of loads with files (see new).
        self.root: str | None = None
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def new(self, name: str) -> str:
        """A new folder for a load with files of model ``name``, in the server's own folder
        (``tritonpy-files-*`` in the temp folder), which its janitor removes should the
        server die without a stop."""
        with self._lock:
            if self.server._stopping:  # its folders are (being) removed: none is made now
                raise load_cancelled()
            root = self.root
            if root is None or not os.path.isdir(root):
                root = self.root = tempfile.mkdtemp(prefix="tritonpy-files-")
                janitor.watch_folder(root)
            folder = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
            self._pending.add(folder)  # not its model's yet: no sweep removes it
            return folder

    def claim(self, folder: str) -> None:
        """``folder`` is its model's now (its caller has set the entry's ``tmpdir``): the
        sweeps keep it for as long as ``in_use`` names it."""
        with self._lock:
            self._pending.discard(folder)

    def drop(self, folder: str) -> None:
        """Remove the folder of a load with files refused before it loaded anything."""
        with self._lock:
            self._pending.discard(folder)
        shutil.rmtree(folder, ignore_errors=True)

    def sweep(self) -> None:
        """Remove the folders of loads with files that nothing uses any more: neither a
        model's current files nor the folder of a version that still serves (or finishes
        its requests). Each load or unload ends with it, so they do not pile up."""
        with self._lock:
            root = self.root
            if root is None:
                return
            keep = set(self._pending)
            keep.update(self._in_use())
            try:
                names = os.listdir(root)
            except OSError:
                return
            for folder in (os.path.join(root, n) for n in names):
                if folder not in keep:
                    shutil.rmtree(folder, ignore_errors=True)

    def remove(self) -> None:
        """Remove the folders of the loads with files (the end of a stop, or an exit)."""
        with self._lock:
            root, self.root = self.root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
            janitor.forget_folder(root)
