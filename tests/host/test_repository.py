"""tritonpy.repository: model directories, versions, version policies, model files, changes."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from tritonclient.grpc.model_config_pb2 import ModelConfig

from tritonpy._errors import ConfigError, NotFoundError
from tritonpy.config import parse_config_text
from tritonpy.repository import (
    available_versions,
    fingerprint,
    model_file,
    scan_repositories,
    select_versions,
)


def make_model(root: Path, name: str, versions: tuple[str, ...] = ("1",)) -> Path:
    model = root / name
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n')
    for v in versions:
        (model / v).mkdir()
        (model / v / "model.py").write_text("class TritonPythonModel:\n    pass\n")
    return model


def cfg(text: str = "", name: str = "m") -> ModelConfig:
    config = parse_config_text(text, "config.pbtxt")
    config.name = name
    return config


# --- scan_repositories --------------------------------------------------------------------------


def test_scan_finds_models_across_repositories(tmp_path: Path) -> None:
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    a = make_model(r1, "a")
    b = make_model(r2, "b")
    (r1 / ".hidden").mkdir()
    (r1 / ".ipynb_checkpoints").mkdir()
    (r1 / "README.md").write_text("not a model")
    (r2 / "linked").symlink_to(a, target_is_directory=True)
    models, errors = scan_repositories([str(r1), str(r2)])
    assert models == {"a": str(a), "b": str(b), "linked": str(r2 / "linked")}
    assert errors == {}


def test_scan_reports_duplicates_and_counts_a_root_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    make_model(r1, "dup")
    make_model(r2, "dup")
    only = make_model(r2, "only")
    with caplog.at_level(logging.ERROR, logger="tritonpy.repository"):
        models, errors = scan_repositories([str(r1), str(r2), str(r2) + "/"])
        scan_repositories([str(r1), str(r2)])  # a poll's scan: said once
    assert models == {"only": str(only)}
    # Triton's reason word for word (QA L0_lifecycle compares it); the folders are logged.
    assert errors == {"dup": "model appears in two or more repositories"}
    assert caplog.text.count(f"({r1 / 'dup'}, {r2 / 'dup'})") == 1
    models, errors = scan_repositories([str(r1), str(r1)])
    assert models == {"dup": str(r1 / "dup")} and errors == {}


def test_scan_missing_root(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match=f"model repository '{tmp_path}/nope' does not exist"):
        scan_repositories([str(tmp_path / "nope")])
    (tmp_path / "file").write_text("")
    with pytest.raises(NotFoundError, match="is not a directory"):
        scan_repositories([str(tmp_path / "file")])


# --- available_versions -------------------------------------------------------------------------


def test_available_versions(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_model(tmp_path, "m", ("10", "2", "1", "0"))
    for name in ("01", "warmup", "configs", "initial_state", "latest", "1abc", "-3", "٣"):
        (model / name).mkdir()
    (model / "7").write_text("a file, not a version")
    with caplog.at_level(logging.WARNING, logger="tritonpy.repository"):
        assert available_versions(str(model)) == [0, 1, 2, 10]
    assert "ignore version directory '01' which contains leading zeros" in caplog.text
    # Triton's words for a folder that is no number (QA L0_lifecycle looks for them); not for
    # the folders Triton knows, nor for hidden ones or files.
    for name in ("latest", "1abc", "-3", "٣"):
        assert (f"ignore version directory '{name}' which fails to convert to integral number"
                in caplog.text), name
    for name in ("warmup", "configs", "initial_state", "7"):
        assert f"directory '{name}'" not in caplog.text, name


def test_available_versions_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        available_versions(str(tmp_path / "missing"))


# --- select_versions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("", [3]),
        ("version_policy { latest { num_versions: 2 } }", [2, 3]),
        ("version_policy { latest { num_versions: 9 } }", [1, 2, 3]),
        ("version_policy { all { } }", [1, 2, 3]),
        ("version_policy { specific { versions: [ 3, 1 ] } }", [1, 3]),
    ],
)
def test_version_policies(policy: str, expected: list[int]) -> None:
    assert select_versions(cfg(policy), [3, 1, 2]) == expected


def test_specific_version_missing_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    config = cfg("version_policy { specific { versions: [ 1, 4 ] } }")
    with caplog.at_level(logging.ERROR, logger="tritonpy.repository"):
        assert select_versions(config, [1, 2]) == [1]
    assert "version 4 is specified for model 'm', but the version directory is not present" in (
        caplog.text
    )


def test_no_version_left_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        select_versions(cfg("version_policy { specific { versions: [ 5 ] } }"), [1, 2])
    assert str(info.value) == (
        "at least one version must be available under the version policy of model 'm' "
        "(version_policy specific { versions: [5] }; versions present: 1, 2)"
    )
    # An explicit 'latest' without num_versions asks for zero versions, as in Triton.
    with pytest.raises(ConfigError, match=r"latest \{ num_versions: 0 \}"):
        select_versions(cfg("version_policy { latest { } }"), [1, 2, 3])
    with pytest.raises(ConfigError) as info:
        select_versions(cfg(), [])
    assert "model 'm' has no version directory" in str(info.value)


# --- model_file ---------------------------------------------------------------------------------


def test_model_file(tmp_path: Path) -> None:
    model = make_model(tmp_path, "m", ("1", "2"))
    assert model_file(cfg(), str(model), 2) == str(model / "2" / "model.py")
    (model / "2" / "entry.py").write_text("")
    custom = cfg('default_model_filename: "entry.py"')
    assert model_file(custom, str(model), 2) == str(model / "2" / "entry.py")
    with pytest.raises(ConfigError) as info:
        model_file(custom, str(model), 1)
    assert str(info.value).startswith(
        f"{model / '1' / 'entry.py'}: model file does not exist (model 'm', version 1"
    )
    (model / "3" / "model.py").mkdir(parents=True)
    with pytest.raises(ConfigError, match="model.py: model file is not a file"):
        model_file(cfg(), str(model), 3)
    with pytest.raises(ConfigError, match="is an ensemble and has no model file"):
        model_file(cfg('platform: "ensemble"'), str(model), 1)


# --- fingerprint --------------------------------------------------------------------------------


def test_fingerprint_sees_every_change_but_bytecode(tmp_path: Path) -> None:
    model = make_model(tmp_path, "m")
    first = fingerprint(str(model))
    assert first == fingerprint(str(model))

    cache = model / "1" / "__pycache__"
    cache.mkdir()
    (cache / "model.cpython-311.pyc").write_bytes(b"\0" * 10)
    (model / "1" / "helper.pyc").write_bytes(b"\0")
    assert fingerprint(str(model)) == first, "importing model.py must not look like a change"

    config = model / "config.pbtxt"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    touched = fingerprint(str(model))
    assert touched != first, "same size, new mtime"

    config.write_text('name: "m"\nbackend: "python"\nmax_batch_size: 2\n')
    edited = fingerprint(str(model))
    assert edited not in (first, touched)

    (model / "2").mkdir()
    with_version = fingerprint(str(model))
    assert with_version != edited, "a new, still empty version directory counts"

    (model / "1" / "model.py").rename(model / "1" / "other.py")
    assert fingerprint(str(model)) != with_version


def test_fingerprint_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        fingerprint(str(tmp_path / "missing"))
