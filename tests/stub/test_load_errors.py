"""Models that fail to load: the traceback reaches the caller of ``load`` and the model's
status, no process is left behind, and the other models keep serving.
"""
from __future__ import annotations

import pytest

import tritonpy
from _models import DOUBLE_PY, fp32, infer, new_prefix, serving, stub_processes, write_model

pytestmark = pytest.mark.timeout(60)

SYNTAX_PY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests)
        return []
'''

IMPORT_PY = '''
import triton_python_backend_utils as pb_utils
import tritonpy_test_no_such_module

class TritonPythonModel:
    def execute(self, requests):
        return []
'''

NOCLASS_PY = '''
class SomethingElse:
    pass
'''

# Two instances: the first initializes, the second refuses; neither process may remain.
INIT_RAISES_PY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        if args["model_instance_name"].endswith("_1"):
            raise RuntimeError("initialize refused by " + args["model_instance_name"])

    def execute(self, requests):
        return []
'''

INIT_EXITS_PY = '''
import os
import sys

class TritonPythonModel:
    def initialize(self, args):
        sys.stderr.write("initexit: giving up\\n")
        sys.stderr.flush()
        os._exit(7)

    def execute(self, requests):
        return []
'''

# sys.exit() in initialize: Triton's text, "SystemExit: 4" and the model's frame (it was the
# stub's whole traceback, its own frames included).
INIT_SYS_EXIT_PY = '''
import sys

class TritonPythonModel:
    def initialize(self, args):
        sys.exit(4)

    def execute(self, requests):
        return []
'''

TWO = ('backend: "python"\nmax_batch_size: 0\n'
       'input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
       'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
       'instance_group [ { count: 2, kind: KIND_CPU } ]\n')

# As Triton words them: "version 1 is at UNAVAILABLE state: Internal: " then "Type: message"
# and the model's frames under "At:" (frames of Python's import machinery included, as there).
FAILED = "version 1 is at UNAVAILABLE state: "
BAD = {
    "syntax": (SYNTAX_PY, None, [FAILED + "Internal: SyntaxError: ", "(model.py, line 5)"]),
    "importerr": (IMPORT_PY, None, [
        FAILED + "Internal: ModuleNotFoundError: No module named "
                 "'tritonpy_test_no_such_module'\n\nAt:\n", "/model.py(3): <module>\n"]),
    "noclass": (NOCLASS_PY, None, [FAILED + "Internal: AttributeError: ",
                                   "defines no class TritonPythonModel"]),
    "initraises": (INIT_RAISES_PY, TWO, [
        FAILED + "Internal: RuntimeError: initialize refused by initraises_0_1\n\nAt:\n",
        "/model.py(7): initialize\n"]),
    "initsysexit": (INIT_SYS_EXIT_PY, None, [
        FAILED + "Internal: SystemExit: 4\n\nAt:\n", "/model.py(6): initialize\n"]),
    "initexit": (INIT_EXITS_PY, None, [
        "Stub process 'initexit_0' is not healthy: pid ", "exited with code 7",
        "initexit: giving up"]),
}


def _index_row_says(row: dict, fragments: list[str]) -> None:
    """As Triton's index: the version that failed, with the reason it gave (the load's error
    says "version 1 is at UNAVAILABLE state: " before it)."""
    assert (row["version"], row["state"]) == ("1", "UNAVAILABLE"), row
    assert not row["reason"].startswith(FAILED), row
    for fragment in fragments:
        fragment = fragment[len(FAILED):] if fragment.startswith(FAILED) else fragment
        assert fragment in row["reason"], row


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("repo")
    write_model(path, "good", DOUBLE_PY)
    for name, (py, config, _) in BAD.items():
        write_model(path, name, py, config)
    return path


@pytest.fixture(scope="module")
def explicit(repo):
    with serving(repo, new_prefix(), model_control_mode="explicit",
                 load_models=["good"]) as srv:
        yield srv


@pytest.mark.parametrize("name", sorted(BAD))
def test_failed_load_reports_the_traceback_and_leaves_no_process(explicit, name):
    before = sorted(p.pid for p in stub_processes())
    assert len(before) == 1  # the good model's stub
    with pytest.raises(tritonpy.TritonpyError) as info:
        explicit.load(name)
    message = info.value.message
    assert isinstance(info.value, tritonpy.InvalidArgumentError)  # HTTP 400, as Triton
    assert message.startswith(f"load failed for model '{name}': "), message
    assert "stub/_" not in message  # no frame of the stub's own modules
    for fragment in BAD[name][2]:
        assert fragment in message, message
    status = {m["name"]: m for m in explicit.models()}[name]
    _index_row_says(status, BAD[name][2])
    assert not explicit.model(name).ready()
    with pytest.raises(tritonpy.NotFoundError, match="has no available versions"):
        explicit.model(name).infer({"IN": fp32(1)})
    assert sorted(p.pid for p in stub_processes()) == before
    # the other model is untouched
    assert infer(explicit.model("good"), {"IN": fp32(1, 2)}).outputs["OUT"].to_numpy().tolist() \
        == [2, 4]


def test_server_start_loads_the_good_models_and_reports_the_bad(repo):
    before = {p.pid for p in stub_processes()}  # the module's explicit-mode server's
    with serving(repo, new_prefix()) as srv:
        status = {m["name"]: m for m in srv.models()}
        assert status["good"]["state"] == "READY"
        for name, (_, _, fragments) in BAD.items():
            _index_row_says(status[name], fragments)
        assert srv.model("good").ready()
        assert len({p.pid for p in stub_processes()} - before) == 1


def test_strict_readiness_counts_models_that_failed_to_load(repo):
    # Triton's --strict-readiness (its default): the server is ready only when every model it
    # was meant to serve is; with it off, serving the good models is enough.
    with serving(repo, new_prefix()) as srv:
        assert srv.model("good").ready()
        assert not srv.ready()
    with serving(repo, new_prefix(), strict_readiness=False) as srv:
        assert srv.ready()


def test_explicit_mode_readiness_follows_loads_and_unloads(repo):
    with serving(repo, new_prefix(), model_control_mode="explicit",
                 load_models=["good"]) as srv:
        assert srv.ready()  # models never asked for do not count
        with pytest.raises(tritonpy.TritonpyError):
            srv.load("syntax")
        assert not srv.ready()
        srv.unload("syntax")  # a failed model unloaded on purpose no longer counts
        assert srv.ready()


@pytest.mark.parametrize("layout", ["no version directory", "no model.py", "broken config"])
def test_strict_readiness_counts_a_model_past_its_configuration(tmp_path, layout):
    # As Triton 2.51 (measured for the first; QA L0_lifecycle's test_parse_error_modelfail and
    # test_parse_error_model_no_version): a model whose configuration reads fine but that has
    # no version to load, or a version without its model.py, failed to load, and the server is
    # not ready. tritonpy took both for unreadable folders, which do not count. A configuration
    # that cannot be read still does not count: Triton's poll does not make it a model.
    write_model(tmp_path, "good", DOUBLE_PY)
    bad = tmp_path / "bad"
    write_model(tmp_path, "bad", DOUBLE_PY)
    if layout == "no version directory":
        (bad / "1" / "model.py").unlink()
        (bad / "1").rmdir()
    elif layout == "no model.py":
        (bad / "1" / "model.py").unlink()
    else:
        (bad / "config.pbtxt").write_text("this is { not a config")
    with serving(tmp_path, new_prefix()) as srv:
        assert srv.model("good").ready()
        assert srv.ready() is (layout == "broken config")


def test_a_version_asked_for_after_an_unload_is_not_ready(repo):
    # As Triton 2.51 (measured, QA L0_lifecycle): a version the model had is looked up first,
    # UNAVAILABLE "not at ready state"; tritonpy answered "has no available versions" (which
    # stays the answer without a version). A version it never had is not found.
    with serving(repo, new_prefix(), model_control_mode="explicit",
                 load_models=["good"]) as srv:
        srv.unload("good")
        with pytest.raises(tritonpy.UnavailableError,
                           match="'good' version 1 is not at ready state"):
            srv.model("good", 1).infer({"IN": fp32(1)})
        with pytest.raises(tritonpy.NotFoundError, match="'good' version 7 is not found"):
            srv.model("good", 7).infer({"IN": fp32(1)})
        with pytest.raises(tritonpy.NotFoundError, match="'good' has no available versions"):
            srv.model("good").infer({"IN": fp32(1)})
        with pytest.raises(tritonpy.TritonpyError):
            srv.load("syntax")
        with pytest.raises(tritonpy.UnavailableError,
                           match="'syntax' version 1 is not at ready state"):
            srv.model("syntax", 1).infer({"IN": fp32(1)})


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_load_and_unload_outside_explicit_mode_say_tritons_words(repo, mode):
    # Triton 2.51's text in both modes (UNAVAILABLE, 503), which tools look for.
    with serving(repo, new_prefix(), model_control_mode=mode) as srv:
        for call in (lambda: srv.load("good"), lambda: srv.unload("good")):
            with pytest.raises(tritonpy.UnavailableError) as info:
                call()
            assert info.value.message == ("explicit model load / unload is not allowed if "
                                          "polling is enabled")
        assert srv.model("good").ready()
