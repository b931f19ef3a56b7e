"""Tensor decoding for both frontends: an input's bytes (raw, or a JSON ``data`` list) into a
numpy array, with Triton's limits on tensors and its words for each refusal.

A BYTES input that came as raw bytes stays a :class:`PendingBytes` until the request has been
checked against the model (see :meth:`.dataplane.DataPlane.stream`).
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

from .._errors import InvalidArgumentError, UnsupportedError
from ..shm._errors import ProtocolError, TruncatedElementError
from ..shm.dtypes import (ITEMSIZE, TRITON_TO_NUMPY, ElementCountError, TruncatedPrefixError,
                          deserialize_bytes)
from ..validation import request_prefix

Buffer = Union[bytes, bytearray, memoryview]


class PendingBytes:
    """A BYTES input as it came off the wire, decoded only once the request has been checked
    against the model (as Triton, which checks datatype and shape before the elements).

    It has the ``dtype`` and ``shape`` its decoded array will have, which is all validation
    reads.
    """

    __slots__ = ("name", "shape", "buf", "model", "request_id")
    dtype = np.dtype(object)

    def __init__(self, name: str, shape: tuple[int, ...], buf: Buffer, model: str,
                 request_id: str) -> None:
        self.name, self.shape, self.buf = name, shape, buf
        self.model, self.request_id = model, request_id

    def decode(self) -> np.ndarray:
        return array_from_raw(self.name, "BYTES", self.shape, self.buf, model=self.model,
                              request_id=self.request_id)


# ------------------------------------------------------------------ Triton's limits on tensors


def is_uint(value: object) -> bool:
    """True for a non-negative int that is not a bool (JSON true is not a number)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: Largest element count and byte size of a tensor (Triton's int64 limit).
MAX_TENSOR_SIZE = 2**63 - 1
#: Deepest nesting of a JSON ``data`` list (Triton's limit).
MAX_JSON_DEPTH = 100
JSON_TOO_DEEP = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"


def _numpy_max_dims() -> int:
    try:
        np.empty((1,) * 64)
    except ValueError:
        return 32  # numpy 1.x
    return 64


#: The most dimensions a numpy array (so a tensor here) can have.
MAX_DIMS = _numpy_max_dims()


def element_count(name: str, shape: Sequence[object]) -> int:
    """Validate a shape from the wire and return its element count."""
    if not isinstance(shape, (list, tuple)) or not all(is_uint(d) for d in shape):
        raise InvalidArgumentError(f"Unable to parse 'shape' of input '{name}'")
    if len(shape) > MAX_DIMS:
        raise InvalidArgumentError(
            f"input '{name}' has {len(shape)} dimensions; tensors have at most {MAX_DIMS} "
            "here (numpy's limit)")
    count = math.prod(shape)  # type: ignore[arg-type]
    if count > MAX_TENSOR_SIZE:
        raise InvalidArgumentError(
            f"shape {list(shape)} of input '{name}' causes total element count to exceed "
            f"maximum size of {MAX_TENSOR_SIZE}")
    return count  # type: ignore[no-any-return]


def check_byte_size(name: str, datatype: str, count: int) -> None:
    """Refuse a fixed-size tensor whose byte size does not fit Triton's int64."""
    if count * ITEMSIZE.get(datatype, 1) > MAX_TENSOR_SIZE:
        raise InvalidArgumentError(
            f"byte size overflow for input '{name}': {count} {datatype} elements exceed "
            f"{MAX_TENSOR_SIZE} bytes")


# --------------------------------------------------------------------------- tensor decoding


def numpy_dtype(name: str, datatype: object) -> np.dtype:
    """The numpy dtype of input ``name``'s Triton ``datatype``, or Triton's error for it."""
    if not isinstance(datatype, str) or datatype not in TRITON_TO_NUMPY:
        if datatype == "BF16":  # only where ml_dtypes cannot be imported
            raise UnsupportedError(f"input '{name}': BF16 tensors need the ml_dtypes package")
        raise InvalidArgumentError(f"invalid datatype '{datatype}' for input '{name}'")
    return np.dtype(TRITON_TO_NUMPY[datatype])


def input_from_raw(name: str, datatype: str, shape: Sequence[int], buf: Buffer, *,
                   model: str, request_id: str = "") -> np.ndarray | PendingBytes:
    """:func:`array_from_raw`, except that a BYTES input is left as :class:`PendingBytes`
    (its shape checked) for :meth:`.dataplane.DataPlane.stream` to decode after validation."""
    if datatype == "BYTES":
        element_count(name, shape)
        return PendingBytes(name, tuple(shape), buf, model, request_id)
    return array_from_raw(name, datatype, shape, buf, model=model, request_id=request_id)


def array_from_raw(name: str, datatype: str, shape: Sequence[int], buf: Buffer, *,
                   model: str, request_id: str = "") -> np.ndarray:
    """A zero-copy array over ``buf``, after checking its size against the shape.

    ``model`` and ``request_id`` are for the messages, in Triton's words.
    """
    dtype = numpy_dtype(name, datatype)
    count = element_count(name, shape)
    if datatype == "BYTES":
        try:
            arr = deserialize_bytes(buf, count)
        except TruncatedElementError as exc:
            raise InvalidArgumentError(
                f"incomplete string data for inference input '{name}', expecting string of "
                f"length {exc.length} but only {exc.available} bytes available") from None
        except TruncatedPrefixError as exc:
            raise InvalidArgumentError(
                f"{request_prefix(request_id)}incomplete string length indicator for inference "
                f"input '{name}' for model '{model}', expecting 4 bytes but only "
                f"{exc.available} bytes available. Please make sure the string length "
                "indicator is in one buffer.") from None
        except ElementCountError as exc:
            raise InvalidArgumentError(request_prefix(request_id) + string_count_error(
                name, exc.found, exc.expected, f" for model '{model}'")) from None
        except ProtocolError as exc:
            raise InvalidArgumentError(f"input '{name}': {exc}") from None
        return arr.reshape(tuple(shape))
    check_raw_size(name, datatype, shape, len(buf), model=model, request_id=request_id)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(tuple(shape))


def string_count_error(name: str, found: int, expected: int, where: str) -> str:
    """The error for a BYTES input of ``found`` elements whose shape says ``expected``, in
    Triton's words; ``where`` (the model, or the shape) goes after the input's name."""
    if found > expected:
        return (f"unexpected number of string elements {found} for inference input "
                f"'{name}'{where}, expecting {expected}")
    return f"expected {expected} string elements for inference input '{name}'{where}, got {found}"


def check_raw_size(name: str, datatype: str, shape: Sequence[int], nbytes: int, *,
                   model: str, request_id: str = "") -> None:
    """Fail unless ``nbytes`` is the size of a (non-BYTES) tensor of this type and shape."""
    numpy_dtype(name, datatype)
    count = element_count(name, shape)
    check_byte_size(name, datatype, count)
    expected = count * ITEMSIZE[datatype]
    if nbytes != expected:
        raise InvalidArgumentError(
            f"{request_prefix(request_id)}input byte size mismatch for input '{name}' for model "
            f"'{model}'. Expected {expected}, got {nbytes}"
        )


_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


def array_from_json(name: str, datatype: str, shape: Sequence[int], data: object) -> np.ndarray:
    """An array from a JSON ``data`` list (any nesting; row-major like Triton)."""
    dtype = numpy_dtype(name, datatype)
    if datatype == "BF16":  # Triton's words: JSON has no bfloat16 form
        raise InvalidArgumentError(
            f"receiving BF16 data via JSON is not supported. Please use the binary data format "
            f"for input {name}")
    count = element_count(name, shape)
    if not isinstance(data, list):
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': expected a list")
    depth = 0
    if datatype != "BYTES":
        check_byte_size(name, datatype, count)
        probe: object = data
        while isinstance(probe, list) and probe:  # rectangular data: its first path is deepest
            depth, probe = depth + 1, probe[0]
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': {JSON_TOO_DEEP}")
    if datatype == "BYTES":
        flat: list[object] = []
        _flatten(name, data, flat, 1)
        if not all(isinstance(s, str) for s in flat):
            raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': BYTES elements must be strings")
        if len(flat) != count:  # the counts, as for binary data (Triton says them for both)
            raise InvalidArgumentError(
                string_count_error(name, len(flat), count, f" (shape {list(shape)})"))
        arr = np.empty(len(flat), dtype=object)
        try:
            arr[:] = [str(s).encode("utf-8") for s in flat]  # all str (checked above)
        except UnicodeEncodeError as exc:  # JSON's "\udcff": no character, hence no UTF-8
            raise InvalidArgumentError(
                f"Unable to parse 'data' of input '{name}': a string holds an unpaired "
                f"surrogate (\\u{ord(exc.object[exc.start]):04x}), which is not text") from None
    else:
        if depth > MAX_DIMS:  # past numpy's dimension limit: flatten in Python first
            flat_values: list[object] = []
            _flatten(name, data, flat_values, 1)
            data = flat_values
        try:
            arr = np.array(data)
        except ValueError:
            # Ragged nesting ([[1, 2], [3]]): as Triton 2.51 (measured), the values are read
            # in order whatever the nesting, and only their count must match the shape.
            flat_values = []
            _flatten(name, data, flat_values, 1)
            data = flat_values
            try:
                arr = np.array(data)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"Unable to parse 'data' of input '{name}': {exc}") from None
        if dtype.kind in "iu" and arr.dtype.kind in "fO":
            # Integers on both sides of 2**63 have no common numpy integer type: numpy makes
            # floats of them (or objects), losing the low bits. Build from exact Python ints.
            arr = _exact_integers(name, datatype, data)
        if arr.size and arr.dtype.kind not in _KINDS[dtype.kind]:
            raise InvalidArgumentError(
                f"Unable to parse 'data' of input '{name}': expected {datatype} values"
            )
        if dtype.kind in "iu" and arr.size:
            info = np.iinfo(dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': value out of range for {datatype}")
        # As Triton's (measured), a float past its type's range is infinite (1e40 for FP32):
        # no numpy RuntimeWarning on the server's stderr for it.
        with np.errstate(over="ignore"):
            arr = arr.astype(dtype, copy=False).ravel()
    if arr.size != count:
        raise InvalidArgumentError(
            f"Unable to parse 'data' of input '{name}': Shape does not match true shape of 'data' field"
        )
    return arr.reshape(tuple(shape))


def _exact_integers(name: str, datatype: str, data: list[object]) -> np.ndarray:
    """``data`` as an array of ``datatype`` when every element is a JSON integer in range."""
    flat: list[object] = []
    _flatten(name, data, flat, 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': expected {datatype} values")
    info = np.iinfo(TRITON_TO_NUMPY[datatype])
    if any(v < info.min or v > info.max for v in flat):  # type: ignore[operator]
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': value out of range for {datatype}")
    return np.array(flat, dtype=TRITON_TO_NUMPY[datatype])


def _flatten(name: str, data: list[object], out: list[object], depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': {JSON_TOO_DEEP}")
    for item in data:
        if isinstance(item, list):
            _flatten(name, item, out, depth + 1)
        else:
            out.append(item)
