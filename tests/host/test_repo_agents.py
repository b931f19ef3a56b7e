"""``model_repository_agents``: the checksum agent (Triton's, run by tritonpy itself before a
load: QA L0_repoagent_checksum) and any other agent, refused by name where tritonpy used to
ignore the section without a word (a model with a wrong checksum served)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from _models import DOUBLE_PY, io_config, new_prefix, serving, write_model

from tritonpy import TritonpyError

pytestmark = pytest.mark.timeout(90)


def _agents(name: str, params: dict[str, str]) -> str:
    body = ", ".join(f'{{ key: "{k}", value: "{v}" }}' for k, v in params.items())
    return f'model_repository_agents {{ agents [ {{ name: "{name}", parameters [ {body} ] }} ] }}\n'


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def test_the_checksum_agent_loads_a_model_whose_files_match_and_refuses_one_that_does_not(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "good", DOUBLE_PY)
    (repo / "good" / "data_file").write_text("some data\n")
    good = _md5(repo / "good" / "1" / "model.py")
    sums = {"MD5:1/model.py": good,  # the algorithm in any case, as Triton's agent takes it
            "md5:data_file": _md5(repo / "good" / "data_file")}
    (repo / "good" / "config.pbtxt").write_text(io_config() + _agents("checksum", sums))
    # Triton's agent's words (its source), but for a path outside the model directory, which
    # Triton reads.
    cases = {
        "bad": ({"MD5:1/model.py": "0" * 32},
                f"Mismatched MD5 hash for file 1/model.py, expect: {'0' * 32}, got: {good}"),
        "upper": ({"MD5:1/model.py": good.upper()},  # Triton compares with lower-case hex
                  f"Mismatched MD5 hash for file 1/model.py, expect: {good.upper()}, got: "
                  f"{good}"),
        "missing": ({"MD5:2/model.py": "0" * 32},
                    "failed to open text file for read 2/model.py: No such file or directory"),
        "folder": ({"MD5:1": "0" * 32}, "failed to open text file for read 1: Is a directory"),
        "outside": ({"MD5:../good/1/model.py": good},
                    "checksum repository agent: ../good/1/model.py is not in the model "
                    "directory"),
        "sha": ({"SHA1:1/model.py": "0" * 40}, "Unsupported checksum algorithm: SHA1"),
        "no_colon": ({"MD5": "0" * 32}, "failed to parse key: MD5"),
    }
    for name, (params, _) in cases.items():
        write_model(repo, name, DOUBLE_PY, io_config() + _agents("checksum", params))
    write_model(repo, "other_agent", DOUBLE_PY, io_config() + _agents("relocation", {}))
    with serving(repo, new_prefix(), model_control_mode="explicit") as srv:
        srv.load("good")
        out = srv.model("good").infer({"IN": np.array([1.0, 2.0], np.float32)}).get(timeout=30)
        assert out.outputs["OUT"].to_numpy().tolist() == [2.0, 4.0]
        for name, (_, why) in cases.items():
            with pytest.raises(TritonpyError) as err:
                srv.load(name)
            assert err.value.message.endswith(why), err.value.message
            assert not srv.model(name).ready()
        with pytest.raises(TritonpyError, match="unable to find repository agent 'relocation'"):
            srv.load("other_agent")
        # The file changes: the next load checks again and refuses it.
        (repo / "good" / "1" / "model.py").write_text(DOUBLE_PY + "\n# changed\n")
        with pytest.raises(TritonpyError, match="Mismatched MD5 hash for file 1/model.py"):
            srv.load("good")
