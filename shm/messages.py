"""Every message that crosses the host <-> stub channel, in one place.

A frame is a msgpack array ``[cmd, call_id, body]``, or ``[cmd, call_id, body, releases]`` when
it carries release ids along (see :class:`~tritonpy.shm.channel.Channel`). ``call_id`` pairs a request with its reply
(0 when none is expected). Commands are named after the Triton Python backend's own stub
commands so that a reader can map one onto the other. Bodies are dicts (TypedDicts below) or
lists; tensors inside them are :data:`tritonpy.shm.transport.WireTensor` lists.
"""
from __future__ import annotations

import enum
from typing import Any, TypedDict

# 2: frames may carry releases (a fourth element); USAGE. 3: immutable tensor handles (a fifth
# element). 4: RECLAIM. 5: GPU tensor handles (CUDA IPC), a request's gpu_ok. 6: HELD, ACK, pace.
# 7: METRIC_FAMILY_DELETE; a family's id in METRIC_FAMILY and METRIC_OP.
# 8: HELD H->S and ACK S->H: a decoupled BLS stream paced by its caller's model.
# 9: no ACK -1 S->H (the host ends a cycle through a paced stream itself); preferred_memory
# kinds in Triton's numbers (GPU 0, CPU 1). 10: a model loading API call's name, config or
# version may be bytes (what the model gave, not UTF-8: msgpack carries no lone surrogate).
# A stub of another version is refused.
PROTOCOL_VERSION = 10
# preferred_memory kinds, as pb_utils' TRITONSERVER_MEMORY_GPU / _CPU (Triton's numbers).
MEMORY_GPU = 0
MEMORY_CPU = 1


class Cmd(enum.IntEnum):
    """Frame commands. Direction: H = host, S = stub."""

    # lifecycle
    HELLO = 1  # S->H: {version, pid}; first frame of a stub
    INITIALIZE = 2  # H->S: InitializeBody -> REPLY {ok|error, info}
    AUTO_COMPLETE = 3  # H->S: {model_dir, config} -> REPLY {config}
    FINALIZE = 4  # H->S -> REPLY
    IS_READY = 5  # H->S -> REPLY {ready}
    PING = 6  # H->S -> REPLY (answered by whichever stub thread reads it)
    USAGE = 7  # H->S -> REPLY {segments, mapped_bytes, used_bytes, peak_bytes}: the stub's pool
    # inference
    EXECUTE = 10  # H->S: ExecuteBody (a batch of requests)
    EXECUTE_DONE = 11  # S->H: {responses | error}  (one frame per execute, default mode)
    RESPONSE_SEND = 12  # S->H: ResponseBody (decoupled / response sender)
    CANCEL = 13  # H->S: {ids}: requests cancelled by the client
    RESCHEDULE = 14  # S->H: {id}: request released with RELEASE_RESCHEDULE
    # Back-pressure on a request whose body has ``pace`` (see RequestBody): the stub keeps at
    # most that many of its responses (and their bytes) that the consumer has not taken yet.
    HELD = 15  # S->H: [ids]: the model's next send for these waits: acknowledge what was taken
    # (H->S: [[call id, bytes, responses], ...]: the producer of these decoupled BLS streams
    # of the stub waits for its model: report what it takes, in batches by those limits)
    # H->S: [[id, taken], ...]: how many of the request's responses were taken so far (-1: no
    # more pacing for it). S->H: [[call id, taken], ...]: how many responses of its decoupled
    # BLS streams the stub's model took so far (after a HELD for them)
    ACK = 16
    # BLS and the model loading API
    BLS_INFER = 20  # S->H: BlsBody -> BLS_RESPONSE frames with the same call id
    BLS_RESPONSE = 21  # H->S: ResponseBody
    BLS_CANCEL = 22  # S->H: cancel the BLS request with this call id
    # (name, config, version: str, or bytes that are not UTF-8, read with surrogateescape)
    LOAD_MODEL = 23  # S->H: {name, config, files} -> REPLY
    UNLOAD_MODEL = 24  # S->H: {name, unload_dependents} -> REPLY
    MODEL_READY = 25  # S->H: {name, version} -> REPLY {ready}
    # observability
    LOG = 30  # S->H: [level, message, file, line]
    # A MetricFamily object of the stub is named by an id of the stub's (the host counts the
    # series each one made, to drop them when it is deleted; see _custom_metrics).
    METRIC_FAMILY = 31  # S->H: {name, description, kind, id} -> REPLY
    METRIC_OP = 32  # S->H: [family, labels, op, value, buckets, family id]
    METRIC_VALUE = 33  # S->H: [family, labels] -> REPLY {value}
    METRIC_FAMILY_DELETE = 34  # S->H: [family, family id]: the model deleted that object
    # memory
    RELEASE = 40  # both: [export ids]
    DROPPED = 41  # both: [segment names unlinked by their owner]
    SPILL = 42  # both: [segment, offset, nbytes, export_id] of a frame too big for the socket
    # both: nbytes: /dev/shm had no room for a new segment of that size. The receiver unlinks
    # every idle segment of its pool at once (then DROPPED); the host also passes it on to the
    # other stubs.
    RECLAIM = 43
    REPLY = 50  # reply to a call: {ok: bool, error?: ErrorBody, ...}


class ErrorBody(TypedDict):
    """An error as it crosses the channel: Triton code name and message."""

    code: str
    message: str


class RequestBody(TypedDict, total=False):
    """One inference request inside an EXECUTE frame."""

    id: int  # host-side request id (responses and cancels name it)
    model: str
    version: int
    request_id: str
    correlation_id: int | str
    flags: int
    timeout: int
    parameters: dict[str, Any]
    inputs: list  # WireTensor
    outputs: list[str]  # requested output names
    preferred_memory: list  # [kind, device_id]: a BLS call's; absent: where the target puts them
    gpu_ok: bool  # its responses may carry GPU tensors (else the stub copies them to the CPU)
    trace: int  # the host's trace id of a traced request (request.trace(); BLS calls name it)
    trace_context: str  # OpenTelemetry mode: the model span's W3C context, as JSON
    pace: list[int]  # [bytes, responses]: at most that much sent and not yet taken (see HELD)


class ExecuteBody(TypedDict):
    requests: list[RequestBody]


class ResponseBody(TypedDict, total=False):
    """One response: to a request of an EXECUTE (RESPONSE_SEND) or to a BLS call."""

    id: int
    outputs: list  # WireTensor
    error: ErrorBody | None
    parameters: dict[str, Any]
    final: bool  # TRITONSERVER_RESPONSE_COMPLETE_FINAL
    empty: bool  # a final flag with no response


class BlsBody(TypedDict, total=False):
    request: RequestBody
    decoupled: bool
    exec: int  # the caller's execute that waits for it: its first request id (0: none);
    # the host's BLS deadlock detection groups an instance's waits by it


class InitializeBody(TypedDict):
    args: dict[str, str]
    model_file: str
    version_dir: str
    decoupled: bool
    max_async: int


def frame(cmd: Cmd, call_id: int = 0, body: Any = None) -> list:
    """A frame as sent on the channel."""
    return [int(cmd), call_id, body]
