"""The spare mount process's wait for its mount, parsing the layer metadata it is handed meanwhile.

The daemon writes lines to the spare's stdin (remote/mounts.py):
    {"preload": MetadataParse doc, "data": PATH,   parse the metadata bytes in PATH (then removed);
     "layers": [DIGEST, ...]}                      for an image's lowest layer: the image's layers,
                                                   lowest first (else empty)
    {"state": STATE_FILE, "log": LOG_FILE,         the assignment: the last line ("auth": the
     "auth": HANDOFF}                              daemon's registry authentication, optional)
End of input without an assignment: the daemon stopped; nothing to serve.

A reader thread takes the lines as they come, and the main thread parses each preload in turn, so
the parse runs while the daemon parses the same bytes for containerd's Prepare (one core each).
Once the assignment has arrived, preloads not yet parsed are skipped: loading the persisted index
is quicker than parsing it. Indexes parsed are kept by parse key (`MetadataParse.key`) and handed
to the mount with the assignment; the state file names each layer's key, so a layer uses a
preloaded index only when it is the one the daemon persisted (fusefs/state.py load_tree).
Once every layer of the image being pulled (the list its lowest layer came with) has been parsed,
its tree as one run of remote layers (the usual mount: every layer lazy) is built too; a mount whose state asks
for exactly that tree, by parse keys and options, starts from it (`Prebuilt`).
A preload may carry an "early" object (fusefs/early.py): right after parsing that layer, the
spare starts its prefetch (`start_early`: its prefetch list and the start-up files it holds), and
the mount it is assigned waits for the early prefetches of its layers before its own.
A preload that fails (damaged file, bad metadata) is logged and dropped: the daemon's own parse
decides what the layer is. Kept at most PRELOAD_TTL seconds and MAX_PRELOADS indexes.
A preload with an "id" asks for an answer: once parsed, `reply` is called with {"id", "ok": true,
"toc_digest"}, so the daemon persists the bytes (remote/store.py `save_metadata`) instead of
parsing them again; a preload skipped or failed is answered {"id", "ok": false, "why"}
(remote/spare_replies.py). The answer goes first, before the early prefetch starts and before
anything else: containerd's Prepare waits for it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from snapshotter.errors import ConfigError, SnapshotterError
from snapshotter.formats.index import LayerIndex
from snapshotter.formats.metadata_parse import MetadataParse, parse_metadata
from snapshotter.fusefs.tree import MountTree, build_tree
from snapshotter.gcpause import gc_paused

log = logging.getLogger(__name__)

PRELOAD_TTL = 300.0  # seconds a preloaded index waits for its mount (a pull whose image never runs)
MAX_PRELOADS = 64
EARLY_SENT_WAIT = 0.03  # seconds the tree waits at most for a just-started early prefetch's requests to go out
_EXPIRY_CHECK = 30.0  # seconds between expiry checks while no line comes


@dataclass(frozen=True)
class Prebuilt:
    """A tree built ahead: one run of the layers whose indexes have these parse keys (lowest
    first), built with the default options and run 0 bare (build_tree's arguments for it)."""

    keys: tuple[str, ...]
    tree: MountTree


@dataclass
class Assignment:
    """The mount the spare was handed: its state file, its log file (or None), the daemon's
    registry authentication (fetch/auth.py `handoff`; {} when none came), the indexes it parsed
    while waiting, by parse key, and the tree it built from them, if any."""

    state: str
    log: str | None
    auth: dict[str, Any] = field(default_factory=dict)
    preloaded: dict[str, LayerIndex] = field(default_factory=dict)
    prebuilt: Prebuilt | None = None
    early: list[Any] = field(default_factory=list)  # what `start_early` returned, oldest first


class _Preloads:
    """What the spare parsed: indexes by key (with when), each layer's latest key, the layer
    list of the image being pulled, and the tree built for it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.indexes: dict[str, tuple[float, LayerIndex]] = {}
        self.key_of_layer: dict[str, str] = {}
        self.chain: tuple[str, ...] = ()
        self.prebuilt: Prebuilt | None = None
        self.early: list[Any] = []

    def expire(self) -> None:
        now = self.clock()
        for key in [k for k, (at, _) in self.indexes.items() if now - at > PRELOAD_TTL]:
            del self.indexes[key]
        if self.prebuilt is not None and not all(k in self.indexes for k in self.prebuilt.keys):
            self.prebuilt = None

    def add(self, layer: str, key: str, index: LayerIndex, layers: tuple[str, ...]) -> None:
        while len(self.indexes) >= MAX_PRELOADS:
            del self.indexes[min(self.indexes, key=lambda k: self.indexes[k][0])]
        self.indexes[key] = (self.clock(), index)
        self.key_of_layer[layer] = key
        # Only an image's lowest layer comes with a list, the whole image's, its own layer first:
        # the image being pulled now (a later pull's list replaces an earlier one).
        if layers and layers[0] == layer:
            self.chain = layers
        self._build_ahead()

    def _build_ahead(self) -> None:
        keys = tuple(self.key_of_layer.get(d, "") for d in self.chain)
        if not keys or not all(k in self.indexes for k in keys) or \
                (self.prebuilt is not None and self.prebuilt.keys == keys):
            return
        self._let_early_requests_out()
        began = self.clock()
        tree = build_tree([[self.indexes[k][1] for k in keys]], bare_runs=(0,))
        self.prebuilt = Prebuilt(keys, tree)
        log.info("event=tree_built_ahead layers=%d inodes=%d seconds=%.3f", len(keys), len(tree),
                 self.clock() - began)

    def _let_early_requests_out(self) -> None:
        """Building a tree holds the GIL for tens of ms: first wait (at most EARLY_SENT_WAIT in
        all) until the early prefetches have their requests out (fusefs/early.py `sent`), so the
        start-up files arrive a round trip after the parse rather than a round trip after the tree."""
        deadline = time.monotonic() + EARLY_SENT_WAIT
        for early in self.early:
            wait_sent = getattr(early, "wait_sent", None)
            if wait_sent is not None:
                wait_sent(max(0.0, deadline - time.monotonic()))

    def assignment(self, found: Assignment) -> Assignment:
        found.preloaded = {k: index for k, (_, index) in self.indexes.items()}
        found.prebuilt = self.prebuilt
        found.early = list(self.early)
        return found


_EOF = object()


def _decode(line: bytes) -> object:
    """The line's JSON value, or None when it is not JSON."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def _is_preload(doc: object) -> bool:
    return isinstance(doc, dict) and "preload" in doc


def _read_lines(stdin: BinaryIO, lines: queue.Queue[object], assigned: threading.Event) -> None:
    """Queue each line as (its JSON value, line) until the assignment (or garbage, which ends the
    wait too), then stop reading; _EOF at the end of input, the exception if reading fails."""
    try:
        for line in iter(stdin.readline, b""):
            if not line.strip():
                break
            doc = _decode(line)
            lines.put((doc, line))
            if not _is_preload(doc):
                assigned.set()
                return
    except Exception as exc:  # reported by the main thread
        lines.put(exc)
        return
    lines.put(_EOF)


def _assignment(doc: object, line: bytes) -> Assignment:
    try:
        assert isinstance(doc, dict), "not a JSON object"
        auth = doc.get("auth")
        return Assignment(str(doc["state"]), str(doc["log"]) if doc.get("log") else None,
                          auth if isinstance(auth, dict) else {})
    except (AssertionError, KeyError, TypeError) as exc:
        shown = line.split(b'"auth"')[0][:200]  # the hand-off holds tokens: never in a message
        raise ConfigError(f"spare mount process: bad assignment {shown!r}: {exc}") from None


def _take_data(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


Reply = Callable[[dict[str, object]], None]
# Called with a layer's index, just parsed, and its preload's "early" object: starts that layer's
# early prefetch (fusefs/early.py) and returns it, or returns None (nothing to prefetch, bad object).
StartEarly = Callable[[LayerIndex, object], Any]


def _no_reply(answer: dict[str, object]) -> None:
    log.warning("event=preload_reply_dropped id=%s reason=no reply channel", answer.get("id"))


def wait_for_assignment(stdin: BinaryIO, *, parse: Callable[[MetadataParse, bytes], LayerIndex] = parse_metadata,
                        clock: Callable[[], float] = time.monotonic, reply: Reply = _no_reply,
                        start_early: StartEarly | None = None) -> Assignment | None:
    """Read `stdin` until the assignment (returned, with the preloaded indexes) or its end (None).
    A bad assignment line is a ConfigError; a bad preload is logged and dropped. reply: how a
    preload that asked for its index is answered (the daemon's reply pipe). start_early: see
    StartEarly (None: no early prefetch)."""
    lines: queue.Queue[object] = queue.Queue()
    assigned = threading.Event()
    threading.Thread(target=_read_lines, args=(stdin, lines, assigned), name="spare-stdin", daemon=True).start()
    preloads = _Preloads(clock)
    while True:
        try:
            item = lines.get(timeout=_EXPIRY_CHECK)
        except queue.Empty:
            item = None
        preloads.expire()
        if item is None:
            continue
        if item is _EOF:
            return None
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, tuple)
        doc, line = item
        if not _is_preload(doc):
            return preloads.assignment(_assignment(doc, line))
        assert isinstance(doc, dict)
        _preload(doc, line, preloads, skip=assigned.is_set(), parse=parse, reply=reply, start_early=start_early)


def _preload(doc: dict[str, Any], line: bytes, preloads: _Preloads, *, skip: bool,
             parse: Callable[[MetadataParse, bytes], LayerIndex], reply: Reply,
             start_early: StartEarly | None = None) -> None:
    answer_id = doc.get("id")
    wants_answer = type(answer_id) is int

    def decline(why: str) -> None:
        if wants_answer:
            reply({"id": answer_id, "ok": False, "why": why})

    try:
        path = str(doc["data"])
        p = MetadataParse.from_doc(doc["preload"])
        layers = tuple(str(d) for d in doc.get("layers", ()))
    except (ValueError, KeyError, TypeError, SnapshotterError) as exc:
        log.warning("event=preload_bad line=%r error=%s", line[:200], exc)
        decline(f"bad preload: {exc}")
        return
    began = preloads.clock()
    try:
        data = _take_data(path)
        if skip:  # the mount is waiting: its persisted indexes load faster than this parses
            log.info("event=preload_skipped layer=%s reason=assigned", p.layer_digest)
            decline("skipped: handed a mount")
            return
        key = p.key(data)
        parse_began = time.perf_counter()
        with gc_paused():
            index = parse(p, data)
        parse_seconds = time.perf_counter() - parse_began
    except (OSError, SnapshotterError) as exc:
        log.info("event=preload_failed layer=%s error=%r", p.layer_digest, str(exc))
        decline(f"parse failed: {exc}")
        return
    del data
    if wants_answer:
        reply({"id": answer_id, "ok": True, "toc_digest": index.toc_digest})
    if start_early is not None and doc.get("early") is not None:
        # After the answer: the daemon's Prepare waits for that, and the two would share the GIL.
        try:
            started = start_early(index, doc["early"])
        except Exception as exc:  # only ever an optimization
            log.warning("event=early_prefetch_not_started layer=%s error=%r", p.layer_digest, str(exc))
        else:
            if started is not None:
                preloads.early = [*preloads.early[-(MAX_PRELOADS - 1):], started]
    log.info("event=preloaded layer=%s entries=%d seconds=%.3f parse_seconds=%.3f answered=%s", p.layer_digest,
             len(index.entries), preloads.clock() - began, parse_seconds, "yes" if wants_answer else "no")
    with gc_paused():  # the tree is object building without cycles, as in the mount (process.py)
        preloads.add(p.layer_digest, key, index, layers)
    # What was parsed lives until the mount (or PRELOAD_TTL): later collections need not scan it.
    gc.freeze()
