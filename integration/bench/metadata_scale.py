"""Benchmark (not a test): how a layer's metadata parse and its mount tree grow with its files.

The cold-start image's big layer holds 11,225 entries; an ML image's site-packages and CUDA
libraries hold ten to twenty times more, and a lazy pull pays for them before the container
starts: containerd's Prepare of a layer waits for its metadata to parse, and the image's mount
process holds the parsed index and the merged tree for as long as it serves. This measures both
against the number of files, with no registry, containerd or FUSE:

1. builds a synthetic layer tar of N regular files (a site-packages-like tree: directories of 20
   files under 50 packages each, one symlink per 50 files, sizes 100-4,000 bytes, a new mtime
   second every 500 files, as an installer leaves them; deterministic) and converts it with our
   writers to eStargz, zstd:chunked and Nydus (cached under `--cache`, keyed by N and RECIPE);
2. per format and N, in a fresh interpreter: parses the layer's metadata bytes (the eStargz TOC
   member, the zstd:chunked manifest, the Nydus bootstrap layer) with
   `formats.metadata_parse.parse_metadata`, GC paused, as the spare mount process does, then builds
   the mount tree (`fusefs.tree.build_tree`, one run, GC paused, as the mount does);
3. reports seconds of each, the entries, and memory: the growth of the process's resident set
   while it holds the index, then the index and the tree (VmRSS), and the growth of its peak
   (VmHWM), also per entry.

    .venv/bin/python -m integration.bench.metadata_scale --files 10000,50000,200000 \
        [--formats estargz,zstdchunked,nydus] [--out DIR]

The numbers are this machine's; `--out` gets `results.csv` and `report.md`.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import random
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from snapshotter.formats.metadata_parse import MetadataParse

REPO_ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("estargz", "zstdchunked", "nydus")
FILES_PER_DIR = 20
DIRS_PER_PACKAGE = 50
SYMLINK_EVERY = 50
FIRST_MTIME = 1_700_000_000
FILES_PER_SECOND = 500  # mtimes as an installer leaves them: a few hundred files written per second
RECIPE = 2  # part of the cache directory's name: bump it when build_tar's output changes
LAYER_DIGEST = "sha256:" + "5c" * 32  # the parse only names the layer with it
MEASURE_TIMEOUT = 900.0


@dataclass(frozen=True)
class Layer:
    """One synthetic layer: its file count and what the tar holds in all."""

    files: int
    entries: int  # regular files, directories and symlinks in the tar


def build_tar(files: int, out: Path) -> Layer:
    """Write the synthetic layer tar of `files` regular files to `out` (see the module docstring)."""
    rnd = random.Random(files)
    entries = 0
    seen_dirs: set[str] = set()
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:

        def add_dir(name: str) -> None:
            nonlocal entries
            parts = name.split("/")
            for depth in range(1, len(parts) + 1):
                path = "/".join(parts[:depth])
                if path not in seen_dirs:
                    seen_dirs.add(path)
                    info = tarfile.TarInfo(path)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, FIRST_MTIME
                    tf.addfile(info)
                    entries += 1

        directory = ""
        for i in range(files):
            if i % FILES_PER_DIR == 0:
                d = i // FILES_PER_DIR
                directory = f"usr/lib/python3/dist-packages/pkg{d // DIRS_PER_PACKAGE:05d}/module{d:06d}"
                add_dir(directory)
            size = rnd.randint(100, 4000)
            data = (f"def function_{i}(x):\n    return x * {i}\n" * (size // 30 + 1)).encode()[:size]
            info = tarfile.TarInfo(f"{directory}/file_{i:07d}_{rnd.getrandbits(32):08x}.py")
            info.size, info.mode, info.mtime = len(data), 0o644, FIRST_MTIME + i // FILES_PER_SECOND
            tf.addfile(info, io.BytesIO(data))
            entries += 1
            if i % SYMLINK_EVERY == SYMLINK_EVERY - 1:
                link = tarfile.TarInfo(f"{directory}/link_{i:07d}.py")
                link.type, link.linkname, link.mtime = tarfile.SYMTYPE, info.name.rsplit("/", 1)[1], info.mtime
                tf.addfile(link)
                entries += 1
    return Layer(files, entries)


def convert(tar: Path, fmt: str, out: Path) -> None:
    """Write the metadata file of `tar` in `fmt`: the whole blob (eStargz, zstd:chunked), or the
    bootstrap layer, a gzip'd tar holding image/image.boot (Nydus; its data blob is dropped)."""
    from snapshotter.formats.estargz_writer import write_estargz
    from snapshotter.formats.rafs_writer import write_nydus
    from snapshotter.formats.zstdchunked import write_zstdchunked

    tmp = out.with_suffix(".tmp")
    if fmt == "estargz":
        with tar.open("rb") as src, tmp.open("wb") as dst:
            write_estargz(src, dst)
    elif fmt == "zstdchunked":
        with tar.open("rb") as src, tmp.open("wb") as dst:
            write_zstdchunked(src, dst)
    elif fmt == "nydus":
        blob = out.with_suffix(".blob")
        with tar.open("rb") as src, blob.open("wb") as sink:
            result = write_nydus([src], lambda _i: sink)
        blob.unlink()
        layer = io.BytesIO()
        with tarfile.open(fileobj=layer, mode="w") as tf:
            info = tarfile.TarInfo("image/image.boot")
            info.size = len(result.bootstrap)
            tf.addfile(info, io.BytesIO(result.bootstrap))
        tmp.write_bytes(gzip.compress(layer.getvalue(), 6))
    else:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    tmp.replace(out)


def metadata_of(fmt: str, path: Path) -> tuple[MetadataParse, bytes]:
    """(the MetadataParse, the bytes) the daemon would hand the spare for this file."""
    from snapshotter.formats import estargz, zstdchunked
    from snapshotter.formats.metadata_parse import ESTARGZ, NYDUS_BOOTSTRAP, ZSTD_CHUNKED, MetadataParse, position_doc

    data = path.read_bytes()
    limit = 1 << 32
    if fmt == "estargz":
        footer = estargz.parse_footer(data[-estargz.FOOTER_SIZE:])
        off, length = estargz.toc_range(footer, len(data))
        return (MetadataParse(ESTARGZ, LAYER_DIGEST, len(data), limit, toc_offset=footer.toc_offset),
                data[off:off + length])
    if fmt == "zstdchunked":
        pos = zstdchunked.parse_footer(data[-zstdchunked.FOOTER_SIZE:], blob_size=len(data))
        return (MetadataParse(ZSTD_CHUNKED, LAYER_DIGEST, len(data), limit, position=position_doc(pos)),
                data[pos.offset:pos.offset + pos.compressed_size])
    return MetadataParse(NYDUS_BOOTSTRAP, LAYER_DIGEST, len(data), limit), data


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(fmt: str, path: Path) -> dict[str, float]:
    """Parse and build the tree of one metadata file in this process (the `--measure` child)."""
    import gc

    from snapshotter.formats.metadata_parse import parse_metadata
    from snapshotter.fusefs.tree import build_tree
    from snapshotter.gcpause import gc_paused

    parse, data = metadata_of(fmt, path)
    metadata_bytes = len(data)
    gc.collect()
    rss0, hwm0 = _status_kib("VmRSS"), _status_kib("VmHWM")
    began = time.perf_counter()
    with gc_paused():
        index = parse_metadata(parse, data)
    parsed = time.perf_counter()
    del data
    gc.collect()
    rss1 = _status_kib("VmRSS")
    with gc_paused():
        tree = build_tree([[index]])
    built = time.perf_counter()
    rss2, hwm2 = _status_kib("VmRSS"), _status_kib("VmHWM")
    return {"entries": len(index.entries), "inodes": len(tree), "metadata_bytes": metadata_bytes,
            "parse_seconds": parsed - began, "tree_seconds": built - parsed,
            "index_mib": (rss1 - rss0) / 1024, "index_tree_mib": (rss2 - rss0) / 1024,
            "peak_mib": (hwm2 - hwm0) / 1024}


@dataclass(frozen=True)
class Row:
    format: str
    files: int
    entries: int
    metadata_mb: float
    parse_s: float
    tree_s: float
    parse_us_per_entry: float
    index_mib: float
    index_tree_mib: float
    bytes_per_entry: int
    peak_mib: float


def run_child(fmt: str, path: Path, files: int) -> Row:
    """`measure` in a fresh interpreter (so that one measurement's memory is not the next's)."""
    proc = subprocess.run([sys.executable, "-m", "integration.bench.metadata_scale", "--measure", fmt, str(path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=MEASURE_TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {fmt} with {files} files ({path}) failed: {proc.stderr.strip()[-2000:]}")
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    entries = int(m["entries"])
    return Row(fmt, files, entries, round(m["metadata_bytes"] / 1e6, 2), round(m["parse_seconds"], 3),
               round(m["tree_seconds"], 3), round(m["parse_seconds"] / entries * 1e6, 2), round(m["index_mib"], 1),
               round(m["index_tree_mib"], 1), round(m["index_tree_mib"] * 2**20 / entries), round(m["peak_mib"], 1))


def prepare(files: int, formats: Sequence[str], cache: Path) -> dict[str, Path]:
    """The metadata file of each format for `files` files, built once (cached in `cache`)."""
    base = cache / f"scale-{files}-r{RECIPE}"
    base.mkdir(parents=True, exist_ok=True)
    tar = base / "layer.tar"
    out: dict[str, Path] = {}
    for fmt in formats:
        path = base / f"layer.{fmt}"
        if not path.exists():
            if not tar.exists():  # written beside and renamed: an interrupted build leaves no tar
                partial = tar.with_suffix(".partial")
                build_tar(files, partial)
                partial.replace(tar)
            convert(tar, fmt, path)
        out[fmt] = path
    return out


def report(rows: Sequence[Row]) -> str:
    head = ("| format | files | entries | metadata MB | parse s | tree s | parse µs / entry | index MiB | "
            "index + tree MiB | bytes / entry | peak MiB |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r.format} | {r.files:,} | {r.entries:,} | {r.metadata_mb} | {r.parse_s:.3f} | {r.tree_s:.3f} "
                     f"| {r.parse_us_per_entry} | {r.index_mib} | {r.index_tree_mib} | {r.bytes_per_entry:,} "
                     f"| {r.peak_mib} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m integration.bench.metadata_scale", description=__doc__.split("\n")[0])
    p.add_argument("--files", default="10000,50000,200000", help="comma-separated file counts")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--cache", type=Path, default=Path("/var/tmp/snapshotter-bench/scale"))
    p.add_argument("--out", type=Path)
    p.add_argument("--measure", nargs=2, metavar=("FORMAT", "FILE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.measure[0], Path(a.measure[1]))))
        return 0
    formats = [f for f in a.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        p.error(f"--formats: unknown {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    try:
        counts = [int(n) for n in a.files.split(",") if n]
    except ValueError:
        p.error(f"--files: {a.files!r} is not a comma-separated list of file counts")
    if not counts or min(counts) <= 0:
        p.error("--files: give at least one positive file count")
    rows: list[Row] = []
    for files in counts:
        for fmt, path in prepare(files, formats, a.cache).items():
            row = run_child(fmt, path, files)
            print(f"{fmt:12} {files:>8,} files: parse {row.parse_s:.3f} s, tree {row.tree_s:.3f} s, "
                  f"index + tree {row.index_tree_mib} MiB ({row.bytes_per_entry} B / entry)", flush=True)
            rows.append(row)
    text = report(rows)
    print(text)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        with (a.out / "results.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
            writer.writeheader()
            writer.writerows(asdict(r) for r in rows)
        (a.out / "report.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
