"""Importing a model's file the way Triton does: as the module ``<version>.<file stem>`` of a
package that is the version directory, so that ``from . import helper`` works in model.py
and ``__name__`` is ``"1.model"``, as with Triton."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types


def model_search_path(version_dir: str) -> list[str]:
    """The folders a model's plain imports search, after the standard library and
    site-packages, as Triton's: its version directory, then its model directory (beside
    config.pbtxt, where versions keep what they share)."""
    version_dir = os.path.normpath(os.path.abspath(version_dir))
    return [version_dir, os.path.dirname(version_dir)]


def import_model(model_file: str, package: str | None) -> types.ModuleType:
    """Import ``model_file`` as ``<package>.<stem>``, ``package`` being its directory; with
    ``package`` None, as the top-level module ``<stem>`` (a Python-based backend's model.py)."""
    stem = os.path.splitext(os.path.basename(model_file))[0]
    if package is None:
        return _exec_model(model_file, stem)
    directory = os.path.dirname(os.path.abspath(model_file))
    pkg = types.ModuleType(package)
    pkg.__path__ = [directory]
    pkg.__package__ = package
    pkg.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=True)
    pkg.__spec__.submodule_search_locations = [directory]
    sys.modules[package] = pkg
    module = _exec_model(model_file, f"{package}.{stem}", package)
    setattr(pkg, stem, module)
    return module


def _exec_model(model_file: str, name: str, package: str | None = None) -> types.ModuleType:
    """Run ``model_file`` as the module ``name`` (and in ``package``, already registered: both
    are taken out of ``sys.modules`` again if it fails)."""
    try:
        spec = importlib.util.spec_from_file_location(name, model_file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {model_file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        if package is not None:
            sys.modules.pop(package, None)
        raise
    if not hasattr(module, "TritonPythonModel"):
        raise AttributeError(f"{model_file} defines no class TritonPythonModel")
    return module
