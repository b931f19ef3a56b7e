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
    """The folders a model's plain imports search first, as Triton's: its version directory,
    then its model directory (beside config.pbtxt, where versions keep what they share)."""
    version_dir = os.path.normpath(os.path.abspath(version_dir))
    return [version_dir, os.path.dirname(version_dir)]


def import_model(model_file: str, package: str) -> types.ModuleType:
    """Import ``model_file`` as ``<package>.<stem>``, ``package`` being its directory."""
    directory = os.path.dirname(os.path.abspath(model_file))
    pkg = types.ModuleType(package)
    pkg.__path__ = [directory]
    pkg.__package__ = package
    pkg.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=True)
    pkg.__spec__.submodule_search_locations = [directory]
    stem = os.path.splitext(os.path.basename(model_file))[0]
    name = f"{package}.{stem}"
    spec = importlib.util.spec_from_file_location(name, model_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {model_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = pkg
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        sys.modules.pop(package, None)
        raise
    setattr(pkg, stem, module)
    if not hasattr(module, "TritonPythonModel"):
        raise AttributeError(f"{model_file} defines no class TritonPythonModel")
    return module
