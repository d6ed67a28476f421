"""Remote snapshots on top of the ordinary snapshotter: what containerd talks to.

Prepare with `containerd.io/snapshot.ref` (the chain id to commit as) and a layer's remote labels:
resolve the layer within `resolve_timeout`; on success persist its index, record a committed
snapshot named after the target with the label `containerd.io/snapshot/remote=FORMAT`, and
answer ALREADY_EXISTS so containerd skips the download. On any failure fall back: log one WARN
line (image, layer, reason, seconds), count it, and prepare an ordinary snapshot so containerd
downloads and unpacks that layer. Everything else is the ordinary snapshotter.

Mounts over remote layers: the parent chain is split into contiguous runs of remote layers; one
mount process per image (keyed by the chain's top snapshot id) serves each run as its own subtree,
and the overlay lowerdir interleaves those subtrees with the local layers' dirs in exact order.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from snapshotter import metrics
from snapshotter.cache import ChunkCache
from snapshotter.config import Config
from snapshotter.errors import (
    AlreadyExists,
    DigestMismatch,
    FetchError,
    FormatError,
    InvalidArgument,
    LimitExceeded,
)
from snapshotter.fetch.auth import AuthError
from snapshotter.fetch.client import RegistryClient, counting_bytes
from snapshotter.fetch.reference import parse_reference
from snapshotter.formats.metadata_parse import MetadataParse
from snapshotter.remote.claims import LayerClaims
from snapshotter.remote.labels import (
    REMOTE_LABEL,
    TARGET_SNAPSHOT_REF,
    LayerRef,
    claimed_layer,
    layer_ref_from_labels,
)
from snapshotter.remote.resolve_ahead import ResolveAhead, may_be_cut
from snapshotter.remote.resolve_loop import ResolveLoop
from snapshotter.remote.resolver import NYDUS_BLOB_FORMAT, NotLazy, ResolvedLayer, resolve_layer
from snapshotter.remote.settings import fetch_config_from
from snapshotter.remote.spare_replies import SpareWait
from snapshotter.remote.store import LayerMeta, LayerStore
from snapshotter.runtime_spec import Program
from snapshotter.snapshots.model import Info, Kind, LowerDirs, Mount, Snapshot, Usage
from snapshotter.snapshots.service import Snapshotter

MOUNT_AHEAD_IDLE = 60.0  # seconds a mount started on pull waits for a container before it is stopped
# Largest layer fetched whole when resolved ahead as a guessed Nydus bootstrap (a bootstrap of
# 11,000 files is 0.7 MB; one this big describes about ten million). Larger ones wait for their Prepare.
AHEAD_MAX_BOOTSTRAP_BYTES = 64 << 20

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteLayer:
    """A remote layer as a mount process needs it."""

    layer_digest: str
    image_ref: str
    format: str
    index_path: str
    blob_size: int
    parse_key: str | None = None  # LayerMeta.parse_key


class Mounter(Protocol):
    """Starts, finds and stops per-image mount processes (remote/mounts.py)."""

    def ensure(self, mount_id: str, runs: list[list[RemoteLayer]], *, bare_runs: tuple[int, ...] = (),
               ahead: bool = False, plain_http_hosts: Collection[str] = (),
               auth: Mapping[str, Any] | None = None) -> str: ...
    def release(self, mount_id: str) -> None: ...
    def mounted_ids(self) -> set[str]: ...
    def metadata_dir(self, mount_id: str) -> str | None: ...
    def direct_dir(self, mount_id: str) -> str | None: ...
    def prune_metadata_images(self) -> list[str]: ...
    def prefetch_program(self, mount_id: str, program: Mapping[str, Any]) -> bool: ...
    def preload(self, parse: MetadataParse, data: bytes, key: str, image_layers: tuple[str, ...] = (), *,
                want_answer: bool = False, early: Mapping[str, Any] | None = None) -> SpareWait | None: ...


def early_object(config: Config, image_ref: str, parse: MetadataParse, *, plain_http_hosts: Collection[str],
                 auth: Mapping[str, Any]) -> dict[str, Any]:
    """What the spare needs to prefetch a layer before its mount is assigned (fusefs/early.py):
    its reader spec, as a mount's state names it, and what the state and assignment carry."""
    return {"reader": {"kind": "registry", "image_ref": image_ref, "layer_digest": parse.layer_digest,
                       "blob_size": parse.blob_size},
            "config": dataclasses.asdict(config), "plain_http_hosts": sorted(plain_http_hosts), "auth": dict(auth)}


def fallback_reason(exc: BaseException) -> str:
    """A short, stable reason for logs and the fallbacks metric."""
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    if isinstance(exc, NotLazy):
        return "not_lazy"
    if isinstance(exc, DigestMismatch):
        return "toc_digest_mismatch"
    if isinstance(exc, LimitExceeded):
        return "limit_exceeded"
    if isinstance(exc, FormatError):
        return "bad_format"
    if isinstance(exc, FetchError):
        # The HTTP status, not the message text: ports and digests in the message contain "401" too.
        auth = isinstance(exc, AuthError) or getattr(exc, "status", None) in (401, 403)
        return "auth" if auth else "registry"
    if isinstance(exc, InvalidArgument):
        return "bad_labels"
    return "error"


def _meta_fits(meta: LayerMeta, ref: LayerRef) -> bool:
    """Whether a stored index answers `ref`'s Prepare: the TOC digest its label names (if any), and
    the Nydus role its markers give it (an index resolved ahead had to guess that role)."""
    if ref.toc_digest is not None and meta.toc_digest not in (None, ref.toc_digest):
        return False
    return (meta.format == "nydus") == ref.nydus_bootstrap and (meta.format == NYDUS_BLOB_FORMAT) == ref.nydus_blob


def _registry_of(image_ref: str) -> str:
    try:
        return parse_reference(image_ref).registry
    except Exception:
        return ""


class RemoteBackend:
    """SnapshotBackend with remote layers. Thread-safe like the Snapshotter under it."""

    def __init__(self, snapshotter: Snapshotter, config: Config, mounter: Mounter) -> None:
        self.sn = snapshotter
        self.config = config
        self.mounter = mounter
        self.layers = LayerStore(snapshotter.root / "layers")
        # Deciding a mount is unused and stopping it must not interleave with handing it out:
        # gRPC calls run on many threads (containerd's GC removes snapshots while others prepare).
        self._mount_lock = threading.RLock()
        # One event loop and registry client for every resolve: connections, tokens and what
        # was learned of each host carry over from layer to layer (remote/resolve_loop.py).
        self.resolve_loop = ResolveLoop(fetch_config_from(config))
        self.claims = LayerClaims()  # what GC keeps although no snapshot refers to it yet (claims.py)
        # The layers above one being prepared are resolved meanwhile (remote/resolve_ahead.py).
        self.ahead = ResolveAhead(self._resolve_ahead, lambda digest: self.layers.meta(digest) is not None)
        snapshotter.set_lowers(self.lowers)

    def close(self) -> None:
        """Stop the resolve loop (the daemon is stopping); resolves ahead end with it."""
        self.resolve_loop.close()
        self.ahead.close()

    # -- remote prepare -----------------------------------------------------------------------

    def _resolve(self, ref: LayerRef, parent: str) -> tuple[str, int, int]:
        """Resolve (or reuse) the layer's index; return (format, bytes fetched, metadata bytes
        the format needed). Raises on failure. A resolve of it ahead, if running, ends first."""
        self.ahead.wait(ref.layer_digest, self.config.resolve_timeout)
        # An image's lowest layer (no parent) lists the whole image, unless the label was cut:
        # the spare builds the image's tree ahead from that list (remote/mounts.py preload).
        return self._resolve_now(ref, whole_image=not parent and not may_be_cut(ref.image_layers))

    def _resolve_ahead(self, ref: LayerRef) -> tuple[str, int, int]:
        """Resolve a layer above the one being prepared; its bytes are logged here
        (`event=resolved_ahead`), as its own Prepare will find it stored and fetch nothing."""
        self.claims.resolved_ahead(ref.layer_digest)
        start = time.monotonic()
        # A guessed Nydus bootstrap is fetched whole: a wrong guess costs at most this cap (its first read).
        fmt, fetched, needed = self._resolve_now(ref, max_bootstrap_bytes=min(
            AHEAD_MAX_BOOTSTRAP_BYTES, self.config.limits.max_bootstrap_bytes))
        if fetched:
            log.info("event=resolved_ahead image=%s layer=%s format=%s seconds=%.3f fetched_bytes=%d metadata_bytes=%d",
                     ref.image_ref, ref.layer_digest, fmt, time.monotonic() - start, fetched, needed)
        return fmt, fetched, needed

    def _resolve_now(self, ref: LayerRef, *, max_bootstrap_bytes: int | None = None,
                     whole_image: bool = False) -> tuple[str, int, int]:
        """whole_image: ref.image_layers is the image's whole layer list, handed to the spare
        with this layer's metadata; otherwise the spare gets the metadata alone."""
        meta = self.layers.meta(ref.layer_digest)
        if meta is not None and _meta_fits(meta, ref):
            return meta.format, 0, 0
        bootstrap_cap = self.config.limits.max_bootstrap_bytes if max_bootstrap_bytes is None else max_bootstrap_bytes

        def preload(parse: MetadataParse, data: bytes, key: str, image_layers: tuple[str, ...]) -> SpareWait | None:
            # The spare parses these bytes anyway; when it says they parse, the daemon stores them
            # instead of parsing too (remote/spare_replies.py).
            early = None
            if self.config.mount_on_pull:  # the pulled image's mount prefetches on pull anyway: start it now
                early = early_object(self.config, ref.image_ref, parse,
                                     plain_http_hosts=self.resolve_loop.plain_http_hosts(),
                                     auth=self.resolve_loop.auth_handoff({ref.image_ref}))
            return self.mounter.preload(parse, data, key, image_layers if whole_image else (), want_answer=True,
                                        early=early)

        async def job(client: RegistryClient) -> tuple[ResolvedLayer, int]:
            with counting_bytes() as fetched:
                try:
                    with trio.fail_after(self.config.resolve_timeout):
                        resolved = await resolve_layer(client, ref, max_toc_bytes=self.config.limits.max_toc_bytes,
                                                       max_bootstrap_bytes=bootstrap_cap,
                                                       on_metadata=preload)
                finally:
                    metrics.RESOLVE_BYTES.labels(_registry_of(ref.image_ref)).inc(fetched[0])
            return resolved, fetched[0]

        resolved, fetched = self.resolve_loop.run(job)  # parsing ran in the loop; saving runs here
        meta = LayerMeta(ref.layer_digest, resolved.format, resolved.blob_size, ref.image_ref,
                         resolved.parsed.toc_digest, resolved.parse_key)
        if resolved.parsed.metadata is not None:  # parsed by the spare: the bytes are what is stored
            self.layers.save_metadata(meta, *resolved.parsed.metadata)
        else:
            self.layers.save(meta, resolved.index)
        return resolved.format, fetched, resolved.metadata_bytes

    def _try_remote(self, target: str, parent: str, labels: Mapping[str, str]) -> bool:
        """True when the layer is now a committed remote snapshot named `target`."""
        try:
            ref = layer_ref_from_labels(labels)
        except Exception as exc:
            self._fall_back(labels, exc, 0.0)
            return False
        if ref is None:
            return False
        with self.claims.preparing(ref.layer_digest):
            return self._try_remote_claimed(ref, target, parent, labels)

    def _fall_back(self, labels: Mapping[str, str], exc: Exception, seconds: float) -> None:
        reason = fallback_reason(exc)
        image, layer = claimed_layer(labels)
        log.warning("event=fallback image=%s layer=%s reason=%s seconds=%.3f error=%r",
                    image, layer, reason, seconds, str(exc))
        metrics.FALLBACKS.labels(reason).inc()
        metrics.LAYER_PREPARES.labels("fallback", "").inc()
        self._record_fallback(layer, image, reason, str(exc))

    def _try_remote_claimed(self, ref: LayerRef, target: str, parent: str, labels: Mapping[str, str]) -> bool:
        start = time.monotonic()
        try:
            if self.config.resolve_ahead:
                self.ahead.start(ref)
            fmt, fetched, needed = self._resolve(ref, parent)
        except Exception as exc:  # every failure of a lazy layer is a fallback, never a failed pull
            self._fall_back(labels, exc, time.monotonic() - start)
            return False
        seconds = time.monotonic() - start
        metrics.RESOLVE_SECONDS.observe(seconds)
        remote_labels = dict(labels)
        remote_labels[REMOTE_LABEL] = fmt
        try:
            top = self.sn.create_remote(target, parent, remote_labels)
        except AlreadyExists:
            top = None  # a concurrent pull of the same image got there first: containerd will find it
        if top is not None and self.config.mount_on_pull and ref.image_layers == (ref.layer_digest,):
            # The image's last layer (its layer list from here on names only itself): a container
            # of it is likely next, so its mount starts now rather than on the container's path.
            threading.Thread(target=self._mount_ahead, args=(top,), name="mount-ahead", daemon=True).start()
        self.layers.clear_fallback(ref.layer_digest)
        log.info("event=lazy_prepare image=%s layer=%s format=%s seconds=%.3f target=%s fetched_bytes=%d "
                 "metadata_bytes=%d", ref.image_ref, ref.layer_digest, fmt, seconds, target, fetched, needed)
        metrics.LAYER_PREPARES.labels("lazy", fmt).inc()
        return True

    def _record_fallback(self, layer: str, image: str, reason: str, error: str) -> None:
        """Persist the fallback for `snapshotter status` (best effort: the pull goes on regardless)."""
        if not layer:
            return
        try:
            self.layers.record_fallback(layer, {"layer": layer, "image": image, "reason": reason,
                                                "error": error, "time": time.time()})
        except (ValueError, OSError) as exc:
            log.warning("event=fallback_record_failed layer=%s error=%s", layer, exc)

    def prepare(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        target = labels.get(TARGET_SNAPSHOT_REF)
        if target and self._try_remote(target, parent, labels):
            raise AlreadyExists(f"target snapshot {target!r} is a remote snapshot now")
        return self.sn.prepare(key, parent, labels)

    # -- mounts over remote layers ------------------------------------------------------------

    def lowers(self, snap: Snapshot) -> LowerDirs:
        """Lower dirs for `snap`, nearest parent first, remote runs served by the image's mount:
        its metadata image's run dirs over the mount's direct directory and the FUSE mount as
        data-only layers once that image is mounted, else the FUSE mount's run dirs."""
        plan = self._plan(snap.parent_ids)
        if plan is None:
            return self.sn.local_lowers(snap)
        runs, placement, bare = plan
        with self._mount_lock:
            mountpoint = self.mounter.ensure(snap.parent_ids[0], runs, bare_runs=bare,
                                             plain_http_hosts=self.resolve_loop.plain_http_hosts(),
                                             auth=self._auth_handoff(runs))
            meta = self.mounter.metadata_dir(snap.parent_ids[0])
            direct = self.mounter.direct_dir(snap.parent_ids[0]) if meta else None
        top = meta or mountpoint
        bottom_up_dirs = [f"{top}/{where}" if kind == "run" else str(where) for kind, where in placement]
        # Data-only layers, first match wins: the big files the mount stored whole, then the mount.
        data = ((direct,) if direct else ()) + ((mountpoint,) if meta else ())
        return LowerDirs(tuple(reversed(bottom_up_dirs)), data)

    def _plan(self, parent_ids: Sequence[str]) -> tuple[list[list[RemoteLayer]], list[tuple[str, int | str]],
                                                         tuple[int, ...]] | None:
        """For a snapshot over `parent_ids` (nearest first): the image mount's runs of remote
        layers, the bottom-up placement of runs and local dirs, and the bare runs; None when no
        parent is remote."""
        if not parent_ids:
            return None
        infos = self.sn.infos_by_id(parent_ids)
        remote = [REMOTE_LABEL in i.labels for i in infos]
        if not any(remote):
            return None
        # Runs are numbered bottom-up: run 0 holds the lowest remote layers.
        bottom_up = list(zip(reversed(parent_ids), reversed(infos), reversed(remote), strict=True))
        runs: list[list[RemoteLayer]] = []
        placement: list[tuple[str, int | str]] = []  # ("run", n) or ("dir", path), bottom-up
        previous_remote = False
        for sid, info, is_remote in bottom_up:
            if is_remote:
                if not previous_remote:
                    runs.append([])
                    placement.append(("run", len(runs) - 1))
                runs[-1].append(self._remote_layer(info))
            else:
                placement.append(("dir", self.sn.fs_dir(sid)))
            previous_remote = is_remote
        # A run at the very bottom deletes nothing below it: it is served without overlay markers,
        # so it is also right when containerd bind-mounts it alone (a read-only view).
        bare = (0,) if placement[0][0] == "run" else ()
        return runs, placement, bare

    def _mount_ahead(self, top: Snapshot) -> None:
        """Start the mount of the image whose top layer is `top` (config `mount_on_pull`), so the
        first container finds it serving; stopped again if no container uses it within
        MOUNT_AHEAD_IDLE seconds. Best effort: on failure the container's start mounts it."""
        parent_ids = (top.id, *top.parent_ids)
        try:
            plan = self._plan(parent_ids)
            if plan is None:
                return
            runs, _placement, bare = plan
            with self._mount_lock:
                self.mounter.ensure(top.id, runs, bare_runs=bare, ahead=True,
                                    plain_http_hosts=self.resolve_loop.plain_http_hosts(),
                                    auth=self._auth_handoff(runs))
        except Exception as exc:
            log.warning("event=mount_ahead_failed mount=%s error=%r; the first container mounts it", top.id, exc)
            return
        timer = threading.Timer(MOUNT_AHEAD_IDLE, self._release_unused)
        timer.daemon = True
        timer.start()

    def _auth_handoff(self, runs: list[list[RemoteLayer]]) -> dict[str, Any]:
        """What the daemon's registry client learned of authenticating for these layers' images,
        for a newly started mount process (its first requests then need no 401 and no token fetch)."""
        return self.resolve_loop.auth_handoff({layer.image_ref for run in runs for layer in run})

    def _remote_layer(self, info: Info) -> RemoteLayer:
        ref = layer_ref_from_labels(info.labels)
        if ref is None:
            raise FormatError(f"remote snapshot {info.name!r} lost its layer labels")
        meta = self.layers.meta(ref.layer_digest)
        if meta is None:
            raise FormatError(f"remote snapshot {info.name!r}: layer {ref.layer_digest} is not resolved under "
                              f"{self.layers.root}; remove the image and pull it again")
        return RemoteLayer(ref.layer_digest, ref.image_ref, meta.format,
                           str(self.layers.index_path(ref.layer_digest)), meta.blob_size, meta.parse_key)

    def _release_unused(self) -> None:
        with self._mount_lock:
            for mount_id in self.mounter.mounted_ids():
                try:
                    users = self.sn.users_of(mount_id)
                except Exception:  # the image's snapshot is gone: nobody can use the mount
                    users = []
                if not users:
                    self.mounter.release(mount_id)

    def container_created(self, namespace: str, snapshotter: str, snapshot_key: str, program: Program) -> bool:
        """containerd created a container (remote/container_watch.py) whose snapshot is
        `snapshot_key` of `snapshotter` in `namespace`: when that snapshot is ours and stands on
        remote layers, ask the image's mount to fetch `program` (config prefetch.program). True
        when asked. containerd names a snapshot to a proxy snapshotter as NAMESPACE/N/KEY."""
        if not self.config.prefetch.program:
            return False
        wanted = re.compile(rf"{re.escape(namespace)}/\d+/{re.escape(snapshot_key)}")
        for info in self.sn.walk([]):
            if info.kind is not Kind.ACTIVE or not wanted.fullmatch(info.name):
                continue
            snap = self.sn.snapshot(info.name)
            if self._plan(snap.parent_ids) is None:
                return False  # no remote layer under it: nothing to fetch
            asked = self.mounter.prefetch_program(snap.parent_ids[0], program.to_doc())
            log.info("event=program_requested snapshotter=%s container_snapshot=%s mount=%s program=%s asked=%s",
                     snapshotter, info.name, snap.parent_ids[0], program.name, "yes" if asked else "no")
            return asked
        return False

    # -- the rest is the ordinary snapshotter ----------------------------------------------------

    def view(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        return self.sn.view(key, parent, labels)

    def mounts(self, key: str) -> list[Mount]:
        return self.sn.mounts(key)

    def commit(self, name: str, key: str, labels: dict[str, str]) -> None:
        self.sn.commit(name, key, labels)
        self._release_unused()  # e.g. the mount used to unpack a local layer over remote ones

    def remove(self, key: str) -> None:
        self.sn.remove(key)
        self._release_unused()

    def stat(self, key: str) -> Info:
        return self.sn.stat(key)

    def update(self, info: Info, paths: list[str]) -> Info:
        return self.sn.update(info, paths)

    def walk(self, filters: list[str]) -> Iterator[Info]:
        return self.sn.walk(filters)

    def usage(self, key: str) -> Usage:
        return self.sn.usage(key)

    def cleanup(self) -> list[str]:
        self._release_unused()
        removed = self.sn.cleanup()
        self.collect_garbage()
        return removed

    def collect_garbage(self) -> None:
        """Drop what no remote snapshot references any more: persisted layer indexes and cached
        chunks (unpinned ones; a live mount pins what it is prefetching). Runs on Cleanup."""
        referenced: list[str] = []
        with self.claims.lock:  # a layer is either still claimed by its Prepare or referenced here
            claimed = self.claims.claimed()
            for info in self.sn.walk([]):
                ref = layer_ref_from_labels(info.labels) if REMOTE_LABEL in info.labels else None
                if ref is not None:
                    referenced.append(ref.layer_digest)
            dropped_layers = self.layers.remove_unreferenced(set(referenced) | claimed)
        self.mounter.prune_metadata_images()  # those built from the indexes just dropped
        keys: set[str] = set()
        for digest in dict.fromkeys(referenced):
            try:
                keys.update(self.layers.cache_keys(digest))
            except (OSError, FormatError) as exc:
                log.warning("event=cache_gc_skipped layer=%s error=%r", digest, str(exc))
                return  # never drop chunks of a layer we could not read the keys of
        cache_dir = self.sn.root / "cache"
        if not cache_dir.exists():
            return
        try:
            cache = ChunkCache(cache_dir, self.config.cache.max_bytes)
            try:
                removed = cache.gc(keys)
            finally:
                cache.close()
        except Exception as exc:  # e.g. disk full: Cleanup's own work is done; the next one retries
            log.warning("event=cache_gc_failed dir=%s error=%r", cache_dir, str(exc))
            return
        log.info("event=cache_gc chunks_removed=%d bytes_removed=%d layers_removed=%d", removed.chunks,
                 removed.bytes, len(dropped_layers))
