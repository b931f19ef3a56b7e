"""HTTP/2 on the wire (RFC 9113) as :mod:`._http2`'s server frames it: the frame header, frame
types, flags, error codes and settings, our windows, the HPACK fields we write (RFC 7541: literals
without indexing, never the dynamic table), padding, and the error that ends a connection.
"""
from __future__ import annotations

import struct
from typing import Any

_FRAME = struct.Struct(">BHBBI")  # length (24 bits: high byte, low 16), type, flags, stream
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags.
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY, \
    _WINDOW_UPDATE, _CONTINUATION = range(10)
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes and settings.
_NO_ERROR, _PROTOCOL_ERROR, _FLOW_CONTROL_ERROR, _STREAM_CLOSED, _FRAME_SIZE_ERROR, \
    _REFUSED_STREAM, _COMPRESSION_ERROR, _ENHANCE_YOUR_CALM = \
    0x0, 0x1, 0x3, 0x5, 0x6, 0x7, 0x9, 0xB
_INITIAL_WINDOW_SIZE, _MAX_FRAME_SIZE, _MAX_CONCURRENT_STREAMS = 0x4, 0x5, 0x3
_DEFAULT_WINDOW = 65535
#: Our receive windows: large, so a client sending big tensors rarely waits for an update.
_WINDOW = 1 << 24
_MAX_FRAME = (1 << 24) - 1
_MAX_WINDOW = (1 << 31) - 1


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with ``first``'s high bits before its prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, with a new name, no Huffman coding."""
    return b"\0" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


_STATUS_200 = b"\x88"  # static table entry 8, ":status: 200"
_TABLE_SIZE_0 = b"\x20"  # a dynamic table size update to 0: ours stays empty


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def _padding(flags: int, payload: Any, start: int) -> int:
    """How many bytes of padding end a frame whose payload's first ``start`` bytes are fields
    (the pad length first, when PADDED is set)."""
    if not flags & _PADDED:
        if len(payload) < start:
            raise _ConnectionError(_FRAME_SIZE_ERROR, "a frame too short for its fields")
        return 0
    if not payload or payload[0] > len(payload) - start:
        raise _ConnectionError(_PROTOCOL_ERROR, "padding longer than its frame")
    return int(payload[0])


class _ConnectionError(Exception):
    """The client broke the protocol: GOAWAY with this error code (and ``debug`` data), then
    close."""

    def __init__(self, code: int, message: str, debug: bytes = b"") -> None:
        super().__init__(message)
        self.code = code
        self.debug = debug
