"""The mount process: one per image, one FUSE mount (`python -m snapshotter.fusefs STATE_FILE`).

The daemon writes a state file (JSON) and starts this process. It loads the persisted layer
indexes (no registry round trip), merges them (`tree.build_tree`), opens one reader per layer,
mounts, writes the ready file, and serves until SIGTERM/SIGINT (then unmounts) or until the
filesystem is unmounted from outside. SIGUSR1 writes the first-read record.

The state file's format is in fusefs/state.py.
Ready file (JSON, written atomically): {"pid", "mountpoint", "inodes", "file_bytes", "prefetch"},
written when every layer's landmark prefetch is in flight (with [prefetch] wait: has ended) or
prefetch_timeout has passed, whichever is first ("prefetch": "in_flight", "done" or "timeout";
fusefs/prefetch.py); the mount serves reads before that.
Record file (JSON, written atomically on SIGUSR1 and at exit): {"files": [{"path", "layer",
"name"}, ...]} in first-read order (`ops.ReadRecorder`).
Exit status: 0 after a clean stop or an external unmount; 2 for a bad state file or index;
1 when mounting fails.

`--spare` instead of STATE_FILE: start up (imports), then wait for {"state": PATH, "log": PATH} on
stdin, parsing the layer metadata the daemon hands it meanwhile (fusefs/spare.py), and serve
that state file (with the registry authentication the assignment carries, if any); exit 0 at
end of stdin (`await_assignment`, remote/mounts.py).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import gc
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import pyfuse3
import trio

from snapshotter.cache import ChunkCache
from snapshotter.errors import ConfigError, FetchError, FormatError, SnapshotterError
from snapshotter.formats.codec import decompress_chunk
from snapshotter.formats.digest import check_digest
from snapshotter.formats.index import Chunk, Entry, EntryType, LayerIndex
from snapshotter.fusefs.direct import DirectFiles
from snapshotter.fusefs.ops import FsConfig, LayerReader, LazyOperations, ReadRecorder
from snapshotter.fusefs.prefetch import ForegroundGate, Prefetcher, PrefetchSettings
from snapshotter.fusefs.program_prefetch import ProgramPrefetch
from snapshotter.fusefs.spare import Assignment, StartEarly, wait_for_assignment
from snapshotter.fusefs.state import (  # noqa: F401  (LayerSpec, parse_state, ... are this module's API too)
    DEFAULT_READ_AHEAD_KB,
    STATE_VERSION,
    LayerSpec,
    MountState,
    load_tree,
    parse_state,
)
from snapshotter.fusefs.state import typed_field as _get
from snapshotter.fusefs.stats import EARLY_PREFETCHES, run_stats_writer
from snapshotter.fusefs.tree import MountTree
from snapshotter.gcpause import gc_paused
from snapshotter.mountinfo import mount_device
from snapshotter.remote.store import METADATA_FILE, write_derived_index, write_derived_keys

if TYPE_CHECKING:
    from snapshotter.fusefs.early import EarlyPrefetch  # imports this module

log = logging.getLogger(__name__)

FSNAME = "lazy"
MOUNT_OPTIONS = frozenset({f"fsname={FSNAME}", "subtype=snapshotter", "allow_other", "default_permissions", "ro"})


# ---------------------------------------------------------------------------------------------
# Readers


@dataclass
class ReaderEnv:
    """What a ReaderFactory may use: the process nursery (background tasks), the exit stack
    (resources closed after unmount), `shared` for resources built once per process (an HTTP
    client, the chunk cache) by whichever factory needs them first, and `auth`: the daemon's
    registry authentication handed to a spare with its assignment ({} otherwise)."""

    nursery: trio.Nursery
    stack: AsyncExitStack
    state: MountState
    shared: dict[str, Any] = field(default_factory=dict)
    auth: Mapping[str, Any] = field(default_factory=dict)


ReaderFactory = Callable[[LayerSpec, LayerIndex, ReaderEnv], AbstractAsyncContextManager[LayerReader]]


class FileBlobReader:
    """A LayerReader over local blob files: pread the chunk's compressed range, decompress,
    check the chunk digest. Blocking work runs in a worker thread that a timeout abandons."""

    def __init__(self, paths: Sequence[str], name: str = "") -> None:
        if not paths:
            raise ConfigError(f"file reader for {name or 'layer'}: no blob paths")
        self._paths = tuple(paths)
        self._fds: dict[int, int] = {}
        self._name = name

    def _fd(self, blob: int) -> int:
        fd = self._fds.get(blob)
        if fd is None:
            if not 0 <= blob < len(self._paths):
                raise FormatError(f"{self._name}: chunk names blob {blob}, layer has {len(self._paths)}")
            fd = self._fds[blob] = os.open(self._paths[blob], os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def _chunk_bytes(self, entry: Entry, c: Chunk) -> bytes:
        if c.zeros:
            return bytes(c.size)
        raw = os.pread(self._fd(c.blob_index), c.blob_size, c.blob_offset)
        if len(raw) != c.blob_size:
            raise FetchError(f"{self._paths[c.blob_index]}: short read at {c.blob_offset}+{c.blob_size}")
        plain = decompress_chunk(c, raw)
        if c.digest is not None:
            check_digest(c.digest, plain, f"{self._name} {entry.name!r} chunk at {c.file_offset}")
        return plain

    def _read_sync(self, entry: Entry, offset: int, size: int) -> bytes:
        end = min(offset + size, entry.size)
        if entry.type is not EntryType.REG or offset >= end:
            return b""
        chunks = entry.chunks_for(offset, end - offset)
        if not chunks or chunks[0].file_offset > offset or chunks[-1].end < end:
            raise FormatError(f"{self._name} {entry.name!r}: no chunks cover [{offset}, {end})")
        data = b"".join(self._chunk_bytes(entry, c) for c in chunks)
        start = offset - chunks[0].file_offset
        return data[start:start + end - offset]

    async def read(self, entry: Entry, offset: int, size: int) -> bytes:
        return await trio.to_thread.run_sync(self._read_sync, entry, offset, size, abandon_on_cancel=True)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@asynccontextmanager
async def file_reader(spec: LayerSpec, index: LayerIndex, env: ReaderEnv) -> AsyncIterator[LayerReader]:
    """ReaderFactory for {"kind": "file", "blob_path": P} or {"kind": "file", "blob_paths": [P, ...]}."""
    what = f"layer {spec.digest or spec.index_path} reader"
    if "blob_paths" in spec.reader:
        paths = _get(spec.reader, "blob_paths", list, what)
    else:
        paths = [_get(spec.reader, "blob_path", str, what)]
    reader = FileBlobReader([str(p) for p in paths], name=spec.digest or spec.index_path)
    try:
        yield reader
    finally:
        reader.close()


READER_KINDS: dict[str, ReaderFactory] = {"file": file_reader}


# ---------------------------------------------------------------------------------------------
# Serving


def _write_atomic(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with _suppress_oserror():
            os.unlink(tmp)
        raise


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, et: object, ev: object, tb: object) -> bool:
        return isinstance(ev, OSError)


def _detach_stale_mount(mountpoint: str) -> None:
    """A mount process that died leaves "Transport endpoint is not connected"; detach it."""
    try:
        os.stat(mountpoint)
        return
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.umount2(os.fsencode(mountpoint), 2) != 0:  # MNT_DETACH
        err = ctypes.get_errno()
        raise OSError(err, f"cannot detach stale mount: {os.strerror(err)}", mountpoint)
    log.warning("detached a stale mount at %s", mountpoint)


def set_read_ahead(mountpoint: str, kib: int) -> None:
    """Set the kernel's read-ahead window of our mount (its BDI) to `kib` KiB; 0 leaves it.

    The kernel gives a FUSE mount 128 KiB, so a sequential reader costs us one request per
    128 KiB; with 1 MiB it is one per MiB (the largest FUSE read), and reading a cached file
    runs about 1.5x faster. Best effort: without /sys (or root) the default stays."""
    if kib <= 0:
        return
    try:
        device = mount_device(mountpoint)  # not a stat: this process may not be serving yet
        if device is None:
            raise OSError(f"{mountpoint} is not in /proc/self/mountinfo")
        Path(f"/sys/class/bdi/{device}/read_ahead_kb").write_text(f"{kib}\n")
    except OSError as exc:
        log.warning("event=read_ahead_unchanged mountpoint=%s error=%s", mountpoint, exc)


def write_record(state: MountState, recorder: ReadRecorder) -> None:
    if state.record_file:
        _write_atomic(state.record_file, recorder.dump())
        log.info("wrote first-read record of %d files to %s", len(recorder.paths), state.record_file)


async def _watch_signals(state: MountState, recorder: ReadRecorder, stop: trio.CancelScope,
                         programs: ProgramPrefetch, nursery: trio.Nursery) -> None:
    """SIGUSR1: write the first-read record; SIGUSR2: fetch the programs asked for (those asked
    before this runs too); SIGTERM, SIGINT: unmount."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2) as signals:
        nursery.start_soon(programs.run_pending)
        async for signum in signals:
            if signum == signal.SIGUSR2:
                nursery.start_soon(programs.run_pending)
            elif signum == signal.SIGUSR1:
                try:
                    write_record(state, recorder)
                except OSError as exc:
                    log.error("cannot write record file: %s", exc)
            else:
                log.info("signal %d: unmounting %s", signum, state.mountpoint)
                stop.cancel()
                return


async def _prefetch_after(prefetcher: Prefetcher, early: Sequence[EarlyPrefetch], env: ReaderEnv) -> None:
    """prefetcher.run(), once the spare's early prefetches of the mount's layers (fusefs/early.py)
    have ended, or after prefetch_timeout; what they fetched counts as the mount's prefetch, and
    what they received from the registry as the mount's (its stats file's "registry", counted as
    it arrives: a mount that stops while one still runs reports what the registry sent it)."""
    names = {st.layer for st in prefetcher.layers}
    deadline = trio.current_time() + prefetcher.settings.prefetch_timeout

    async def note_in_flight(e: EarlyPrefetch) -> None:
        left = max(0.0, deadline - trio.current_time())
        if await trio.to_thread.run_sync(e.started.wait, left, abandon_on_cancel=True):
            prefetcher.note_in_flight(e.layer_digest)

    ours = [e for e in early if e.layer_digest in names]
    env.shared.setdefault(EARLY_PREFETCHES, []).extend(ours)
    async with trio.open_nursery() as nursery:
        for e in ours:
            nursery.start_soon(note_in_flight, e)
        for e in ours:
            left = max(0.0, deadline - trio.current_time())
            if await trio.to_thread.run_sync(e.wait, left, abandon_on_cancel=True):
                prefetcher.credit(e.layer_digest, e.fetched_bytes, e.requests)
    await prefetcher.run()


def _early_starter(reader_kinds: Mapping[str, ReaderFactory]) -> StartEarly:
    """The spare's StartEarly: an EarlyPrefetch of the layer with these reader kinds, started;
    None for a malformed "early" object."""
    def start(index: LayerIndex, doc: object) -> EarlyPrefetch | None:
        from snapshotter.fusefs.early import EarlyContext, EarlyPrefetch

        context = EarlyContext.from_doc(doc)
        if context is None:
            log.info("event=early_prefetch_not_started reason=bad_early_object")
            return None
        early = EarlyPrefetch(index, context, reader_kinds)
        early.start()
        return early
    return start


async def _read_ahead_after_init(state: MountState) -> None:
    """Set the mount's read-ahead window once the kernel has set its own: it does when it gets
    our INIT reply (sent by pyfuse3.main), which a stat answered through the mount shows."""
    with trio.move_on_after(5):
        await trio.to_thread.run_sync(os.stat, state.mountpoint, abandon_on_cancel=True)
    set_read_ahead(state.mountpoint, state.read_ahead_kb)


async def _ready_after_prefetch(state: MountState, tree: MountTree, prefetcher: Prefetcher) -> None:
    """Write the ready file once the prefetch of every layer with a prefetch list is in flight
    (with [prefetch] wait: has ended) or prefetch_timeout passed, whichever is first (the mount
    serves reads meanwhile; prefetch, start-up files included, goes on after). Not after the
    read-ahead is set: the mount exists (the kernel holds requests until our INIT reply), and
    that wait for a round trip through the mount cost a container's start 15 ms at +50 ms per
    registry round trip, with the early prefetch's responses being stored meanwhile; a read in
    that window gets the kernel's window."""
    settings = prefetcher.settings
    timeout = settings.prefetch_timeout
    began = trio.current_time()
    awaited = prefetcher.listed_prefetched if settings.wait else prefetcher.listed_in_flight
    with trio.move_on_after(timeout):
        await awaited.wait()
    summary = prefetcher.summary()
    # "done": fetched; "in_flight": being fetched (reads wait for it); "timeout": neither in time.
    status = "done" if summary["listed_prefetch_done"] else "in_flight" if awaited.is_set() else "timeout"
    log.info("event=ready prefetch=%s wait=%s waited=%.3f timeout=%.1f prefetch_bytes=%d prefetch_requests=%d",
             status, "done" if settings.wait else "in_flight", trio.current_time() - began, timeout,
             summary["prefetch_bytes"], summary["prefetch_requests"])
    if state.ready_file:
        _write_atomic(state.ready_file, json.dumps({
            "pid": os.getpid(), "mountpoint": state.mountpoint, "inodes": len(tree),
            "file_bytes": tree.file_bytes, "prefetch": status,
        }).encode())


async def serve(state: MountState, tree: MountTree, reader_kinds: Mapping[str, ReaderFactory],
                auth: Mapping[str, Any] | None = None, early: Sequence[EarlyPrefetch] = ()) -> int:
    """Mount `tree` at state.mountpoint and serve it until stopped; returns the exit status.
    auth: the daemon's registry authentication, for the readers (`ReaderEnv.auth`). early: the
    spare's early prefetches (fusefs/early.py): the mount's prefetch starts once those of its
    layers have ended."""
    layer_specs = [spec for run in state.runs for spec in run]
    for spec in layer_specs:
        if spec.reader["kind"] not in reader_kinds:
            raise ConfigError(f"layer {spec.digest or spec.index_path}: unknown reader kind {spec.reader['kind']!r}")
    recorder = ReadRecorder(tree)
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)  # runs before the nursery waits for its tasks
        env = ReaderEnv(nursery=nursery, stack=stack, state=state, auth=auth or {})
        readers: list[LayerReader] = []
        for spec, index in zip(layer_specs, tree.layers, strict=True):
            factory = reader_kinds[spec.reader["kind"]]
            readers.append(await stack.enter_async_context(factory(spec, index, env)))
        prefetcher = Prefetcher(tree, readers, [spec.digest for spec in layer_specs],
                                PrefetchSettings.from_doc(state.doc))
        env.shared.setdefault("stats_hooks", []).append(prefetcher.stats_hook)
        direct = direct_files(state, tree, readers, env)
        if direct is not None:
            env.shared["stats_hooks"].append(direct.stats)
        # The filesystem reads through tracked readers, and reports each request: the container's
        # reads and requests pause the background fetch.
        ops = LazyOperations(tree, prefetcher.tracked(readers), FsConfig(fetch_timeout=state.fetch_timeout,
                                                                         cache_timeout=state.cache_timeout), recorder,
                             on_request=prefetcher.gate.note_request,
                             on_file_end=direct.note_end if direct is not None else None)
        nursery.start_soon(run_stats_writer, state, ops, readers, env)  # state["stats_file"], if named
        _detach_stale_mount(state.mountpoint)
        try:
            pyfuse3.init(ops, state.mountpoint, set(MOUNT_OPTIONS))
        except RuntimeError as exc:
            log.error("cannot mount %s: %s", state.mountpoint, exc)
            return 1
        unmounted_outside = False
        meta_writer = MetaWriter(state, tree)
        try:
            log.info("serving %d inodes from %d layers at %s", len(tree), len(tree.layers), state.mountpoint)
            async with trio.open_nursery() as inner:
                programs = ProgramPrefetch(_get(state.doc, "programs_dir", (str, type(None)), "state", None),
                                           tree, readers)
                inner.start_soon(_watch_signals, state, recorder, inner.cancel_scope, programs, inner)
                inner.start_soon(_prefetch_after, prefetcher, early, env)
                inner.start_soon(_read_ahead_after_init, state)
                inner.start_soon(_ready_after_prefetch, state, tree, prefetcher)
                inner.start_soon(meta_writer.when_quiet, prefetcher.gate)
                if direct is not None:
                    inner.start_soon(direct.run)
                await pyfuse3.main(max_tasks=state.max_tasks)
                # main() returns by itself only when the kernel ended the session.
                unmounted_outside = True
                log.info("%s was unmounted", state.mountpoint)
                inner.cancel_scope.cancel()
        finally:
            pyfuse3.close(unmount=not unmounted_outside)
            meta_writer.start()  # a mount that stops before it was ever quiet leaves its image too
            if state.ready_file:
                with _suppress_oserror():
                    os.unlink(state.ready_file)
            with _suppress_oserror():
                write_record(state, recorder)
    return 0


def direct_files(state: MountState, tree: MountTree, readers: Sequence[LayerReader],
                 env: ReaderEnv) -> DirectFiles | None:
    """The mount's direct directory (fusefs/direct.py), when the state names one ("direct_dir",
    with "direct_min_bytes") and the readers share a chunk cache; else None."""
    directory = state.doc.get("direct_dir")
    if directory is None:
        return None
    what = f"state file of {state.mountpoint}"
    if not isinstance(directory, str) or not directory:
        raise ConfigError(f"{what}: direct_dir must be a directory path")
    min_bytes = _get(state.doc, "direct_min_bytes", int, what)
    if min_bytes <= 0:
        raise ConfigError(f"{what}: direct_min_bytes must be positive")
    cache = env.shared.get("chunk_cache")
    if not isinstance(cache, ChunkCache):
        log.info("event=direct_off reason=no_chunk_cache")
        return None
    return DirectFiles(tree, readers, cache, Path(directory), min_bytes)


META_QUIET = 1.0  # seconds without a filesystem request before the metadata image is written


class MetaWriter:
    """Writes what the mount keeps of its tree for later once, from a forked child, when the
    mount has been quiet for META_QUIET seconds, or when it stops if it never was: never while a
    container is starting on it. That is the index of each layer the daemon stored as metadata
    bytes only (remote/store.py `write_derived_index`: later mounts then load it instead of
    parsing the bytes; its cache keys, which the daemon's collection reads, are written before the
    fork, by this process: `write_derived_keys`), then the metadata image (state "meta_image": its
    path; metamount.fork_writer), which the daemon mounts next to this mount when it appears
    (remote/metaimages.py)."""

    def __init__(self, state: MountState, tree: MountTree) -> None:
        path = state.doc.get("meta_image")
        self.path = Path(path) if isinstance(path, str) and path else None
        self.state, self.tree = state, tree
        self.started = False

    def derived_indexes(self) -> list[tuple[Path, LayerIndex, str, str]]:
        """(index file, index, layer digest, parse key) of each layer whose index file is
        missing while its stored metadata is there."""
        specs = [spec for run in self.state.runs for spec in run]
        return [(Path(spec.index_path), index, spec.digest, spec.parse_key)
                for spec, index in zip(specs, self.tree.layers, strict=True)
                if spec.digest and spec.parse_key and spec.index_path and not os.path.exists(spec.index_path)
                and os.path.exists(Path(spec.index_path).with_name(METADATA_FILE))]

    def start(self) -> int | None:
        """Fork the writer unless it was started before; its pid (None: nothing to write)."""
        if self.started:
            return None
        self.started = True
        from snapshotter.fusefs.metamount import fork_writer

        derived = self.derived_indexes()
        for index_file, index, digest, key in derived:  # the keys here, before this process can exit
            with suppress(OSError, SnapshotterError):
                write_derived_keys(index_file, index, digest, key)

        def write_indexes() -> None:  # in the child: no logging (another thread may hold its lock)
            for index_file, index, digest, key in derived:
                with suppress(OSError, SnapshotterError):
                    write_derived_index(index_file, index, digest, key)

        try:
            pid = fork_writer(self.tree, self.state, self.path, write_indexes if derived else None)
        except OSError as exc:
            log.warning("event=meta_failed image=%s error=%s", self.path, exc)
            return None
        if pid is not None:
            log.info("event=meta_writing image=%s indexes=%d pid=%d", self.path or "-", len(derived), pid)
        return pid

    async def when_quiet(self, gate: ForegroundGate, quiet: float = META_QUIET) -> None:
        began = trio.current_time()
        while self.active(gate, quiet, began):
            await trio.sleep(0.1)
        pid = self.start()
        if pid is not None:  # reap it (the process may also exit first: the child is then init's)
            await trio.to_thread.run_sync(os.waitpid, pid, 0, abandon_on_cancel=True)

    @staticmethod
    def active(gate: ForegroundGate, quiet: float, began: float) -> bool:
        return gate.active > 0 or trio.current_time() - max(gate.last_end, began) < quiet


def _replier(fd: int | None) -> Callable[[dict[str, object]], None]:
    """Answers to the daemon's preloads, one JSON line each on `fd` (its reply pipe), never
    blocking long: a line is far shorter than PIPE_BUF, so it is written whole."""
    def reply(answer: dict[str, object]) -> None:
        if fd is None:
            log.warning("event=preload_reply_dropped id=%s reason=no --reply-fd", answer.get("id"))
            return
        try:
            os.write(fd, json.dumps(answer).encode() + b"\n")
        except OSError as exc:  # the daemon is gone: it parses nothing more either
            log.warning("event=preload_reply_failed id=%s error=%s", answer.get("id"), exc)
    return reply


def await_assignment(stdin: BinaryIO, reply_fd: int | None = None,
                     start_early: StartEarly | None = None) -> Assignment | None:
    """The spare's wait (fusefs/spare.py: preloads, then one line {"state": PATH, "log": PATH} on
    `stdin`), or None at end of input. Takes the assignment: stdout/stderr go to the log file,
    stdin to /dev/null, and the working directory becomes the state file's directory (how the
    daemon recognises this process later). reply_fd: the daemon's reply pipe (remote/spare_replies.py),
    closed here once the wait ends, so no answer is awaited from this process afterwards.
    start_early: how the spare starts an early prefetch (fusefs/spare.py StartEarly), if it may."""
    try:
        found = wait_for_assignment(stdin, reply=_replier(reply_fd), start_early=start_early)
    finally:
        if reply_fd is not None:
            os.close(reply_fd)
    if found is None:
        return None
    if found.log:
        fd = os.open(found.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(os.path.dirname(os.path.abspath(found.state)))
    return found


def main(argv: Sequence[str] | None = None, *, reader_kinds: Mapping[str, ReaderFactory] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snapshotter.fusefs", description=__doc__.split("\n")[0])
    parser.add_argument("state_file", nargs="?", help="JSON state file written by the daemon")
    parser.add_argument("--spare", action="store_true",
                        help="start up, then wait for the state file's path on stdin (see remote/mounts.py)")
    parser.add_argument("--reply-fd", type=int, help="with --spare: the pipe on which preloads that ask for their "
                        "index are answered (remote/spare_replies.py)")
    parser.add_argument("--log-level", default=os.environ.get("SNAPSHOTTER_FUSE_LOG", "INFO"))
    parser.add_argument("--log-format", choices=["text", "json"], default="text",
                        help="text (key=value) or json, as the daemon's log_format")
    args = parser.parse_args(argv)
    from snapshotter.memory import MOUNT_PROCESS, tune_malloc

    tune_malloc(MOUNT_PROCESS)  # before trio starts worker threads
    # A program request (SIGUSR2) that comes before the mount watches for it must not end the
    # process (the default action): the request waits in its directory until then.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if (args.state_file is None) != args.spare:
        parser.error("give a state file, or --spare (not both)")
    from snapshotter.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    from snapshotter.fusefs.registry_reader import registry_reader  # the IO stack only the real mounts need

    kinds = {**READER_KINDS, "registry": registry_reader, **(reader_kinds or {})}
    state_file = args.state_file
    auth: dict[str, Any] = {}
    preloaded: dict[str, LayerIndex] = {}
    prebuilt: tuple[tuple[str, ...], MountTree] | None = None
    found: Assignment | None = None
    if args.spare:
        from snapshotter.fetch.client import warm_up

        warm_up()  # what the first request of any mount would otherwise pay
        # Start-up done: from here the spare only waits (and parses preloads). A benchmark or a
        # test that wants an idle daemon waits for this line in ROOT/mounts/spare.log.
        log.info("event=spare_waiting pid=%d", os.getpid())
        try:
            if args.reply_fd is not None:
                os.set_inheritable(args.reply_fd, False)  # not into the metadata image writer
            found = await_assignment(sys.stdin.buffer, args.reply_fd, _early_starter(kinds))
        except (OSError, ConfigError) as exc:
            log.error("%s", exc)
            return 2
        if found is None:
            return 0  # the daemon stopped before it needed this process
        state_file, preloaded, auth = found.state, found.preloaded, found.auth
        if found.prebuilt is not None:
            prebuilt = (found.prebuilt.keys, found.prebuilt.tree)
    early = found.early if found is not None else []  # layers prefetched before the assignment
    try:
        state = parse_state(Path(state_file).read_bytes(), state_file)
        with gc_paused():
            tree = load_tree(state, preloaded, prebuilt)
            del preloaded, prebuilt
            if found is not None:
                found.preloaded, found.prebuilt = {}, None  # only what the tree uses stays
            # The tree lives as long as the process: later collections need not scan it. Frozen
            # before the collector is back on, or its first pass scans the whole tree (9 ms for
            # 11,000 files, on the container's start path).
            gc.freeze()
    except (OSError, SnapshotterError) as exc:
        log.error("%s", exc)
        return 2
    try:
        return trio.run(serve, state, tree, kinds, auth, early)
    except (OSError, SnapshotterError) as exc:
        log.error("mount process failed: %s", exc)
        return 1
    except BaseExceptionGroup as group:  # from a reader factory inside the nursery
        ours, rest = group.split((OSError, SnapshotterError))
        if rest is not None or ours is None:
            raise
        log.error("mount process failed: %s", "; ".join(str(e) for e in ours.exceptions))
        return 1
