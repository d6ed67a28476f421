"""Shared fixtures: a daemon serving on a real unix socket, a gRPC stub for it, and one real
distribution registry for the whole session (tests push to repositories of their own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from snapshotter.config import Config
from snapshotter.daemon import Daemon
from tests.fetch.registry import RegistryProcess, start_registry


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    """`docker-registry serve` on loopback, plain HTTP, no auth; stopped after the session."""
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(Config(root=str(tmp_path / "root"), address=str(tmp_path / "run" / "snap.sock")))
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def stub(daemon: Daemon) -> Iterator[pb_grpc.SnapshotsStub]:
    channel = grpc.insecure_channel(f"unix://{daemon.config.address}")
    grpc.channel_ready_future(channel).result(timeout=10)
    try:
        yield pb_grpc.SnapshotsStub(channel)
    finally:
        channel.close()
