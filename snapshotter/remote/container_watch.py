"""Containers as containerd creates them, from its event stream: what each will run.

A thread subscribes to containerd's events (`containerd.services.events.v1.Events/Subscribe`,
filter topic=="/containers/create") on `address`, reads each new container's record
(`containerd.services.containers.v1.Containers/Get`, in the event's namespace) and calls
`on_container(namespace, snapshotter, snapshot_key, program)` with the program its runtime spec
runs (runtime_spec.py). containerd creates the record after the container's snapshot is
prepared and before the task, whose exec reads the program about 100 ms later: time for a
prefetch of it (fusefs/program_prefetch.py).

Only an optimization: containerd not there yet, gone or restarting, or an event or record that
cannot be read costs that prefetch, never a container. A lost stream is subscribed again after
RETRY_INITIAL seconds, doubling up to RETRY_MAX; the first failure of an outage is logged at
INFO, its end too. `close` ends the thread within a second.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from snapshotter._proto.containerd.events import container_pb2
from snapshotter._proto.containerd.services.containers.v1 import containers_pb2, containers_pb2_grpc
from snapshotter._proto.containerd.services.events.v1 import events_pb2, events_pb2_grpc
from snapshotter.errors import FormatError
from snapshotter.runtime_spec import Program, program_from_spec

log = logging.getLogger(__name__)

CREATE_TOPIC = "/containers/create"
RETRY_INITIAL = 1.0
RETRY_MAX = 5.0  # a failed connect to a unix socket costs nothing; a missed container costs its prefetch
GET_TIMEOUT = 5.0  # seconds for one container record
NAMESPACE_HEADER = "containerd-namespace"

# (namespace, the container's snapshotter, its snapshot key, what it runs)
OnContainer = Callable[[str, str, str, Program], object]


class ContainerWatch:
    """Calls `on_container` for each container containerd at `address` (its unix socket) creates."""

    def __init__(self, address: str, on_container: OnContainer) -> None:
        self.address = address
        self.on_container = on_container
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None  # the running Subscribe stream (a grpc call), cancelled by close()
        self._thread = threading.Thread(target=self._run, name="container-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        delay = RETRY_INITIAL
        down = False
        while not self._stop.is_set():
            try:
                with grpc.insecure_channel(f"unix:{self.address}") as channel:
                    events = events_pb2_grpc.EventsStub(channel)
                    containers = containers_pb2_grpc.ContainersStub(channel)
                    stream = events.Subscribe(events_pb2.SubscribeRequest(filters=[f'topic=="{CREATE_TOPIC}"']))
                    with self._lock:
                        self._call = stream
                    if self._stop.is_set():
                        stream.cancel()
                    for envelope in stream:
                        if down:
                            log.info("event=container_watch_up address=%s", self.address)
                            down = False
                        delay = RETRY_INITIAL
                        self._handle(containers, envelope)
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if not down:
                    log.info("event=container_watch_down address=%s error=%r retry_seconds=%.0f", self.address,
                             _describe(exc), delay)
                    down = True
            with self._lock:
                self._call = None
            self._stop.wait(delay)
            delay = min(RETRY_MAX, delay * 2)

    def _handle(self, containers: containers_pb2_grpc.ContainersStub, envelope: events_pb2.Envelope) -> None:
        try:
            created = container_pb2.ContainerCreate.FromString(envelope.event.value)
            record = containers.Get(containers_pb2.GetContainerRequest(id=created.id),
                                    metadata=((NAMESPACE_HEADER, envelope.namespace),), timeout=GET_TIMEOUT).container
            program = program_from_spec(record.spec.value) if record.spec.value else None
        except (grpc.RpcError, FormatError, DecodeError) as exc:
            log.info("event=container_unread namespace=%s error=%r", envelope.namespace,
                     _describe(exc) if isinstance(exc, grpc.RpcError) else str(exc))
            return
        if program is None or not record.snapshot_key:
            return
        try:
            self.on_container(envelope.namespace, record.snapshotter, record.snapshot_key, program)
        except Exception as exc:  # an optimization: never the end of the watch
            log.warning("event=container_prefetch_failed container=%s error=%r", record.id, str(exc))


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code is not None else 'error'}: {details}"
