"""Reading file bytes of a lazily pulled layer: cache -> single-flight fetch -> verify -> cache.

`LayerReader.read(entry, offset, size)` returns the file bytes [offset, offset+size) (clipped to
the file) of a regular-file `Entry` of the layer's index.

Contracts / concurrency invariants (one trio event loop; blocking cache IO, decompression and
hashing run in worker threads):
- Bytes are verified (chunk digest, when the format records one) BEFORE they are cached or
  returned. Corrupt bytes (digest mismatch, undecodable compressed data) are fetched once more;
  if still bad: DigestMismatch (FormatError for digest-less chunks). Bad bytes are never cached.
  A source answering the wrong number of bytes is a FetchError (retrying transport errors is
  the registry client's job).
- Single flight: at most one fetch per chunk key is in flight in this reader. Other readers of
  the same chunk wait for it and get its bytes or its error. The leader is whichever read
  needed the chunk first; if it is cancelled, waiters retry (one of them becomes the leader).
- Adjacent chunks needed together (same blob, contiguous/overlapping compressed ranges, up to
  `max_merge_bytes`) are fetched with one range request.
- Streaming: with a cache, a fetched range is decoded while it arrives (reader/runstream.py):
  each chunk goes through its decompressor and digest check into a cache temp file, committed
  once verified; a read waiting for the chunk reads its span back from the cache as soon as the
  chunk is in (the rest of the range may still be coming). A chunk evicted before it was read
  back is fetched again into memory. Without a cache, chunks are decoded into memory.
- Memory: a chunk larger than `max_chunk_bytes` (compressed, or inner offset + size) is refused
  with LimitExceeded before anything is fetched. Every fetch holds what it keeps in memory from
  a byte budget (`max_inflight_bytes`) while it runs: a streamed range one batch of compressed
  bytes and one piece of output (`_run_cost`), plus the whole of chunks kept in memory and of
  LZ4 blocks; a background cache write of a refetched chunk holds its bytes. A read never needs
  more than its chunks, never the blob.
- `fetch_timeout` bounds each fetch (budget wait, request, decode, the refetch); on expiry the
  read fails with FetchError. Waiters give up after the same bound.
- Read-ahead: after `readahead_trigger` sequential reads of an entry, up to `readahead_bytes`
  of the following chunks are fetched into the cache in the background (needs the nursery and
  a cache). Read-ahead never waits for budget: it skips when memory is short.
- Read amplification (`amplify_bytes` > 0, needs `order` and a cache): once misses come in a
  burst, a read that misses also fetches the uncached chunks stored right after its last missing
  chunk, in a window growing to `amplify_bytes` compressed bytes, in the same request, into the
  cache (see `_neighbours` and reader/neighbours.py).
"""

from __future__ import annotations

import contextvars
import logging
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import trio

from snapshotter.cache.keys import is_digest_key
from snapshotter.cache.store import ChunkCache
from snapshotter.errors import (
    CacheError,
    DigestMismatch,
    FetchError,
    FormatError,
    LimitExceeded,
    SnapshotterError,
)
from snapshotter.formats.codec import DEFAULT_PIECE, Buffer
from snapshotter.formats.digest import check_digest
from snapshotter.formats.index import Chunk, Compression, Entry, EntryType
from snapshotter.reader.budget import ByteBudget
from snapshotter.reader.causes import FETCH_CAUSES
from snapshotter.reader.keys import chunk_key
from snapshotter.reader.neighbours import BlobOrder
from snapshotter.reader.runstream import CacheTarget, ChunkOutcome, MemoryTarget, RunDecoder, TargetFactory
from snapshotter.reader.shared_flights import PROCESS_FLIGHTS, SharedFlights
from snapshotter.reader.source import RangeSource, StreamingRangeSource
from snapshotter.reader.units import UNIT_BYTES, decode_unit, is_verified, units, units_for

log = logging.getLogger(__name__)

_MAX_SEQ_TRACKED = 1024
# Amplified chunks may be this far apart in the blob (eStargz: a tar header's gzip member sits
# between two files' payloads); the gap's bytes are fetched and dropped.
AMPLIFY_MAX_GAP = 16 << 10
# Amplification ramps up as misses keep coming, as the kernel's read-ahead window grows: a start
# that misses only a few times (`true`: the binary, the loader, libc) fetches nothing extra; a
# storm of misses (an interpreter importing hundreds of modules) soon fetches `amplify_bytes`
# with each. A miss within AMPLIFY_BURST_SECONDS of the previous one continues the burst.
AMPLIFY_FREE_MISSES = 8
AMPLIFY_FIRST_BYTES = 64 << 10
AMPLIFY_BURST_SECONDS = 1.0
# Why bytes are being fetched (FETCH_CAUSES). Trio tasks inherit the context of the task that
# starts them, so a fetch led on behalf of a prefetch or a read-ahead is counted under that cause.
_CAUSE: contextvars.ContextVar[str] = contextvars.ContextVar("fetch_cause", default="on_demand")


@contextmanager
def fetch_cause(cause: str) -> Iterator[None]:
    """Count the fetches of this task (and tasks it starts) under `cause` (one of FETCH_CAUSES),
    e.g. `with fetch_cause("background"): await reader.prefetch(entry)` for a background fill."""
    if cause not in FETCH_CAUSES:
        raise ValueError(f"unknown fetch cause {cause!r}")
    token = _CAUSE.set(cause)
    try:
        yield
    finally:
        _CAUSE.reset(token)


# A sequential reader's reads reach us as several concurrent requests (the kernel's read-ahead),
# which finish in any order: a read starting within this distance of where the stream's reads
# have got to continues the stream (256 KiB reset it about every other 1 MiB read, and each reset
# started the read-ahead window again).
_SEQ_SLACK = 4 << 20
# Disk reads at once when warming cached chunks for read-ahead. Measured on this machine's
# virtio disk, 64 chunk files of 4 MiB after drop_caches, sendfile to /dev/null: 1 thread
# 0.19-0.22 s, 4 threads 0.15-0.17 s, 8 threads 0.13-0.14 s, 16 no better; a warm read of the
# bench's 256 MiB file through the mount, median of 15: 0.229 s with 8 threads, 0.247 s with 4.
_WARM_THREADS = 8
# A streamed range answer is decoded a batch of at least this many compressed bytes at a time.
_STREAM_BATCH = 256 << 10
# How often a read fetches chunks into the cache and reads them back before giving up (only a
# cache evicting them as fast as they come needs more than one).
_STORED_READ_ROUNDS = 3


def describe_source(source: object, blob: int) -> str:
    """Where a RangeSource reads from, for log lines: "REGISTRY/REPOSITORY" for the registry."""
    repo = getattr(source, "repo", None)
    return str(repo) if repo else type(source).__name__


@dataclass(frozen=True)
class ReaderConfig:
    fetch_timeout: float = 30.0
    max_inflight_bytes: int = 64 << 20
    max_merge_bytes: int = 4 << 20
    max_chunk_bytes: int = 64 << 20
    readahead_bytes: int = 32 << 20
    readahead_trigger: int = 2
    max_readahead_tasks: int = 4
    verify_cached: bool = False
    amplify_bytes: int = 0
    unit_bytes: int = UNIT_BYTES

    def __post_init__(self) -> None:
        if self.fetch_timeout <= 0 or self.max_inflight_bytes <= 0 or self.readahead_trigger < 1:
            raise ValueError(f"bad reader config {self}")


@dataclass
class ReaderStatistics:
    """Counters since the reader was made (a live object; copy it to snapshot)."""

    cache_hits: int = 0
    requests: int = 0
    fetched_bytes: int = 0
    chunks_fetched: int = 0
    refetches: int = 0
    readahead_chunks: int = 0
    readahead_warmed: int = 0
    readahead_skipped: int = 0
    cache_put_failures: int = 0
    cache_misses: int = 0
    amplified_chunks: int = 0
    shared_waits: int = 0  # chunks a read or prefetch waited for another loop's reader to fetch
    fetched_bytes_by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FETCH_CAUSES, 0))


class _Flight:
    """One chunk being fetched. Stays in the in-flight table until its bytes are in the cache
    (`storing`: finished, cache write still running), so nobody fetches it again meanwhile.
    It ends with its bytes in the cache (`stored`), in memory (`data`), or an `error`."""

    __slots__ = ("done", "data", "stored", "error", "abandoned", "storing")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None
        self.stored = False
        self.error: BaseException | None = None
        self.abandoned = False
        self.storing = False

    def finish(self, data: bytes | None = None, error: BaseException | None = None, *, stored: bool = False) -> None:
        if not self.done.is_set():
            self.data, self.error, self.stored = data, error, stored
            self.done.set()

    def abandon(self) -> None:
        if not self.done.is_set():
            self.abandoned = True
            self.done.set()


@dataclass
class _SeqState:
    next_offset: int
    streak: int
    ahead_until: int = 0


@dataclass
class _Job:
    """Chunks this task leads, keyed by cache key, how to group them into range requests
    (`max_gap`, `max_run_bytes`; 0: contiguous ranges up to max_merge_bytes) and what it cost.
    `waited`: the keys a read waits for (the rest, amplified neighbours, may come later);
    `in_memory`: fetch into memory, not into the cache; `trust_cache`: a chunk found in the
    cache when the job starts counts as done (a read that must get bytes does not trust it)."""

    chunks: dict[str, Chunk] = field(default_factory=dict)
    flights: dict[str, _Flight] = field(default_factory=dict)
    waited: set[str] = field(default_factory=set)
    in_memory: bool = False
    trust_cache: bool = True
    max_gap: int = 0
    max_run_bytes: int = 0
    requests: int = 0
    fetched_bytes: int = 0
    skipped: int = 0
    shared: bool = False  # its chunks are claimed in the process's shared table (see _lead)
    on_started: Callable[[], None] | None = None  # told once every chunk is claimed (see fetch_chunks)


@dataclass
class FetchTally:
    """What one `fetch_chunks` call did. requests/fetched_bytes: range requests it made and their
    compressed bytes (gaps included); fetched: chunks it fetched; present: chunks that were
    cached or being fetched by someone else already; skipped: chunks a background fetch left out
    for lack of memory budget; failed: chunks whose fetch failed (background only)."""

    requests: int = 0
    fetched_bytes: int = 0
    fetched: int = 0
    present: int = 0
    skipped: int = 0
    failed: int = 0


class _DecoderSink:
    """A RangeSink feeding a RunDecoder in worker threads, a batch of at least _STREAM_BATCH
    bytes at a time (a thread hop per network read would cost more than the decoding)."""

    def __init__(self, decoder: RunDecoder) -> None:
        self._decoder = decoder
        self._batch = bytearray()
        self.received = 0

    async def restart(self) -> None:
        self._batch = bytearray()
        self.received = 0
        await trio.to_thread.run_sync(self._decoder.reset)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self.received += len(data)
        if not self._batch and len(data) >= _STREAM_BATCH:
            await self._feed(data)
            return
        self._batch += data
        if len(self._batch) >= _STREAM_BATCH:
            batch, self._batch = self._batch, bytearray()
            await self._feed(batch)

    async def close(self) -> None:
        """The bytes ended: decode the rest and end every chunk."""
        if self._batch:
            batch, self._batch = self._batch, bytearray()
            await self._feed(batch)
        await trio.to_thread.run_sync(self._decoder.close)

    async def _feed(self, data: bytes | bytearray | memoryview) -> None:
        await trio.to_thread.run_sync(self._decoder.feed, data)


class LayerReader:
    """Reads regular files of one layer (its chunks live in `blobs`, served by `source`)."""

    def __init__(
        self,
        source: RangeSource,
        *,
        blobs: Sequence[str],
        cache: ChunkCache | None,
        config: ReaderConfig | None = None,
        nursery: trio.Nursery | None = None,
        order: BlobOrder | None = None,
        shared: SharedFlights | None = PROCESS_FLIGHTS,
    ) -> None:
        self.source = source
        # Fetches of this cache's chunks by readers on other event loops of this process
        # (reader/shared_flights.py); None: this reader meets only its own flights.
        self._shared = shared if cache is not None else None
        self._scope = str(cache.root) if cache is not None else ""
        self._order = order
        self.blobs = tuple(blobs)
        self.cache = cache
        self.config = config or ReaderConfig()
        self.stats = ReaderStatistics()
        self._nursery = nursery
        self._budget = ByteBudget(self.config.max_inflight_bytes)
        self._flights: dict[str, _Flight] = {}
        self._seq: OrderedDict[str, _SeqState] = OrderedDict()
        self._readahead_tasks = 0
        self._cache_limiter = trio.CapacityLimiter(8)
        # Threads reading cached chunks into the page cache ahead of a sequential reader.
        self._warm_limiter = trio.CapacityLimiter(_WARM_THREADS)
        self._burst = 0  # misses in the current burst (read amplification)
        self._last_miss = -math.inf

    # -- public -----------------------------------------------------------------------------

    async def read(self, entry: Entry, offset: int, size: int) -> Buffer:
        """File bytes [offset, offset+size) of `entry`, clipped to its size (b"" past the end)."""
        if entry.type is not EntryType.REG:
            raise FormatError(f"{entry.name!r} is a {entry.type.value}, not a regular file")
        chunks = units_for(entry, offset, size, self.config.unit_bytes)
        if not chunks:
            return b""
        end = min(offset + size, entry.size)
        pieces = await self._get(chunks, offset, end)
        self._note_access(entry, offset, end, chunks[-1])
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def prefetch(self, entry: Entry, *, pin: bool = False) -> None:
        """Fetch every chunk of `entry` into the cache (prefetch lists); errors propagate.

        pin=True pins its chunks first (so eviction and GC keep them while this process
        lives, or until `unpin(entry)`); pinned chunks count against the cap.
        """
        cache = self.cache
        if cache is None or entry.type is not EntryType.REG:
            return
        # A caller that named its cause (fetch_cause("background")) keeps it.
        token = _CAUSE.set("prefetch" if _CAUSE.get() == "on_demand" else _CAUSE.get())
        try:
            if pin:
                keys = [self.key_for(c) for c in self.units(entry)]
                await trio.to_thread.run_sync(cache.pin, keys, limiter=self._cache_limiter)
            step = max(self.config.max_merge_bytes, 1)
            for start in range(0, entry.size, step):
                await self._ensure_cached(units_for(entry, start, step, self.config.unit_bytes), background=False)
        finally:
            _CAUSE.reset(token)

    async def fetch_chunks(
        self,
        chunks: Sequence[Chunk],
        *,
        pin: bool = False,
        max_gap: int = 0,
        max_run_bytes: int = 0,
        background: bool = False,
        on_started: Callable[[], None] | None = None,
    ) -> FetchTally:
        """Fetch into the cache those of `chunks` that are neither cached nor being fetched.

        Chunks of one blob whose compressed ranges are at most `max_gap` bytes apart share one
        range request of at most `max_run_bytes` (0: `max_merge_bytes`); the gaps' bytes are
        fetched and dropped. Landmark prefetch uses this to read a layer's prefetch region (file
        payloads separated by small tar headers) in one request.
        pin=True pins the chunks first (see `prefetch`). background=True never waits for the
        byte budget (a run that does not fit is skipped) and counts failures instead of raising;
        otherwise the first chunk error propagates.
        on_started (on this event loop, once, also when the call fails or has nothing to fetch):
        every one of `chunks` is cached or claimed by now, so a read of one from here on waits
        for its fetch in flight (this process's, whatever the event loop) rather than fetching it.
        """
        told = on_started is None

        def started() -> None:
            nonlocal told
            if not told:
                told = True
                assert on_started is not None
                on_started()

        try:
            return await self._fetch_chunks(chunks, pin=pin, max_gap=max_gap, max_run_bytes=max_run_bytes,
                                            background=background, on_started=started)
        finally:
            started()

    async def _fetch_chunks(self, chunks: Sequence[Chunk], *, pin: bool, max_gap: int, max_run_bytes: int,
                            background: bool, on_started: Callable[[], None]) -> FetchTally:
        tally = FetchTally()
        cache = self.cache
        if cache is None or not chunks:
            return tally
        by_key = {self.key_for(c): c for c in chunks if not c.zeros}
        if pin:
            await trio.to_thread.run_sync(cache.pin, list(by_key), limiter=self._cache_limiter)
        token = _CAUSE.set("background" if background else "prefetch")
        try:
            job = await self._ensure_cached(list(by_key.values()), background=background, max_gap=max_gap,
                                            max_run_bytes=max_run_bytes, on_started=on_started)
        finally:
            _CAUSE.reset(token)
        tally.requests, tally.fetched_bytes, tally.skipped = job.requests, job.fetched_bytes, job.skipped
        tally.present = len(by_key) - len(job.flights)
        for flight in job.flights.values():
            if flight.error is not None:
                tally.failed += 1
            elif flight.data is not None or flight.stored:
                tally.fetched += 1
        return tally

    async def unpin(self, entry: Entry) -> None:
        """Undo `prefetch(entry, pin=True)`."""
        if self.cache is not None and entry.type is EntryType.REG:
            keys = [self.key_for(c) for c in self.units(entry)]
            await trio.to_thread.run_sync(self.cache.unpin, keys, limiter=self._cache_limiter)

    def units(self, entry: Entry) -> Sequence[Chunk]:
        """What this reader fetches and caches of a regular file: its chunks, small ones grouped
        (reader/units.py). Chunks handed to `fetch_chunks` should be these."""
        return units(entry, self.config.unit_bytes)

    def key_for(self, chunk: Chunk) -> str:
        """The cache key of one of this layer's chunks or units (see `chunk_key`)."""
        return chunk_key(chunk, self.blobs)

    # -- getting chunk bytes -----------------------------------------------------------------

    async def _get(self, chunks: Sequence[Chunk], offset: int, end: int) -> list[Buffer]:
        """The bytes of `chunks` inside file range [offset, end), in order: one part per chunk,
        or one part for all of them when the page cache holds them all."""
        keys = [self.key_for(c) for c in chunks]
        spans = [(max(offset, c.file_offset) - c.file_offset, min(end, c.end) - c.file_offset) for c in chunks]
        wanted = [(k, lo, hi - lo) for k, (lo, hi) in zip(keys, spans, strict=True)]
        if len(wanted) > 1:
            joined = await self._cache_read_joined(wanted, end - offset)
            if joined is not None:
                return [joined]
        found = await self._cached_parts(wanted)
        missing = {keys[i]: chunks[i] for i in range(len(chunks)) if i not in found}
        self.stats.cache_misses += len(missing)
        extra = await self._neighbours(missing) if missing else None
        for round_no in range(_STORED_READ_ROUNDS):
            if not missing:
                break
            # Chunks evicted before they could be read back (a cache smaller than the reads and
            # their read-ahead) are fetched into memory the next time; the last round fetches
            # them itself, as joining another read's flight could end in the cache again.
            last = round_no == _STORED_READ_ROUNDS - 1
            full = await self._obtain(missing, extra, into_memory=round_no > 0, private=last)
            extra = None
            stored: list[int] = []
            for i, key in enumerate(keys):
                if i in found or key not in full:
                    continue
                data = full[key]
                if data is None:
                    stored.append(i)
                else:
                    lo, hi = spans[i]
                    found[i] = data[lo:hi]
            # Fetched into the cache: read the spans back (just written, so from the page cache).
            again = await self._cached_parts([wanted[i] for i in stored])
            found.update((stored[j], data) for j, data in again.items())
            # A chunk evicted before we read it back (a cache far smaller than the reads) is fetched again.
            missing = {keys[i]: chunks[i] for i in stored if i not in found}
        if missing:
            raise FetchError(f"chunks {', '.join(sorted(missing))[:200]}: evicted from the cache as fast as "
                             "they were fetched (cache.max_bytes too small for the reads?)")
        return [found[i] for i in range(len(chunks))]

    async def _cached_parts(self, wanted: list[tuple[str, int, int]]) -> dict[int, Buffer]:
        """Those of the (key, offset, size) parts the cache holds, by position: only the needed
        part of each chunk (a 128 KiB FUSE read of a 4 MiB chunk), from the page cache inline
        when it is there, else in a worker thread."""
        found = self._cache_get_resident(wanted)
        if len(found) < len(wanted):
            rest = [i for i in range(len(wanted)) if i not in found]
            more = await self._cache_get_many([wanted[i] for i in rest])
            found.update((rest[j], data) for j, data in more.items())
        return found

    async def _obtain(self, wanted: dict[str, Chunk], extra: dict[str, Chunk] | None = None, *,
                      into_memory: bool = False, private: bool = False) -> dict[str, bytes | None]:
        """Every wanted chunk: its bytes, or None when they are in the cache. Leads fetches
        nobody runs (into memory, not the cache, with `into_memory`), waits for the others.
        `private` (with `into_memory`): fetches every chunk itself, joining no other flight and
        trusting no cached copy, so that every chunk comes back as bytes. `extra` chunks (nobody
        fetches them yet) go into the cache with the first round's requests; they are not returned."""
        got: dict[str, bytes | None] = {}
        while wanted:
            job = _Job(in_memory=into_memory or private, trust_cache=not private)
            waits: dict[str, _Flight] = {}
            late: list[str] = []
            for key, chunk in wanted.items():
                flight = None if private else self._flights.get(key)
                if flight is None:
                    flight = _Flight()
                    if not private:
                        self._flights[key] = flight
                    job.chunks[key] = chunk
                    job.flights[key] = flight
                    job.waited.add(key)
                waits[key] = flight
            if extra and job.chunks and not private:
                for key, chunk in extra.items():
                    if key not in self._flights:
                        job.chunks[key] = chunk
                        job.flights[key] = self._flights[key] = _Flight()
                job.max_gap = AMPLIFY_MAX_GAP
            extra = None
            async with trio.open_nursery() as nursery:
                if job.chunks:
                    nursery.start_soon(self._lead, job, False)
                for key, flight in waits.items():
                    nursery.start_soon(self._wait, key, flight, late)
            if late:
                raise FetchError(f"chunk {late[0]}: not fetched within {self.config.fetch_timeout}s")
            retry: dict[str, Chunk] = {}
            for key, flight in waits.items():
                if flight.abandoned:
                    retry[key] = wanted[key]
                elif flight.error is not None:
                    raise flight.error
                else:
                    assert flight.data is not None or flight.stored
                    got[key] = flight.data
            wanted = retry
        return got

    async def _neighbours(self, missing: dict[str, Chunk]) -> dict[str, Chunk]:
        """Read amplification: for an on-demand miss, the chunks stored right after the last
        missing one (`BlobOrder.following`), up to the first that is cached or being fetched
        (by this loop or, in the process's shared flights, another: the read would wait for
        that fetch to reach its neighbours), so that they come in the same request. The window:
        nothing for the first AMPLIFY_FREE_MISSES misses of a burst, then AMPLIFY_FIRST_BYTES doubling with each
        miss up to `amplify_bytes`."""
        cfg = self.config
        if self._order is None or self.cache is None or cfg.amplify_bytes <= 0 or _CAUSE.get() != "on_demand":
            return {}
        now = trio.current_time()
        self._burst = self._burst + 1 if now - self._last_miss <= AMPLIFY_BURST_SECONDS else 1
        self._last_miss = now
        if self._burst <= AMPLIFY_FREE_MISSES:
            return {}
        window = min(cfg.amplify_bytes, AMPLIFY_FIRST_BYTES << min(self._burst - AMPLIFY_FREE_MISSES - 1, 20))
        last = max(missing.values(), key=lambda c: (c.blob_index, c.blob_offset))
        candidates: dict[str, Chunk] = {}
        shared = self._shared
        for c in self._order.following(last, max_bytes=window, max_gap=AMPLIFY_MAX_GAP):
            key = self.key_for(c)
            if key in self._flights or (shared is not None and shared.held(self._scope, key)):
                break
            if key not in missing:
                candidates[key] = c
        if not candidates:
            return {}
        present = await trio.to_thread.run_sync(self.cache.present, list(candidates), limiter=self._cache_limiter)
        extra: dict[str, Chunk] = {}
        for key, c in candidates.items():
            if key in present:
                break  # fetching past a cached chunk would mean a second request or refetched bytes
            extra[key] = c
        self.stats.amplified_chunks += len(extra)
        return extra

    async def _wait(self, key: str, flight: _Flight, late: list[str]) -> None:
        """Wait for a flight, bounded; on expiry note the key in `late` (raising here would
        come out of the nursery wrapped in an ExceptionGroup)."""
        with trio.move_on_after(self.config.fetch_timeout + 1.0):
            await flight.done.wait()
            return
        late.append(key)

    async def _lead(self, job: _Job, background: bool) -> None:
        """Fetch the job's chunks (grouped into runs) and finish their flights.

        Every flight of the job is finished (data or error) or abandoned when this returns or
        is cancelled, and removed from the in-flight table.
        """
        try:
            # Claimed before the cache is looked at: a reader on another loop stores a chunk
            # before it ends its claim, so a chunk is either in the cache by now or still claimed.
            foreign: list[str] = []
            if self._sharing(job):
                assert self._shared is not None
                job.shared = True
                foreign = self._shared.claim(self._scope, job.chunks, self)
            if job.on_started is not None:  # every chunk is claimed now: by this job or another loop
                job.on_started()
            # Re-check the cache: a fetch of these chunks may have completed (and left the
            # in-flight table) while our caller was looking them up.
            cache = self.cache
            present: set[str] = set()
            if cache is not None and job.trust_cache:
                try:
                    present = await trio.to_thread.run_sync(cache.present, list(job.chunks),
                                                            limiter=self._cache_limiter)
                except CacheError as exc:
                    log.warning("%s", exc)
                for key in present:
                    job.flights[key].finish(stored=True)
                    del job.chunks[key]
            foreign = [key for key in foreign if key in job.chunks]
            if foreign:
                await self._wait_for_other_loops(job, foreign)
            async with trio.open_nursery() as nursery:
                for run in self._runs(job.chunks, job.max_gap, job.max_run_bytes):
                    nursery.start_soon(self._lead_run, job, run, background)
        finally:
            for key, flight in job.flights.items():
                flight.abandon()
                if not flight.storing:
                    self._forget_flight(key, flight)
            if job.shared and self._shared is not None:
                self._shared.release(self._scope, job.flights, self)

    def _sharing(self, job: _Job) -> bool:
        """Whether the job's fetches meet other loops' (they end in the cache, where a waiter looks)."""
        return self._shared is not None and job.trust_cache and not job.in_memory and bool(job.chunks)

    async def _wait_for_other_loops(self, job: _Job, foreign: list[str]) -> None:
        """Wait for the `foreign` chunks of the job, which readers on other loops are fetching
        (at most fetch_timeout), then take from the job those that reached the cache meanwhile.
        The rest stays in the job, claimed now by this reader, which fetches it."""
        assert self._shared is not None and self.cache is not None
        self.stats.shared_waits += len(foreign)
        await self._shared.wait(self._scope, foreign, self.config.fetch_timeout)
        try:
            present = await trio.to_thread.run_sync(self.cache.present, foreign, limiter=self._cache_limiter)
        except CacheError as exc:
            log.warning("%s", exc)
            present = set()
        for key in present:
            job.flights[key].finish(stored=True)
            del job.chunks[key]
        self._shared.claim(self._scope, job.chunks, self)

    def _forget_flight(self, key: str, flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]

    def _runs(self, chunks: dict[str, Chunk], max_gap: int = 0, max_bytes: int = 0) -> list[list[tuple[str, Chunk]]]:
        """Group chunks into runs fetched by one range request each: same blob, at most `max_gap`
        bytes between ranges, at most `max_bytes` (0: max_merge_bytes) in all."""
        limit = max_bytes or self.config.max_merge_bytes
        items = sorted(chunks.items(), key=lambda kc: (kc[1].blob_index, kc[1].blob_offset))
        runs: list[list[tuple[str, Chunk]]] = []
        start = end = 0
        for key, c in items:
            c_end = c.blob_offset + c.blob_size
            if (
                runs
                and runs[-1][-1][1].blob_index == c.blob_index
                and c.blob_offset <= end + max_gap
                and max(end, c_end) - start <= limit
            ):
                runs[-1].append((key, c))
                end = max(end, c_end)
            else:
                runs.append([(key, c)])
                start, end = c.blob_offset, c_end
        return runs

    async def _lead_run(self, job: _Job, run: list[tuple[str, Chunk]], background: bool) -> None:
        blob = run[0][1].blob_index
        start = min(c.blob_offset for _, c in run)
        end = max(c.blob_offset + c.blob_size for _, c in run)
        cost = self._run_cost(run, end - start, in_memory=job.in_memory)
        timeout = self.config.fetch_timeout
        try:
            limit = self.config.max_chunk_bytes
            for key, c in run:
                if max(c.blob_size, c.inner_offset + c.size) > limit:
                    # A hostile or broken index must not make us allocate gigabytes.
                    raise LimitExceeded(
                        f"chunk {key}: {c.blob_size} compressed / {c.inner_offset + c.size} uncompressed "
                        f"bytes exceed max_chunk_bytes {limit}"
                    )
            with trio.move_on_after(timeout) as scope:
                if background:
                    if not self._budget.acquire_nowait(cost):
                        self.stats.readahead_skipped += len(run)
                        job.skipped += len(run)
                        return  # flights are abandoned by _lead; a foreground reader retries
                    held = min(cost, self._budget.capacity)
                else:
                    held = await self._budget.acquire(cost)
                try:
                    await self._fetch_run(job, run, blob, start, end, background)
                finally:
                    self._budget.release(held)
            if scope.cancelled_caught:
                err = FetchError(
                    f"blob {self._blob_name(blob)} range {start}+{end - start}: not fetched within {timeout}s"
                )
                for key, _ in run:
                    job.flights[key].finish(error=err)
        except Exception as exc:
            for key, _ in run:
                job.flights[key].finish(error=exc)

    def _run_cost(self, run: list[tuple[str, Chunk]], length: int, *, in_memory: bool) -> int:
        """The memory a run's fetch holds at most (what it takes from the byte budget): a
        streamed answer holds one batch of compressed bytes and one piece of output at a time,
        a source that cannot stream holds the whole answer; chunks kept in memory (no cache) and
        LZ4 blocks (which decode whole) hold all of their bytes."""
        cost = min(length, _STREAM_BATCH) + DEFAULT_PIECE
        if not isinstance(self.source, StreamingRangeSource):
            cost += length
        for _, c in run:
            if in_memory or self.cache is None:
                cost += c.size
            if c.compression is Compression.LZ4_BLOCK:
                cost += c.blob_size + c.inner_offset + c.size
        return cost

    def _targets(self, in_memory: bool) -> TargetFactory:
        """Where the fetched chunks of a run go: the cache (files kept open when a read is
        about to read them back), or memory."""
        cache = self.cache
        if cache is None or in_memory:
            return lambda chunk, key: MemoryTarget()
        keep_open = _CAUSE.get() == "on_demand"
        return lambda chunk, key: CacheTarget(cache, key, keep_open=keep_open)

    async def _fetch_run(
        self, job: _Job, run: list[tuple[str, Chunk]], blob: int, start: int, end: int, background: bool
    ) -> None:
        bad: dict[int, Exception] = {}  # by position in the run (a retried answer reports again)

        def ended(outcomes: list[tuple[int, ChunkOutcome]]) -> None:  # on the event loop
            stored: list[str] = []
            for i, outcome in outcomes:
                if outcome.error is not None:
                    bad[i] = outcome.error  # fetched again below, once the run is done
                    continue
                key = run[i][0]
                flight = job.flights[key]
                flight.finish(data=outcome.data, stored=outcome.stored)
                if outcome.stored:
                    self._forget_flight(key, flight)  # in the cache: later readers find it there
                    stored.append(key)
                if outcome.data is not None and self.cache is not None and not job.in_memory:
                    self.stats.cache_put_failures += 1  # verified, but the cache had no room
            if stored and job.shared and self._shared is not None:
                self._shared.release(self._scope, stored, self)

        # The decoder runs in worker threads and reports each chunk as it ends: its waiters go on
        # while the rest of the run is still being decoded.
        decoder = RunDecoder(run, start, self._targets(job.in_memory), urgent=job.waited,
                             on_ended=lambda outcomes: trio.from_thread.run_sync(ended, outcomes))
        try:
            sink = _DecoderSink(decoder)
            await self._stream(blob, start, end - start, sink)
            await sink.close()
        except BaseException:
            decoder.abort()
            raise
        job.requests += 1
        job.fetched_bytes += end - start
        self.stats.chunks_fetched += len(run)
        if background:
            self.stats.readahead_chunks += len(run)
        refetched: list[tuple[str, bytes | None]] = []
        for i, err in bad.items():
            key, c = run[i]
            if isinstance(err, CacheError):
                # The bytes were good but could not be stored: fetch them into memory instead.
                self.stats.cache_put_failures += 1
                log.warning("%s; fetching chunk %s again into memory", err, key)
            else:
                # Corrupt in transit or at rest: one more try with a fresh request for this chunk.
                self.stats.refetches += 1
                log.warning("event=chunk_corrupt source=%s blob=%s range=%d+%d chunk=%s error=%r; fetching it again",
                            describe_source(self.source, blob), self._blob_name(blob),
                            c.blob_offset, c.blob_size, key, str(err))
            try:
                again = await self._fetch(blob, c.blob_offset, c.blob_size)
                plain = await trio.to_thread.run_sync(self._decode, key, c, again)
            except (FormatError, FetchError) as exc:
                job.flights[key].finish(error=exc)  # only this chunk fails; the run's others stand
            else:
                job.flights[key].finish(data=plain)
                if not isinstance(err, CacheError):
                    refetched.append((key, plain))
        if not refetched or self.cache is None:
            return
        nbytes = sum(len(d or b"") for _, d in refetched)
        if not background and self._nursery is not None and self._budget.acquire_nowait(nbytes):
            # Let the foreground read return now; the cache write finishes in the background.
            flights = {key: job.flights[key] for key, _ in refetched}
            for flight in flights.values():
                flight.storing = True
            self._nursery.start_soon(self._store_later, refetched, flights, min(nbytes, self._budget.capacity))
        else:
            stored = await self._cache_put_many(refetched)
            self.stats.cache_put_failures += len(refetched) - stored

    async def _stream(self, blob: int, offset: int, length: int, sink: _DecoderSink) -> None:
        """Blob bytes [offset, offset+length) into `sink`, streamed when the source can."""
        source = self.source
        if not isinstance(source, StreamingRangeSource):
            await sink.write(await self._fetch(blob, offset, length))
            return
        with self._source_request(blob, offset, length):
            await source.stream_range(blob, offset, length, sink)
        self._answered(blob, offset, length, sink.received)

    async def _store_later(
        self, items: list[tuple[str, bytes | None]], flights: dict[str, _Flight], held: int
    ) -> None:
        try:
            stored = await self._cache_put_many(items)
            self.stats.cache_put_failures += len(items) - stored
        except Exception as exc:  # a failed cache write must not take the reader's nursery down
            log.warning("storing %d chunks failed: %s", len(items), exc)
        finally:
            self._budget.release(held)
            for key, flight in flights.items():
                self._forget_flight(key, flight)

    async def _fetch(self, blob: int, offset: int, length: int) -> bytes | bytearray:
        with self._source_request(blob, offset, length):
            data = await self.source.read_range(blob, offset, length)
        self._answered(blob, offset, length, len(data))
        return data

    @contextmanager
    def _source_request(self, blob: int, offset: int, length: int) -> Iterator[None]:
        """One request to the source, counted; its OS-level errors leave as FetchError naming the range."""
        self.stats.requests += 1
        try:
            yield
        except SnapshotterError:
            raise
        except (OSError, ValueError) as exc:
            raise FetchError(f"blob {self._blob_name(blob)} range {offset}+{length}: {exc}") from exc

    def _answered(self, blob: int, offset: int, length: int, got: int) -> None:
        """The source answered `got` bytes for the range: FetchError unless that is all of it;
        else count them (under this task's fetch cause)."""
        if got != length:
            raise FetchError(f"blob {self._blob_name(blob)} range {offset}+{length}: source answered {got} bytes")
        self.stats.fetched_bytes += length
        cause = _CAUSE.get()
        self.stats.fetched_bytes_by_cause[cause] = self.stats.fetched_bytes_by_cause.get(cause, 0) + length

    @staticmethod
    def _decode(key: str, chunk: Chunk, data: Buffer) -> bytes:
        """Decompress and verify one chunk (runs in a worker thread)."""
        what = f"chunk {key} (blob offset {chunk.blob_offset})"
        try:
            plain = decode_unit(chunk, data, what=what)  # a group checks its parts' digests
        except DigestMismatch:
            raise
        except FormatError as exc:
            if is_verified(chunk):
                raise DigestMismatch(f"{what}: compressed bytes do not decode: {exc}") from exc
            raise
        if chunk.digest is not None:
            try:
                check_digest(chunk.digest, plain, what)
            except ImportError as exc:
                raise FormatError(f"{what}: cannot verify {chunk.digest.split(':')[0]}: {exc}") from exc
        return plain

    def _blob_name(self, blob: int) -> str:
        return self.blobs[blob] if 0 <= blob < len(self.blobs) else f"#{blob}"

    # -- cache access (worker threads) -------------------------------------------------------

    def _cache_get_resident(self, wanted: list[tuple[str, int, int]]) -> dict[int, Buffer]:
        """Those of the (key, offset, size) requests the cache serves without waiting (see
        `ChunkCache.get_resident`), by position; a worker thread costs more than such a read."""
        cache = self.cache
        if cache is None or self.config.verify_cached:
            return {}
        found: dict[int, Buffer] = {}
        for i, (key, off, size) in enumerate(wanted):
            data = cache.get_resident(key, off, size)
            if data is not None:
                found[i] = data
        self.stats.cache_hits += len(found)
        return found

    async def _cache_read_joined(self, wanted: list[tuple[str, int, int]], total: int) -> bytearray | None:
        """The (key, offset, size) parts read one after another into one buffer, when the cache
        holds every one; None otherwise (the caller then takes the parts one by one). A read
        spanning two chunks (Nydus's 1 MiB chunks under the kernel's 1 MiB reads, mostly) then
        costs no join of the parts.

        The parts the page cache holds are read inline. When the reader has caught up with the
        read-ahead (the first parts are in the page cache, a later one is still on its way from
        the disk), the rest is read into the same buffer in a worker thread: going part by part
        instead would read the first parts again and join them. When not even the first part
        is in the page cache, the read is most likely a miss, and goes part by part at once."""
        cache = self.cache
        if cache is None or self.config.verify_cached:
            return None
        if sum(size for _, _, size in wanted) != total:
            return None
        buf = bytearray(total)
        view = memoryview(buf)
        pos = done = 0
        for key, off, size in wanted:
            if not cache.read_resident_into(key, off, view[pos:pos + size]):
                break
            pos += size
            done += 1
        if done == 0:
            return None
        if done < len(wanted):
            rest = wanted[done:]

            def read_rest() -> bool:
                at = pos
                for key, off, size in rest:
                    if not cache.read_into(key, off, view[at:at + size]):
                        return False
                    at += size
                return True

            try:
                if not await trio.to_thread.run_sync(read_rest, limiter=self._cache_limiter):
                    return None
            except CacheError as exc:
                log.warning("%s", exc)
                return None
        self.stats.cache_hits += len(wanted)
        return buf

    async def _cache_get_many(self, wanted: list[tuple[str, int, int | None]]) -> dict[int, bytes]:
        """Cached bytes of (key, offset, size) requests (size None: to the end), by position."""
        cache = self.cache
        if cache is None or not wanted:
            return {}
        verify = self.config.verify_cached

        def get_all() -> dict[int, bytes]:
            found: dict[int, bytes] = {}
            for i, (key, off, size) in enumerate(wanted):
                if not (verify and is_digest_key(key)):
                    data = cache.get(key, off, size)
                    if data is not None:
                        found[i] = data
                    continue
                whole = cache.get(key)
                if whole is None:
                    continue
                try:
                    check_digest(key, whole, f"cached chunk {key}")
                except (FormatError, ImportError) as exc:
                    log.error("%s; dropping it from the cache", exc)
                    cache.discard(key)
                    continue
                found[i] = whole[off:] if size is None else whole[off:off + size]
            return found

        try:
            found = await trio.to_thread.run_sync(get_all, limiter=self._cache_limiter)
        except CacheError as exc:
            log.warning("%s", exc)
            return {}
        self.stats.cache_hits += len(found)
        return found

    async def _cache_put_many(self, items: list[tuple[str, bytes | None]]) -> int:
        """Store verified chunks; returns how many the cache took."""
        cache = self.cache
        if cache is None or not items:
            return 0

        def put_all() -> int:
            n = 0
            for key, data in items:
                if data is None:
                    continue
                try:
                    n += cache.put(key, data)
                except CacheError as exc:
                    log.warning("%s", exc)
            return n

        return await trio.to_thread.run_sync(put_all, limiter=self._cache_limiter)

    # -- read-ahead --------------------------------------------------------------------------

    def _note_access(self, entry: Entry, offset: int, end: int, last: Chunk) -> None:
        cfg = self.config
        if self._nursery is None or self.cache is None or cfg.readahead_bytes <= 0:
            return
        st = self._seq.pop(entry.name, None)
        if st is not None and abs(offset - st.next_offset) <= _SEQ_SLACK:
            st.streak += 1
            st.next_offset = max(st.next_offset, end)
        else:
            st = _SeqState(next_offset=end, streak=1, ahead_until=0)
        self._seq[entry.name] = st
        while len(self._seq) > _MAX_SEQ_TRACKED:
            self._seq.popitem(last=False)
        if st.streak < cfg.readahead_trigger or self._readahead_tasks >= cfg.max_readahead_tasks:
            return
        window_end = min(end + cfg.readahead_bytes, entry.size)
        begin = max(last.end, st.ahead_until)
        # Refill only when less than half the window is left ahead of the reader.
        if begin >= window_end or st.ahead_until - end > cfg.readahead_bytes // 2:
            return
        ahead = units_for(entry, begin, window_end - begin, cfg.unit_bytes)
        if not ahead:
            return
        st.ahead_until = ahead[-1].end
        self._readahead_tasks += 1
        self._nursery.start_soon(self._readahead, tuple(ahead))

    async def _readahead(self, chunks: Sequence[Chunk]) -> None:
        """Fetch the window's missing chunks; read its cached ones into the page cache, a few at
        once (a warm sequential reader then finds them there: one chunk file after another is
        otherwise read from disk one request at a time, at half the disk's speed)."""
        _CAUSE.set("background")
        cache = self.cache
        assert cache is not None
        try:
            by_key = {self.key_for(c): c for c in chunks if not c.zeros}
            warmed: set[str] = set()

            async def warm(keys: list[str]) -> None:
                warmed.update(await trio.to_thread.run_sync(cache.warm, keys, limiter=self._warm_limiter))

            # Striped over the threads (thread i warms chunks i, i+n, ...): the reader's next
            # chunks are read first, and a window costs n thread hand-offs, not one per chunk.
            keys = list(by_key)
            async with trio.open_nursery() as nursery:
                for i in range(min(_WARM_THREADS, len(keys))):
                    nursery.start_soon(warm, keys[i::_WARM_THREADS])
            self.stats.readahead_warmed += len(warmed)
            missing = [c for k, c in by_key.items() if k not in warmed]
            if missing:
                await self._ensure_cached(missing, background=True)
        except Exception as exc:  # a failed read-ahead only costs a later foreground fetch
            log.info("read-ahead of %d chunks failed: %s", len(chunks), exc)
        finally:
            self._readahead_tasks -= 1

    async def _ensure_cached(self, chunks: Sequence[Chunk], *, background: bool, max_gap: int = 0,
                             max_run_bytes: int = 0, on_started: Callable[[], None] | None = None) -> _Job:
        """Fetch into the cache the chunks that are neither cached nor being fetched
        (`on_started`: see fetch_chunks)."""
        job = _Job(max_gap=max_gap, max_run_bytes=max_run_bytes, on_started=on_started)
        cache = self.cache
        if cache is None or not chunks:
            return job
        by_key = {self.key_for(c): c for c in chunks}
        present = await trio.to_thread.run_sync(cache.present, list(by_key), limiter=self._cache_limiter)
        for key, chunk in by_key.items():
            if key in present or key in self._flights:
                continue
            job.chunks[key] = chunk
            job.flights[key] = self._flights[key] = _Flight()
        if not job.chunks:
            return job
        await self._lead(job, background)
        if not background:
            for flight in job.flights.values():
                if flight.error is not None:
                    raise flight.error
        return job


@asynccontextmanager
async def open_layer_reader(
    source: RangeSource,
    *,
    blobs: Sequence[str],
    cache: ChunkCache | None,
    config: ReaderConfig | None = None,
    order: BlobOrder | None = None,
) -> AsyncIterator[LayerReader]:
    """A LayerReader with its own nursery for read-ahead; background work stops on exit.

    An exception from the body comes out as itself, not wrapped in an ExceptionGroup.
    """
    try:
        async with trio.open_nursery() as nursery:
            reader = LayerReader(source, blobs=blobs, cache=cache, config=config, nursery=nursery, order=order)
            try:
                yield reader
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
