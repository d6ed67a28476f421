"""Nydus RAFS v6: reader against the real fixture and the kernel's erofs, writer against the kernel.

Needs root (mount, losetup). Every mount/loop device is undone in a finally.
"""

from __future__ import annotations

import dataclasses
import errno
import gzip
import hashlib
import io
import os
import stat
import subprocess
import tarfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotter.errors import DigestMismatch, FormatError, LimitExceeded
from snapshotter.formats import rafs_layout as L
from snapshotter.formats.codec import decompress_chunk
from snapshotter.formats.digest import check_digest, compute_digest
from snapshotter.formats.index import Entry, EntryType, LayerIndex
from snapshotter.formats.lz4block import compress_block, decompress_block
from snapshotter.formats.nydus import blob_ci_range, parse_blob_toc, parse_bootstrap, read_bootstrap_info, write_nydus
from tests.formats.corpus import MTIME, EntryFacts, index_tree, tar_tree, write_corpus_tar

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "nydus"
if not FIXTURES.exists():
    FIXTURES = Path("/work/shared/fixtures/nydus")
BOOT = FIXTURES / "rafs-v6-2.2.boot"
BLOB_ID = "be7d77eeb719f70884758d1aa800ed0fb09d701aaec469964e9d54325f0d5fef"
CAP = 64 << 20


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout.strip()


@contextmanager
def mounted(boot: Path, mnt: Path, devices: list[Path] | None = None) -> Iterator[Path]:
    """Mount `boot` with the kernel's erofs (devices as loop devices via -o device=)."""
    mnt.mkdir(parents=True, exist_ok=True)
    loops: list[str] = []
    try:
        for dev in devices or []:
            loops.append(_run("losetup", "-f", "--show", "-r", str(dev)))
        opts = "ro" + "".join(f",device={lp}" for lp in loops)
        _run("mount", "-t", "erofs", "-o", opts, str(boot), str(mnt))
        try:
            yield mnt
        finally:
            _run("umount", str(mnt))
    finally:
        for lp in loops:
            subprocess.run(["losetup", "-d", lp], check=False, timeout=60)


def kernel_tree(root: Path) -> dict[str, os.stat_result]:
    out = {"": os.lstat(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = os.lstat(p)
    return out


def kernel_facts(root: Path) -> dict[str, EntryFacts]:
    """The mounted tree as corpus EntryFacts (hard links appear as regular files)."""
    import hashlib

    kinds = {stat.S_IFDIR: "dir", stat.S_IFREG: "reg", stat.S_IFLNK: "symlink", stat.S_IFCHR: "char",
             stat.S_IFBLK: "block", stat.S_IFIFO: "fifo"}
    out = {}
    for name, st_ in kernel_tree(root).items():
        path = root / name if name else root
        kind = kinds[stat.S_IFMT(st_.st_mode)]
        sha = None
        if kind == "reg":
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
                    h.update(block)
            sha = h.hexdigest()
        xattrs = tuple(sorted((k, _getxattr(path, k)) for k in os.listxattr(path, follow_symlinks=False)))
        dev = (os.major(st_.st_rdev), os.minor(st_.st_rdev)) if kind in ("char", "block") else (0, 0)
        out[name] = EntryFacts(kind, stat.S_IMODE(st_.st_mode), st_.st_uid, st_.st_gid, int(st_.st_mtime),
                               st_.st_size if kind == "reg" else 0, os.readlink(path) if kind == "symlink" else "",
                               dev, xattrs, sha)
    return out


_BAD_CAPS = b"<kernel rejects malformed security.capability>"


def _getxattr(path: Path, key: str) -> bytes:
    try:
        return os.getxattr(path, key, follow_symlinks=False)
    except OSError as exc:
        # The corpus's 4-byte security.capability is no valid vfs_cap_data, so the kernel's
        # capability code answers EINVAL instead of the raw bytes; listxattr still names it.
        if key == "security.capability" and exc.errno == errno.EINVAL:
            return _BAD_CAPS
        raise


def resolve_hardlinks(tree: dict[str, EntryFacts], *, kernel_view: bool = False) -> dict[str, EntryFacts]:
    """Hard links as their target's facts; with kernel_view, malformed caps as the kernel shows them."""
    out = {n: (tree[f.link] if f.type == "hardlink" else f) for n, f in tree.items()}
    if kernel_view:
        for n, f in out.items():
            xs = tuple((k, _BAD_CAPS if k == "security.capability" and len(v) not in (12, 20, 24) else v)
                       for k, v in f.xattrs)
            out[n] = dataclasses.replace(f, xattrs=xs)
    return out


def device_images(index_data: bytes, blobs: list[bytes], out_dir: Path) -> list[Path]:
    """Uncompressed blob devices: every chunk of the chunk table at its uncompressed offset."""
    info = read_bootstrap_info(index_data, max_bootstrap_bytes=CAP)
    paths = []
    for bi, (entry, blob) in enumerate(zip(info.blobs, blobs, strict=True)):
        path = out_dir / f"dev{bi}.img"
        with open(path, "wb") as f:
            f.truncate(max(entry.uncompressed_size, 4096))
            for c in info.chunk_table:
                if c.blob_index != bi:
                    continue
                comp = L.BLOB_COMPRESSION[entry.compression_algo] if c.flags & L.CHUNK_COMPRESSED else None
                from snapshotter.formats.codec import decompress_prefix
                from snapshotter.formats.index import Compression

                raw = blob[c.compressed_offset:c.compressed_offset + c.compressed_size]
                plain = decompress_prefix(comp or Compression.NONE, raw, c.uncompressed_size)
                assert len(plain) == c.uncompressed_size
                f.seek(c.uncompressed_offset)
                f.write(plain)
        paths.append(path)
    return paths


def fsck_erofs(boot: Path, devs: list[Path], extract: Path | None = None) -> None:
    """erofs-utils' fsck.erofs (a second, independent EROFS implementation) accepts the image."""
    cmd = ["fsck.erofs", *[f"--device={d}" for d in devs]]
    if extract is not None:
        cmd.append(f"--extract={extract}")
    r = subprocess.run([*cmd, str(boot)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "<E>" not in r.stdout + r.stderr, r.stdout + r.stderr


def reader_for(blobs: list[bytes], verify: bool = True):  # type: ignore[no-untyped-def]
    def read(e: Entry) -> bytes:
        out = bytearray()
        for c in e.chunks:
            plain = decompress_chunk(c, blobs[c.blob_index][c.blob_offset:c.blob_offset + c.blob_size])
            if verify and c.digest:
                check_digest(c.digest, plain, f"{e.name}@{c.file_offset}")
            out += plain
        return bytes(out)
    return read


# ---------------------------------------------------------------------------------------------
# The real fixture
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fixture_index() -> LayerIndex:
    return parse_bootstrap(BOOT.read_bytes(), max_bootstrap_bytes=CAP)


def test_fixture_index_facts(fixture_index: LayerIndex) -> None:
    idx = fixture_index
    assert idx.format == "nydus"
    assert idx.blobs == (BLOB_ID,)
    assert [e.name for e in idx.entries] == ["", "lib.rs", "sync_io.rs"]
    lib, sync = idx["lib.rs"], idx["sync_io.rs"]
    assert (lib.size, sync.size) == (16931, 13400)
    assert lib.mtime_ns == 1676819553_628661334
    c0, c1 = lib.chunks[0], sync.chunks[0]
    assert (c0.blob_offset, c0.blob_size, c1.blob_offset, c1.blob_size) == (0, 4828, 4828, 2974)
    assert c0.compression.value == "zstd" and c0.digest and c0.digest.startswith("blake3:")


def test_fixture_matches_kernel_tree_and_bytes(fixture_index: LayerIndex, tmp_path: Path) -> None:
    blob = (FIXTURES / BLOB_ID).read_bytes()
    read = reader_for([blob])  # verifies each chunk's blake3 digest from the bootstrap
    ours = {e.name: e for e in fixture_index.entries}
    devs = device_images(BOOT.read_bytes(), [blob], tmp_path)
    fsck_erofs(BOOT, devs)
    info = read_bootstrap_info(BOOT.read_bytes(), max_bootstrap_bytes=CAP)
    assert sorted(c.uncompressed_offset for c in info.chunk_table) == [0, 0x5000]
    with mounted(BOOT, tmp_path / "mnt", devs) as mnt:
        ktree = kernel_tree(mnt)
        assert set(ktree) == set(ours)
        for name, st_ in ktree.items():
            e = ours[name]
            assert stat.S_IFMT(st_.st_mode) == (stat.S_IFDIR if e.type is EntryType.DIR else stat.S_IFREG)
            assert stat.S_IMODE(st_.st_mode) == e.mode
            assert st_.st_nlink == e.nlink
            assert st_.st_mtime_ns == e.mtime_ns
            assert (st_.st_uid, st_.st_gid) == (e.uid, e.gid)
            if e.type is EntryType.REG:
                assert st_.st_size == e.size
                assert (mnt / name).read_bytes() == read(e)


# ---------------------------------------------------------------------------------------------
# Writer round trips
# ---------------------------------------------------------------------------------------------

def _write(tars: list[Path], out_dir: Path, **kw: object) -> tuple[Path, list[bytes], object]:
    files: list[BinaryIO] = []

    def blob_out(i: int) -> BinaryIO:
        f = open(out_dir / f"blob{i}", "wb")  # noqa: SIM115
        files.append(f)
        return f

    with ExitStack() as stack:
        streams = [stack.enter_context(open(t, "rb")) for t in tars]
        result = write_nydus(streams, blob_out, **kw)  # type: ignore[arg-type]
    for f in files:
        f.close()
    boot = out_dir / "image.boot"
    boot.write_bytes(result.bootstrap)
    blobs = [(out_dir / f"blob{i}").read_bytes() for i in range(len(tars))]
    return boot, blobs, result


def _skip_whiteouts(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.startswith(".wh.")


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus_tar(tmp_path_factory.mktemp("corpus") / "corpus.tar")


def test_writer_corpus_100mb_kernel_and_reader(big_corpus: Path, tmp_path: Path) -> None:
    boot, blobs, result = _write([big_corpus], tmp_path, prefetch=["data/text", "bin"])
    expected = resolve_hardlinks(tar_tree(big_corpus, skip=_skip_whiteouts))
    # our reader
    idx = parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP)
    assert idx.blobs == result.blob_ids  # type: ignore[attr-defined]
    assert idx.blobs[0] == compute_digest("sha256", blobs[0]).removeprefix("sha256:")
    assert resolve_hardlinks(index_tree(idx, reader_for(blobs))) == expected
    assert idx.prefetch == ("data/text", "bin/hello", "bin/suid")
    assert result.deduplicated_chunks >= 2  # type: ignore[attr-defined]  # the zero runs of sparse-like
    big = idx["data/big.bin"]
    assert big.size == 100 * 1024 * 1024 and len(big.chunks) == 100
    # the kernel
    devs = device_images(boot.read_bytes(), blobs, tmp_path)
    fsck_erofs(boot, devs)
    with mounted(boot, tmp_path / "mnt", devs) as mnt:
        assert kernel_facts(mnt) == resolve_hardlinks(expected, kernel_view=True)
        a, b = os.lstat(mnt / "etc/passwd"), os.lstat(mnt / "etc/hardlink-to-passwd")
        assert a.st_ino == b.st_ino and a.st_nlink == b.st_nlink == 2
        assert os.lstat(mnt / "deep").st_nlink == 3


def _lower_layer(path: Path) -> Path:
    text = b"".join(b"line %d of a compressible text file\n" % i for i in range(200_000))
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        def add(name: str, type_: bytes, data: bytes = b"", mode: int = 0o644) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.size = type_, mode, MTIME - 5, len(data)
            tf.addfile(info, io.BytesIO(data) if data else None)
        add("data", tarfile.DIRTYPE, mode=0o711)
        add("data/deleted", tarfile.REGTYPE, b"gone\n")
        add("data/lower-text", tarfile.REGTYPE, text)  # same bytes as the corpus's data/text
        add("opaque", tarfile.DIRTYPE, mode=0o755)
        add("opaque/hidden", tarfile.REGTYPE, b"hidden\n")
        add("opaque/sub", tarfile.DIRTYPE, mode=0o755)
        add("opaque/sub/deeper", tarfile.REGTYPE, b"deeper\n")
        add("etc", tarfile.DIRTYPE, mode=0o700)
        add("etc/passwd", tarfile.REGTYPE, b"old passwd\n")
        add("lower-only", tarfile.REGTYPE, b"lower\n")
    return path


def test_writer_two_layers_whiteouts_and_dedup(tmp_path: Path) -> None:
    lower = _lower_layer(tmp_path / "lower.tar")
    upper = write_corpus_tar(tmp_path / "upper.tar", big_size=3 << 20)
    boot, blobs, result = _write([lower, upper], tmp_path)
    lower_tree = tar_tree(lower)
    expected = {n: f for n, f in lower_tree.items()
                if n not in ("data/deleted",) and not n.startswith("opaque/")}
    expected.update(tar_tree(upper, skip=_skip_whiteouts))
    expected = resolve_hardlinks(expected)
    assert "data/deleted" in lower_tree  # the whiteout data/.wh.deleted must remove it
    # upper's data/.wh.deleted and the opaque marker are gone; lower's opaque/* too
    idx = parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP)
    assert len(idx.blobs) == 2
    assert resolve_hardlinks(index_tree(idx, reader_for(blobs))) == expected
    # data/text (layer 1) reuses layer 0's chunks of the identical data/lower-text
    assert {c.blob_index for c in idx["data/text"].chunks} == {0}
    assert idx["data/text"].chunks == idx["data/lower-text"].chunks
    assert result.deduplicated_chunks >= 8  # type: ignore[attr-defined]
    devs = device_images(boot.read_bytes(), blobs, tmp_path)
    with mounted(boot, tmp_path / "mnt", devs) as mnt:
        assert kernel_facts(mnt) == resolve_hardlinks(expected, kernel_view=True)
    fsck_erofs(boot, devs, extract=tmp_path / "extracted")
    extracted = kernel_facts(tmp_path / "extracted")
    for name, facts in expected.items():
        got = extracted[name]
        assert (got.type, got.size, got.sha256, got.link) == (facts.type, facts.size, facts.sha256, facts.link)


def _three_files_tar(path: Path) -> dict[str, bytes]:
    """A tar with "a/first", "b/middle" (3 chunks of 16 KiB) and "z/wanted", in that order."""
    rand = hashlib.sha256(b"prefetch-first").digest()
    files = {"a/first": rand * 700, "b/middle": os.urandom(40_000), "z/wanted": os.urandom(20_000)}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), MTIME
            tf.addfile(info, io.BytesIO(data))
    return files


def _assert_files_read_back(boot: Path, blobs: list[bytes], idx: LayerIndex, files: dict[str, bytes],
                            tmp_path: Path) -> None:
    """The bytes are unchanged: our reader and the kernel's erofs read the same files."""
    read = reader_for(blobs)
    assert {name: read(idx[name]) for name in files} == files
    devs = device_images(boot.read_bytes(), blobs, tmp_path)
    with mounted(boot, tmp_path / "mnt", devs) as mnt:
        assert {name: (mnt / name).read_bytes() for name in files} == files


class _OneWay(io.RawIOBase):
    """A stream that cannot seek (a pipe, say)."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        return self._f.readinto(b)


@pytest.mark.parametrize("listed", ["z/wanted", "z"])
def test_writer_puts_prefetch_files_first_in_the_blob(listed: str, tmp_path: Path) -> None:
    # As nydus-image lays a blob out: the prefetch files' chunks at its head, so a mount's
    # prefetch of them is one run of the blob, not ranges scattered over it.
    files = _three_files_tar(tmp_path / "l.tar")
    boot, blobs, result = _write([tmp_path / "l.tar"], tmp_path, chunk_size=16 << 10, prefetch=[listed])
    idx = parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP)
    assert idx.prefetch == ("z/wanted",)
    # The second pass takes the listed file's chunks from the first (its bytes are not stored twice
    # and deduplicated; no two chunks of these files hold the same bytes).
    assert result.deduplicated_chunks == 0  # type: ignore[attr-defined]
    wanted = idx["z/wanted"].chunks
    others = [c for name in ("a/first", "b/middle") for c in idx[name].chunks]
    assert [c.blob_offset for c in wanted][0] == 0
    assert max(c.blob_offset + c.blob_size for c in wanted) <= min(c.blob_offset for c in others)
    _assert_files_read_back(boot, blobs, idx, files, tmp_path)


@pytest.mark.parametrize(("listed", "order"), [
    (["z/wanted", "a/first"], ["z/wanted", "a/first", "b/middle"]),
    (["b", "z/wanted", "a"], ["b/middle", "z/wanted", "a/first"]),  # a file at its directory's position
    (["z/wanted", "", "b/middle"], ["z/wanted", "a/first", "b/middle"]),  # the root lists the rest in tar order
])
def test_writer_lays_prefetch_files_out_in_list_order(listed: list[str], order: list[str], tmp_path: Path) -> None:
    # A mount's prefetch streams the region in blob order: the list's order is the order its
    # files come in (the converter puts the start-up files first in it).
    files = _three_files_tar(tmp_path / "l.tar")
    boot, blobs, result = _write([tmp_path / "l.tar"], tmp_path, chunk_size=16 << 10, prefetch=listed)
    idx = parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP)
    assert result.deduplicated_chunks == 0  # type: ignore[attr-defined]
    spans = {name: (idx[name].chunks[0].blob_offset, idx[name].chunks[-1].blob_offset) for name in files}
    assert spans[order[0]][0] == 0
    assert spans[order[0]][1] < spans[order[1]][0] <= spans[order[1]][1] < spans[order[2]][0]
    _assert_files_read_back(boot, blobs, idx, files, tmp_path)


def test_writer_stores_a_listed_sparse_file_with_its_holes(tmp_path: Path) -> None:
    # A PAX sparse member stores only its data segments: read at its data offset it would be wrong.
    src = tmp_path / "src"
    src.mkdir()
    (src / "plain").write_bytes(os.urandom(30_000))
    with open(src / "holes", "wb") as f:
        f.write(b"start of a sparse file\n")
        f.seek(300_000)
        f.write(b"its end\n")
    tar = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "--format=posix", "-cf", str(tar), "-C", str(src), "plain", "holes"],
                   check=True, timeout=60)
    with tarfile.open(tar) as tf:
        assert tf.getmember("holes").issparse()  # else this file system kept no holes to test
    files = {name: (src / name).read_bytes() for name in ("plain", "holes")}
    boot, blobs, _ = _write([tar], tmp_path, chunk_size=16 << 10, prefetch=["holes", "plain"])
    idx = parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP)
    _assert_files_read_back(boot, blobs, idx, files, tmp_path)


def test_writer_keeps_tar_order_of_prefetch_files_in_a_compressed_tar(tmp_path: Path) -> None:
    # Its data offsets are in the decompressed tar: the first pass reads it as a stream, in order.
    files = _three_files_tar(tmp_path / "l.tar")
    packed = io.BytesIO(gzip.compress((tmp_path / "l.tar").read_bytes()))
    result = write_nydus([packed], lambda i: io.BytesIO(), chunk_size=16 << 10, prefetch=["z/wanted", "a/first"])
    idx = parse_bootstrap(result.bootstrap, max_bootstrap_bytes=CAP)
    offsets = {name: idx[name].chunks[0].blob_offset for name in files}
    assert offsets["a/first"] == 0 and offsets["a/first"] < offsets["z/wanted"] < offsets["b/middle"]


def test_writer_keeps_tar_order_when_the_stream_cannot_seek(tmp_path: Path) -> None:
    files = _three_files_tar(tmp_path / "l.tar")
    result = write_nydus([_OneWay((tmp_path / "l.tar").read_bytes())], lambda i: io.BytesIO(),
                         chunk_size=16 << 10, prefetch=["z/wanted"])
    idx = parse_bootstrap(result.bootstrap, max_bootstrap_bytes=CAP)
    assert idx.prefetch == ("z/wanted",)
    offsets = {name: idx[name].chunks[0].blob_offset for name in files}
    assert offsets["a/first"] < offsets["b/middle"] < offsets["z/wanted"]


@pytest.mark.parametrize(("compression", "digest"), [("none", "sha256"), ("gzip", "sha256"),
                                                      ("lz4_block", "blake3"), ("zstd", "blake3")])
def test_writer_compressions_round_trip(compression: str, digest: str, tmp_path: Path) -> None:
    tar = write_corpus_tar(tmp_path / "c.tar", big_size=40_000)
    boot, blobs, _ = _write([tar], tmp_path, compression=compression, chunk_size=64 << 10, digest=digest)
    idx = parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP)
    assert all(c.digest and c.digest.startswith(digest + ":") for e in idx.regular_files() for c in e.chunks)
    expected = resolve_hardlinks(tar_tree(tar, skip=_skip_whiteouts))
    assert resolve_hardlinks(index_tree(idx, reader_for(blobs))) == expected
    used = {c.compression.value for e in idx.regular_files() for c in e.chunks}
    assert compression in used
    if compression == "none":
        # an uncompressed blob is itself a usable device for the kernel only once chunks are at
        # their 4K-aligned uncompressed offsets; the chunk table says where they are
        info = read_bootstrap_info(boot.read_bytes(), max_bootstrap_bytes=CAP)
        assert all(c.flags & L.CHUNK_COMPRESSED == 0 for c in info.chunk_table)


def test_writer_many_dir_entries_span_blocks(tmp_path: Path) -> None:
    tar = tmp_path / "many.tar"
    with tarfile.open(tar, "w") as tf:
        for i in range(600):
            info = tarfile.TarInfo(f"dir/file-with-a-longish-name-{i:04d}")
            data = b"%d\n" % i
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
            link = tarfile.TarInfo(f"links/l{i:04d}")
            link.type, link.linkname = tarfile.SYMTYPE, "x" * (i % 300 + 1)
            tf.addfile(link)
        for major, minor in [(259, 300_000), (4095, 0xFFFFF), (0, 256)]:
            dev = tarfile.TarInfo(f"devs/{major}-{minor}")
            dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, major, minor
            tf.addfile(dev)
    boot, blobs, _ = _write([tar], tmp_path)
    idx = parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP)
    expected = tar_tree(tar)
    assert index_tree(idx, reader_for(blobs), skip=lambda n: n in ("", "dir", "links", "devs")) == {
        n: f for n, f in expected.items()}
    devs = device_images(boot.read_bytes(), blobs, tmp_path)
    with mounted(boot, tmp_path / "mnt", devs) as mnt:
        facts = kernel_facts(mnt)
        for n, f in resolve_hardlinks(expected, kernel_view=True).items():
            assert facts[n] == f


# ---------------------------------------------------------------------------------------------
# LZ4 block and digests
# ---------------------------------------------------------------------------------------------

def _lz4_frame_blocks(frame: bytes) -> list[tuple[bool, bytes]]:
    assert frame[:4] == b"\x04\x22\x4d\x18"
    flg = frame[4]
    pos = 7 + (8 if flg & 0x08 else 0)
    out = []
    while True:
        size = int.from_bytes(frame[pos:pos + 4], "little")
        pos += 4
        if size == 0:
            return out
        out.append((bool(size >> 31), frame[pos:pos + (size & 0x7FFFFFFF)]))
        pos += (size & 0x7FFFFFFF) + (4 if flg & 0x10 else 0)


@pytest.mark.parametrize("data", [b"a" * 100_000, os.urandom(3000) + b"xyz" * 9000,
                                  b"".join(b"row %d\n" % i for i in range(30_000))])
def test_lz4_block_decodes_real_lz4_output(data: bytes) -> None:
    frame = subprocess.run(["lz4", "-c", "-B4", "--no-frame-crc"], input=data, capture_output=True,
                           check=True, timeout=60).stdout
    plain = b"".join(raw if stored else decompress_block(raw, max_output=64 << 10)
                     for stored, raw in _lz4_frame_blocks(frame))
    assert plain == data
    assert decompress_block(compress_block(data), max_output=len(data)) == data


@settings(max_examples=200, deadline=2000)
@given(st.binary(max_size=3000), st.integers(min_value=0, max_value=5000))
def test_lz4_block_round_trip_and_bounds(data: bytes, cap: int) -> None:
    block = compress_block(data)
    if data:
        assert decompress_block(block, max_output=len(data)) == data
    assert len(decompress_block(block, max_output=cap)) <= cap if data else True


@settings(max_examples=300, deadline=2000)
@given(st.binary(min_size=1, max_size=300))
def test_lz4_block_hostile_input_typed_errors(data: bytes) -> None:
    try:
        out = decompress_block(data, max_output=1 << 16)
    except FormatError:
        return
    assert len(out) <= 1 << 16


def test_lz4_block_bomb_is_bounded() -> None:
    bomb = bytes([0x1F, 0x41, 0x01, 0x00]) + b"\xff" * 10_000 + b"\x00"  # 1 literal, a ~2.5 MB match
    assert decompress_block(bomb, max_output=100) == b"A" * 100


def test_check_digest_blake3_and_sha256() -> None:
    check_digest("blake3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262", b"", "empty")
    check_digest(compute_digest("sha256", b"x"), b"x", "x")
    with pytest.raises(DigestMismatch):
        check_digest(compute_digest("blake3", b"x"), b"y", "y")
    with pytest.raises(FormatError):
        check_digest("md5:00", b"", "md5")


# ---------------------------------------------------------------------------------------------
# Hostile bootstraps
# ---------------------------------------------------------------------------------------------

def _small_bootstrap() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in [("a/b/c", b"hello" * 100), ("a/x", b"x"), ("top", b"t" * 5000)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.pax_headers = {"SCHILY.xattr.user.k": "v"}
            tf.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("a/link")
        link.type, link.linkname = tarfile.SYMTYPE, "b/c"
        tf.addfile(link)
    buf.seek(0)
    return write_nydus([buf], lambda i: io.BytesIO(), chunk_size=4096).bootstrap


SMALL = _small_bootstrap()
SEEDS = [BOOT.read_bytes(), SMALL]


def _parse_bounded(data: bytes) -> None:
    start = time.monotonic()
    try:
        parse_bootstrap(data, max_bootstrap_bytes=CAP)
    except FormatError:
        pass
    assert time.monotonic() - start < 5


@settings(max_examples=300, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)),
                                        min_size=1, max_size=8))
def test_hostile_byte_flips(seed: bytes, edits: list[tuple[int, int]]) -> None:
    data = bytearray(seed)
    for pos, value in edits:
        # aim most edits at the metadata-heavy first 20 KiB
        data[pos % min(len(data), 20480)] = value
    _parse_bounded(bytes(data))


@settings(max_examples=100, deadline=5000)
@given(st.sampled_from(SEEDS), st.integers(min_value=0, max_value=20480))
def test_hostile_truncation(seed: bytes, length: int) -> None:
    _parse_bounded(seed[:length])


def _patch(data: bytes, off: int, value: bytes) -> bytes:
    return data[:off] + value + data[off + len(value):]


def _root_dirents(data: bytes) -> tuple[int, list[tuple[int, int, int, int]]]:
    """(absolute offset of the root's first dirent block, [(offset, nid, nameoff, ftype)])."""
    info = read_bootstrap_info(data, max_bootstrap_bytes=CAP)
    meta = info.sb.meta_blkaddr * 4096
    root_off = meta + info.sb.root_nid * 32
    ino = L.unpack_inode(data[root_off:root_off + 64])
    inline = ino.layout == L.LAYOUT_FLAT_INLINE and ino.size < 4096
    base = root_off + ino.inode_size + ino.xattr_size if inline else ino.i_u * 4096
    n = L.unpack_dirent(data, base)[1] // 12
    return base, [(base + 12 * i, *L.unpack_dirent(data, base + 12 * i)) for i in range(n)]


def _fixed_corpus() -> list[tuple[str, bytes, type[Exception]]]:
    boot = BOOT.read_bytes()
    cases: list[tuple[str, bytes, type[Exception]]] = [
        ("empty", b"", FormatError),
        ("truncated superblock", boot[:1100], FormatError),
        ("bad magic", _patch(boot, 1024, b"\0\0\0\0"), FormatError),
        ("root nid out of range", _patch(boot, 1024 + 14, (0xFFFF).to_bytes(2, "little")), FormatError),
        ("meta block past end", _patch(boot, 1024 + 40, (0xFFFFFF).to_bytes(4, "little")), FormatError),
        ("blob table past end", _patch(boot, 1152 + 8, (1 << 40).to_bytes(8, "little")), FormatError),
        ("chunk size not power of 2", _patch(boot, 1152 + 20, (12345).to_bytes(4, "little")), FormatError),
        ("two compressions", _patch(boot, 1152, (0x194 | 0x1).to_bytes(8, "little")), FormatError),
        ("blob index mismatch", _patch(boot, 4096 + 64, (7).to_bytes(4, "little")), FormatError),
    ]
    base, ents = _root_dirents(boot)
    root_nid = ents[0][1]
    # lib.rs's dirent pointing back at the root directory: a cycle
    lib = next(e for e in ents if e[1] != root_nid)
    cases.append(("dir cycle", _patch(boot, lib[0], root_nid.to_bytes(8, "little")), FormatError))
    cases.append(("nid out of range", _patch(boot, lib[0], (1 << 40).to_bytes(8, "little")), FormatError))
    # rename lib.rs -> "..x/..": names with '/' are rejected; ".." as a child name is skipped as the
    # parent link, so a crafted "../" style name must not escape
    name_off = base + lib[2]
    cases.append(("slash in name", _patch(boot, name_off, b"a/b"), FormatError))
    cases.append(("NUL in name", _patch(boot, name_off, b"a\0b"), FormatError))
    # huge file size: chunk count beyond what the bootstrap holds
    info = read_bootstrap_info(boot, max_bootstrap_bytes=CAP)
    lib_off = info.sb.meta_blkaddr * 4096 + lib[1] * 32
    cases.append(("huge file size", _patch(boot, lib_off + 8, (1 << 60).to_bytes(8, "little")), FormatError))
    cases.append(("bad layout", _patch(boot, lib_off, (1 | (6 << 1)).to_bytes(2, "little")), FormatError))
    cases.append(("chunk index device 0", _patch(boot, lib_off + 64 + 2, b"\0\0"), FormatError))
    cases.append(("chunk past blob end", _patch(boot, 0x4000 + 48, (1 << 33).to_bytes(8, "little")), FormatError))
    cases.append(("chunk size disagrees", _patch(boot, 0x4000 + 44, (5).to_bytes(4, "little")), FormatError))
    cases.append(("'..' pointing at a file", _patch(boot, ents[1][0], lib[1].to_bytes(8, "little")), FormatError))
    cases.append(("'.' pointing at a file", _patch(boot, ents[0][0], lib[1].to_bytes(8, "little")), FormatError))
    cases.append(("duplicate name", _patch(boot, base + ents[-1][2], b"lib.rs\0\0\0\0"), FormatError))
    # our own bootstrap: a subdirectory's dirent pointing at the root is a cycle too
    small = SMALL
    sbase, sents = _root_dirents(small)
    a = next(e for e in sents if e[1] not in (sents[0][1],) and e[3] == L.FT_DIR)
    cases.append(("cycle via subdir", _patch(small, a[0], sents[0][1].to_bytes(8, "little")), FormatError))
    return cases


@pytest.mark.parametrize("case", _fixed_corpus(), ids=lambda c: c[0])
def test_hostile_fixed_corpus(case: tuple[str, bytes, type[Exception]]) -> None:
    _name, data, exc = case
    start = time.monotonic()
    with pytest.raises(exc):
        parse_bootstrap(data, max_bootstrap_bytes=CAP)
    assert time.monotonic() - start < 5


def test_oversized_bootstrap_is_limit_exceeded() -> None:
    with pytest.raises(LimitExceeded):
        parse_bootstrap(BOOT.read_bytes(), max_bootstrap_bytes=4096)


def _blob_side_tables(boot: bytes, blobs: list[bytes]) -> tuple[dict[int, bytes], dict[int, bytes]]:
    info = read_bootstrap_info(boot, max_bootstrap_bytes=CAP)
    cis, digests = {}, {}
    for i, (entry, blob) in enumerate(zip(info.blobs, blobs, strict=True)):
        toc = parse_blob_toc(entry, blob[len(blob) - entry.toc_size:])
        d = toc["blob.digest"]
        digests[i] = blob[d.compressed_offset:d.compressed_offset + d.compressed_size]
        off, size = blob_ci_range(entry)
        assert entry.ci_compressor == 0
        cis[i] = blob[off:off + size]
        meta = toc["blob.meta"]
        assert (meta.compressed_offset, meta.compressed_size) == (off, size)
        assert hashlib.sha256(cis[i]).digest() == meta.sha256
    return cis, digests


def test_blob_ci_arrays_and_digests_replace_chunk_table(tmp_path: Path) -> None:
    fixture_boot = BOOT.read_bytes()
    fixture_blob = (FIXTURES / BLOB_ID).read_bytes()
    cis, digests = _blob_side_tables(fixture_boot, [fixture_blob])
    # drop the bootstrap chunk table: everything must come from the blob's own tables
    no_table = _patch(fixture_boot, 1152 + 24, bytes(16))
    with pytest.raises(FormatError):
        parse_bootstrap(no_table, max_bootstrap_bytes=CAP)
    from_blob = parse_bootstrap(no_table, max_bootstrap_bytes=CAP, ci_arrays=cis, blob_digests=digests)
    assert from_blob.entries == parse_bootstrap(fixture_boot, max_bootstrap_bytes=CAP).entries

    tar = write_corpus_tar(tmp_path / "c.tar", big_size=3 << 20)
    boot, blobs, _ = _write([tar], tmp_path, chunk_size=256 << 10)
    cis, digests = _blob_side_tables(boot.read_bytes(), blobs)
    no_table = _patch(boot.read_bytes(), 1152 + 24, bytes(16))
    from_blob = parse_bootstrap(no_table, max_bootstrap_bytes=CAP, ci_arrays=cis, blob_digests=digests)
    assert from_blob.entries == parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP).entries


def test_shared_directory_blocks_amplification_is_refused() -> None:
    """1000 directory inodes all pointing at one big directory's blocks: refused, quickly."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(1000):
            tf.addfile(tarfile.TarInfo(f"a/file{i:05d}"), io.BytesIO(b""))
        for i in range(1000):
            d = tarfile.TarInfo(f"e{i:04d}")
            d.type = tarfile.DIRTYPE
            tf.addfile(d)
    buf.seek(0)
    boot = write_nydus([buf], lambda i: io.BytesIO()).bootstrap
    assert len(parse_bootstrap(boot, max_bootstrap_bytes=CAP)) == 2001 + 1
    info = read_bootstrap_info(boot, max_bootstrap_bytes=CAP)
    meta = info.sb.meta_blkaddr * 4096
    _, ents = _root_dirents(boot)
    a_nid = ents[2][1]  # sorted: ".", "..", "a", "e0000", ...
    a = L.unpack_inode(boot[meta + a_nid * 32:meta + a_nid * 32 + 64])
    full = a.size // 4096 * 4096
    assert full >= 3 * 4096
    data = bytearray(boot)
    for _off, nid, _nameoff, ftype in ents[3:]:
        assert ftype == L.FT_DIR
        pos = meta + nid * 32
        data[pos:pos + 2] = (1).to_bytes(2, "little")  # extended, FLAT_PLAIN
        data[pos + 8:pos + 16] = full.to_bytes(8, "little")
        data[pos + 16:pos + 20] = a.i_u.to_bytes(4, "little")
    start = time.monotonic()
    with pytest.raises(FormatError, match="re-reads more bytes|more dirents|bad '.' entry"):
        parse_bootstrap(bytes(data), max_bootstrap_bytes=CAP)
    assert time.monotonic() - start < 5


def test_writer_compact_inodes_kernel_agrees(tmp_path: Path) -> None:
    """compact_inodes=True: 32-byte inodes where possible; reader and kernel agree on every stat."""
    lower = _lower_layer(tmp_path / "lower.tar")
    upper = write_corpus_tar(tmp_path / "upper.tar", big_size=1 << 20)
    odd = tmp_path / "odd.tar"
    with tarfile.open(odd, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, uid, mtime in [("odd/nsec", 0, MTIME + 0.25), ("odd/biguid", 70_000, MTIME),
                                 ("odd/old", 0, 1000.0)]:
            info = tarfile.TarInfo(name)
            info.uid, info.mtime, info.size = uid, mtime, 3  # type: ignore[assignment]
            tf.addfile(info, io.BytesIO(b"abc"))
    boot, blobs, _ = _write([lower, upper, odd], tmp_path, compact_inodes=True)
    idx = parse_bootstrap(boot.read_bytes(), max_bootstrap_bytes=CAP)
    devs = device_images(boot.read_bytes(), blobs, tmp_path)
    sizes = {}
    for path in ("etc/passwd", "odd/nsec", "odd/biguid", "odd/old", "bin"):
        r = subprocess.run(["dump.erofs", *[f"--device={d}" for d in devs], f"--path=/{path}", str(boot)],
                           capture_output=True, text=True, timeout=60, check=True)
        sizes[path] = int(r.stdout.split("Inode size:")[1].split()[0])
    assert sizes == {"etc/passwd": 32, "odd/nsec": 64, "odd/biguid": 64, "odd/old": 32, "bin": 32}
    assert idx["odd/nsec"].mtime_ns == MTIME * 10**9 + 250_000_000
    with mounted(boot, tmp_path / "mnt", devs) as mnt:
        ktree = kernel_tree(mnt)
        assert set(ktree) == {e.name for e in idx.entries}
        for e in idx.entries:
            st_ = ktree[e.name]
            assert (st_.st_mtime_ns, st_.st_uid, st_.st_gid, stat.S_IMODE(st_.st_mode), st_.st_nlink) == (
                e.mtime_ns, e.uid, e.gid, e.mode, e.nlink), e.name
        expected = {n: f for n, f in tar_tree(lower).items()
                    if n != "data/deleted" and not n.startswith("opaque/")}
        expected.update(tar_tree(upper, skip=_skip_whiteouts))
        expected.update(tar_tree(odd))
        facts = kernel_facts(mnt)
        assert facts == resolve_hardlinks(expected, kernel_view=True) | {"odd": facts["odd"]}


_NAME = st.text(alphabet="abcé-_.x", min_size=1, max_size=6).filter(lambda s: s not in (".", "..")
                                                                   and not s.startswith(".wh."))
_SPEC = st.tuples(st.lists(_NAME, min_size=1, max_size=3), st.sampled_from(["reg", "dir", "symlink"]),
                  st.binary(max_size=64), st.integers(0, 20_000), st.integers(0, 0o7777))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_SPEC, max_size=25), st.sampled_from(["zstd", "none", "gzip"]))
def test_writer_reader_round_trip_random_trees(specs: list[tuple[list[str], str, bytes, int, int]],
                                               compression: str) -> None:
    buf = io.BytesIO()
    taken: dict[str, str] = {}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for parts, kind, seed, size, mode in specs:
            name = "/".join(parts)
            parents = ["/".join(parts[:i]) for i in range(1, len(parts))]
            if name in taken or any(taken.get(p, "dir") != "dir" for p in parents):
                continue
            for p in parents:
                if p not in taken:
                    taken[p] = "dir"
                    d = tarfile.TarInfo(p)
                    d.type, d.mode = tarfile.DIRTYPE, 0o755
                    tf.addfile(d)
            taken[name] = kind
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, MTIME
            if kind == "reg":
                data = (seed or b"z") * (size // max(len(seed), 1) + 1)
                data = data[:size]
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.type, info.linkname = tarfile.SYMTYPE, "t" + name
                tf.addfile(info)
    raw = buf.getvalue()
    blob = io.BytesIO()
    blob.close = lambda: None  # type: ignore[method-assign]
    result = write_nydus([io.BytesIO(raw)], lambda i: blob, chunk_size=4096, compression=compression)
    idx = parse_bootstrap(result.bootstrap, max_bootstrap_bytes=CAP)
    tar_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"nydus-hyp-{os.getpid()}.tar"
    tar_path.write_bytes(raw)
    try:
        expected = tar_tree(tar_path)
    finally:
        tar_path.unlink()
    got = index_tree(idx, reader_for([blob.getvalue()]), skip=lambda n: n == "")
    assert got == expected


def test_blob_trailer_records_match_the_fixture_bytes() -> None:
    """Our blob's tar headers and CI header are byte-identical to what nydus 2.2 wrote."""
    from snapshotter.formats.rafs_writer import _ci_header, _tar_header

    blob = (FIXTURES / BLOB_ID).read_bytes()
    for off, name, size in [(7802, "image.blob", 7802), (12442, "blob.meta", 32 + 4096),
                            (13018, "blob.digest", 64), (14042, "rafs.blob.toc", 512)]:
        assert blob[off:off + 512] == _tar_header(name, size)
    assert blob[8346:8346 + 4096] == _ci_header(0x7000_0021, 2, 8314, 32)
    info = read_bootstrap_info(BOOT.read_bytes(), max_bootstrap_bytes=CAP)
    ci = blob[8314:8314 + 32]
    expected = [(c.uncompressed_offset, c.uncompressed_size, c.compressed_offset, c.compressed_size)
                for c in sorted(info.chunk_table, key=lambda c: c.index)]
    assert [L.decode_ci_v1(ci, 16 * i) for i in range(2)] == expected
    assert b"".join(L.encode_ci_v1(*e) for e in expected) == ci


def test_shared_symlink_blocks_amplification_is_refused() -> None:
    """1000 symlink inodes all reading one 4095-byte target block: the byte budget stops it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i, target in [(-1, "x" * 4095)] + [(i, "t") for i in range(1000)]:
            link = tarfile.TarInfo("big" if i < 0 else f"s{i:04d}")
            link.type, link.linkname = tarfile.SYMTYPE, target
            tf.addfile(link)
    buf.seek(0)
    boot = write_nydus([buf], lambda i: io.BytesIO()).bootstrap
    assert parse_bootstrap(boot, max_bootstrap_bytes=CAP)["big"].link_target == "x" * 4095
    info = read_bootstrap_info(boot, max_bootstrap_bytes=CAP)
    meta = info.sb.meta_blkaddr * 4096
    _, ents = _root_dirents(boot)
    big_nid = ents[2][1]  # ".", "..", "big", "s0000", ...
    big = L.unpack_inode(boot[meta + big_nid * 32:meta + big_nid * 32 + 64])
    assert big.layout == L.LAYOUT_FLAT_PLAIN and big.size == 4095
    data = bytearray(boot)
    for _off, nid, _nameoff, ftype in ents[3:]:
        assert ftype == L.FT_SYMLINK
        pos = meta + nid * 32
        data[pos:pos + 2] = (1).to_bytes(2, "little")  # extended, FLAT_PLAIN
        data[pos + 8:pos + 16] = (4095).to_bytes(8, "little")
        data[pos + 16:pos + 20] = big.i_u.to_bytes(4, "little")
    start = time.monotonic()
    with pytest.raises(FormatError, match="re-reads more bytes"):
        parse_bootstrap(bytes(data), max_bootstrap_bytes=CAP)
    assert time.monotonic() - start < 5


def test_chunk_table_decodes_records_when_asked() -> None:
    """ChunkTable: the records of the raw table, decoded one at a time; keys without decoding."""
    from snapshotter.formats.nydus import ChunkTable

    records = [L.ChunkInfo(bytes([i]) * 32, i % 2, L.CHUNK_COMPRESSED, 100 + i, 4096, 1000 * i, 4096 * i, 0, i, 7)
               for i in range(5)]
    table = ChunkTable(b"".join(L.pack_chunk_info(c) for c in records))
    assert len(table) == 5 and list(table) == records
    assert table[-1] == records[4] and table[1:3] == records[1:3]
    assert list(table.keys()) == [(c.blob_index, c.index) for c in records]
    assert table == ChunkTable(b"".join(L.pack_chunk_info(c) for c in records))
    with pytest.raises(IndexError):
        table[5]
    with pytest.raises(ValueError):
        ChunkTable(b"\x00" * 79)
