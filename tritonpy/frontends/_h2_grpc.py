"""gRPC on HTTP/2, as :mod:`._http2`'s server speaks it: the message prefix, status codes, the
response header blocks and trailers, response compression (levels and algorithms), request
timeouts, what a served method is (:class:`Method`), a response serialized already
(:class:`Serialized`), and the exceptions that end one call.
"""
from __future__ import annotations

import gzip
import struct
import zlib
from typing import Any, Awaitable, Callable

import grpc

from ._h2_frames import _STATUS_200, _literal

_PREFIX = struct.Struct(">BI")  # a gRPC message: compressed flag, length
#: The largest request message, in bytes (Triton's, gRPC's signed 32-bit limit).
MAX_MESSAGE_SIZE = (1 << 31) - 1
#: Request headers that are HTTP/2 or gRPC plumbing, not a call's metadata.
_NOT_METADATA = frozenset((b"te", b"content-type", b"user-agent"))
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_OK = 0
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
#: Printable ASCII but '%': what a grpc-message carries as is (the rest is percent-encoded).
_MESSAGE_SAFE = " !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"


_RESPONSE_HEADERS = (_STATUS_200 + _literal(b"content-type", b"application/grpc")
                     + _literal(b"grpc-accept-encoding", b"identity,deflate,gzip"))
_TRAILERS_OK = _literal(b"grpc-status", b"0")
#: Response headers of a call whose messages are compressed, by algorithm.
_COMPRESSED_HEADERS = {algo: _RESPONSE_HEADERS + _literal(b"grpc-encoding", algo)
                       for algo in (b"gzip", b"deflate")}
#: Triton's --grpc-infer-response-compression-level: the algorithm for each level among those
#: the client accepts, as gRPC's core ranks them (gzip, then deflate: low takes the first, medium
#: the middle one, high the last).
COMPRESSION_LEVELS = ("none", "low", "medium", "high")
_COMPRESS_OFF_LOOP = 1 << 20
#: A response message larger than this goes to the socket as views of its parts, framed
#: without a copy (a copy of a few KiB costs less than the views and the writev).
_SMALL_MESSAGE = 1 << 16


def _algorithm(level: str, accepted: bytes | None) -> bytes | None:
    """The algorithm to compress a response with at ``level`` for a client that accepts
    ``accepted`` (its grpc-accept-encoding), or None."""
    if level == "none" or not accepted:
        return None
    names = {a.strip() for a in accepted.split(b",")}
    ranked = [a for a in (b"gzip", b"deflate") if a in names]
    if not ranked:
        return None
    return ranked[{"low": 0, "medium": len(ranked) // 2, "high": len(ranked) - 1}[level]]


def _compress(algo: bytes, payload: bytes) -> bytes:
    if algo == b"gzip":
        return gzip.compress(payload, compresslevel=6)
    return zlib.compress(payload)


class Serialized:
    """A response message serialized already, as parts to send one after the other (the
    large tensors of a response need not be copied into one buffer)."""

    __slots__ = ("parts", "size")

    def __init__(self, parts: list[Any], size: int) -> None:
        self.parts, self.size = parts, size

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return b"".join(self.parts)


class Method:
    """One RPC: its handler (a servicer's bound method), how to read its requests and write its
    responses, whether the client streams (bidirectional) or sends one request, and whether
    its responses are compressed at the server's compression level (inference calls)."""

    __slots__ = ("handler", "parse", "streaming", "compressible", "restricted", "metadata")

    def __init__(self, handler: Callable[..., Awaitable[Any]], parse: Callable[[Any], Any],
                 streaming: bool, compressible: bool = False,
                 restricted: tuple[str, str] | None = None, metadata: bool = False) -> None:
        self.handler, self.parse, self.streaming = handler, parse, streaming
        self.compressible = compressible
        # (header, value) a call must carry, else it is refused UNAVAILABLE (Triton's
        # --grpc-restricted-protocol); the header is already the full, prefixed name.
        self.restricted = (None if restricted is None
                           else (restricted[0].lower().encode(), restricted[1].encode()))
        # Whether its handler sees the call's metadata (context.metadata).
        self.metadata = metadata


class _Closed(Exception):
    """The call is over (cancelled, reset by the client, or the connection is gone)."""


class _Status(Exception):
    """End the call with this gRPC status (before or outside a handler)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def _parse_timeout(value: bytes) -> float | None:
    """A grpc-timeout in seconds: at most 8 digits and a unit (gRPC's form); None when it is
    not one (the call then has no deadline)."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit
