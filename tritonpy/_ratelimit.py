"""Triton's rate limiter (``--rate-limit execution_count``): an instance whose group lists
``rate_limiter { resources [...] }`` runs an execute only while the resources it lists are
free, holding them until the execute ends, across all models.

Resources are counted per device (a CPU instance's is device 0), or in one pool for a
resource marked ``global`` (a name may not be both, in Triton's words). A resource has the
copies ``--rate-limit-resource name:count[:device]`` gives it (without a device: on every
device; for a global one the device is ignored); one named there for other devices only has
none on the rest, and once any is given, one not named has none (as Triton 2.51, measured).
Without any, it has as many as the largest count one of the live instances lists. An instance
that lists more than a given count fails to load, in Triton's words.

An instance takes what it needs when it is free; instances that wait for resources get them
as they are released, lowest ``executes * priority`` first (priority 1 at least), as Triton's
rate limiter orders them: ``executes`` counts every execute of the instance since it was loaded,
waiting or not, and starts at 2, for Triton runs each instance's initialize and warm-up through
its rate limiter too (so a fresh instance of priority 2 starts at 2 x 2, one of priority 1 at 2:
the latter runs twice first, as Triton 2.51 measured). An instance of priority 2 thus gets half the
turns of one of priority 1, and one loaded later, or idle a while, goes first until its count
catches up with the others'. On a tie, the one waiting longer goes first. Nobody jumps the
queue: while an instance waits for what it lacks, the copies it needs are claimed for it, and
an instance ranked after it, a newcomer included, takes only what is free beyond the claims
(as in Triton, whose queue serves only its first; there an instance needing 2 copies would
otherwise wait for ever behind others taking 1 copy each in turn). What is free beyond them
goes on being used meanwhile (Triton's queue waits for its first whatever the others need).
A model claims for one request (its first instance waiting), and not against its own other
instances, which would serve that request as well; a model whose queued requests all ended
before running (cancelled, timed out) or went to another of its instances withdraws from the
queue (:meth:`RateLimiter.withdraw`). What is released is reserved for the instances chosen,
whose models are told to dispatch; a reservation not used by then goes back at once.

Locks: the limiter's own lock is taken under a model's lock, never the other way round (a
model's scheduler forms its batches holding both, and calls nothing outside the model then),
and the limiter never calls a model while it holds its lock.
"""
from __future__ import annotations

import contextlib
import logging
import re
import threading
import weakref
from collections import defaultdict
from typing import Any, Iterable, Iterator, Sequence

from tritonclient.grpc.model_config_pb2 import ModelInstanceGroup

from ._errors import InvalidArgumentError

log = logging.getLogger(__name__)

#: An instance's executes once loaded: Triton's rate limiter counts its initialize and warm-up.
LOADED_EXECUTES = 2

#: The device of a global resource's pool.
GLOBAL = -1

Key = tuple  # (resource name, device or GLOBAL)

_RESOURCE = re.compile(r"^([^:]+):(\d+)(?::(\d+))?$")


def parse_resource(text: str) -> tuple[str, int, int | None]:
    """``--rate-limit-resource``'s ``<name>:<count>[:<device>]``.

    Raises:
        InvalidArgumentError: Anything else, in words that say the form.
    """
    m = _RESOURCE.match(text.strip())
    if m is None:
        raise InvalidArgumentError(
            f"--rate-limit-resource '{text}': expected <name>:<count> or "
            "<name>:<count>:<device> (count and device whole numbers)")
    return m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3))


def instance_limits(signature: bytes, device: int) -> tuple[tuple[tuple[Key, int], ...], int]:
    """What an instance of the group with ``signature`` (see ``_instances.instance_signature``)
    needs on ``device``: ((key, count), ...) and its priority; no needs where its group has
    no ``rate_limiter`` resources. A resource the group lists twice needs the count listed
    last, as in Triton 2.51 (measured: ``R:2, R:1`` needs 1, ``R:1, R:2`` needs 2)."""
    if not signature:
        return (), 1
    limiter = ModelInstanceGroup.FromString(signature).rate_limiter
    needs: dict[Key, int] = {}
    for r in limiter.resources:
        needs[(r.name, GLOBAL if getattr(r, "global") else device)] = int(r.count)
    return tuple(needs.items()), max(1, int(limiter.priority))


def _count(table: dict[Key, int], inst: Any, sign: int) -> None:
    """Add (``sign`` 1) or take away (-1) ``inst``'s needs in ``table``."""
    for k, n in inst.limits:
        table[k] += sign * n


class RateLimiter:
    """The resources of one server, and the instances that hold, reserve or wait for them."""

    def __init__(self, resources: Iterable[tuple[str, int, int | None]] = ()) -> None:
        self._explicit: dict[str, dict[int | None, int]] = {}
        for name, count, device in resources:
            self._explicit.setdefault(name, {})[device] = count
        self._lock = threading.RLock()
        self._taking: list[Any] | None = None  # admitted during the current take
        self._instances: weakref.WeakSet[Any] = weakref.WeakSet()
        self._in_use: dict[Key, int] = defaultdict(int)
        self._reserved: dict[Key, int] = defaultdict(int)
        self._waiting: dict[Any, None] = {}  # instances waiting, in the order they came

    # -- instances ------------------------------------------------------------------------------
    def register(self, insts: Sequence[Any]) -> None:
        """Give ``insts`` (not started yet) their needs, from their groups' ``rate_limiter``.

        Raises:
            InvalidArgumentError: One needs more of a resource than ``--rate-limit-resource``
                gives it (Triton's words).
        """
        limits = [instance_limits(inst.signature, inst.device_id) for inst in insts]
        with self._lock:
            scope = {name: device == GLOBAL for i in self._instances
                     if i.state not in ("STOPPED", "RETIRING") for (name, device), _ in i.limits}
            for (name, device), _ in (need for needs, _ in limits for need in needs):
                if scope.setdefault(name, device == GLOBAL) != (device == GLOBAL):
                    raise InvalidArgumentError(
                        f'Resource "{name}" is present as both global and device-specific '
                        "resource in the model configuration.")
            for (name, device), count in (need for needs, _ in limits for need in needs):
                have = self._explicit_count(name, device) if self._explicit else count
                if have < count:
                    raise InvalidArgumentError(
                        f'Resource count for "{name}" is limited to {have} which will prevent '
                        "scheduling of one or more model instances, the minimum required "
                        f"count is {count}")
            for inst, (needs, priority) in zip(insts, limits):
                if needs:
                    inst.limits, inst.priority = needs, priority
                    inst.executes = LOADED_EXECUTES
                    self._instances.add(inst)

    def log_resources(self) -> None:
        """With --log-verbose: the most of each resource on each device the instances that
        serve now may take, in Triton 2.51's words (QA L0_model_update looks for them)."""
        if not log.isEnabledFor(logging.DEBUG):
            return
        gone = ("STOPPED", "RETIRING")  # (a retiring one's executes still count elsewhere)
        with self._lock:
            keys = sorted({k for i in self._instances if i.state not in gone
                           for k, _ in i.limits}, key=lambda k: (k[1], k[0]))
            table: dict[int, list[str]] = {}
            for name, device in keys:
                count = self._capacity((name, device), gone)
                table.setdefault(device, []).append(f"\t\tResource: {name}\t Count: {count}\n")
        text = "\nMax Resource Map===>\n" + "".join(
            f"\tDevice: {'GLOBAL' if device == GLOBAL else device}\n" + "".join(rows)
            for device, rows in table.items())
        log.debug("%s", text)

    def _explicit_count(self, name: str, device: int) -> int:
        """The copies ``--rate-limit-resource`` gives ``name`` on ``device``: none for a name
        it does not give once it gives any (as Triton 2.51, measured), and for a global
        resource whatever device it names (Triton ignores it there)."""
        given = self._explicit.get(name)
        if not given:
            return 0
        if device == GLOBAL:
            return given[None] if None in given else max(given.values())
        if device in given:
            return given[device]
        return given.get(None, 0)

    def _capacity(self, key: Key, gone: tuple[str, ...] = ("STOPPED",)) -> int:
        """The copies of ``key``: those given, else the most that one instance not in a state
        of ``gone`` needs."""
        name, device = key
        if self._explicit:
            return self._explicit_count(name, device)
        return max((n for i in self._instances if i.state not in gone
                    for k, n in i.limits if k == key), default=0)

    def _free(self, key: Key) -> int:
        return self._capacity(key) - self._in_use[key] - self._reserved[key]

    def _fits(self, inst: Any, claims: dict[Key, dict[Any, int]] | None = None) -> bool:
        """Whether what ``inst`` needs is free, beyond what ``claims`` (per key, per model)
        holds for other models."""
        for k, n in inst.limits:
            claimed = 0
            if claims and k in claims:
                claimed = sum(c for m, c in claims[k].items() if m is not inst.model)
            if self._free(k) - claimed < n:
                return False
        return True

    @staticmethod
    def _claim(claims: dict[Key, dict[Any, int]], inst: Any) -> None:
        """``inst`` waits: what it needs is claimed for its model (once per model)."""
        if any(inst.model in claims.get(k, ()) for k, _ in inst.limits):
            return
        for k, n in inst.limits:
            claims.setdefault(k, {})[inst.model] = n

    def _live(self, inst: Any) -> bool:
        return inst.state == "READY" and not (inst.holding or inst.reserved)

    def _ranked(self) -> list[Any]:
        """The waiting instances in turn order (sorted is stable: on a tie, the one waiting
        longer first)."""
        return sorted(self._waiting, key=lambda i: i.executes * i.priority)

    def _blockers(self, inst: Any) -> list[Any]:
        """The instances waiting ahead of ``inst`` (in turn order; a newcomer comes after
        those of its rank) whose claims leave too little of what ``inst`` needs: it may not
        take it before them. Under the lock."""
        if not self._waiting:
            return []
        rank = inst.executes * inst.priority
        claims: dict[Key, dict[Any, int]] = {}
        ahead = []
        for w in self._ranked():
            if w is inst or w.executes * w.priority > rank:
                break
            if self._live(w) and w.model is not inst.model:
                self._claim(claims, w)
                ahead.append(w)
        if not ahead or self._fits(inst, claims) or not self._fits(inst):
            return []  # (one that does not fit even unclaimed lacks copies, not its turn)
        short = {k for k, n in inst.limits
                 if self._free(k) - sum(claims.get(k, {}).values()) < n}
        return [w for w in ahead if any(k in short for k, _ in w.limits)]

    # -- scheduling -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def taking(self) -> Iterator[None]:
        """A model's scheduler forms its batches (the model's lock held): an instance that
        :meth:`admits` takes its resources at once, so that no other instance, of this model
        or another, counts them free meanwhile. :meth:`settle` ends it."""
        with self._lock:
            self._taking = []
            try:
                yield
            finally:
                self._taking = None

    def admits(self, inst: Any) -> bool:
        """Whether ``inst`` may start an execute now: its resources are reserved for it, or
        free. Inside :meth:`taking` it takes them; where it may not, it waits for them (its
        model is told once they are reserved for it)."""
        with self._lock:
            if inst.holding:
                return False
            if not (inst.reserved or self._fits(inst) and not self._blockers(inst)):
                self._wait(inst)
                return False
            if self._taking is not None:
                if inst.reserved:
                    inst.reserved = False
                    _count(self._reserved, inst, -1)
                _count(self._in_use, inst, 1)
                inst.holding = True
                self._waiting.pop(inst, None)
                self._taking.append(inst)
            return True

    def settle(self, planned: Iterable[Any]) -> tuple[list[Any], bool]:
        """Inside :meth:`taking`, once the batches are formed: the instances admitted that got
        no batch give their resources back. Returns whom they are now reserved for, and
        whether any was given back (the model may form batches again: an instance admitted
        that found only answered requests kept the others from being admitted meanwhile)."""
        assert self._taking is not None
        sent = {id(i) for i in planned}
        unused = [i for i in self._taking if id(i) not in sent]
        for inst in unused:
            inst.holding = False
            _count(self._in_use, inst, -1)
        return (self._grant(), True) if unused else ([], False)

    def _wait(self, inst: Any) -> None:
        if inst not in self._waiting:
            self._waiting[inst] = None

    def release(self, inst: Any, again: bool = False) -> list[Any]:
        """``inst``'s execute ended (or its stub died): its resources go back. ``again``: its
        model has more queued, so it takes its turn among those waiting (else whoever waits
        would always come before it, whatever the priorities). Returns the instances they
        are now reserved for (tell their models: see ``ModelRuntime.kick_reserved``)."""
        with self._lock:
            if not inst.holding:
                return []
            inst.holding = False
            inst.executes += 1
            _count(self._in_use, inst, -1)
            if again:
                self._wait(inst)
            return self._grant()

    def unreserve(self, inst: Any) -> list[Any]:
        """A reservation ``inst``'s model did not use goes back; returns whom it went to."""
        with self._lock:
            if not inst.reserved:
                return []
            inst.reserved = False
            _count(self._reserved, inst, -1)
            return self._grant()

    def withdraw(self, insts: Iterable[Any]) -> list[Any]:
        """``insts``' model has nothing queued for them any more (its requests ended before
        running, or went to another of its instances): they wait no more, and hold back
        nobody. Returns the instances what they claimed is now reserved for."""
        if not any(i in self._waiting for i in insts):  # (most calls: nothing to do)
            return []
        with self._lock:
            gone = [i for i in insts if i in self._waiting and not i.reserved]
            for inst in gone:
                del self._waiting[inst]
            return self._grant() if gone else []

    def _grant(self) -> list[Any]:
        granted = []
        claims: dict[Key, dict[Any, int]] = {}  # what the instances ahead wait for
        for inst in self._ranked():
            if not self._live(inst):
                del self._waiting[inst]
                continue
            if not self._fits(inst, claims):
                self._claim(claims, inst)
                continue
            del self._waiting[inst]
            _count(self._reserved, inst, 1)
            inst.reserved = True
            granted.append(inst)
        return granted

    # -- the BLS deadlock detector --------------------------------------------------------------
    def lacking_holders(self, inst: Any) -> list[list[Any]]:
        """For each resource ``inst`` lacks now, the instances that hold some of it (an empty
        list where only reservations do); and each instance waiting ahead of it for what it
        needs too, alone (it goes on only after each of them)."""
        with self._lock:
            out = []
            for k, n in inst.limits:
                if self._capacity(k) - self._in_use[k] - self._reserved[k] < n:
                    out.append([i for i in self._instances if i.holding
                                and any(kk == k for kk, _ in i.limits)])
            out.extend([w] for w in self._blockers(inst))
            return out
