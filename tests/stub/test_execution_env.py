"""EXECUTION_ENV_PATH: a model's stub runs under the interpreter of its own environment, given as
a directory or as an archive that is unpacked once and cached by content hash; an environment
whose tritonpy speaks another channel protocol is refused at start with a clear error instead
of misreading frames.

The environments here are real directories whose ``bin/python3`` is a shell script: it marks
the environment (an environment variable the model reports) and runs this test's interpreter.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from _models import fp32, infer, serving, stub_processes

import tritonpy

pytestmark = pytest.mark.timeout(90)

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "ENV", data_type: TYPE_STRING, dims: [ 1 ] } ]
parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/%s" } }
"""

MODEL_PY = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        mark = os.environ.get("TRITONPY_TEST_ENV", "").encode()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("ENV", np.array([mark], dtype=np.object_))])
                for _ in requests]
"""

# What an environment with an older tritonpy does: say HELLO with its own protocol version,
# then wait. (argv: -c, -c, <the stub's bootstrap>, <socket fd>, <options>)
OLD_STUB = ("import msgpack, socket, sys, time; "
            "s = socket.socket(fileno=int(sys.argv[3])); "
            "s.send(msgpack.packb([1, 0, {'version': 1, 'pid': 0}])); time.sleep(60)")


def make_env(root: Path, mark: str, run: str = "") -> Path:
    """An environment directory whose bin/python3 marks itself and runs this interpreter."""
    bindir = root / "bin"
    bindir.mkdir(parents=True)
    script = bindir / "python3"
    code = f'-c "{run}" ' if run else ""
    script.write_text(f'#!/bin/sh\nexport TRITONPY_TEST_ENV={mark}\nexec {sys.executable} {code}"$@"\n')
    script.chmod(0o755)
    return root


def write(repo: Path, name: str, env: str) -> Path:
    mdir = repo / name
    (mdir / "1").mkdir(parents=True)
    (mdir / "config.pbtxt").write_text(CONFIG % env)
    (mdir / "1" / "model.py").write_text(MODEL_PY)
    return mdir


def env_of(srv: tritonpy.Server, model: str) -> str:
    return infer(srv.model(model), {"IN": fp32(1)}).outputs["ENV"].to_numpy()[0].decode()


def test_a_model_runs_under_its_environment_directory(tmp_path: Path, shm_prefix: str) -> None:
    make_env(write(tmp_path / "repo", "in_env", "env") / "env", "from_dir")
    (tmp_path / "repo" / "plain").mkdir()
    (tmp_path / "repo" / "plain" / "1").mkdir()
    (tmp_path / "repo" / "plain" / "config.pbtxt").write_text(
        "\n".join(line for line in CONFIG.splitlines() if "EXECUTION_ENV_PATH" not in line))
    (tmp_path / "repo" / "plain" / "1" / "model.py").write_text(MODEL_PY)
    with serving(tmp_path / "repo", shm_prefix) as srv:
        assert env_of(srv, "in_env") == "from_dir"
        assert env_of(srv, "plain") == ""  # the server's own interpreter


def test_an_environment_archive_is_unpacked_once_and_cached_by_hash(
        tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    env = make_env(tmp_path / "build", "from_archive")
    repo = tmp_path / "repo"
    for name in ("first", "second"):  # two models, the same archive
        mdir = write(repo, name, "env.tar.gz")
        with tarfile.open(mdir / "env.tar.gz", "w:gz") as tar:
            tar.add(env / "bin", arcname="bin")
    caplog.set_level(logging.INFO, logger="tritonpy.repository")
    with serving(repo, shm_prefix) as srv:
        assert env_of(srv, "first") == "from_archive" and env_of(srv, "second") == "from_archive"
    # Triton's log line, once: the second model found it unpacked.
    lines = [r.getMessage() for r in caplog.records if "execution env" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0] in {f"Extracting Python execution env {repo / name / 'env.tar.gz'}"
                        for name in ("first", "second")}
    cached = list((tmp_path / "home" / ".cache" / "tritonpy" / "envs").iterdir())
    assert len(cached) == 1 and len(cached[0].name) == 16  # one unpacked copy, by content hash
    assert os.access(cached[0] / "bin" / "python3", os.X_OK)


def test_an_unpacked_environment_removed_meanwhile_is_unpacked_again(
        tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The server trusted its memory of the copy: once a cache clean-up had removed it, the
    # model could neither reload nor restart ("has neither bin/activate nor bin/python3").
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    env = make_env(tmp_path / "build", "from_archive")
    repo = tmp_path / "repo"
    mdir = write(repo, "in_env", "env.tar.gz")
    with tarfile.open(mdir / "env.tar.gz", "w:gz") as tar:
        tar.add(env / "bin", arcname="bin")
    with serving(repo, shm_prefix, model_control_mode="explicit",
                 load_models=["in_env"]) as srv:
        assert env_of(srv, "in_env") == "from_archive"
        shutil.rmtree(tmp_path / "home" / ".cache" / "tritonpy" / "envs")
        (mdir / "1" / "model.py").write_text(MODEL_PY + "\n")  # a reload starts a new stub
        srv.load("in_env")
        assert env_of(srv, "in_env") == "from_archive"


def test_a_corrupt_environment_archive_is_named_in_the_error(
        tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    env = make_env(tmp_path / "build", "from_archive")
    mdir = write(tmp_path / "repo", "in_env", "env.tar.gz")
    with tarfile.open(tmp_path / "whole.tar.gz", "w:gz") as tar:
        tar.add(env / "bin", arcname="bin")
    (mdir / "env.tar.gz").write_bytes((tmp_path / "whole.tar.gz").read_bytes()[:60])
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit") as srv:
        with pytest.raises(tritonpy.InvalidArgumentError,
                           match=f"EXECUTION_ENV_PATH '{mdir / 'env.tar.gz'}' could not be "
                                 "unpacked: "):
            srv.load("in_env")


ENV_AND_LIBS_PY = MODEL_PY.replace(
    'mark = os.environ.get("TRITONPY_TEST_ENV", "").encode()',
    'mark = (os.environ.get("TRITONPY_TEST_ENV", "") + "|" '
    '+ os.environ.get("LD_LIBRARY_PATH", "")).encode()')


def test_an_environment_is_activated_as_triton_does(tmp_path: Path, shm_prefix: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # As Triton's launcher: bin/activate is sourced (a conda-pack environment's activation
    # scripts set its variables) and the environment's lib comes first on LD_LIBRARY_PATH. An
    # environment with bin/activate and no Python of its own runs on the server's (Triton ran
    # such an archive, tritonpy refused it: "has no bin/python3").
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/before")
    repo = tmp_path / "repo"
    only = tmp_path / "only_activate"
    (only / "bin").mkdir(parents=True)
    (only / "lib").mkdir()
    (only / "bin" / "activate").write_text("export TRITONPY_TEST_ENV=activated\n")
    mdir = write(repo, "archived", "env.tar.gz")
    (mdir / "1" / "model.py").write_text(ENV_AND_LIBS_PY)
    with tarfile.open(mdir / "env.tar.gz", "w:gz") as tar:
        tar.add(only / "bin", arcname="bin")
        tar.add(only / "lib", arcname="lib")
    # With a Python of its own too: activated first, then its Python runs the stub.
    both = make_env(write(repo, "both", "env") / "env", "from_dir$TRITONPY_TEST_ACTIVATED")
    (both / "bin" / "activate").write_text("export TRITONPY_TEST_ACTIVATED=+activated\n")
    with serving(repo, shm_prefix) as srv:
        mark, libs = env_of(srv, "archived").split("|")
        (cached,) = (tmp_path / "home" / ".cache" / "tritonpy" / "envs").iterdir()
        assert mark == "activated"
        assert libs == f"{cached / 'lib'}:/opt/before"
        assert env_of(srv, "both") == "from_dir+activated"


def test_an_environment_with_another_protocol_is_refused(tmp_path: Path, shm_prefix: str) -> None:
    make_env(write(tmp_path, "old_env", "env") / "env", "old", run=OLD_STUB)
    before = {p.pid for p in stub_processes()}
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        with pytest.raises(tritonpy.TritonpyError) as info:
            srv.load("old_env")
        message = info.value.message
        assert "protocol 1" in message and "another version of tritonpy" in message, message
        assert not srv.model("old_env").ready()
        assert {p.pid for p in stub_processes()} == before  # the old stub was stopped


def _venv(path: Path, broken_msgpack: bool = False) -> Path:
    """A real virtualenv of this Python with nothing installed (no tritonpy, numpy or
    msgpack); ``broken_msgpack``: with a msgpack of its own that cannot be imported."""
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)  # as `python -m venv`
    if broken_msgpack:
        site = next(path.glob("lib/python3*/site-packages"))
        (site / "msgpack").mkdir()
        (site / "msgpack" / "__init__.py").write_text("raise ImportError('this msgpack is broken')\n")
    return path


def test_a_plain_virtualenv_runs_a_stub_with_the_servers_packages(tmp_path: Path,
                                                                  shm_prefix: str) -> None:
    # As Triton's, whose stub needs only numpy in the environment: a virtualenv without
    # tritonpy (or msgpack, posix_ipc, psutil) runs the model; what it lacks comes from the
    # server's site-packages, after its own (measured with Triton 2.51 on a venv holding only
    # numpy 1.26; tritonpy's stub died of "No module named 'msgpack'").
    mdir = write(tmp_path / "repo", "venv_model", "env")
    _venv(mdir / "env")
    (mdir / "1" / "model.py").write_text(MODEL_PY.replace(
        'os.environ.get("TRITONPY_TEST_ENV", "")', "sys.prefix").replace("import os", "import sys"))
    with serving(tmp_path / "repo", shm_prefix) as srv:
        assert env_of(srv, "venv_model") == str(mdir / "env")  # the stub ran in the venv


def test_an_environment_that_cannot_run_the_stub_says_why(tmp_path: Path,
                                                          shm_prefix: str) -> None:
    # A Python of another version cannot use the server's compiled packages: the load fails
    # naming the environment's Python and what to do. (Made here with a msgpack of the
    # environment's own that cannot be imported: the environment's packages come first.)
    mdir = write(tmp_path / "repo", "broken_env", "env")
    _venv(mdir / "env", broken_msgpack=True)
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit") as srv:
        with pytest.raises(tritonpy.TritonpyError) as err:
            srv.load("broken_env")
    assert (f"the Python of EXECUTION_ENV_PATH ({mdir / 'env' / 'bin' / 'python3'}, "
            f"{sys.version_info[0]}.{sys.version_info[1]}) cannot import what the stub needs "
            "from this server's packages") in err.value.message
    assert "this msgpack is broken. Install tritonpy into that environment." in err.value.message


def test_a_virtualenv_archive_loads_and_nothing_lands_outside(
        tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every virtualenv's bin/python is a link to an absolute path, which Triton 2.51 unpacks
    # (measured); tritonpy refused the archive ("is a link to an absolute path"). An entry
    # written through such a link, or a link that climbs out, is still refused, and nothing
    # is written outside the cache.
    import io

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    repo = tmp_path / "repo"
    mdir = write(repo, "venv_tar", "env.tar.gz")
    (mdir / "1" / "model.py").write_text(MODEL_PY.replace(
        'os.environ.get("TRITONPY_TEST_ENV", "")', "sys.prefix").replace("import os", "import sys"))
    venv_dir = _venv(tmp_path / "build" / "venv")
    assert any(os.path.isabs(os.readlink(p)) for p in (venv_dir / "bin").glob("python*")
               if p.is_symlink())
    with tarfile.open(mdir / "env.tar.gz", "w:gz") as tar:
        tar.add(venv_dir, arcname=".")
        # And, whatever order the folder listed the venv's links in: an absolute link, then a
        # relative one to it (refused on Python 3.10 when python3 came after python3.10).
        for name, target in (("bin/py_abs", sys.executable), ("bin/py_rel", "py_abs")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    outside = tmp_path / "outside"
    outside.mkdir()
    for name, members in (("through_link", [("bin/out", str(outside)), ("bin/out/evil", None)]),
                          ("climbs_out", [("lib/up", "../../../../outside")])):
        bad = write(repo, name, "env.tar.gz")
        with tarfile.open(bad / "env.tar.gz", "w:gz") as tar:
            for member, target in members:
                info = tarfile.TarInfo(member)
                if target is not None:
                    info.type, info.linkname = tarfile.SYMTYPE, target
                    tar.addfile(info)
                else:
                    info.size = 4
                    tar.addfile(info, io.BytesIO(b"evil"))
    with serving(repo, shm_prefix, model_control_mode="explicit") as srv:
        srv.load("venv_tar")
        prefix = env_of(srv, "venv_tar")
        assert prefix.startswith(str(tmp_path / "home" / ".cache" / "tritonpy" / "envs"))
        for name in ("through_link", "climbs_out"):
            with pytest.raises(tritonpy.TritonpyError, match="outside the destination"):
                srv.load(name)
    assert list(outside.iterdir()) == []
