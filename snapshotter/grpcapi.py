"""containerd.services.snapshots.v1.Snapshots over gRPC: translation only.

Requests become calls on `Snapshotter`; our errors become gRPC status codes that containerd's
proxy client maps back (errdefs.FromGRPC): NotFound -> NOT_FOUND, AlreadyExists -> ALREADY_EXISTS,
FailedPrecondition -> FAILED_PRECONDITION, InvalidArgument -> INVALID_ARGUMENT. Anything else is
logged with its traceback and answered as INTERNAL.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import empty_pb2, timestamp_pb2

from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from snapshotter._proto.containerd.types import mount_pb2
from snapshotter.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from snapshotter.logs import q
from snapshotter.snapshots.model import Info, Kind, Mount, Usage

log = logging.getLogger(__name__)

LIST_BATCH = 100

_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
]


class SnapshotBackend(Protocol):
    """What the gRPC layer needs; `snapshots.service.Snapshotter` (and the lazy wrapper) provide it."""

    def prepare(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]: ...
    def view(self, key: str, parent: str, labels: dict[str, str]) -> list[Mount]: ...
    def mounts(self, key: str) -> list[Mount]: ...
    def commit(self, name: str, key: str, labels: dict[str, str]) -> None: ...
    def remove(self, key: str) -> None: ...
    def stat(self, key: str) -> Info: ...
    def update(self, info: Info, paths: list[str]) -> Info: ...
    def walk(self, filters: list[str]) -> Iterator[Info]: ...
    def usage(self, key: str) -> Usage: ...
    def cleanup(self) -> Any: ...


def _mounts_pb(mounts: list[Mount]) -> list[mount_pb2.Mount]:
    return [mount_pb2.Mount(type=m.type, source=m.source, target=m.target, options=list(m.options))
            for m in mounts]


def _ts(ns: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000)


def info_to_pb(info: Info) -> pb.Info:
    return pb.Info(name=info.name, parent=info.parent, kind=pb.Kind.Name(int(info.kind)),
                   created_at=_ts(info.created_ns), updated_at=_ts(info.updated_ns), labels=dict(info.labels))


def info_from_pb(msg: pb.Info) -> Info:
    return Info(msg.name, msg.parent, Kind(msg.kind),
                msg.created_at.seconds * 1_000_000_000 + msg.created_at.nanos,
                msg.updated_at.seconds * 1_000_000_000 + msg.updated_at.nanos, dict(msg.labels))


R = TypeVar("R")


def _rpc(method: Callable[..., R]) -> Callable[..., R]:
    """Map our errors to gRPC status codes and log each call at debug level."""

    @functools.wraps(method)
    def wrapper(self: SnapshotsServicer, request: Any, context: grpc.ServicerContext) -> R:
        start = time.monotonic()
        name = method.__name__.strip("_").title()  # "_list" -> "List"
        key = getattr(request, "key", "") or getattr(request, "name", "")
        try:
            result = method(self, request, context)
        except Exception as exc:
            for cls, code in _CODES:
                if isinstance(exc, cls):
                    log.debug("event=grpc method=%s key=%s code=%s seconds=%.3f error=%s", name, q(key), code.name,
                              time.monotonic() - start, q(exc))
                    self.observe(name, code.name, time.monotonic() - start)
                    context.abort(code, str(exc))
            log.exception("event=grpc_internal_error method=%s key=%s", name, q(key))
            self.observe(name, "INTERNAL", time.monotonic() - start)
            context.abort(grpc.StatusCode.INTERNAL, f"{name} {key!r}: {type(exc).__name__}: {exc}")
        log.debug("event=grpc method=%s key=%s code=OK seconds=%.3f", name, q(key), time.monotonic() - start)
        self.observe(name, "OK", time.monotonic() - start)
        return result

    return wrapper


class SnapshotsServicer(pb_grpc.SnapshotsServicer):
    def __init__(self, backend: SnapshotBackend,
                 observe: Callable[[str, str, float], None] | None = None) -> None:
        self.backend = backend
        self._observe = observe

    def observe(self, method: str, code: str, seconds: float) -> None:
        if self._observe is not None:
            self._observe(method, code, seconds)

    @_rpc
    def Prepare(self, request: pb.PrepareSnapshotRequest, context: grpc.ServicerContext) -> Any:
        mounts = self.backend.prepare(request.key, request.parent, dict(request.labels))
        return pb.PrepareSnapshotResponse(mounts=_mounts_pb(mounts))

    @_rpc
    def View(self, request: pb.ViewSnapshotRequest, context: grpc.ServicerContext) -> Any:
        mounts = self.backend.view(request.key, request.parent, dict(request.labels))
        return pb.ViewSnapshotResponse(mounts=_mounts_pb(mounts))

    @_rpc
    def Mounts(self, request: pb.MountsRequest, context: grpc.ServicerContext) -> Any:
        return pb.MountsResponse(mounts=_mounts_pb(self.backend.mounts(request.key)))

    @_rpc
    def Commit(self, request: pb.CommitSnapshotRequest, context: grpc.ServicerContext) -> Any:
        self.backend.commit(request.name, request.key, dict(request.labels))
        return empty_pb2.Empty()

    @_rpc
    def Remove(self, request: pb.RemoveSnapshotRequest, context: grpc.ServicerContext) -> Any:
        self.backend.remove(request.key)
        return empty_pb2.Empty()

    @_rpc
    def Stat(self, request: pb.StatSnapshotRequest, context: grpc.ServicerContext) -> Any:
        return pb.StatSnapshotResponse(info=info_to_pb(self.backend.stat(request.key)))

    @_rpc
    def Update(self, request: pb.UpdateSnapshotRequest, context: grpc.ServicerContext) -> Any:
        info = self.backend.update(info_from_pb(request.info), list(request.update_mask.paths))
        return pb.UpdateSnapshotResponse(info=info_to_pb(info))

    def List(self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        # A generator cannot use the _rpc wrapper (errors surface while iterating): collect first.
        infos = self._list(request, context)
        for i in range(0, len(infos), LIST_BATCH):
            yield pb.ListSnapshotsResponse(info=[info_to_pb(x) for x in infos[i:i + LIST_BATCH]])

    @_rpc
    def _list(self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext) -> list[Info]:
        return list(self.backend.walk(list(request.filters)))

    @_rpc
    def Usage(self, request: pb.UsageRequest, context: grpc.ServicerContext) -> Any:
        usage = self.backend.usage(request.key)
        return pb.UsageResponse(size=usage.size, inodes=usage.inodes)

    @_rpc
    def Cleanup(self, request: pb.CleanupRequest, context: grpc.ServicerContext) -> Any:
        self.backend.cleanup()
        return empty_pb2.Empty()


def add_to_server(servicer: SnapshotsServicer, server: grpc.Server) -> None:
    pb_grpc.add_SnapshotsServicer_to_server(servicer, server)
