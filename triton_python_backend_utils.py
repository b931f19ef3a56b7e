"""Top-level alias so that ``import triton_python_backend_utils`` works in a plain interpreter.

Models written for Triton import this name; inside a stub process the stub installs the same
module object under this name before it imports ``model.py``.
"""
from tritonpy.stub.pb_utils import *  # noqa: F401,F403
from tritonpy.stub.pb_utils import __all__  # noqa: F401
