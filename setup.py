"""Packaging: ``stub/`` and ``shm/`` install as ``tritonpy.stub`` and ``tritonpy.shm``."""
from setuptools import setup

setup(
    packages=["tritonpy", "tritonpy.frontends", "tritonpy.stub", "tritonpy.shm"],
    package_dir={
        "tritonpy": "tritonpy",
        "tritonpy.frontends": "tritonpy/frontends",
        "tritonpy.stub": "stub",
        "tritonpy.shm": "shm",
    },
)
