"""Model warmup (``model_warmup`` in config.pbtxt), as Triton 2.51 runs it (checked side by side).

Each new instance, after ``initialize`` and before it takes any request, runs every warmup
sample in order: ``count`` executes (at least one; none for a ``batch_size`` of 0), each of
``batch_size`` requests of batch 1
(``dims`` with a batch dimension of 1 prepended when the model batches). Inputs are zeros
(``zero_data``), random values (``random_data``; BYTES are empty either way) or the raw
tensor bytes of a file in the model's ``warmup/`` folder (``input_data_file``; BYTES in
Triton's length-prefixed layout). An execute that raises, or any error response, fails the
instance's start with "failed to run warmup sample '<name>': ...", and so the model's load.
Warmup requests count in the model's statistics, as in Triton.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from tritonpy.shm.dtypes import deserialize_bytes, numpy_dtype

from ._errors import InvalidArgumentError, TritonpyError
from ._request import HostRequest
from .validation import triton_type_name

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ._instances import Instance
    from ._model import ModelRuntime


def sample_inputs(rt: ModelRuntime, sample: Any) -> list[tuple[str, np.ndarray]]:
    """The input arrays of one warmup sample (one request's worth)."""
    arrays = []
    rng = np.random.default_rng()
    for name, spec in sample.inputs.items():
        datatype = triton_type_name(spec.data_type)
        dims = [int(d) for d in spec.dims]
        if any(d < 0 for d in dims):
            raise InvalidArgumentError(f"warmup setting '{sample.name}': input '{name}' has a "
                                       f"variable dimension in {dims}; warmup dims must be fixed")
        shape = ([1] + dims) if rt.max_batch_size > 0 else dims
        count = int(np.prod(shape))
        choice = spec.WhichOneof("input_data_type")
        if datatype == "BYTES":
            if choice == "input_data_file":
                arr = deserialize_bytes(_read(rt, sample, name, spec.input_data_file), count)
            else:
                arr = np.full(count, b"", dtype=object)
        else:
            dtype = numpy_dtype(datatype)
            if choice == "zero_data":
                arr = np.zeros(count, dtype)
            elif choice == "random_data":
                if dtype.kind == "b":
                    arr = rng.integers(0, 2, count).astype(bool)
                elif dtype.kind in "iu":
                    arr = rng.integers(0, 100, count).astype(dtype)
                else:
                    arr = rng.random(count).astype(dtype)
            elif choice == "input_data_file":
                data = _read(rt, sample, name, spec.input_data_file)
                need = count * dtype.itemsize
                if len(data) < need:  # as Triton, a longer file gives its first bytes
                    raise InvalidArgumentError(
                        f"warmup setting '{sample.name}': input '{name}' expects "
                        f"{need} bytes, but the data provided from "
                        f"'{spec.input_data_file}' has {len(data)} bytes")
                arr = np.frombuffer(data[:need], dtype).copy()
            else:
                raise InvalidArgumentError(f"warmup setting '{sample.name}': input '{name}' sets "
                                           "none of zero_data, random_data, input_data_file")
        arrays.append((name, arr.reshape(shape)))
    return arrays


def _read(rt: ModelRuntime, sample: Any, name: str, file: str) -> bytes:
    folder = os.path.join(rt.model_dir, "warmup")
    path = os.path.normpath(os.path.join(folder, file))
    if not path.startswith(folder + os.sep):
        raise InvalidArgumentError(f"warmup setting '{sample.name}': input '{name}': "
                                   f"'{file}' is outside the model's warmup folder")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidArgumentError(f"warmup setting '{sample.name}': input '{name}': "
                                   f"cannot read '{file}': {exc.strerror}") from None


def run(rt: ModelRuntime, inst: Instance) -> None:
    """Run every warmup sample on ``inst`` (not yet serving); raise on the first that fails.

    As Triton 2.51's: a sample of ``batch_size`` 0 runs nothing, and one whose requests add up
    to more than ``max_batch_size`` (more than 1 for a model that does not batch) fails each
    of them, hence the load.
    """
    for sample in rt.config.model_warmup:
        try:
            inputs = sample_inputs(rt, sample)
        except TritonpyError as exc:
            raise InvalidArgumentError(f"failed to run warmup sample '{sample.name}': {exc.message}") from None
        batch_size = int(sample.batch_size)
        if batch_size == 0:
            continue
        for iteration in range(1, max(1, int(sample.count)) + 1):
            # Triton's verbose line, word for word (QA L0_warmup looks for it).
            log.debug("model '%s' instance %s is running warmup sample '%s' for iteration %d",
                      rt.name, inst.name, sample.name, iteration)
            if batch_size != 1 and batch_size > rt.max_batch_size:
                errors = [f"batch size {batch_size} for '{inst.name}', max allowed is "
                          f"{rt.max_batch_size}"] * batch_size
            else:
                errors = _execute(rt, inst, inputs, batch_size)
            if errors:
                raise InvalidArgumentError(
                    f"failed to run warmup sample '{sample.name}': " + "".join(e + "; " for e in errors))


def _execute(rt: ModelRuntime, inst: Instance, inputs: list[tuple[str, np.ndarray]],
             batch_size: int) -> list[str]:
    """One execute of ``batch_size`` requests on ``inst``; the error messages it gave."""
    lock = threading.Lock()
    finished = threading.Event()
    errors: list[str] = []
    left = [batch_size]

    def sink(req: HostRequest, outputs: Any, error: TritonpyError | None, params: Any,
             final: bool) -> None:
        with lock:
            if error is not None:
                errors.append(error.message)
            if final:
                left[0] -= 1
                if not left[0]:
                    finished.set()

    batch = [HostRequest(rt, inputs, None, sink) for _ in range(batch_size)]
    # Checked as a client's request would be, but for inputs the config does not name: as
    # Triton's warmup, those reach the model as they are.
    known = {i.name for i in rt.config.input}
    probe = HostRequest(rt, [(n, a) for n, a in inputs if n in known], None, sink)
    try:
        rt.server.validate(rt, probe)
    except TritonpyError as exc:
        return [exc.message]
    for req in batch:
        req.batch_size = probe.batch_size
    with rt.lock:
        inst.running += 1  # as a scheduler's take() does; the execute's end gives it back
        for req in batch:
            req.instance = inst  # as _take_locked does
    rt._send(inst, batch)  # straight to this instance: it is not serving yet
    finished.wait()  # a stub that dies fails its requests, which ends this too
    # A decoupled model's final response can come before its execute has returned: wait for
    # that too, so the execute is counted and over before the next one or the first request.
    with rt.lock:
        while inst.running and inst.stub is not None and inst.stub.alive:
            rt._idle.wait(0.1)  # _finish_execute and the death path notify it
    return errors
