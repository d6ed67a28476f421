"""One range answer decoded while it arrives: every chunk of a run goes through its decoder and
digest check straight into the chunk cache (or into memory when there is no cache), so that
neither the answer nor a whole chunk is held in memory (but an LZ4 block, which only decodes
whole, or a chunk kept in memory).

`RunDecoder(run, start, targets)`: `feed(data)` takes the next bytes of the run's blob range
(from `start`, in order, in any pieces), `close()` ends it; `outcomes()` then tells, for each
chunk of the run in order, how it ended (`ChunkOutcome`): stored in the cache, bytes in memory,
or an error. `on_ended(ended)` hears of each, `ended` a list of (i, outcome) in run order, as
soon as it and the chunks before it ended (called from within `feed` / `close`): chunks verified
in one `feed` are finished together (one cache transaction) and reported in one call, but for the
`urgent` ones (someone waits for them), which are finished and reported at once (the reader's
callback hops to its event loop, 50-60 µs of CPU a call). A chunk is committed to the cache only
after its digest matched (its bytes go to a cache temp file as they are decoded; a bad chunk's
temp file is removed). `reset()` starts over (a retried request sends the answer again);
`abort()` drops everything not committed.

Blocking (decompression, hashing, cache file writes): call it from a worker thread, one call at
a time.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Protocol

from snapshotter.cache.store import ChunkCache, ChunkWriter
from snapshotter.errors import CacheError, DigestMismatch, FormatError
from snapshotter.formats.codec import DEFAULT_PIECE, Buffer
from snapshotter.formats.digest import DigestCheck
from snapshotter.formats.index import Chunk
from snapshotter.reader.units import UnitDecoder, is_verified


@dataclass(slots=True)
class ChunkOutcome:
    """How one chunk of a run ended. stored: its bytes are in the cache; data: its bytes, held
    in memory (no cache, or the cache had no room); error: FormatError / DigestMismatch (the
    fetched bytes were bad) or CacheError (the cache could not take them)."""

    stored: bool = False
    data: bytes | None = None
    error: Exception | None = None


class ChunkTarget(Protocol):
    """Where one chunk's verified bytes go."""

    def write(self, data: bytes) -> None: ...

    def finish(self) -> ChunkOutcome:
        """The bytes are complete and verified: keep them."""
        ...

    def abort(self) -> None: ...


def finish_all(targets: list[ChunkTarget]) -> list[ChunkOutcome]:
    """`finish` of each target, the cache targets of one cache in one index transaction (a
    CacheError is then the outcome of each of them)."""
    out: dict[int, ChunkOutcome] = {}
    by_cache: dict[int, list[tuple[int, CacheTarget]]] = {}
    for i, t in enumerate(targets):
        if isinstance(t, CacheTarget):
            by_cache.setdefault(id(t.cache), []).append((i, t))
        else:
            out[i] = t.finish()
    for group in by_cache.values():
        out.update(zip((i for i, _ in group), CacheTarget.finish_group([t for _, t in group]), strict=True))
    return [out[i] for i in range(len(targets))]


class MemoryTarget:
    """The chunk's bytes kept in memory (a reader without a cache)."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._pieces.append(data)

    def finish(self) -> ChunkOutcome:
        pieces, self._pieces = self._pieces, []
        return ChunkOutcome(data=pieces[0] if len(pieces) == 1 else b"".join(pieces))

    def abort(self) -> None:
        self._pieces = []


class CacheTarget:
    """The chunk's bytes written to the cache as they come (`ChunkWriter`), committed once
    verified. A cache without room for it gives the bytes back in memory instead."""

    def __init__(self, cache: ChunkCache, key: str, *, keep_open: bool) -> None:
        self.cache = cache
        self._writer: ChunkWriter = cache.writer(key)
        self._keep_open = keep_open

    def write(self, data: bytes) -> None:
        self._writer.write(data)

    def finish(self) -> ChunkOutcome:
        return self.finish_group([self])[0]

    @staticmethod
    def finish_group(targets: list[CacheTarget]) -> list[ChunkOutcome]:
        """`finish` of targets of one cache, committed in one transaction."""
        cache = targets[0].cache
        writers = [t._writer for t in targets]
        try:
            done = cache.commit_all(writers, keep_open=targets[0]._keep_open)
            out: list[ChunkOutcome] = []
            for w, ok in zip(writers, done, strict=True):
                try:
                    out.append(ChunkOutcome(stored=True) if ok else ChunkOutcome(data=w.read_back()))
                except CacheError as exc:
                    out.append(ChunkOutcome(error=exc))
            return out
        except CacheError as exc:
            return [ChunkOutcome(error=exc) for _ in targets]
        finally:
            for w in writers:
                w.abort()

    def abort(self) -> None:
        self._writer.abort()


# (chunk, its cache key) -> where its bytes go
TargetFactory = Callable[[Chunk, str], ChunkTarget]


class _ChunkState:
    __slots__ = ("chunk", "key", "end", "decoder", "check", "target", "outcome")

    def __init__(self, chunk: Chunk, key: str, target: ChunkTarget, max_piece: int) -> None:
        self.chunk, self.key, self.target = chunk, key, target
        self.end = chunk.blob_offset + chunk.blob_size
        self.check = DigestCheck(chunk.digest, f"chunk {key}") if chunk.digest is not None else None
        self.decoder = UnitDecoder(chunk, self._take, what=f"chunk {key}", max_piece=max_piece)
        self.outcome: ChunkOutcome | None = None

    def _take(self, piece: bytes) -> None:
        if self.check is not None:
            self.check.update(piece)
        self.target.write(piece)

    def fail(self, exc: Exception) -> None:
        self.target.abort()
        self.outcome = ChunkOutcome(error=exc)

    def feed(self, data: Buffer) -> None:
        try:
            self.decoder.feed(data)
        except (FormatError, CacheError) as exc:
            self.fail(self._bad(exc))

    def complete(self) -> bool:
        """The chunk's bytes are all in: True when they decoded and verified (the target is
        then ready to finish); False when the chunk failed (its outcome says why)."""
        try:
            self.decoder.finish()
            if self.check is not None:
                self.check.verify()
            return True
        except (FormatError, CacheError) as exc:
            self.fail(self._bad(exc))
            return False

    def _bad(self, exc: Exception) -> Exception:
        """As the whole-chunk decode reports it: undecodable bytes of a chunk with a digest are
        a digest mismatch."""
        if isinstance(exc, FormatError) and not isinstance(exc, DigestMismatch) and is_verified(self.chunk):
            return DigestMismatch(f"chunk {self.key} (blob offset {self.chunk.blob_offset}): "
                                  f"compressed bytes do not decode: {exc}")
        return exc


class RunDecoder:
    """Decodes the blob bytes [start, ...) of a run of (key, chunk) pairs sorted by blob offset
    (gaps between chunks are skipped; overlapping ranges each get their bytes)."""

    def __init__(self, run: Sequence[tuple[str, Chunk]], start: int, targets: TargetFactory, *,
                 max_piece: int = DEFAULT_PIECE,
                 on_ended: Callable[[list[tuple[int, ChunkOutcome]]], None] | None = None,
                 urgent: Container[str] = ()) -> None:
        self._run = list(run)
        self._on_ended = on_ended
        self._urgent = urgent
        self._start = start
        self._targets = targets
        self._max_piece = max_piece
        self._states: list[_ChunkState] = []
        self._ready: list[_ChunkState] = []  # verified, to finish together at the end of a call
        self._pos = start
        self._first = 0  # states before this one have ended
        self._reported = 0  # outcomes handed out by `take_ended`
        self.reset()

    def reset(self) -> None:
        """Forget what was fed (aborting unfinished targets): the bytes come again from `start`."""
        self.abort()
        self._states = [_ChunkState(c, key, self._targets(c, key), self._max_piece) for key, c in self._run]
        self._ready = []
        self._pos = self._start
        self._first = 0
        self._reported = 0

    def feed(self, data: Buffer) -> None:
        lo, hi = self._pos, self._pos + len(data)
        view = memoryview(data)
        states = self._states
        for i in range(self._first, len(states)):
            st = states[i]
            c_start = st.chunk.blob_offset
            if c_start >= hi:
                break  # sorted by start: none further begins inside this piece
            if st.outcome is not None or st.end <= lo:
                continue
            st.feed(view[max(lo, c_start) - lo:min(hi, st.end) - lo])
            if st.end <= hi and st.outcome is None and st.complete():
                self._ready.append(st)
                if st.key in self._urgent:
                    self._finish_ready()  # a read waits for it: not for the rest of this piece
        self._finish_ready()
        while self._first < len(states) and states[self._first].outcome is not None:
            self._first += 1
        self._pos = hi

    def close(self) -> None:
        """The bytes ended: every chunk not complete yet ends now (short ones as FormatError)."""
        for st in self._states[self._first:]:
            if st.outcome is None and st.complete():
                self._ready.append(st)
        self._finish_ready()
        self._first = len(self._states)

    def _finish_ready(self) -> None:
        """Finish the chunks verified during this call together (one cache transaction for a
        run of small chunks), then report them."""
        ready, self._ready = self._ready, []
        if ready:
            for st, outcome in zip(ready, finish_all([st.target for st in ready]), strict=True):
                st.outcome = outcome
        self._report()  # failed chunks too

    def abort(self) -> None:
        for st in self._states:
            if st.outcome is None:
                st.target.abort()
        self._ready = []

    def _report(self) -> None:
        """Tell `on_ended`, in one call, of the chunks that ended, in run order, as soon as every
        earlier one has ended too (a read waiting for one chunk need not wait for the rest of the
        run)."""
        states = self._states
        ended: list[tuple[int, ChunkOutcome]] = []
        while self._reported < len(states) and (outcome := states[self._reported].outcome) is not None:
            ended.append((self._reported, outcome))
            self._reported += 1
        if ended and self._on_ended is not None:
            self._on_ended(ended)

    def outcomes(self) -> list[ChunkOutcome]:
        """One per chunk of the run, in order (after `close`)."""
        return [st.outcome or ChunkOutcome(error=FormatError(f"chunk {st.key}: not decoded")) for st in self._states]
