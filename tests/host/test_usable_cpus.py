"""How many CPUs polling counts on (``tritonpy.shm.waiting.usable_cpus``): the process's affinity,
capped by a cgroup CPU quota (``docker --cpus``, a Kubernetes CPU limit), which the affinity
does not show. Under a 1-CPU quota on a many-CPU machine nothing polls: a poll would spend the
quota the work needs. The quota is read from a cgroup tree written in a temporary directory
(cgroup v1 and v2 layouts), and from a real cgroup with a quota where this machine lets the
test make one (root, a writable cpu controller)."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tritonpy.shm import waiting
from tritonpy.shm.waiting import cgroup_cpu_quota, usable_cpus

V2 = "30 23 0:26 {root} {point} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1 = "32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"


def tree(tmp_path: Path, mount: str, cgroup: str, files: dict[str, str]) -> float | None:
    """cgroup_cpu_quota over a mountinfo line, a /proc/self/cgroup text and cgroup files
    (path relative to the mount point -> content) under ``tmp_path``."""
    point = tmp_path / "cg"
    for rel, text in files.items():
        (point / rel).parent.mkdir(parents=True, exist_ok=True)
        (point / rel).write_text(text)
    (tmp_path / "mountinfo").write_text(mount.replace("{point}", str(point)))
    (tmp_path / "cgroup").write_text(cgroup)
    return cgroup_cpu_quota(str(tmp_path / "mountinfo"), str(tmp_path / "cgroup"))


def test_v2_quota_of_the_process_cgroup(tmp_path: Path) -> None:
    assert tree(tmp_path, V2.replace("{root}", "/"), "0::/app\n",
                {"app/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"}) == 1.5


def test_v2_a_tighter_quota_above_counts(tmp_path: Path) -> None:
    assert tree(tmp_path, V2.replace("{root}", "/"), "0::/pod/app\n",
                {"pod/app/cpu.max": "max 100000\n", "pod/cpu.max": "50000 100000\n"}) == 0.5


def test_v2_inside_a_container_its_cgroup_is_the_mount_root(tmp_path: Path) -> None:
    # cgroupns off: /proc/self/cgroup names the host's path, the mount shows it as its root.
    assert tree(tmp_path, V2.replace("{root}", "/docker/abc"), "0::/docker/abc\n",
                {"cpu.max": "200000 100000\n"}) == 2.0


def test_v1_quota_and_period(tmp_path: Path) -> None:
    assert tree(tmp_path, V1.replace("{root}", "/"),
                "4:memory:/x\n3:cpu,cpuacct:/job\n0::/\n",
                {"job/cpu.cfs_quota_us": "300000\n", "job/cpu.cfs_period_us": "100000\n",
                 "cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}) == 3.0


@pytest.mark.parametrize("files", [
    {},  # no cgroup files at all
    {"cpu.max": "max 100000\n"},  # no quota
    {"cpu.max": "garbage\n"},
    {"cpu.max": "100000 0\n"},
])
def test_no_quota_or_unreadable_means_none(tmp_path: Path, files: dict[str, str]) -> None:
    assert tree(tmp_path, V2.replace("{root}", "/"), "0::/\n", files) is None


@pytest.mark.parametrize("quota, expected", [
    (None, 2), (0.5, 1), (1.0, 1), (1.5, 1), (2.0, 2), (2.5, 2), (64.0, 2),
])
def test_a_quota_counts_rounded_down_and_never_beyond_the_affinity(
        monkeypatch: pytest.MonkeyPatch, quota: float | None, expected: int) -> None:
    # Two CPUs in the affinity; past its quota a cgroup is stopped until the next period, so
    # two processes busy under a 1.5-CPU quota would be.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(waiting, "cgroup_cpu_quota", lambda: quota)
    assert usable_cpus() == expected


PROBE = """
from tritonpy.shm import waiting
from tritonpy._options import BackendOptions
print(waiting._CPUS, waiting.SpinPolicy(0.001).window, BackendOptions().bls_spin_us())
"""


def _quota_cgroup() -> Path | None:
    """A new cgroup with a 1-CPU quota, or None where this machine does not let us make one."""
    name = f"tpytest_{secrets.token_hex(4)}"
    for base, v2 in ((Path("/sys/fs/cgroup/cpu"), False), (Path("/sys/fs/cgroup"), True)):
        marker = base / ("cpu.max" if v2 else "cpu.cfs_quota_us")
        if v2 and not (base / "cgroup.controllers").exists():
            continue
        if not v2 and not marker.exists():
            continue
        path = base / name
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            if v2:
                (path / "cpu.max").write_text("100000 100000")
            else:
                (path / "cpu.cfs_period_us").write_text("100000")
                (path / "cpu.cfs_quota_us").write_text("100000")
            return path
        except OSError:
            path.rmdir()
    return None


def test_under_a_real_one_cpu_quota_nothing_polls() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing polls anyway, the quota would change nothing")
    path = _quota_cgroup()
    if path is None:
        pytest.skip("this machine does not let the test make a cgroup with a CPU quota")
    try:
        probe = subprocess.run(
            ["sh", "-c", f'echo $$ > {path}/cgroup.procs || exit 99; exec "$0" -c "$1"',
             sys.executable, PROBE], capture_output=True, text=True, timeout=60)
    finally:
        path.rmdir()  # (the probe has exited: the cgroup is empty)
    if probe.returncode == 99:
        pytest.skip(f"this machine does not let the test move a process into {path}: "
                    f"{probe.stderr.strip()}")
    assert probe.returncode == 0, probe.stderr
    # One CPU: no idle polling (window 0), and a sync BLS caller sleeps too.
    assert probe.stdout.split() == ["1", "0.0", "0.0"]
