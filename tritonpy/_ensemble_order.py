"""The order in which Triton 2.51 lists an ensemble's outputs in its responses
(:func:`triton_output_order`): a replay of libstdc++'s ``std::unordered_map`` and
``std::hash<std::string>``, which Triton's ensemble walks to write them.
"""
from __future__ import annotations

from typing import Sequence

# The bucket counts of a libstdc++ unordered_map as it grows one key at a time, from its first
# insertion on (measured with GCC 12; the hashtable of GCC 11, which builds Triton 2.51, grows
# alike): at load factor 1 it moves to the next count when a key would exceed the current one.
_BUCKET_COUNTS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229,
                  172933, 351061, 712697, 1447153, 2938679, 5967347)
_M64 = (1 << 64) - 1
_HASH_MUL = (0xC6A4A793 << 32) | 0x5BD1E995
_HASH_SEED = 0xC70F6907


def _cxx_string_hash(name: str) -> int:
    """``std::hash<std::string>`` of libstdc++ on 64-bit Linux: a MurmurHash2-style mix of
    the UTF-8 bytes, eight at a time (little-endian), then the tail, with a fixed seed."""

    def mix(v: int) -> int:
        return v ^ (v >> 47)

    data = name.encode()
    size = len(data)
    h = (_HASH_SEED ^ (size * _HASH_MUL)) & _M64
    whole = size & ~7
    for i in range(0, whole, 8):
        word = (mix((int.from_bytes(data[i:i + 8], "little") * _HASH_MUL) & _M64)
                * _HASH_MUL) & _M64
        h = ((h ^ word) * _HASH_MUL) & _M64
    if size & 7:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * _HASH_MUL) & _M64
    return mix((mix(h) * _HASH_MUL) & _M64)


def triton_output_order(names: Sequence[str]) -> tuple[str, ...]:
    """The order in which Triton 2.51 lists an ensemble's outputs in its responses.

    Triton's ensemble keeps its outputs in a ``std::unordered_map`` filled in the config's
    order and writes a response's outputs by walking that map (measured: over HTTP JSON, HTTP
    binary and gRPC alike, whatever order the client asked for them in). The walk follows the
    map's single list of nodes: a key whose bucket is empty goes to the front of the list, one
    whose bucket has keys goes just before them, and growing the map relinks the nodes in list
    order by the same rule. This replays that for the names, in config order.
    """
    hashes: dict[str, int] = {}
    nodes: list[str] = []
    counts = iter(_BUCKET_COUNTS)
    buckets = next(counts)

    def link(into: list[str], name: str) -> None:
        bucket = hashes[name] % buckets
        for i, other in enumerate(into):
            if hashes[other] % buckets == bucket:
                into.insert(i, name)
                return
        into.insert(0, name)

    for name in names:
        if name in hashes:
            continue
        hashes[name] = _cxx_string_hash(name)
        if len(nodes) + 1 > buckets:
            buckets = next(counts, buckets)
            relinked: list[str] = []
            for other in nodes:
                link(relinked, other)
            nodes = relinked
        link(nodes, name)
    return tuple(nodes)

