"""Plain pulls against the real distribution registry (no auth, no mirrors)."""

from __future__ import annotations

import json
import logging
import random

import pytest
import trio

from snapshotter.errors import FetchError
from snapshotter.fetch import RegistryClient, RegistryError, parse_reference
from snapshotter.formats.index import Chunk, Compression
from tests.fetch.conftest import FAST
from tests.fetch.proxies import BlobServer, RegistryProxy
from tests.fetch.registry import OCI_MANIFEST, PushedImage, RegistryProcess


def test_resolve_and_manifest(image: PushedImage, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="snapshotter.fetch")

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            desc = await c.resolve(image.ref)
            assert (desc.digest, desc.size, desc.media_type) == (image.manifest_digest, len(image.manifest),
                                                                 OCI_MANIFEST)
            m = await c.fetch_manifest(image.ref)
            assert m.content == image.manifest and m.descriptor == desc
            by_digest = await c.fetch_manifest(parse_reference(image.ref).with_digest(desc.digest))
            assert by_digest.content == image.manifest
            assert [layer["digest"] for layer in m.json()["layers"]] == list(image.layers)
            assert (await c.resolve(f"{image.registry}/{image.repository}@{desc.digest}")) == desc

    trio.run(main)
    # The loopback registry has no TLS: the client fell back to plain HTTP, as containerd does.
    assert "falling back to plain HTTP" in caplog.text
    assert f"served by server http://{image.registry}/v2" in caplog.text


def test_blob_size_and_ranges(image: PushedImage, big_layer: tuple[str, bytes]) -> None:
    digest, data = big_layer
    rnd = random.Random(7)
    wanted = [(rnd.randrange(len(data) - 5000), rnd.randrange(1, 5000)) for _ in range(40)]
    wanted += [(0, 1), (len(data) - 1, 1), (100, 50), (150, 50), (120, 10)]

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            assert await c.blob_size(image.ref, digest) == len(data)
            assert await c.read_range(image.ref, digest, 12345, 1000) == data[12345:13345]
            assert await c.read_range(image.ref, digest, 0, len(data)) == data
            got = await c.read_ranges(image.ref, digest, wanted)
            assert got == [data[o:o + n] for o, n in wanted]
            # The distribution registry (Go http.ServeContent) answers multipart/byteranges.
            assert c.stats.multi_range_requests >= 1
            assert c.stats.retries == 0
            chunks = [Chunk(0, 10, 500, 10, Compression.GZIP, None), Chunk(10, 7, 510, 7, Compression.GZIP, None)]
            assert await c.read_chunks(image.ref, digest, chunks) == [data[500:510], data[510:517]]

    trio.run(main)


def test_tail_and_size_in_one_request(image: PushedImage, big_layer: tuple[str, bytes],
                                      origin: RegistryProcess) -> None:
    """A suffix range gives the last bytes and, in its Content-Range, the blob's size: one GET,
    no HEAD. Asking for more than the blob holds gives all of it."""
    digest, data = big_layer
    small = min(image.layers, key=lambda d: len(image.layers[d]))

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            # The registry logs a request after answering it: let an earlier test's lines land
            # first (bounded), or they count as this test's.
            with trio.move_on_after(3):
                size = -1
                while size != (size := origin.log_path.stat().st_size):
                    await trio.sleep(0.3)
            before = len(origin.log_path.read_text())
            assert await c.read_tail(image.ref, digest, 65536) == (data[-65536:], len(data))
            get = f"GET /v2/{image.repository}/blobs/{digest}"
            # The registry writes its access log line after the answer: wait for it, bounded.
            with trio.move_on_after(10):
                while get not in origin.log_path.read_text()[before:]:
                    await trio.sleep(0.02)
            await trio.sleep(0.2)  # and for any line a second request would have written
            log = origin.log_path.read_text()[before:]
            # Only requests sent to the registry itself: a proxy of an earlier test may still
            # forward a request its client gave up on (it names the proxy as the Host), even
            # after the log has been quiet for a while.
            uri = f'http.request.uri="/v2/{image.repository}/blobs/{digest}"'
            ours = [line for line in log.splitlines() if "response completed" in line and uri in line
                    and f'http.request.host="{origin.host}"' in line]
            assert [line for line in ours if "http.request.method=GET" in line] == ours and len(ours) == 1, log
            whole = image.layers[small]
            assert await c.read_tail(image.ref, small, len(whole) + 1000) == (whole, len(whole))

    trio.run(main)


def test_tail_from_storage_without_suffix_ranges(image: PushedImage, big_layer: tuple[str, bytes],
                                                 origin: RegistryProcess, caplog: pytest.LogCaptureFixture) -> None:
    """Blob storage that answers a suffix range with the whole blob (200): that body is not read;
    a HEAD and a plain range read give the same answer."""
    digest, data = big_layer
    caplog.set_level(logging.INFO, logger="snapshotter.fetch")
    with BlobServer(image.layers) as storage, RegistryProxy(origin.url, redirect_blobs_to=storage.url) as p:
        ref = f"{p.host}/{image.repository}"

        async def main() -> None:
            async with RegistryClient(FAST) as c:
                assert await c.read_tail(ref, digest, 1000) == (data[-1000:], len(data))

        trio.run(main)
        assert [r.status for r in storage.requests] == [200, 206]
        assert [r.method for r in p.requests if "/blobs/" in r.path] == ["GET", "HEAD", "GET"]
    assert "no suffix range answer" in caplog.text


def test_merging_cuts_requests(image: PushedImage, big_layer: tuple[str, bytes]) -> None:
    digest, data = big_layer
    adjacent = [(i * 1000, 1000) for i in range(64)]

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            got = await c.read_ranges(image.ref, digest, adjacent)
            assert b"".join(got) == data[:64_000]
            assert c.stats.range_requests + c.stats.multi_range_requests == 1

    trio.run(main)


def test_missing_blob_and_manifest(image: PushedImage, origin: RegistryProcess) -> None:
    missing = "sha256:" + "0" * 64

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            with pytest.raises(RegistryError) as ei:
                await c.read_range(image.ref, missing, 10, 20)
            msg = str(ei.value)
            for part in (origin.host, image.repository, missing, "bytes 10-29", "404"):
                assert part in msg
            assert ei.value.status == 404
            assert c.stats.retries == 0
            with pytest.raises(FetchError, match="manifest nope"):
                await c.resolve(f"{image.registry}/{image.repository}:nope")
            with pytest.raises(FetchError, match="range ends past"):
                digest = next(iter(image.layers))
                await c.read_range(image.ref, digest, len(image.layers[digest]) - 5, 10)

    trio.run(main)


def test_manifest_digest_is_verified(image: PushedImage) -> None:
    """A digest reference whose content hashes differently is refused (registry cannot lie)."""
    m = json.loads(image.manifest)
    assert m["schemaVersion"] == 2

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            bad = parse_reference(image.ref).with_digest("sha256:" + "1" * 64)
            with pytest.raises(FetchError, match="sha256:1111"):
                await c.fetch_manifest(bad)

    trio.run(main)


def test_concurrent_first_requests_all_fall_back_to_plain_http_without_retrying(
        image: PushedImage, caplog: pytest.LogCaptureFixture) -> None:
    """Several requests to a loopback registry start before any has learned it has no TLS (a
    daemon resolving an image's layers at once): each one's failed TLS attempt switches to plain
    HTTP at once. The one that lost the race used to wait out a retry's backoff."""
    caplog.set_level(logging.INFO, logger="snapshotter.fetch")
    digest = min(image.layers, key=lambda d: len(image.layers[d]))
    data = image.layers[digest]
    got: dict[int, bytes] = {}

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            async def one(i: int) -> None:
                got[i] = bytes(await c.read_range(image.ref, digest, i * 100, 100))

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
            assert c.stats.retries == 0
            assert c.stats.requests == 4

    trio.run(main)
    assert got == {i: data[i * 100:i * 100 + 100] for i in range(4)}
    assert "attempt 1/" not in caplog.text
    assert caplog.text.count("falling back to plain HTTP") == 1


def test_hosts_known_to_answer_plain_http_get_no_tls_attempt(image: PushedImage,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """What one client learned (the daemon's), another is told (a mount process's): its first
    request goes straight to plain HTTP."""
    caplog.set_level(logging.INFO, logger="snapshotter.fetch")
    learned: set[str] = set()

    async def main() -> None:
        async with RegistryClient(FAST) as first:
            assert first.plain_http_hosts() == frozenset()
            await first.resolve(image.ref)
            learned.update(first.plain_http_hosts())
        async with RegistryClient(FAST) as told:
            told.assume_plain_http(learned)
            assert (await told.resolve(image.ref)).digest == image.manifest_digest
            assert told.stats.retries == 0

    trio.run(main)
    assert learned == {image.registry}
    assert caplog.text.count("falling back to plain HTTP") == 1, "the told client tried TLS"
