"""Faults injected by a proxy in front of the real registry: what is retried, what is not, and
that every failure is logged naming registry, repository, digest and range."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import pytest
import trio

from snapshotter.fetch import RegistryClient, RegistryError
from tests.fetch.conftest import FAST
from tests.fetch.proxies import Fault, RegistryProxy
from tests.fetch.registry import PushedImage, RegistryProcess


@pytest.fixture
def proxy(origin: RegistryProcess) -> Iterator[RegistryProxy]:
    with RegistryProxy(origin.url) as p:
        yield p


def warnings_naming(caplog: pytest.LogCaptureFixture, *parts: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and all(p in r.getMessage() for p in parts)]


def read(proxy: RegistryProxy, image: PushedImage, digest: str, offset: int, length: int,
         **cfg: float) -> tuple[bytes, RegistryClient]:
    ref = f"{proxy.host}/{image.repository}"
    client = RegistryClient(replace(FAST, **cfg))  # type: ignore[arg-type]

    async def main() -> bytes:
        async with client:
            return await client.read_range(ref, digest, offset, length)

    return trio.run(main), client


class RecordingSink:
    """A RangeSink that keeps what it is given and counts restarts."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.restarts = 0
        self.writes = 0

    async def restart(self) -> None:
        self.restarts += 1
        self.data.clear()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        self.data += data


def stream(proxy: RegistryProxy, image: PushedImage, digest: str, offset: int, length: int,
           **cfg: float) -> tuple[RecordingSink, RegistryClient]:
    ref = f"{proxy.host}/{image.repository}"
    client = RegistryClient(replace(FAST, **cfg))  # type: ignore[arg-type]
    sink = RecordingSink()

    async def main() -> None:
        async with client:
            await client.stream_range(ref, digest, offset, length, sink)

    trio.run(main)
    return sink, client


@pytest.mark.parametrize("mode", ["read", "stream"])
@pytest.mark.parametrize(
    ("fault", "logged"),
    [
        (Fault("status", status=500), "server error 500"),
        (Fault("status", status=503, times=2), "server error 503"),
        (Fault("status", status=429), "server error 429"),
        (Fault("reset"), "connection failed mid-request"),
        (Fault("short"), "short body"),
        (Fault("bad_content_range"), "wrong Content-Range"),
        (Fault("bad_content_range", shift=-1), "wrong Content-Range"),
    ],
    ids=["500", "503x2", "429", "reset", "short", "content-range+1", "content-range-1"],
)
def test_transient_fault_is_retried(proxy: RegistryProxy, image: PushedImage, big_layer: tuple[str, bytes],
                                    caplog: pytest.LogCaptureFixture, fault: Fault, logged: str, mode: str) -> None:
    digest, data = big_layer
    times = fault.times
    proxy.add_fault(fault)
    if mode == "read":
        got, client = read(proxy, image, digest, 4096, 20_000)
    else:
        sink, client = stream(proxy, image, digest, 4096, 20_000)
        got = bytes(sink.data)
        # A body that broke off after its first bytes made the sink start over; an error
        # status gave it nothing to forget.
        assert sink.restarts == (times if fault.action in ("reset", "short") else 0)
    assert got == data[4096:24_096]
    assert client.stats.retries == times
    assert len(proxy.blob_requests()) == times + 1
    msgs = warnings_naming(caplog, proxy.host, image.repository, digest, "bytes 4096-24095", logged)
    assert len(msgs) == times, caplog.text


def test_404_is_not_retried(proxy: RegistryProxy, image: PushedImage, big_layer: tuple[str, bytes],
                            caplog: pytest.LogCaptureFixture) -> None:
    digest, _ = big_layer
    proxy.add_fault(Fault("status", status=404))
    with pytest.raises(RegistryError) as ei:
        read(proxy, image, digest, 10, 10)
    for part in (proxy.host, image.repository, digest, "bytes 10-19", "404"):
        assert part in str(ei.value)
    assert len(proxy.blob_requests()) == 1
    assert warnings_naming(caplog, proxy.host, image.repository, digest, "bytes 10-19", "not found")


def test_persistent_500_gives_up_after_retries(proxy: RegistryProxy, image: PushedImage,
                                               big_layer: tuple[str, bytes]) -> None:
    digest, _ = big_layer
    proxy.add_fault(Fault("status", status=500, times=100))
    with pytest.raises(RegistryError, match="server error 500") as ei:
        read(proxy, image, digest, 0, 10)
    assert ei.value.status == 500
    assert len(proxy.blob_requests()) == FAST.retries + 1


def test_slow_answer_times_out_and_is_retried(proxy: RegistryProxy, image: PushedImage,
                                              big_layer: tuple[str, bytes], caplog: pytest.LogCaptureFixture) -> None:
    digest, data = big_layer
    proxy.add_fault(Fault("delay", seconds=2.0))
    got, _ = read(proxy, image, digest, 0, 100, request_timeout=0.5)
    assert got == data[:100]
    assert warnings_naming(caplog, digest, "bytes 0-99", "timed out")


def test_multi_range_faults_are_retried(proxy: RegistryProxy, image: PushedImage, big_layer: tuple[str, bytes],
                                        caplog: pytest.LogCaptureFixture) -> None:
    digest, data = big_layer
    proxy.add_fault(Fault("reset"))
    proxy.add_fault(Fault("short"))
    ref = f"{proxy.host}/{image.repository}"
    wanted = [(0, 100), (1000, 100), (100_000, 5000)]

    async def main() -> RegistryClient:
        async with RegistryClient(FAST) as c:
            assert await c.read_ranges(ref, digest, wanted) == [data[o:o + n] for o, n in wanted]
            return c

    c = trio.run(main)
    assert c.stats.multi_range_requests == 3 and c.stats.retries == 2
    assert warnings_naming(caplog, digest, "range 0-99,1000-1099,100000-104999", "connection failed")
    assert warnings_naming(caplog, digest, "range 0-99,1000-1099,100000-104999", "multipart")


def test_manifest_fault(proxy: RegistryProxy, image: PushedImage, caplog: pytest.LogCaptureFixture) -> None:
    proxy.add_fault(Fault("status", status=502, method="HEAD", path="/manifests/"))

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            desc = await c.resolve(f"{proxy.host}/{image.repository}:{image.tag}")
            assert desc.digest == image.manifest_digest

    trio.run(main)
    assert warnings_naming(caplog, proxy.host, image.repository, f"manifest {image.tag}", "server error 502")


def test_stream_of_a_whole_blob_answer_gets_just_the_range(proxy: RegistryProxy, image: PushedImage,
                                                          big_layer: tuple[str, bytes],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Storage that ignores Range sends the whole blob (200): the sink gets exactly the range
    asked for, and the rest of the body is not read."""
    caplog.set_level(logging.INFO, logger="snapshotter.fetch")
    digest, data = big_layer
    proxy.add_fault(Fault("ignore_range"))
    sink, client = stream(proxy, image, digest, 70_000, 50_000)
    assert bytes(sink.data) == data[70_000:120_000] and sink.restarts == 0
    assert client.stats.retries == 0
    assert "server ignored Range and sent the whole blob" in caplog.text
    assert [r.status for r in proxy.blob_requests()] == [200]


def test_stream_hands_out_the_body_in_pieces_as_it_comes(image: PushedImage, big_layer: tuple[str, bytes]) -> None:
    """Straight from the registry: the sink sees the bytes piece by piece, never the whole
    answer at once, and nothing is held here."""
    digest, data = big_layer
    sink = RecordingSink()
    biggest = 0

    class Sizes(RecordingSink):
        async def write(self, piece: bytes | bytearray | memoryview) -> None:
            nonlocal biggest
            biggest = max(biggest, len(piece))
            await sink.write(piece)

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            await c.stream_range(image.ref, digest, 1, len(data) - 1, Sizes())

    trio.run(main)
    assert bytes(sink.data) == data[1:]
    assert sink.writes > 1 and biggest < len(data) // 2
