"""The shared-memory substrate: pools, tensor handles, the message channel, orphan sweeps.

Imports nothing from the host (``tritonpy``) or the stub (``tritonpy.stub``); both sides use it.
"""
from __future__ import annotations

from ._errors import (
    ChannelClosedError,
    ProtocolError,
    SegmentGoneError,
    ShmError,
    ShmExhaustedError,
)
from .channel import FRAME_LIMIT, Channel, socket_pair
from .dtypes import (
    TRITON_TO_NUMPY,
    deserialize_bytes,
    numpy_dtype,
    serialize_bytes,
    triton_dtype_of,
)
from .messages import PROTOCOL_VERSION, Cmd
from .pool import Pool, SegmentMap
from .segment import Segment, process_token
from .sweep import list_segments, sweep_orphans
from .transport import INLINE_LIMIT, Peer, TensorTransport

__all__ = [
    "FRAME_LIMIT",
    "INLINE_LIMIT",
    "PROTOCOL_VERSION",
    "TRITON_TO_NUMPY",
    "Channel",
    "ChannelClosedError",
    "Cmd",
    "Peer",
    "Pool",
    "ProtocolError",
    "Segment",
    "SegmentGoneError",
    "SegmentMap",
    "ShmError",
    "ShmExhaustedError",
    "TensorTransport",
    "deserialize_bytes",
    "list_segments",
    "numpy_dtype",
    "process_token",
    "serialize_bytes",
    "socket_pair",
    "sweep_orphans",
    "triton_dtype_of",
]
