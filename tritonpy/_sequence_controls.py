"""The inputs the sequence batcher (:mod:`._sequence`) adds to each request it sends: its
control tensors and implicit state, and the direct strategy's null request.

* The control inputs the configuration names are added to each request as it is sent:
  START, END, READY with their configured false/true values and data type, CORRID with the
  correlation ID in its configured type. Shapes are ``[1]``, or ``[1, 1]`` for a model with
  max_batch_size > 0.
* Implicit state (``sequence_batching.state``) as Triton documents it, which its 2.51 Python
  backend does not do (it gives the initial value at every step): each state input is added
  to a request, with the state output of the sequence's last request that returned one, or
  the initial value (zeros, or the initial state's data file) at START. The model is asked
  for its state outputs whatever the client asked for; a client gets one only when the
  config lists it among the outputs and the client asked for it (or for every output).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
from tritonclient.grpc.model_config_pb2 import DataType

from ._errors import InternalError, InvalidArgumentError
from ._request import HostRequest
from .shm.dtypes import deserialize_bytes, numpy_dtype
from .validation import triton_type_name

#: The flags of a request of a sequence (``HostRequest.flags``).
FLAG_START = 1
FLAG_END = 2
# ModelSequenceBatching.Control.Kind values.
_START, _READY, _END, _CORRID = 0, 1, 2, 3
_CORRID_DTYPES = {DataType.TYPE_UINT64: np.uint64, DataType.TYPE_INT64: np.int64,
                  DataType.TYPE_UINT32: np.uint32, DataType.TYPE_INT32: np.int32,
                  DataType.TYPE_STRING: object}
_INT_TYPE_STRING = DataType.TYPE_STRING
_U64 = (1 << 64) - 1


class _Controls:
    """The control tensors a configuration asks for, built once."""

    def __init__(self, cfg: Any, model_dir: str = "") -> None:
        shape = (1, 1) if int(cfg.max_batch_size) > 0 else (1,)
        self.shape = shape
        initialized: set[str] = set()  # the states given an initial_state so far
        self.states = [(st.input_name, _initial_state(st, int(cfg.max_batch_size) > 0, model_dir,
                                                      initialized, cfg.name))
                       for st in cfg.sequence_batching.state]
        # State output name -> (its input's name, its data type: config name, wire name).
        self.state_outputs = {st.output_name: (st.input_name, DataType.Name(int(st.data_type)),
                                               triton_type_name(st.data_type))
                              for st in cfg.sequence_batching.state}
        self.flags: list[tuple[str, int, np.ndarray, np.ndarray]] = []
        self.corrid: tuple[str, Any, bool] | None = None
        for ci in cfg.sequence_batching.control_input:
            for ctl in ci.control:
                kind = int(ctl.kind)
                if kind == _CORRID:
                    dt = _CORRID_DTYPES.get(int(ctl.data_type), np.uint64)
                    self.corrid = (ci.name, dt, int(ctl.data_type) == _INT_TYPE_STRING)
                    continue
                if len(ctl.int32_false_true):
                    vals, dt = list(ctl.int32_false_true), np.int32
                elif len(ctl.fp32_false_true):
                    vals, dt = list(ctl.fp32_false_true), np.float32
                else:
                    vals, dt = list(ctl.bool_false_true), np.bool_
                false = np.full(shape, vals[0], dtype=dt)
                true = np.full(shape, vals[1], dtype=dt)
                self.flags.append((ci.name, kind, false, true))
        self.names = frozenset([n for n, *_ in self.flags] + [n for n, _ in self.states] +
                               ([self.corrid[0]] if self.corrid else []))

    def tensors(self, req: HostRequest, carried: dict[str, Any]) -> list[tuple[str, Any]]:
        """The control and state inputs of ``req``; ``carried``: its sequence's state."""
        out: list[tuple[str, Any]] = []
        flags = req.flags
        null = req.null
        for name, kind, false, true in self.flags:
            if kind == _START:
                on = bool(flags & FLAG_START)
            elif kind == _END:
                on = bool(flags & FLAG_END)
            else:
                on = not null  # READY: false only for a null request
            out.append((name, true if on else false))
        if self.corrid is not None:
            name, dt, is_str = self.corrid
            cid = req.correlation_id
            if is_str:
                arr = np.empty(self.shape, dtype=object)
                arr.flat[0] = str(cid).encode("utf-8")
            else:
                # The ID's low bytes in the configured type, as Triton copies them.
                arr = np.full(self.shape, int(cid) & _U64, dtype=np.uint64).astype(dt)
            out.append((name, arr))
        if carried:
            out.extend((name, carried.get(name, initial)) for name, initial in self.states)
        else:
            out.extend(self.states)
        return out


class NullRequest(HostRequest):
    """A direct-strategy batch's filler for a slot with nothing to send (see
    :mod:`._sequence`'s notes): zeros of the shapes of ``like``'s inputs, answered to nobody."""

    null = True

    def __init__(self, like: HostRequest) -> None:
        inputs = [(name, _zeros(list(np.shape(arr)), np.asarray(arr).dtype))
                  for name, arr in like.inputs]
        super().__init__(like.model, inputs, None, _nowhere)


def _nowhere(req: HostRequest, outputs: Any, error: Any, params: Any, final: bool) -> None:
    """Where a null request's answer goes."""


def _zeros(dims: list[int], dtype: np.dtype) -> np.ndarray:
    """A state's zero value: zeros, or empty elements for BYTES."""
    return np.full(dims, b"", dtype=object) if dtype == np.object_ else np.zeros(dims, dtype)


def _initial_state(st: Any, batched: bool, model_dir: str, initialized: set[str],
                   model: str) -> np.ndarray:
    """A state input's value at a sequence's START: its ``initial_state`` (zeros, or the raw
    bytes of ``<model dir>/initial_state/<data_file>``), else zeros.

    The ``initial_state`` is checked as Triton 2.51 checks it when the model loads, in its
    order and words (measured; QA L0_implicit_state): its data type, its name, a state input
    given one twice (``initialized``: those given one so far), its number of dimensions,
    each dimension (none variable, each the state's unless that one is), then its data (zero
    or a file at least as long as the state, or the whole file for BYTES). A state with no
    ``input_name`` is refused too (Triton 2.51 aborts at its first request)."""
    if not st.input_name:
        raise InvalidArgumentError(f"a 'state' of the sequence batching of model '{model}' "
                                   "has no 'input_name'")
    if not st.data_type:  # (TYPE_INVALID) Triton 2.51 loads it; what it holds is anyone's guess
        raise InvalidArgumentError(f"the 'state' '{st.input_name}' of the sequence batching of "
                                   f"model '{model}' has no 'data_type'")
    init = st.initial_state[0] if len(st.initial_state) else None
    if init is None:
        dtype = numpy_dtype(DataType.Name(int(st.data_type)))
        dims = [max(0, int(d)) for d in st.dims]
        arr = _zeros(dims, dtype)
        return arr.reshape((1, *arr.shape)) if batched else arr
    name = st.input_name
    if int(init.data_type) != int(st.data_type):
        raise InvalidArgumentError(f"The data type used for 'initial_state' field of state "
                                   f"'{name}' does not match the state data type.")
    if not init.name:
        raise InvalidArgumentError(f"Field 'name' must be set when using initial_state for "
                                   f"state input '{name}'.")
    if name in initialized:
        raise InvalidArgumentError(f"State input name '{name}' specified more than once.")
    if len(init.dims) != len(st.dims):
        raise InvalidArgumentError(
            f"Number of dimensions in 'initial_state' doesn't match the size of 'state' "
            f"dimensions for state input '{name}'. {len(init.dims)} != {len(st.dims)}")
    for want, have in zip(init.dims, st.dims):
        if want == -1:
            raise InvalidArgumentError(f"'initial_state' field for state input name '{name}' "
                                       "contains variable dimensions.")
        if have != -1 and want != have:
            raise InvalidArgumentError(f"'initial_state' dim for input name '{name}' doesn't "
                                       f"match 'state' dim description. {want} != {have}")
    initialized.add(name)
    dtype = numpy_dtype(DataType.Name(int(init.data_type)))
    dims = [int(d) for d in init.dims]
    count = int(np.prod(dims)) if dims else 1
    which = init.WhichOneof("state_data")
    if which == "zero_data":
        arr = _zeros(dims, dtype)
    elif which == "data_file":
        path = os.path.join(model_dir, "initial_state", init.data_file)
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise InternalError(f"failed to open text file for read {path}: "
                                f"{exc.strerror}") from None
        if dtype == np.object_:  # BYTES: the whole file, as serialized elements
            try:
                arr = deserialize_bytes(raw).reshape(dims)
            except (ValueError, TypeError) as exc:
                raise InvalidArgumentError(f"initial_state data file '{init.data_file}' of "
                                           f"state '{name}': {exc}") from None
        else:
            need = count * dtype.itemsize
            if need > len(raw):  # Triton's words, its missing space included
                raise InvalidArgumentError(
                    f"initial_state setting expects {need} bytes, but the data provided from "
                    f"{init.data_file}only has {len(raw)} bytes.")
            arr = np.frombuffer(raw[:need], dtype=dtype).reshape(dims).copy()
    else:
        raise InvalidArgumentError(f"initial_state setting expects state'{name}' to have "
                                   "state_data set")
    return arr.reshape((1, *arr.shape)) if batched else arr
