"""The wire-neutral types of inference both frontends share: the :class:`InferRequest` a
frontend decodes its wire format into, the :class:`InferResult` it encodes back, and the
:class:`RequestPlan` it keeps per request header to make the next such request quickly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import numpy as np

from .._errors import TritonpyError
from .._trace import Trace
from ._tensor_decode import Buffer, PendingBytes
from ._tensor_encode import tensor_bytes

if TYPE_CHECKING:
    from ..shm.cuda import DeviceRef

ParamValue = Union[bool, int, float, str]


@dataclass(frozen=True)
class ShmRef:
    """A window of a registered client shared-memory region."""

    region: str
    offset: int
    byte_size: int


@dataclass
class RequestedOutput:
    """One entry of a request's ``outputs``; ``binary`` None means the request's default;
    ``classification`` > 0 asks for that many classes instead of the tensor."""

    name: str
    binary: bool | None = None
    shm: ShmRef | None = None
    classification: int = 0


@dataclass
class InferRequest:
    """An inference request after wire decoding, before it reaches the model."""

    model: str
    version: int = -1
    # (a DeviceRef: an input in a client's CUDA shared-memory region, passed on unread)
    inputs: dict[str, np.ndarray | PendingBytes | DeviceRef] = field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    request_id: str = ""
    parameters: dict[str, ParamValue] = field(default_factory=dict)
    correlation_id: int | str = 0
    flags: int = 0
    timeout: int = 0
    priority: int = 0
    binary_output_default: bool = False
    enable_empty_final: bool = False
    # Tracing: the frontend's timestamps so far (name, ns), the caller's W3C traceparent
    # (OpenTelemetry mode), and the trace once sampled.
    received: tuple[tuple[str, int], ...] = ()
    traceparent: str = ""
    trace: Trace | None = None
    # The system shared-memory regions its outputs go to, kept registered while it runs.
    shm_held: Sequence[Any] = ()


#: Decoded request headers kept for the next request of the same header, and encoded response
#: headers kept for the next response of the same shape (a client sends requests of one shape
#: alike, and gets answers alike): at most this many of each, all forgotten at once when full.
HEADER_CACHE_SIZE = 256

#: An input a :class:`RequestPlan` decodes: name, byte size as it came, numpy dtype (None:
#: BYTES, left as :class:`PendingBytes` whatever its size), shape, element count. An input read
#: from a system shared-memory region has the byte size -1 (see :meth:`RequestPlan.shm_spec`).
InputSpec = tuple[str, int, "np.dtype | None", tuple[int, ...], int]
#: How a plan reads an input from shared memory: :meth:`.dataplane.DataPlane.input_from_shm`
#: (the region and window checked each time).
ShmReader = Callable[..., Any]


class RequestPlan:
    """What a request said apart from its tensors' bytes, decoded and checked once: the
    request's settings, its requested outputs, and how to decode each input from its bytes
    (``inputs``, see :data:`InputSpec`). A frontend keeps one per request header it has seen
    (only headers whose inputs all come with the request or from system shared memory, not
    from JSON) and makes the next such request with :meth:`request`; its bytes are checked as a
    full decode checks them, and an input in shared memory is read as a full decode reads it."""

    __slots__ = ("model", "version", "settings", "outputs", "inputs", "shm", "raw_count")

    def __init__(self, req: InferRequest, inputs: list[InputSpec],
                 shm: dict[str, tuple[str, list, ShmRef]] | None = None) -> None:
        self.model, self.version = req.model, req.version
        # Copies: the request goes on, and its parameters may gain forwarded headers.
        self.settings = (req.request_id, dict(req.parameters), req.correlation_id, req.flags,
                         req.timeout, req.priority, req.binary_output_default,
                         req.enable_empty_final)
        self.outputs = None if req.outputs is None else list(req.outputs)
        self.inputs = inputs
        self.shm = shm or {}  # name -> (datatype, shape, region window) of a shm input
        self.raw_count = len(inputs) - len(self.shm)  # the buffers request() takes

    @staticmethod
    def shm_spec(name: str) -> InputSpec:
        """The :data:`InputSpec` of an input read from shared memory (its datatype, shape and
        window go in the plan's ``shm``)."""
        return (name, -1, None, (), 0)

    @staticmethod
    def spec(name: str, value: np.ndarray | PendingBytes | DeviceRef, nbytes: int) -> InputSpec:
        """The :data:`InputSpec` of a decoded input that came as ``nbytes`` bytes."""
        dtype = None if isinstance(value, PendingBytes) else value.dtype
        return (name, nbytes, dtype, tuple(value.shape), int(math.prod(value.shape)))

    def request(self, buffers: Sequence[Buffer],
                from_shm: ShmReader | None = None) -> InferRequest | None:
        """A request with this plan's settings and inputs decoded from ``buffers`` (one per
        input that came with the request, in order) and read with ``from_shm`` (the others);
        None when they do not fit (their number or a size): a full decode then gives the
        error."""
        specs = self.inputs
        if len(buffers) != self.raw_count:
            return None
        rid, params, correlation_id, flags, timeout, priority, binary, empty_final = self.settings
        req = InferRequest(self.model, self.version,
                           outputs=None if self.outputs is None else list(self.outputs),
                           request_id=rid, parameters=dict(params), correlation_id=correlation_id,
                           flags=flags, timeout=timeout, priority=priority,
                           binary_output_default=binary, enable_empty_final=empty_final)
        inputs = req.inputs
        if self.shm:
            given = iter(buffers)
            buffers = [b"" if spec[1] < 0 else next(given) for spec in specs]
        for (name, nbytes, dtype, shape, count), buf in zip(specs, buffers):
            if nbytes < 0:
                assert from_shm is not None
                datatype, asked, ref = self.shm[name]
                inputs[name] = from_shm(name, datatype, asked, ref, model=self.model,
                                        request_id=rid)
            elif dtype is None:
                inputs[name] = PendingBytes(name, shape, buf, self.model, rid)
            elif len(buf) != nbytes:
                return None
            else:
                arr = np.frombuffer(buf, dtype, count)
                # (1-D: the shape frombuffer gives, count elements)
                inputs[name] = arr if len(shape) == 1 else arr.reshape(shape)
        return req


def keep(cache: dict, key: Any, value: Any) -> None:
    """``cache[key] = value``, forgetting everything first once it holds
    :data:`HEADER_CACHE_SIZE` entries."""
    if len(cache) >= HEADER_CACHE_SIZE:
        cache.clear()
    cache[key] = value


@dataclass
class OutputTensor:
    """An output ready for the wire: ``array`` for the body, or ``shm`` when already written."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray | None
    shm: ShmRef | None = None
    binary: bool = False

    def raw(self) -> Buffer:
        """The tensor's bytes in Triton's layout (length-prefixed elements for BYTES)."""
        assert self.array is not None
        return tensor_bytes(self.array, self.datatype)


@dataclass
class InferResult:
    """One response of a model, wire-neutral; ``final`` marks the last of a stream."""

    model: str
    version: int
    request_id: str
    outputs: list[OutputTensor]
    parameters: dict[str, Any]
    final: bool = True
    error: TritonpyError | None = None
    empty: bool = False  # only the final flag, no response (see InferenceResponse.empty)
