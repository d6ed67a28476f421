"""fusefs/prefetch.py over a real eStargz blob (our writer + TOC parser) and a counting source:
landmark prefetch in one request, background fetch of the rest, yielding to on-demand reads,
the cache cap, and the status it reports."""

from __future__ import annotations

import functools
import io
import json
import random
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import trio

from snapshotter.cache import ChunkCache
from snapshotter.formats.estargz import parse_footer, parse_toc, toc_range, write_estargz
from snapshotter.formats.index import Landmark, LayerIndex
from snapshotter.formats.nydus import parse_bootstrap
from snapshotter.formats.rafs_writer import write_nydus
from snapshotter.fusefs.prefetch import Prefetcher, PrefetchSettings
from snapshotter.fusefs.process import parse_state
from snapshotter.fusefs.tree import build_tree
from snapshotter.reader import FileRangeSource, ReaderConfig, open_layer_reader
from tests.tars import tar_of

CHUNK = 16 << 10
PREFETCH = ["app/f07", "app/f21", "app/f02", "lib/big"]


@dataclass
class CountingSource:
    inner: FileRangeSource
    calls: list[tuple[int, int, float]] = field(default_factory=list)

    async def read_range(self, blob: int, offset: int, length: int) -> bytes:
        self.calls.append((offset, length, trio.current_time()))
        return await self.inner.read_range(blob, offset, length)


def _tar() -> tuple[bytes, dict[str, bytes]]:
    rng = random.Random(5)
    files = {f"app/f{i:02d}": rng.randbytes(rng.randint(1_000, 60_000)) for i in range(30)}
    files["lib/big"] = rng.randbytes(300_000)
    return tar_of(files, dirs=("app", "lib")), files


def _layer(tmp: Path, prefetch: Sequence[str] | None) -> tuple[Path, LayerIndex, dict[str, bytes]]:
    raw_tar, files = _tar()
    buf = io.BytesIO(raw_tar)
    blob = tmp / "layer.estargz"
    with open(blob, "wb") as dst:
        result = write_estargz(buf, dst, chunk_size=CHUNK, prefetch=prefetch)
    raw = blob.read_bytes()
    footer = parse_footer(raw[-51:])
    off, length = toc_range(footer, len(raw))
    index = parse_toc(raw[off:off + length], blob_size=len(raw), layer_digest=result.digest,
                      max_toc_bytes=16 << 20, toc_offset=footer.toc_offset)
    return blob, index, files


async def _run(tmp: Path, index: LayerIndex, blob: Path, settings: PrefetchSettings, *,
               cache_bytes: int = 64 << 20, body=None) -> tuple[Prefetcher, CountingSource, ChunkCache]:  # type: ignore[no-untyped-def]
    source = CountingSource(FileRangeSource([blob]))
    cache = ChunkCache(tmp / "cache", cache_bytes)
    tree = build_tree([[index]])
    config = ReaderConfig(max_merge_bytes=64 << 10, readahead_bytes=0)
    async with open_layer_reader(source, blobs=list(index.blobs), cache=cache, config=config) as reader:
        prefetcher = Prefetcher(tree, [reader], ["sha256:layer"], settings)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefetcher.run)
            if body is not None:
                await body(prefetcher, reader, source)
    return prefetcher, source, cache


def run(*args, **kwargs) -> tuple[Prefetcher, CountingSource, ChunkCache]:  # type: ignore[no-untyped-def]
    return trio.run(functools.partial(_run, *args, **kwargs))


def test_landmark_prefetch_is_one_request_and_serves_the_listed_files(tmp_path: Path) -> None:
    blob, index, files = _layer(tmp_path, PREFETCH)
    assert index.landmark is Landmark.PREFETCH and list(index.prefetch) == PREFETCH
    reads: dict[str, bytes] = {}

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        with trio.fail_after(10):
            await p.prefetched.wait()
        assert len(source.calls) == 1  # every prefetch file, 300 KB of them, in one range request
        (tracked,) = p.tracked([reader])
        for name in PREFETCH:
            reads[name] = await tracked.read(index[name], 0, index[name].size)
        assert len(source.calls) == 1, "prefetched files are read from the cache"

    p, source, _cache = run(tmp_path, index, blob, PrefetchSettings(background=False), body=body)
    assert reads == {n: files[n] for n in PREFETCH}
    st = p.status["0:sha256:layer"]
    assert st["prefetch"] == "done" and st["prefetch_files"] == 4 and st["prefetch_requests"] == 1
    assert st["prefetch_bytes"] == source.calls[0][1] and st["prefetch_bytes"] >= 300_000
    assert st["background"] == "disabled"


def test_nydus_prefetch_table_is_prefetched_with_few_requests(tmp_path: Path) -> None:
    raw_tar, files = _tar()
    outs: list[BinaryIO] = []

    def blob_out(i: int) -> BinaryIO:
        outs.append(open(tmp_path / f"blob{i}", "wb"))  # noqa: SIM115 - closed below
        return outs[-1]

    result = write_nydus([io.BytesIO(raw_tar)], blob_out, chunk_size=16 << 10, prefetch=PREFETCH)
    for f in outs:
        f.close()
    index = parse_bootstrap(result.bootstrap, max_bootstrap_bytes=64 << 20)
    assert set(index.prefetch) == set(PREFETCH) and index.landmark is Landmark.NONE
    reads: dict[str, bytes] = {}

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        with trio.fail_after(10):
            await p.prefetched.wait()
        n = len(source.calls)
        for name in PREFETCH:
            reads[name] = await reader.read(index[name], 0, index[name].size)
        assert len(source.calls) == n

    p, source, _ = run(tmp_path, index, tmp_path / "blob0", PrefetchSettings(background=False), body=body)
    assert reads == {n: files[n] for n in PREFETCH}
    st = p.status["0:sha256:layer"]
    # The files are spread over the blob; gaps up to 1 MiB are fetched rather than split.
    assert st["prefetch"] == "done" and st["prefetch_requests"] == len(source.calls)
    assert 1 <= len(source.calls) <= 2


def test_no_prefetch_landmark_skips_and_background_fetches_everything(tmp_path: Path) -> None:
    blob, index, files = _layer(tmp_path, [])
    assert index.landmark is Landmark.NO_PREFETCH

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        with trio.fail_after(20):
            while p.status["0:sha256:layer"]["background"] != "done":
                await trio.sleep(0.02)
        n = len(source.calls)
        for name, data in files.items():
            assert await reader.read(index[name], 0, index[name].size) == data
        assert len(source.calls) == n, "after the background fetch every read is a cache hit"

    p, source, _ = run(tmp_path, index, blob, PrefetchSettings(background_delay=0.0), body=body)
    st = p.status["0:sha256:layer"]
    assert st["prefetch"] == "skipped" and st["prefetch_reason"] == "no_prefetch_landmark"
    assert st["background_requests"] == len(source.calls) and st["background_bytes"] > 1_000_000
    # Merged ranges of at most max_merge_bytes (64 KiB) plus one chunk: far fewer than the chunks.
    assert len(source.calls) < sum(len(e.chunks) for e in index.regular_files())


def test_background_waits_for_on_demand_reads_to_pause(tmp_path: Path) -> None:
    blob, index, _files = _layer(tmp_path, None)
    delay = 0.4
    ended: list[float] = []

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        (tracked,) = p.tracked([reader])
        for _ in range(5):  # a busy workload: background must not start meanwhile
            await tracked.read(index["lib/big"], 0, 1000)
            await trio.sleep(delay / 4)
        ended.append(trio.current_time())
        with trio.fail_after(20):
            while p.status["0:sha256:layer"]["background"] != "done":
                await trio.sleep(0.02)

    _p, source, _ = run(tmp_path, index, blob, PrefetchSettings(background_delay=delay), body=body)
    first_background = source.calls[1][2]  # calls[0]: the on-demand read
    assert first_background >= ended[0] - delay / 4 + delay - 0.05


def test_background_waits_for_filesystem_requests_to_pause(tmp_path: Path) -> None:
    """Lookups, getattrs and readdirs (a `find` over the image) fetch nothing, but the mount
    serves them on the loop the background fetch uses: they hold it back as reads do."""
    blob, index, _files = _layer(tmp_path, None)
    delay = 0.4
    ended: list[float] = []

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        for _ in range(6):  # a metadata-busy workload: background must not start meanwhile
            p.gate.note_request()
            await trio.sleep(delay / 4)
        ended.append(trio.current_time() - delay / 4)
        with trio.fail_after(20):
            while p.status["0:sha256:layer"]["background"] != "done":
                await trio.sleep(0.02)

    _p, source, _ = run(tmp_path, index, blob, PrefetchSettings(background_delay=delay), body=body)
    assert source.calls, "the background fetch never ran"
    assert source.calls[0][2] >= ended[0] + delay - 0.05


def test_background_stops_before_evicting(tmp_path: Path) -> None:
    blob, index, _files = _layer(tmp_path, None)
    cap = 400_000

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        with trio.fail_after(20):
            while p.status["0:sha256:layer"]["background"] == "pending" or \
                    p.status["0:sha256:layer"]["background"] in ("waiting", "running"):
                await trio.sleep(0.02)

    p, _source, cache = run(tmp_path, index, blob, PrefetchSettings(background_delay=0.0),
                                 cache_bytes=cap, body=body)
    st = p.status["0:sha256:layer"]
    assert st["background"] == "stopped" and st["background_reason"] == "cache_full"
    assert 0 < cache.usage().bytes <= cap and cache.evicted_chunks == 0


def test_a_mount_started_on_pull_fetches_in_background_only_after_a_read(tmp_path: Path) -> None:
    """mount_on_pull: an image nobody runs costs no bandwidth; its first read starts the fetch
    (as does the daemon's in_use file, tested below)."""
    blob, index, files = _layer(tmp_path, [])
    idle_calls: list[int] = []

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        await trio.sleep(0.5)  # well past background_delay=0
        idle_calls.append(len(source.calls))
        assert p.status["0:sha256:layer"]["background"] == "waiting"
        (tracked,) = p.tracked([reader])
        await tracked.read(index["lib/big"], 0, 1000)
        with trio.fail_after(20):
            while p.status["0:sha256:layer"]["background"] != "done":
                await trio.sleep(0.02)

    settings = PrefetchSettings(background_delay=0.0, in_use_file=str(tmp_path / "in_use"))
    p, source, _ = run(tmp_path, index, blob, settings, body=body)
    assert idle_calls == [0], "nothing was fetched before the first read"
    # The read fetched lib/big (its chunks are one read unit); the background, every other file.
    rest = sum(len(data) for name, data in files.items() if name != "lib/big")
    assert p.status["0:sha256:layer"]["background_bytes"] >= rest


def test_a_mount_started_on_pull_fetches_in_background_once_in_use(tmp_path: Path) -> None:
    blob, index, _files = _layer(tmp_path, [])
    marker = tmp_path / "in_use"

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        await trio.sleep(0.5)
        assert not source.calls and p.status["0:sha256:layer"]["background"] == "waiting"
        marker.touch()  # a snapshot over the image asked for the mount
        with trio.fail_after(20):
            while p.status["0:sha256:layer"]["background"] != "done":
                await trio.sleep(0.02)

    p, _source, _ = run(tmp_path, index, blob, PrefetchSettings(background_delay=0.0, in_use_file=str(marker)),
                        body=body)
    assert p.status["0:sha256:layer"]["background_bytes"] > 1_000_000


def test_settings_from_the_daemon_state_doc() -> None:
    doc = {"prefetch_timeout": 2.5, "config": {"prefetch_timeout": 9.0, "prefetch": {
        "background": False, "background_bytes_per_second": 1000, "background_delay": 0.5}}}
    assert PrefetchSettings.from_doc(doc) == PrefetchSettings(2.5, False, 1000, 0.5)
    assert PrefetchSettings.from_doc({"config": {"prefetch_timeout": 9.0}}).prefetch_timeout == 9.0
    assert PrefetchSettings.from_doc({}) == PrefetchSettings()
    assert PrefetchSettings.from_doc({"in_use_file": "/x/in_use"}).in_use_file == "/x/in_use"


def test_background_and_on_demand_reads_together_read_right(tmp_path: Path) -> None:
    blob, index, files = _layer(tmp_path, PREFETCH)
    got: dict[str, bytes] = {}

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        (tracked,) = p.tracked([reader])
        rng = random.Random(3)

        async def read_file(name: str) -> None:
            await trio.sleep(rng.random() * 0.05)
            e = index[name]
            got[name] = b"".join([await tracked.read(e, o, 7_000) for o in range(0, e.size, 7_000)])

        async with trio.open_nursery() as nursery:
            for name in files:
                nursery.start_soon(read_file, name)
        with trio.fail_after(20):
            while p.status["0:sha256:layer"]["background"] != "done":
                await trio.sleep(0.02)

    p, _source, cache = run(tmp_path, index, blob, PrefetchSettings(background_delay=0.0), body=body)
    assert got == files
    assert p.status["0:sha256:layer"]["prefetch"] == "done"


def test_background_stops_with_the_mount(tmp_path: Path) -> None:
    blob, index, _files = _layer(tmp_path, [])
    settings = PrefetchSettings(background_delay=0.0, background_bytes_per_second=100_000)
    seen: dict[str, object] = {}

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        seen["p"], seen["source"] = p, source
        await trio.sleep_forever()

    async def main() -> None:
        with trio.move_on_after(0.5):  # the unmount cancels the mount's tasks like this
            await _run(tmp_path, index, blob, settings, body=body)

    trio.run(main)
    p, source = seen["p"], seen["source"]
    assert isinstance(p, Prefetcher) and isinstance(source, CountingSource)
    st = p.status["0:sha256:layer"]
    assert st["background"] == "stopped" and st["background_reason"] == "unmounted"
    assert 1 <= len(source.calls) < 5  # paced at 100 kB/s: started, and cut short


def test_with_wait_the_ready_file_waits_for_prefetch_at_most_the_timeout(tmp_path: Path) -> None:
    from snapshotter.fusefs.process import _ready_after_prefetch

    blob, index, _files = _layer(tmp_path, PREFETCH)
    ready = tmp_path / "ready"

    class SlowSource(CountingSource):
        async def read_range(self, blob: int, offset: int, length: int) -> bytes:
            await trio.sleep(1.0)
            return await super().read_range(blob, offset, length)

    async def main() -> tuple[float, float]:
        source = SlowSource(FileRangeSource([blob]))
        cache = ChunkCache(tmp_path / "cache", 64 << 20)
        state = parse_state(json.dumps({"mountpoint": str(tmp_path), "ready_file": str(ready),
                                        "runs": [[{"index": "i", "reader": {"kind": "file"}}]]}).encode())
        async with open_layer_reader(source, blobs=list(index.blobs), cache=cache) as reader:
            p = Prefetcher(build_tree([[index]]), [reader], ["sha256:layer"],
                           PrefetchSettings(prefetch_timeout=0.3, background=False, wait=True))
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.run)
                await _ready_after_prefetch(state, build_tree([[index]]), p)
                written = trio.current_time() - start
                assert json.loads(ready.read_text())["prefetch"] == "timeout"
                await p.prefetched.wait()
            return written, trio.current_time() - start

    written, prefetched = trio.run(main)
    assert 0.25 <= written < 0.8 and prefetched >= 1.0
    assert PrefetchSettings.from_doc({"config": {"prefetch": {"wait": True}}}).wait is True
    assert PrefetchSettings.from_doc({"config": {}}).wait is False


@dataclass
class ReadyThenRead:
    """What `_ready_then_read` saw: seconds until the ready file, whether the prefetch lists'
    fetch (`listed_fetching`) and the whole prefetch (`fetching`) were still running then, the
    source's requests when the prefetch ended and at the end, the bytes read, the ready file."""

    written: float
    listed_fetching: bool
    fetching: bool
    at_prefetch_end: int
    calls: int
    data: bytes
    ready: dict[str, object]


def _ready_then_read(tmp: Path, blob: Path, index: LayerIndex, name: str, delay: float) -> ReadyThenRead:
    """Prefetch the layer through a source answering each range after `delay` seconds, wait for
    the ready file (`_ready_after_prefetch`, default settings), then read file `name` whole."""
    from snapshotter.fusefs.process import _ready_after_prefetch

    ready = tmp / "ready"

    class SlowSource(CountingSource):
        async def read_range(self, blob: int, offset: int, length: int) -> bytes:
            await trio.sleep(delay)
            return await super().read_range(blob, offset, length)

    async def main() -> ReadyThenRead:
        source = SlowSource(FileRangeSource([blob]))
        cache = ChunkCache(tmp / "cache", 64 << 20)
        state = parse_state(json.dumps({"mountpoint": str(tmp), "ready_file": str(ready),
                                        "runs": [[{"index": "i", "reader": {"kind": "file"}}]]}).encode())
        async with open_layer_reader(source, blobs=list(index.blobs), cache=cache) as reader:
            tree = build_tree([[index]])
            p = Prefetcher(tree, [reader], ["sha256:layer"], PrefetchSettings(prefetch_timeout=5, background=False))
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.run)
                with trio.fail_after(5):
                    await _ready_after_prefetch(state, tree, p)
                written = trio.current_time() - start
                listed_fetching, fetching = not p.listed_prefetched.is_set(), not p.prefetched.is_set()
                (tracked,) = p.tracked([reader])
                entry = index[name]
                with trio.fail_after(5):
                    data = await tracked.read(entry, 0, entry.size)  # waits for the prefetch's fetch
                    await p.prefetched.wait()
                at_prefetch_end = len(source.calls)
            return ReadyThenRead(written, listed_fetching, fetching, at_prefetch_end, len(source.calls), data,
                                 json.loads(ready.read_text()))

    return trio.run(main)


def test_ready_file_comes_once_the_prefetch_is_in_flight_and_reads_join_it(tmp_path: Path) -> None:
    """The default: container start waits for the prefetch list's fetch to be under way, not to
    end; a read of a listed file then waits for that fetch and makes no request of its own."""
    blob, index, files = _layer(tmp_path, PREFETCH)
    # lib/big is the last of the list: its bytes come at the end of the fetch.
    got = _ready_then_read(tmp_path, blob, index, "lib/big", 0.6)
    assert got.ready["prefetch"] == "in_flight"
    assert got.written < 0.5 and got.listed_fetching, "the ready file came before the prefetch's fetch ended"
    assert got.data == files["lib/big"]
    assert got.calls >= 1 and got.calls == got.at_prefetch_end, "the read was served by the prefetch's requests"


def _startup_layer(tmp: Path) -> tuple[Path, LayerIndex, dict[str, bytes]]:
    """An eStargz layer written with no prefetch list (so `.no.prefetch.landmark`) holding a
    glibc userland's start-up files and an unrelated big file."""
    rng = random.Random(9)
    files = {"etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n", "etc/group": b"root:x:0:\n",
             "etc/ld.so.cache": rng.randbytes(2_000), "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2":
             rng.randbytes(90_000), "lib/x86_64-linux-gnu/libc.so.6": rng.randbytes(200_000),
             "opt/weights": rng.randbytes(400_000)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in ("etc", "lib", "lib/x86_64-linux-gnu", "lib64", "opt"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(info)
        link = tarfile.TarInfo("lib64/ld-linux-x86-64.so.2")
        link.type, link.linkname = tarfile.SYMTYPE, "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
        tf.addfile(link)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    blob = tmp / "layer.estargz"
    with open(blob, "wb") as dst:
        result = write_estargz(io.BytesIO(buf.getvalue()), dst, chunk_size=CHUNK, prefetch=[])
    raw = blob.read_bytes()
    footer = parse_footer(raw[-51:])
    off, length = toc_range(footer, len(raw))
    index = parse_toc(raw[off:off + length], blob_size=len(raw), layer_digest=result.digest,
                      max_toc_bytes=16 << 20, toc_offset=footer.toc_offset)
    return blob, index, files


STARTUP = ("etc/passwd", "etc/group", "etc/ld.so.cache", "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
           "lib/x86_64-linux-gnu/libc.so.6")


def test_startup_files_are_prefetched_even_under_a_no_prefetch_landmark(tmp_path: Path) -> None:
    blob, index, files = _startup_layer(tmp_path)
    assert index.landmark is Landmark.NO_PREFETCH
    reads: dict[str, bytes] = {}

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        with trio.fail_after(10):
            await p.prefetched.wait()
        n = len(source.calls)
        assert 1 <= n <= 2  # the five files lie together: one or two merged ranges, not five
        (tracked,) = p.tracked([reader])
        for name in STARTUP:
            reads[name] = await tracked.read(index[name], 0, index[name].size)
        assert len(source.calls) == n, "start-up files are read from the cache"
        await tracked.read(index["opt/weights"], 0, 1000)
        assert len(source.calls) == n + 1, "files outside the start-up set were not prefetched"

    p, _source, _ = run(tmp_path, index, blob, PrefetchSettings(background=False), body=body)
    assert reads == {n: files[n] for n in STARTUP}
    st = p.status["0:sha256:layer"]
    assert st["prefetch"] == "done" and st["startup_files"] == 5 and st["prefetch_files"] == 5


def test_startup_files_off_leaves_a_no_prefetch_layer_alone(tmp_path: Path) -> None:
    blob, index, _files = _startup_layer(tmp_path)

    async def body(p: Prefetcher, reader, source: CountingSource) -> None:  # type: ignore[no-untyped-def]
        with trio.fail_after(10):
            await p.prefetched.wait()
        assert source.calls == []

    p, _source, _ = run(tmp_path, index, blob, PrefetchSettings(background=False, startup_files=False),
                        body=body)
    st = p.status["0:sha256:layer"]
    assert st["prefetch"] == "skipped" and st["prefetch_reason"] == "no_prefetch_landmark"
    assert PrefetchSettings.from_doc({"config": {"prefetch": {"startup_files": False}}}).startup_files is False


def test_ready_does_not_wait_for_start_up_files_but_their_reads_join_the_fetch(tmp_path: Path) -> None:
    blob, index, files = _startup_layer(tmp_path)
    got = _ready_then_read(tmp_path, blob, index, "lib/x86_64-linux-gnu/libc.so.6", 0.5)
    assert got.ready["prefetch"] == "done"
    assert got.written < 0.4 and got.fetching, "the ready file came before the start-up files' fetch ended"
    assert got.data == files["lib/x86_64-linux-gnu/libc.so.6"]
    assert 1 <= got.calls <= 2 and got.calls == got.at_prefetch_end, "the read was served by the prefetch's requests"
