"""Benchmark (not a test): read a big file cold through LayerReader from a local registry.

Builds an eStargz-like blob (one gzip member per chunk, sha256 chunk digests) holding one file
of --size MiB, pushes it to a `docker-registry` started on 127.0.0.1 (temp dir, free port),
then prints MiB/s for:
  curl        GET of the whole blob (compressed bytes / s)
  cold seq    LayerReader, empty cache, sequential reads of --read-size (FUSE-like) with read-ahead
  cold par    LayerReader, empty cache, --parallel readers on disjoint stripes
  warm        the same sequential read again, from the chunk cache
Throughputs of the reader are file (uncompressed) bytes / s; "wire" is blob bytes / s, the number
compared with curl ("ratio"). --rate caps loopback with `tc qdisc ... tbf` for the run (removed
afterwards), so the link rate is known. Run as:
  .venv/bin/python integration/bench/blob_read.py [--size 256] [--chunk-size 4] [--rate 200mbit]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from snapshotter.cache import ChunkCache  # noqa: E402
from snapshotter.fetch import FetchConfig, RegistryClient  # noqa: E402
from snapshotter.formats.index import Chunk, Compression, Entry, EntryType  # noqa: E402
from snapshotter.reader import LayerReader, ReaderConfig, RegistryRangeSource, open_layer_reader  # noqa: E402
from tests.fetch.registry import push_blob, start_registry  # noqa: E402

MiB = 1 << 20


def build(path: Path, size: int, chunk_size: int) -> tuple[Entry, str]:
    """Write the blob; return the file's entry and its sha256. Half random, half text-like."""
    text = (b"the quick brown fox jumps over the lazy dog " * 2000)[: 64 << 10]
    whole = hashlib.sha256()
    chunks = []
    off = 0
    with open(path, "wb") as out:
        while off < size:
            n = min(chunk_size, size - off)
            piece = bytearray()
            while len(piece) < n:
                piece += os.urandom(64 << 10) + text
            data = bytes(piece[:n])
            whole.update(data)
            member = gzip.compress(data, compresslevel=1, mtime=0)
            chunks.append(
                Chunk(
                    file_offset=off,
                    size=n,
                    blob_offset=out.tell(),
                    blob_size=len(member),
                    compression=Compression.GZIP,
                    digest="sha256:" + hashlib.sha256(data).hexdigest(),
                )
            )
            out.write(member)
            off += n
    return Entry(name="big", type=EntryType.REG, size=size, chunks=tuple(chunks)), whole.hexdigest()


async def read_all(
    source: RegistryRangeSource,
    blobs: list[str],
    cache: ChunkCache,
    entry: Entry,
    read_size: int,
    parallel: int,
    config: ReaderConfig,
) -> tuple[float, str]:
    async with open_layer_reader(source, blobs=blobs, cache=cache, config=config) as reader:
        try:
            return await _timed_reads(reader, entry, read_size, parallel)
        finally:
            st = reader.stats
            print(
                f"  [requests {st.requests}, chunks fetched {st.chunks_fetched} (read-ahead "
                f"{st.readahead_chunks}, skipped {st.readahead_skipped}), cache hits {st.cache_hits}]"
            )


async def _timed_reads(reader: LayerReader, entry: Entry, read_size: int, parallel: int) -> tuple[float, str]:
    start = time.perf_counter()
    if parallel <= 1:
        h = hashlib.sha256()
        for off in range(0, entry.size, read_size):
            h.update(await reader.read(entry, off, read_size))
        return time.perf_counter() - start, h.hexdigest()
    stripe = -(-entry.size // parallel)

    async def one(lo: int) -> None:
        for off in range(lo, min(lo + stripe, entry.size), read_size):
            await reader.read(entry, off, min(read_size, lo + stripe - off))

    async with trio.open_nursery() as nursery:
        for i in range(parallel):
            nursery.start_soon(one, i * stripe)
    return time.perf_counter() - start, ""


@contextlib.contextmanager
def shaped(rate: str) -> Iterator[None]:
    """Cap loopback with a tbf qdisc for the duration (needs root); always removed afterwards."""
    if not rate:
        yield
        return
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb",
                    "latency", "50ms"], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="file size, MiB")
    ap.add_argument("--chunk-size", type=int, default=4, help="chunk size, MiB")
    ap.add_argument("--read-size", type=int, default=128, help="read size, KiB")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--readahead", type=int, default=8, help="read-ahead window, MiB")
    ap.add_argument("--rate", default="", help="tbf rate on lo for the run, e.g. 200mbit ('' = unshaped)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="blobbench-") as tmp, shaped(args.rate):
        work = Path(tmp)
        t = time.perf_counter()
        entry, want = build(work / "blob", args.size * MiB, args.chunk_size * MiB)
        blob_size = (work / "blob").stat().st_size
        print(
            f"built {args.size} MiB file as {blob_size / MiB:.1f} MiB blob, "
            f"{len(entry.chunks)} chunks, in {time.perf_counter() - t:.1f}s"
        )
        reg = start_registry(work / "registry")
        try:
            digest = push_blob(reg.url, "bench/blob", (work / "blob").read_bytes())
            url = f"{reg.url}/v2/bench/blob/blobs/{digest}"
            subprocess.run(["curl", "-s", "-o", "/dev/null", url], check=True)  # registry's page cache warm
            out = subprocess.run(
                ["curl", "-s", "-o", "/dev/null", "-w", "%{time_total}", url],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            curl_s = float(out)
            print(f"link                 {args.rate or 'unshaped loopback'}")
            print(f"curl whole blob      {blob_size / MiB / curl_s:8.1f} MiB/s  ({curl_s:.2f}s)")

            config = ReaderConfig(readahead_bytes=args.readahead * MiB)

            async def run() -> None:
                async with RegistryClient(FetchConfig()) as client:
                    source = RegistryRangeSource(client, f"{reg.host}/bench/blob", [digest])
                    cache = ChunkCache(work / "cache", 4 * args.size * MiB)
                    el, got = await read_all(source, [digest], cache, entry, args.read_size << 10, 1, config)
                    assert got == want, "bytes differ"
                    print(f"cold seq {args.read_size:4d} KiB    {args.size / el:8.1f} MiB/s  ({el:.2f}s)  "
                          f"wire {blob_size / MiB / el:.1f} MiB/s, ratio to curl {curl_s / el:.2f}")
                    el, got = await read_all(source, [digest], cache, entry, args.read_size << 10, 1, config)
                    assert got == want, "bytes differ"
                    print(f"warm seq {args.read_size:4d} KiB    {args.size / el:8.1f} MiB/s  ({el:.2f}s)")
                    cache2 = ChunkCache(work / "cache2", 4 * args.size * MiB)
                    el, _ = await read_all(source, [digest], cache2, entry, args.read_size << 10, args.parallel, config)
                    print(f"cold {args.parallel} readers       {args.size / el:8.1f} MiB/s  ({el:.2f}s)")

            trio.run(run)
        finally:
            reg.stop()


if __name__ == "__main__":
    main()
