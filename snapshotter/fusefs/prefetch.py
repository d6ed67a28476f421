"""Prefetch in the mount process: the landmark prefetch before start-up, then the background fetch.

Landmark prefetch (per layer, all layers at once, as soon as the mount is up):
- runs when the layer's index lists prefetch files (`LayerIndex.prefetch`: the files before an
  eStargz/zstd:chunked `.prefetch.landmark`, or a Nydus bootstrap's prefetch table) and the layer
  has no `.no.prefetch.landmark`; and, unless `[prefetch] startup_files` is off, for the
  start-up files (`startup_files.py`: the user database runc reads, the dynamic loader, its
  cache and the C library) that the merged tree serves from the layer, landmark or not (a
  converter writes `.no.prefetch.landmark` whenever it was given no prefetch list);
- fetches every chunk of those files into the chunk cache, pinned for the life of the process,
  merging chunks of one blob that lie at most `PREFETCH_MAX_GAP` bytes apart into one range
  request of at most max(max_merge_bytes, max_inflight_bytes / 4) bytes: an eStargz prefetch
  region is contiguous (file payloads separated by small tar headers), so a layer whose region
  fits takes one request;
- a foreground read of a chunk being prefetched waits for that fetch (the reader's single
  flight), so start-up reads of prefetched files are served from it, never fetched twice.
Readiness: the mount serves reads as soon as it is mounted; the process writes its ready file
when the prefetch of every layer with a prefetch list (landmark, prefetch table) is in flight
(all its chunks cached or claimed, `LayerReader.fetch_chunks` on_started: a read of one waits
for that fetch, in whichever event loop of the process it runs, rather than fetching it again)
or, with `[prefetch] wait`, has finished, as stargz-snapshotter's mounts do; at most
`prefetch_timeout` either way (prefetch goes on after it). The daemon waits for the ready file,
so container start waits for it. Not waiting for the fetch to end started a cold `true` over a
recorded profile 0.11-0.19 s sooner in the bench (unshaped and +50 ms per round trip, n=3) and
the recorded python workload itself no later (1.41-1.50 s vs 1.56-1.77 s at +50 ms): its reads
wait only for the chunks they need, the runtime starts meanwhile. Start-up files alone were
never waited for (a read of one waits for its fetch).

Background fetch (`[prefetch] background`, after every layer's prefetch has finished):
- one task per mount fetches the chunks of every layer that are not cached yet, lowest layer
  first, one merged range request (a "unit") at a time, so at most one background request is
  in flight;
- with an "in_use_file" in the state, it starts only once that file exists (the daemon makes it
  when a snapshot over the image asks for the mount; a mount started on pull has none yet) or
  an on-demand read came;
- it starts `background_delay` seconds after the prefetch at the earliest, and before each unit
  waits until no on-demand read has been running, and no filesystem request of any kind has
  ended (`ForegroundGate.note_request`), for `background_delay` seconds, so the container's
  requests always go first (the mount serves them and the background fetch on one event loop:
  a `find` over the image took 3-8 s while background units were in flight, 0.6-0.9 s without);
- `background_bytes_per_second` (0 = unlimited) paces it: after each unit it sleeps until the
  bytes fetched so far divided by the elapsed time is at most the cap; units are then about a
  quarter second of the cap (at least 64 KiB, at most max_merge_bytes);
- it stops, `reason=cache_full`, before a unit that would not fit in the cache without
  evicting anything (pinned or not), and ends with the process (cancelled by the unmount).
Observability: one `event=prefetch` and one `event=background` log line per layer (key=value),
and `Prefetcher.status`: a plain dict, layer key -> dict (see `PrefetchStatus`), updated live.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import trio

from snapshotter.formats.codec import Buffer
from snapshotter.formats.index import Chunk, Entry, EntryType, Landmark, LayerIndex
from snapshotter.fusefs.ops import LayerReader
from snapshotter.fusefs.startup_files import startup_files
from snapshotter.fusefs.tree import MountTree
from snapshotter.reader.units import UNIT_BYTES, units

log = logging.getLogger(__name__)

PREFETCH_MAX_GAP = 1 << 20
BACKGROUND_MAX_GAP = 64 << 10
MIN_UNIT_BYTES = 64 << 10
DEFAULT_PREFETCH_TIMEOUT = 10.0


@dataclass(frozen=True)
class PrefetchSettings:
    """From the state file: "prefetch_timeout" (or the daemon config's), and the daemon config's
    [prefetch] section."""

    prefetch_timeout: float = DEFAULT_PREFETCH_TIMEOUT
    background: bool = True
    background_bytes_per_second: int = 0
    background_delay: float = 3.0
    startup_files: bool = True
    wait: bool = False  # readiness waits for the prefetch lists' fetches to end, not just to be in flight
    in_use_file: str | None = None  # background waits until this file exists or a read came

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> PrefetchSettings:
        config = doc.get("config") if isinstance(doc.get("config"), Mapping) else {}
        assert isinstance(config, Mapping)
        section = config.get("prefetch") if isinstance(config.get("prefetch"), Mapping) else {}
        assert isinstance(section, Mapping)
        timeout = doc.get("prefetch_timeout", config.get("prefetch_timeout", DEFAULT_PREFETCH_TIMEOUT))

        def num(value: Any, default: float) -> float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            return float(value) if ok and value >= 0 else default

        background = section.get("background", True)
        startup = section.get("startup_files", True)
        wait = section.get("wait", False)
        return cls(
            prefetch_timeout=num(timeout, DEFAULT_PREFETCH_TIMEOUT),
            background=background if isinstance(background, bool) else True,
            background_bytes_per_second=int(num(section.get("background_bytes_per_second", 0), 0)),
            background_delay=num(section.get("background_delay", 3.0), 3.0),
            startup_files=startup if isinstance(startup, bool) else True,
            wait=wait if isinstance(wait, bool) else False,
            in_use_file=doc["in_use_file"] if isinstance(doc.get("in_use_file"), str) else None,
        )


@dataclass
class PrefetchStatus:
    """One layer's prefetch and background fetch, as the stats file and logs show them.

    prefetch: "pending", "running", "done", "failed" or "skipped" (then prefetch_reason says why:
      "no_prefetch_landmark", "no_prefetch_files", "local_blob", "no_cache").
    prefetch_files counts the layer's prefetch list and its start-up files (startup_files of them).
    background: "pending", "waiting" (for the landmark prefetch / for reads to pause), "running",
      "done", "disabled", "stopped" (background_reason: "cache_full", "unmounted", "error: ...")
      or "skipped" (same reasons as prefetch_reason).
    *_bytes: compressed bytes fetched from the registry (range gaps included); *_seconds: wall time.
    """

    layer: str
    format: str
    landmark: str
    prefetch: str = "pending"
    prefetch_reason: str = ""
    prefetch_files: int = 0
    startup_files: int = 0
    prefetch_chunks: int = 0
    prefetch_bytes: int = 0
    prefetch_requests: int = 0
    prefetch_seconds: float = 0.0
    background: str = "pending"
    background_reason: str = ""
    background_chunks: int = 0
    background_bytes: int = 0
    background_requests: int = 0
    background_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ForegroundGate:
    """Counts on-demand reads in flight, and when the last one or any other filesystem request
    ended (trio clock)."""

    def __init__(self) -> None:
        self.active = 0
        self.last_end = -math.inf
        self.reads = 0

    def note_request(self) -> None:
        """A filesystem request (lookup, getattr, readdir, ...) ended: the quiet period starts again."""
        self.last_end = trio.current_time()

    def wrap(self, reader: LayerReader) -> LayerReader:
        return _TrackedReader(reader, self)

    async def wait_quiet(self, quiet: float) -> float:
        """Return once no read is running and no read or other request ended in the last `quiet`
        seconds; returns the seconds waited."""
        began = trio.current_time()
        while True:
            now = trio.current_time()
            if self.active == 0 and now - self.last_end >= quiet:
                return now - began
            wait = quiet - (now - self.last_end) if self.active == 0 else quiet
            await trio.sleep(max(0.01, min(wait, 0.1)))


class _TrackedReader:
    """A reader whose reads the gate counts; other attributes are the wrapped reader's."""

    def __init__(self, inner: LayerReader, gate: ForegroundGate) -> None:
        self.inner = inner
        self._gate = gate

    async def read(self, entry: Any, offset: int, size: int) -> Buffer:
        gate = self._gate
        gate.active += 1
        gate.reads += 1
        try:
            return await self.inner.read(entry, offset, size)
        finally:
            gate.active -= 1
            gate.last_end = trio.current_time()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _landmark_name(index: LayerIndex) -> str:
    return index.landmark.value


def listed_prefetch(index: LayerIndex) -> Sequence[str]:
    """The layer's prefetch list (landmark or prefetch table), empty under a `.no.prefetch.landmark`."""
    return () if index.landmark is Landmark.NO_PREFETCH else index.prefetch


def prefetch_chunks(index: LayerIndex, unit_bytes: int = UNIT_BYTES,
                    extra: Sequence[Entry] = ()) -> tuple[int, list[Chunk]]:
    """(number of files, their read units) of the index's prefetch files in list order (none under
    a `.no.prefetch.landmark`), then of the `extra` entries not among them (`unit_bytes`: the
    reader's ReaderConfig.unit_bytes)."""
    files = 0
    chunks: list[Chunk] = []
    taken: set[int] = set()
    for entry in (*(index.get(name) for name in listed_prefetch(index)), *extra):
        if entry is None or entry.type is not EntryType.REG or id(entry) in taken:
            continue
        taken.add(id(entry))
        files += 1
        chunks.extend(c for c in units(entry, unit_bytes) if not c.zeros)
    return files, chunks


def _layer_chunks(index: LayerIndex, unit_bytes: int) -> list[Chunk]:
    """Every fetchable read unit of the layer, in blob order."""
    chunks = [c for e in index.entries if e.type is EntryType.REG for c in units(e, unit_bytes) if not c.zeros]
    chunks.sort(key=lambda c: (c.blob_index, c.blob_offset))
    return chunks


class Prefetcher:
    """The prefetch and background fetch of one mount; see the module docstring.

    `readers[i]` serves `tree.layers[i]`; `names[i]` is its layer digest (status key).
    Start `run()` in a nursery once the filesystem is mounted; `prefetched` is set when every
    layer's prefetch (its list and its start-up files) has ended (done, failed or skipped),
    `listed_prefetched` when that of every layer with a prefetch list has (at once when none has
    one), `listed_in_flight` when that of every such layer is in flight (`note_in_flight`, or this
    prefetcher's fetch of it started or ended): what readiness waits for.
    """

    def __init__(self, tree: MountTree, readers: Sequence[LayerReader], names: Sequence[str],
                 settings: PrefetchSettings, *, event: str = "prefetch") -> None:
        if len(readers) != len(tree.layers) or len(names) != len(tree.layers):
            raise ValueError("one reader and one name per layer")
        self.event = event  # the per-layer log line's name (fusefs/early.py logs its own)
        self._credited: list[tuple[int, int]] = [(0, 0)] * len(tree.layers)
        self.tree = tree
        self.readers = tuple(readers)
        self.settings = settings
        self.gate = ForegroundGate()
        self.prefetched = trio.Event()
        self.listed_prefetched = trio.Event()
        self.listed_in_flight = trio.Event()
        self.layers: list[PrefetchStatus] = []
        self.status: dict[str, dict[str, Any]] = {}
        self._keys: list[str] = []
        self._startup: dict[int, list[Entry]] = {}
        if settings.startup_files:
            self._startup = {layer: [n.entry for n in nodes if n.entry is not None]
                             for layer, nodes in startup_files(tree).items()}
        for i, (index, name) in enumerate(zip(tree.layers, names, strict=True)):
            key = f"{i}:{name}" if name else str(i)
            self._keys.append(key)
            self.layers.append(PrefetchStatus(layer=name, format=index.format, landmark=_landmark_name(index)))
        self._listed_pending = {i for i, index in enumerate(tree.layers)
                                if listed_prefetch(index) and not self._skip_reason(i)}
        self._listed_unstarted = {names[i] for i in self._listed_pending}
        if not self._listed_pending:
            self.listed_prefetched.set()
            self.listed_in_flight.set()
        self._publish()

    def note_in_flight(self, name: str) -> None:
        """Layer `name`'s prefetch list is in flight in this process (this prefetcher's fetch of
        it, or the spare's early prefetch, fusefs/early.py): its chunks are claimed, reads of
        them wait for that fetch."""
        self._listed_unstarted.discard(name)
        if not self._listed_unstarted:
            self.listed_in_flight.set()

    def tracked(self, readers: Sequence[LayerReader]) -> list[LayerReader]:
        """The readers to give the filesystem: on-demand reads through them pause the background."""
        return [self.gate.wrap(r) for r in readers]

    def _publish(self) -> None:
        for key, st in zip(self._keys, self.layers, strict=True):
            self.status[key] = st.as_dict()

    def summary(self) -> dict[str, Any]:
        """Totals for the ready file and logs."""
        return {
            "prefetch_bytes": sum(s.prefetch_bytes for s in self.layers),
            "prefetch_requests": sum(s.prefetch_requests for s in self.layers),
            "prefetch_layers": sum(s.prefetch == "done" for s in self.layers),
            "prefetch_done": self.prefetched.is_set(),
            "listed_prefetch_done": self.listed_prefetched.is_set(),
        }

    def stats_hook(self) -> dict[str, Any]:
        """For the mount's stats file (fusefs/stats.py `stats_hooks`): {"prefetch": {...}}."""
        return {"prefetch": {**self.summary(), "layers": {k: dict(v) for k, v in self.status.items()}}}

    def _skip_reason(self, i: int) -> str:
        index, reader = self.tree.layers[i], self.readers[i]
        if not hasattr(reader, "fetch_chunks"):  # reader.layer.LayerReader; a local blob needs no prefetch
            return "local_blob"
        if getattr(reader, "cache", None) is None:
            return "no_cache"
        if self._startup.get(i):
            return ""
        if index.landmark is Landmark.NO_PREFETCH:
            return "no_prefetch_landmark"
        if not index.prefetch:
            return "no_prefetch_files"
        return ""

    # -- running -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Prefetch every layer, then (when enabled) fetch the rest in the background."""
        await self.prefetch()
        await self._background()

    def credit(self, name: str, fetched_bytes: int, requests: int) -> None:
        """Count the bytes and requests of an earlier prefetch of layer `name` (fusefs/early.py)
        as this one's: what it fetched, this one finds cached. Call it before `run`."""
        for i, st in enumerate(self.layers):
            if st.layer == name:
                b, r = self._credited[i]
                self._credited[i] = (b + fetched_bytes, r + requests)

    async def prefetch(self) -> None:
        """Prefetch every layer (its list and its start-up files), all layers at once."""
        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(self.layers)):
                    nursery.start_soon(self._prefetch_layer, i)
        finally:
            self.prefetched.set()
            self.listed_prefetched.set()
            self.listed_in_flight.set()
            self._publish()

    async def _prefetch_layer(self, i: int) -> None:
        st = self.layers[i]
        reason = self._skip_reason(i)
        if reason:
            st.prefetch, st.prefetch_reason = "skipped", reason
            log.info("event=%s layer=%s status=skipped reason=%s landmark=%s", self.event, st.layer, reason,
                     st.landmark)
            self._publish()
            return
        reader: Any = self.readers[i]
        startup = self._startup.get(i, [])
        files, chunks = prefetch_chunks(self.tree.layers[i], reader.config.unit_bytes, startup)
        st.prefetch, st.prefetch_files, st.prefetch_chunks = "running", files, len(chunks)
        st.startup_files = len(startup)
        self._publish()
        began = time.monotonic()
        cfg = reader.config
        max_run = max(cfg.max_merge_bytes, cfg.max_inflight_bytes // 4)
        tally: Any = None
        try:
            tally = await reader.fetch_chunks(chunks, pin=True, max_gap=PREFETCH_MAX_GAP, max_run_bytes=max_run,
                                              on_started=lambda: self.note_in_flight(st.layer))
        except Exception as exc:  # a failed prefetch only costs on-demand fetches later
            st.prefetch, st.prefetch_reason = "failed", f"{type(exc).__name__}: {exc}"
        else:
            st.prefetch = "done"
        finally:
            st.prefetch_seconds = round(time.monotonic() - began, 6)
            credited_bytes, credited_requests = self._credited[i]
            st.prefetch_bytes, st.prefetch_requests = credited_bytes, credited_requests
            if tally is not None:
                st.prefetch_bytes += tally.fetched_bytes
                st.prefetch_requests += tally.requests
            self._listed_pending.discard(i)
            if not self._listed_pending:
                self.listed_prefetched.set()
            self._publish()
        log.info("event=%s layer=%s status=%s files=%d startup_files=%d chunks=%d bytes=%d requests=%d "
                 "seconds=%.3f%s", self.event, st.layer, st.prefetch, files, len(startup), len(chunks),
                 st.prefetch_bytes, st.prefetch_requests, st.prefetch_seconds,
                 f" error={st.prefetch_reason!r}" if st.prefetch == "failed" else "")

    async def _background(self) -> None:
        if not self.settings.background:
            for st in self.layers:
                st.background = "disabled"
            self._publish()
            log.info("event=background status=disabled")
            return
        in_use = self.settings.in_use_file
        if in_use is not None and self.gate.reads == 0 and not os.path.exists(in_use):
            # Mounted on pull: an image nobody runs costs no bandwidth beyond its prefetch.
            for st in self.layers:
                st.background = "waiting"
            self._publish()
            while self.gate.reads == 0 and not os.path.exists(in_use):
                await trio.sleep(0.2)
        # The quiet period counts from now too: background starts `background_delay` after the
        # landmark prefetch at the earliest, giving a starting container's first reads the way.
        self.gate.last_end = max(self.gate.last_end, trio.current_time())
        for i, st in enumerate(self.layers):
            reason = self._skip_reason(i)
            if reason in ("local_blob", "no_cache"):
                st.background, st.background_reason = "skipped", reason
                self._publish()
                continue
            try:
                done = await self._background_layer(i)
            except trio.Cancelled:
                self._stop_from(i, "unmounted")
                raise
            except Exception as exc:  # the background fetch is an optimization: never fatal
                self._stop_from(i, f"error: {type(exc).__name__}: {exc}")
                return
            if not done:
                self._stop_from(i + 1, st.background_reason)
                return

    def _stop_from(self, first: int, reason: str) -> None:
        for st in self.layers[first:]:
            if st.background in ("pending", "waiting", "running"):
                if st.background != "pending":
                    log.info("event=background layer=%s status=stopped reason=%s chunks=%d bytes=%d requests=%d",
                             st.layer, reason.split(":")[0], st.background_chunks, st.background_bytes,
                             st.background_requests)
                st.background, st.background_reason = "stopped", reason
        self._publish()

    async def _background_layer(self, i: int) -> bool:
        """Fetch layer i's missing chunks; False when the background fetch must stop."""
        s = self.settings
        st = self.layers[i]
        reader: Any = self.readers[i]
        cache = reader.cache
        assert cache is not None
        st.background = "waiting"
        self._publish()
        chunks = _layer_chunks(self.tree.layers[i], reader.config.unit_bytes)
        keys = [reader.key_for(c) for c in chunks]
        present = await trio.to_thread.run_sync(cache.present, list(set(keys)))
        missing = [c for c, k in zip(chunks, keys, strict=True) if k not in present]
        rate = s.background_bytes_per_second
        unit = reader.config.max_merge_bytes
        if rate:
            unit = min(unit, max(MIN_UNIT_BYTES, rate // 4))
        began = time.monotonic()
        paced_from = trio.current_time()
        paced_bytes = 0
        st.background = "running"
        for group in _units(missing, unit, BACKGROUND_MAX_GAP):
            await self.gate.wait_quiet(s.background_delay)
            need = sum(c.inner_offset + c.size for c in group)
            usage = await trio.to_thread.run_sync(cache.usage)
            if usage.bytes + need > cache.max_bytes:
                st.background, st.background_reason = "stopped", "cache_full"
                break
            tally = await reader.fetch_chunks(group, background=True, max_gap=BACKGROUND_MAX_GAP,
                                              max_run_bytes=unit)
            st.background_chunks += tally.fetched
            st.background_bytes += tally.fetched_bytes
            st.background_requests += tally.requests
            st.background_seconds = round(time.monotonic() - began, 6)
            self._publish()
            if rate and tally.fetched_bytes:
                paced_bytes += tally.fetched_bytes
                await trio.sleep_until(paced_from + paced_bytes / rate)
        else:
            st.background = "done"
        st.background_seconds = round(time.monotonic() - began, 6)
        self._publish()
        log.info("event=background layer=%s status=%s%s chunks=%d bytes=%d requests=%d seconds=%.3f rate_cap=%d",
                 st.layer, st.background, f" reason={st.background_reason}" if st.background_reason else "",
                 st.background_chunks, st.background_bytes, st.background_requests, st.background_seconds, rate)
        return st.background == "done"


def _units(chunks: Sequence[Chunk], limit: int, max_gap: int) -> list[list[Chunk]]:
    """Split blob-ordered chunks into groups the reader fetches with one request each: one blob,
    ranges at most `max_gap` apart, at most `limit` bytes (a bigger chunk is a unit of its own)."""
    units: list[list[Chunk]] = []
    start = end = 0
    for c in chunks:
        c_end = c.blob_offset + c.blob_size
        if (units and units[-1][-1].blob_index == c.blob_index and c.blob_offset <= end + max_gap
                and max(end, c_end) - start <= limit):
            units[-1].append(c)
            end = max(end, c_end)
        else:
            units.append([c])
            start, end = c.blob_offset, c_end
    return units

