"""Resolving an image's later layers while containerd prepares an earlier one.

containerd's unpacker prepares an image's layers one after another, each Prepare waiting for the
one before, so lazily resolving N layers costs N times (round trips + TOC parse). The labels of a
layer's Prepare name it and every layer above it (`cri.image-layers`, or stargz's `layers`): once
the first Prepare arrives, the others can be resolved at the same time, and their own Prepares
find the index ready (stargz-snapshotter pre-resolves the same way).

A layer resolved ahead is resolved without its own labels: no expected TOC digest (its Prepare
checks the stored digest against its label, and resolves again on a mismatch) and no tail-size
hint (the first request asks for the usual suffix; the Prepare's hint is its own layer's tail).
Nydus markers are guessed: above a Nydus blob layer, the image's last layer is its bootstrap and
the others are blobs (the layout nydusify and `snapshotter convert` write); the layer's own
Prepare uses what was resolved ahead only when its markers say the same. A failure ahead is only
logged: the layer's own Prepare resolves it (or falls back) as if nothing happened.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from snapshotter.remote.labels import LayerRef

log = logging.getLogger(__name__)

MAX_AHEAD = 32  # layers resolved ahead per Prepare; longer lists are rare and cut off here
# containerd's limit on a label (key + value, labels.Validate). The clients that write the layers
# label stop adding digests when the next would pass it, so a long list may lack the image's top.
LABEL_MAX = 4096
_LAYERS_KEY_MAX = 43  # len("containerd.io/snapshot/remote/stargz.layers"), the longer of the two keys
_DIGEST_ITEM = 72  # ",sha256:" + 64 hex digits


def may_be_cut(layers: tuple[str, ...]) -> bool:
    """Whether a layers label listing `layers` may have been cut short by the label size limit
    (then its last digest need not be the image's top layer)."""
    value = _DIGEST_ITEM * len(layers) - 1
    return _LAYERS_KEY_MAX + value + _DIGEST_ITEM > LABEL_MAX


class ResolveAhead:
    """Thread-safe. `resolve(ref)` is the backend's own resolve-and-store of one layer."""

    def __init__(self, resolve: Callable[[LayerRef], object], is_known: Callable[[str], bool], *,
                 workers: int = 2) -> None:
        self._resolve = resolve
        self._is_known = is_known
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="resolve-ahead")
        self._lock = threading.RLock()  # a done callback may run at once, in start(), under it
        self._running: dict[str, Future[None]] = {}
        self._closed = False

    def start(self, ref: LayerRef) -> list[str]:
        """Resolve in the background the layers `ref.image_layers` lists above `ref`'s own that are
        neither stored nor being resolved; returns their digests."""
        if ref.nydus_bootstrap:
            return []  # a Nydus image's top layer: nothing above it
        layers = ref.image_layers
        later = [d for d in layers if d != ref.layer_digest]
        # Above a Nydus blob, the list's last layer is the bootstrap: when the list is whole, it
        # goes first (it is the one that takes time: fetched whole and parsed).
        bootstrap = later[-1] if ref.nydus_blob and later and not may_be_cut(layers) else None
        if bootstrap is not None:
            later = [bootstrap, *later[:-1]]
        started: list[str] = []
        with self._lock:
            if self._closed:
                return []
            for digest in later[:MAX_AHEAD]:
                if digest in self._running or self._is_known(digest):
                    continue
                ahead = dataclasses.replace(ref, layer_digest=digest, image_layers=layers[layers.index(digest):],
                                            toc_digest=None, tail_size=None)
                if ref.nydus_blob:
                    is_boot = digest == bootstrap
                    ahead = dataclasses.replace(ahead, nydus_blob=not is_boot, nydus_bootstrap=is_boot)
                future = self._pool.submit(self._one, ahead)
                self._running[digest] = future
                future.add_done_callback(self._forget)
                started.append(digest)
        return started

    def wait(self, layer_digest: str, timeout: float) -> None:
        """If `layer_digest` is being resolved ahead, wait for that to end (at most `timeout` s)."""
        with self._lock:
            future = self._running.get(layer_digest)
        if future is None:
            return
        try:
            future.result(timeout)
        except FutureTimeout:
            log.info("event=resolve_ahead_slow layer=%s waited=%.1f", layer_digest, timeout)

    def close(self) -> None:
        """Drop what has not started; wait for what has (each is bounded by resolve_timeout)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _one(self, ref: LayerRef) -> None:
        if self._is_known(ref.layer_digest):
            return
        try:
            self._resolve(ref)
        except Exception as exc:  # its own Prepare resolves it again, or falls back
            log.info("event=resolve_ahead_failed image=%s layer=%s error=%r", ref.image_ref, ref.layer_digest,
                     str(exc))

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            for digest, running in list(self._running.items()):
                if running is future:
                    del self._running[digest]
