"""The stub process and the ``triton_python_backend_utils`` module (``pb_utils``).

Imports only :mod:`tritonpy.shm`; the host never imports this package into its own process
except to find the stub's entry point.
"""
