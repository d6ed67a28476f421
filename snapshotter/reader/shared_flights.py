"""Chunk fetches shared between the event loops of one process.

A LayerReader's own in-flight table (reader/layer.py `_Flight`) keeps one trio loop from fetching
a chunk twice. A mount process can run more than one loop over the same chunk cache: the spare's
early prefetch (fusefs/early.py) fetches a layer's start-up files on a thread and loop of its own
while the image's mount, on the main loop, already serves the container, whose first reads want
those very chunks. Without this table such a read sent its own request for a chunk that was
already on its way (one more registry round trip on a cold start, measured at +50 ms per round
trip: /etc/group read by containerd while the early prefetch still had it in flight).

Contract: a reader about to fetch chunks `claim`s their keys (scoped by its cache's root, so
that only readers of one cache meet). Keys another reader holds come back to it: it `wait`s for
them (bounded), looks in the cache again and fetches only what is still missing, so a claim that
ends without the chunk in the cache costs a waiter the wait and its own fetch, never a wrong or
lost read. The claimant `release`s each key once its chunk is in the cache, or once its fetch
ended any other way. Thread-safe; waiters are woken on their own loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import trio


@dataclass
class _Claim:
    owner: object
    waiters: list[tuple[trio.lowlevel.TrioToken, trio.Event]] = field(default_factory=list)


class SharedFlights:
    """The keys being fetched, by (scope, key), with who fetches each and who waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[tuple[str, str], _Claim] = {}

    def claim(self, scope: str, keys: Iterable[str], owner: object) -> list[str]:
        """Claim for `owner` each of `keys` that nobody holds; return those another owner holds
        (keys `owner` holds already stay its own)."""
        foreign: list[str] = []
        with self._lock:
            for key in keys:
                held = self._claims.get((scope, key))
                if held is None:
                    self._claims[(scope, key)] = _Claim(owner)
                elif held.owner is not owner:
                    foreign.append(key)
        return foreign

    def release(self, scope: str, keys: Iterable[str], owner: object) -> None:
        """End `owner`'s claims on `keys` (others' claims and unclaimed keys are left alone) and
        wake whoever waits for them."""
        woken: list[tuple[trio.lowlevel.TrioToken, trio.Event]] = []
        with self._lock:
            for key in keys:
                held = self._claims.get((scope, key))
                if held is not None and held.owner is owner:
                    del self._claims[(scope, key)]
                    woken.extend(held.waiters)
        for token, event in woken:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass  # that loop is gone, and its waiter with it

    def held(self, scope: str, key: str) -> bool:
        with self._lock:
            return (scope, key) in self._claims

    async def wait(self, scope: str, keys: Sequence[str], timeout: float) -> None:
        """Return once none of `keys` is claimed any more, or after `timeout` seconds."""
        token = trio.lowlevel.current_trio_token()
        events: list[trio.Event] = []
        with self._lock:
            for key in keys:
                held = self._claims.get((scope, key))
                if held is not None:
                    event = trio.Event()
                    held.waiters.append((token, event))
                    events.append(event)
        with trio.move_on_after(timeout):
            for event in events:
                await event.wait()


# The process's table: every LayerReader that names no other shares it.
PROCESS_FLIGHTS = SharedFlights()
