"""Output encoding for both frontends: an output's bytes in Triton's layout, its JSON form, and
Triton's classification extension (the top classes of an output instead of the tensor).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .._errors import InvalidArgumentError
from ..shm.dtypes import serialize_bytes

if TYPE_CHECKING:
    from ._infer_types import OutputTensor
    from ._tensor_decode import Buffer


# ------------------------------------------------------------------ classification extension

#: Output datatypes that can be classified, as in Triton (FP16, BOOL and BYTES cannot; Triton
#: 2.51 even drops the connection, and dies, on a BYTES output).
_CLASSIFIABLE = frozenset({"FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16",
                           "UINT32", "UINT64"})


def class_count(name: str, value: object) -> int:
    """The ``classification`` parameter of requested output ``name``: 0 (absent) or more."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(
            f"output '{name}': the 'classification' parameter must be a non-negative integer "
            f"(how many classes to return), got {value!r}")
    return value


def classify(name: str, datatype: str, arr: np.ndarray, count: int, batched: bool,
             labels: Sequence[str] | None) -> np.ndarray:
    """Triton's classification extension: the ``count`` highest values of an output as BYTES
    elements ``"<value>:<index>[:<label>]"``, highest first, equal values by index.

    A batching model's output is classified per batch entry (shape ``[batch, count]``), any
    other over all its elements (shape ``[count]``); ``count`` past the number of classes gives
    them all. Floats print with 6 decimals, integers as they are; ``labels[i]`` (the output's
    ``label_filename``, a line per class) names index ``i`` when it has that many lines.
    """
    if datatype not in _CLASSIFIABLE:
        raise InvalidArgumentError(
            f"class result not available for output '{name}' due to unsupported type "
            f"'{datatype}'")
    rows = arr.reshape(arr.shape[0], -1) if batched and arr.ndim else arr.reshape(1, -1)
    n = rows.shape[1]
    k = min(count, n)
    floating = datatype in ("FP32", "FP64")
    out = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        # Descending by value, equal values by ascending index: a stable ascending sort of the
        # reversed row, read backwards (no negation, which unsigned types would wrap).
        order = (n - 1) - np.argsort(row[::-1], kind="stable")[::-1][:k]
        for j, i in enumerate(order.tolist()):
            value = row[i].item()
            text = f"{value:f}:{i}" if floating else f"{value}:{i}"
            if labels is not None and i < len(labels):
                text += f":{labels[i]}"
            out[r, j] = text.encode()
    return out if batched else out[0]


# ------------------------------------------------------------------ output bytes and JSON


def tensor_bytes(arr: np.ndarray, datatype: str) -> Buffer:
    """The bytes of an output in Triton's layout; a zero-copy view for fixed-size types."""
    if datatype == "BYTES":
        return serialize_bytes(arr)
    if arr.size and arr.flags.c_contiguous:
        try:
            return arr.data.cast("B")  # one call where numpy's view takes three
        except (TypeError, ValueError):  # a type the buffer protocol does not carry (BF16)
            pass
    # A flat uint8 view (memoryview.cast refuses shapes with a zero, e.g. (0, 3)).
    return np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data


def json_data(out: OutputTensor) -> list[Any] | None:
    """The output as a flat JSON list, or None when JSON cannot carry it losslessly (FP16 and
    BF16, bytes that are not UTF-8). NaN and infinities stay floats: the encoder writes them as
    ``NaN``, ``Infinity`` and ``-Infinity``, as Triton's does (Python's json reads them)."""
    assert out.array is not None
    flat = out.array.ravel()
    if out.datatype == "BYTES":
        try:
            return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in flat.tolist()]
        except UnicodeDecodeError:
            return None
    if out.datatype in ("FP16", "BF16"):
        return None
    return flat.tolist()  # type: ignore[no-any-return]
