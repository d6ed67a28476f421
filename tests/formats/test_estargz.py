"""eStargz / legacy stargz reader and writer: round trips, fixed byte facts, hostile input.

The interop tests against containerd and ctr-remote live in test_estargz_interop.py.
"""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import io
import json
import tarfile
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotter.errors import DigestMismatch, FormatError, LimitExceeded
from snapshotter.formats import estargz
from snapshotter.formats.codec import decompress_chunk
from snapshotter.formats.index import (
    NO_PREFETCH_LANDMARK,
    PREFETCH_LANDMARK,
    Entry,
    EntryType,
    Landmark,
    LayerIndex,
)
from tests.formats import corpus
from tests.tars import tar_of

MAX_TOC = 64 << 20


def skip_landmarks(name: str) -> bool:
    return name in (PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK)


def skip_landmarks_and_toc(name: str) -> bool:
    return skip_landmarks(name) or name == estargz.TOC_TAR_NAME


def open_blob(path: Path, layer_digest: str = "sha256:" + "0" * 64, *,
              expected_toc_digest: str | None = None) -> tuple[estargz.Footer, LayerIndex]:
    """Parse a blob file the way the daemon does: footer, then the TOC range only."""
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(max(0, size - estargz.FOOTER_SIZE))
        footer = estargz.parse_footer(f.read())
        off, length = estargz.toc_range(footer, size)
        f.seek(off)
        member = f.read(length)
    index = estargz.parse_toc(member, blob_size=size, layer_digest=layer_digest, max_toc_bytes=MAX_TOC,
                              expected_toc_digest=expected_toc_digest, toc_offset=footer.toc_offset)
    return footer, index


def chunk_reader(path: Path) -> Callable[[Entry], bytes]:
    """read(entry) -> the file's bytes, fetched chunk by chunk from the blob and verified."""

    def read(entry: Entry) -> bytes:
        out = bytearray()
        with path.open("rb") as f:
            for chunk in entry.chunks:
                f.seek(chunk.blob_offset)
                plain = decompress_chunk(chunk, f.read(chunk.blob_size))
                estargz.verify_chunk(chunk, plain)
                out += plain
        assert len(out) == entry.size
        return bytes(out)

    return read


def toc_member(doc: Any, *, raw_json: bytes | None = None, claimed_size: int | None = None,
               tail: bytes | None = None) -> bytes:
    """A TOC gzip member holding `doc` as stargz.index.json (or `raw_json` verbatim)."""
    data = raw_json if raw_json is not None else json.dumps(doc).encode()
    info = tarfile.TarInfo(estargz.TOC_TAR_NAME)
    info.size = len(data) if claimed_size is None else claimed_size
    body = info.tobuf(tarfile.USTAR_FORMAT) + data
    body += tail if tail is not None else b"\x00" * (-len(data) % 512 + 1024)
    return gzip.compress(body, mtime=0)


def blob_with_toc(payload: bytes, member: bytes, *, legacy: bool = False) -> bytes:
    """payload (already gzip members) + TOC member + footer."""
    return payload + member + estargz.footer_bytes(len(payload), legacy=legacy)


def parse_blob(blob: bytes, *, max_toc_bytes: int = MAX_TOC) -> LayerIndex:
    """Footer -> range -> TOC, all from bytes (for hostile-input tests)."""
    footer = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    off, length = estargz.toc_range(footer, len(blob))
    return estargz.parse_toc(blob[off:off + length], blob_size=len(blob), layer_digest="sha256:test",
                             max_toc_bytes=max_toc_bytes, toc_offset=footer.toc_offset)


def read_all(blob: bytes, index: LayerIndex) -> None:
    """Fetch and verify every chunk of every file (used to check hostile blobs fail cleanly)."""
    for e in index.regular_files():
        for c in e.chunks:
            plain = decompress_chunk(c, blob[c.blob_offset:c.blob_offset + c.blob_size])
            estargz.verify_chunk(c, plain)


def small_tar(files: dict[str, bytes]) -> bytes:
    return tar_of(files, mtime=1_700_000_000)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def write_blob(src: Path, dst: Path, **kwargs: Any) -> estargz.EstargzResult:
    with src.open("rb") as s, dst.open("wb") as d:
        return estargz.write_estargz(s, d, **kwargs)


def gunzip_to(blob: Path, out: Path) -> tuple[str, int]:
    """Decompress every member of the blob (what containerd's unpack does); (sha256, length)."""
    h = hashlib.sha256()
    n = 0
    with gzip.open(blob, "rb") as g, out.open("wb") as f:
        for block in iter(lambda: g.read(1 << 20), b""):
            h.update(block)
            n += len(block)
            f.write(block)
    return "sha256:" + h.hexdigest(), n


# ---------------------------------------------------------------------------------------------
# Round trips


BIG = 100 * 1024 * 1024


@pytest.fixture(scope="module")
def big_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, estargz.EstargzResult, int]:
    """The full corpus (100 MiB incompressible file) converted once with default settings."""
    d = tmp_path_factory.mktemp("esgz-big")
    src = corpus.write_corpus_tar(d / "layer.tar", big_size=BIG)
    blob = d / "layer.esgz"
    tracemalloc.start()
    try:
        result = write_blob(src, blob)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return src, blob, result, peak


def test_big_layer_reads_back_chunk_by_chunk(big_case: tuple[Path, Path, estargz.EstargzResult, int]) -> None:
    src, blob, result, _ = big_case
    footer, index = open_blob(blob, result.digest, expected_toc_digest=result.toc_digest)
    assert not footer.legacy
    assert index.format == "estargz"
    assert index.blobs == (result.digest,)
    assert index.toc_digest == result.toc_digest
    assert index.landmark is Landmark.NONE and index.prefetch == ()
    assert corpus.index_tree(index, chunk_reader(blob)) == corpus.tar_tree(src)
    big = index["data/big.bin"]
    assert len(big.chunks) == BIG // (4 << 20)
    assert all(c.digest and c.digest.startswith("sha256:") for c in big.chunks)
    # payloads are separate gzip members, each range ending where the next one starts
    starts = [c.blob_offset for c in big.chunks]
    assert all(a + c.blob_size == b for a, c, b in zip(starts, big.chunks, starts[1:], strict=False))
    assert index["etc/passwd"].nlink == index["etc/hardlink-to-passwd"].nlink == 2
    assert index["etc"].nlink == 2 and index["deep"].nlink == 3


def test_big_layer_converts_with_bounded_memory(
        big_case: tuple[Path, Path, estargz.EstargzResult, int]) -> None:
    *_, peak = big_case
    assert peak < 16 << 20, f"writer peaked at {peak} bytes of Python allocations for a 100 MiB file"


def test_big_blob_gunzips_to_the_source_tar(big_case: tuple[Path, Path, estargz.EstargzResult, int]) -> None:
    src, blob, result, _ = big_case
    plain = blob.parent / "gunzipped.tar"
    diff_id, n = gunzip_to(blob, plain)
    assert result.diff_id == diff_id
    assert result.uncompressed_size == n
    assert result.size == blob.stat().st_size
    assert result.digest == sha256_file(blob)
    assert result.annotations() == {
        "containerd.io/snapshot/stargz/toc.digest": result.toc_digest,
        "io.containers.estargz.uncompressed-size": str(n),
        "containerd.io/snapshot/lazy/tail.size": str(result.size - result.toc_offset),
    }
    assert corpus.tar_tree(plain, skip=lambda name: name == estargz.TOC_TAR_NAME) == corpus.tar_tree(src)
    with tarfile.open(plain) as tf:
        last = tf.getmembers()[-1]
        assert last.name == estargz.TOC_TAR_NAME
        toc_json = tf.extractfile(last).read()  # type: ignore[union-attr]
    assert "sha256:" + hashlib.sha256(toc_json).hexdigest() == result.toc_digest


@pytest.fixture(scope="module")
def small_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # an odd size so the last chunk of the big file is short
    return corpus.write_corpus_tar(tmp_path_factory.mktemp("esgz-small") / "layer.tar",
                                   big_size=(3 << 20) + 12345)


PREFETCH = ["data/text", "/etc/hardlink-to-passwd", "./bin/sh", "no/such/file"]


@pytest.mark.parametrize(("prefetch", "legacy", "chunk_size"), [
    (None, False, 1 << 20),
    ([], False, 4 << 20),
    (PREFETCH, False, 256 << 10),
    (None, True, 1 << 20),
    ([], True, 100_000),
])
def test_small_layer_round_trip(small_src: Path, tmp_path: Path, prefetch: list[str] | None, legacy: bool,
                                chunk_size: int) -> None:
    blob = tmp_path / "layer.esgz"
    result = write_blob(small_src, blob, prefetch=prefetch, legacy=legacy, chunk_size=chunk_size, level=1)
    footer, index = open_blob(blob, result.digest, expected_toc_digest=result.toc_digest)
    assert footer.legacy is legacy
    if not legacy:  # parse_toc's default toc_offset assumes the 51-byte footer
        data = blob.read_bytes()
        off, length = estargz.toc_range(footer, len(data))
        assert estargz.parse_toc(data[off:off + length], blob_size=len(data), layer_digest=result.digest,
                                 max_toc_bytes=MAX_TOC) == index
    assert blob.read_bytes()[-footer.size:] == estargz.footer_bytes(footer.toc_offset, legacy=legacy)
    expected = corpus.tar_tree(small_src)
    assert corpus.index_tree(index, chunk_reader(blob), skip=skip_landmarks) == expected
    diff_id, _ = gunzip_to(blob, tmp_path / "plain.tar")
    assert diff_id == result.diff_id
    assert corpus.tar_tree(tmp_path / "plain.tar", skip=skip_landmarks_and_toc) == expected
    big = index["data/big.bin"]
    assert [c.size for c in big.chunks] == [chunk_size] * (big.size // chunk_size) + (
        [big.size % chunk_size] if big.size % chunk_size else [])
    names = [e.name for e in index.entries]
    if prefetch is None:
        assert index.landmark is Landmark.NONE
        assert not any(skip_landmarks(n) for n in names)
        assert names == list(expected)  # tar order kept
    elif not prefetch:
        assert index.landmark is Landmark.NO_PREFETCH and index.prefetch == ()
        assert names[0] == NO_PREFETCH_LANDMARK and names[1:] == list(expected)
    else:
        assert index.landmark is Landmark.PREFETCH
        # parents first, hard-link targets before links, then the landmark
        assert names[:names.index(PREFETCH_LANDMARK)] == [
            "", "data", "data/text", "etc", "etc/passwd", "etc/hardlink-to-passwd", "bin", "bin/sh"]
        assert index.prefetch == ("data/text", "etc/passwd")
        assert result.missing_prefetch == ("no/such/file",)
        assert index[PREFETCH_LANDMARK].size == 1


def test_legacy_footer_and_toc_range(small_src: Path, tmp_path: Path) -> None:
    """The 51-byte parse fails on a legacy blob's tail and the 47-byte one takes over."""
    blob = tmp_path / "legacy.stargz"
    write_blob(small_src, blob, legacy=True)
    data = blob.read_bytes()
    footer = estargz.parse_footer(data[-estargz.FOOTER_SIZE:])
    assert footer == estargz.Footer(footer.toc_offset, legacy=True)
    assert estargz.toc_range(footer, len(data)) == (footer.toc_offset, len(data) - 47 - footer.toc_offset)


class OneWay(io.RawIOBase):
    """A non-seekable stream over bytes (like a pipe)."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, b: Any) -> int:
        return self._src.readinto(b)


def one_way(data: bytes) -> BinaryIO:
    return cast(BinaryIO, io.BufferedReader(OneWay(data)))


def test_non_seekable_source_streams_to_the_same_blob(small_src: Path) -> None:
    a, b = io.BytesIO(), io.BytesIO()
    with small_src.open("rb") as s:
        ra = estargz.write_estargz(s, a, chunk_size=1 << 20, prefetch=[])
    rb = estargz.write_estargz(one_way(small_src.read_bytes()), b, chunk_size=1 << 20, prefetch=[])
    assert ra == rb and a.getvalue() == b.getvalue()
    with pytest.raises(ValueError, match="seekable"):
        estargz.write_estargz(one_way(small_src.read_bytes()), io.BytesIO(), prefetch=["bin/sh"])


def test_duplicate_tar_names_keep_the_last_entry_or_fail_when_streaming() -> None:
    tar = small_tar({"a": b"one", "b": b"bee", "./a": b"two", ".prefetch.landmark": b"\x0f",
                     "stargz.index.json": b"{}"})
    out = io.BytesIO()
    estargz.write_estargz(io.BytesIO(tar), out)
    index = parse_blob(out.getvalue())
    assert [e.name for e in index.entries] == ["b", "a"]  # old landmark and TOC entries dropped
    blob = out.getvalue()
    a = index["a"]
    assert decompress_chunk(a.chunks[0], blob[a.chunks[0].blob_offset:][:a.chunks[0].blob_size]) == b"two"
    with pytest.raises(FormatError, match="twice"):
        estargz.write_estargz(one_way(tar), io.BytesIO())


def test_binary_xattrs_and_unicode_names_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "layer.tar"
    with tarfile.open(src, "w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("caps/ünïcode-é")
        info.size = 3
        info.pax_headers = {
            "SCHILY.xattr.security.capability": b"\x01\x00\x00\x02\x80\xff\x00\x00".decode("utf-8", "surrogateescape"),
            "SCHILY.xattr.user.ü": "ü",
        }
        tf.addfile(info, io.BytesIO(b"abc"))
    blob = tmp_path / "layer.esgz"
    write_blob(src, blob)
    _, index = open_blob(blob)
    entry = index["caps/ünïcode-é"]
    assert dict(entry.xattrs) == {"security.capability": b"\x01\x00\x00\x02\x80\xff\x00\x00",
                                  "user.ü": "ü".encode()}
    assert corpus.index_tree(index, chunk_reader(blob)) == corpus.tar_tree(src)
    gunzip_to(blob, tmp_path / "plain.tar")
    assert corpus.tar_tree(tmp_path / "plain.tar", skip=skip_landmarks_and_toc) == corpus.tar_tree(src)


@pytest.mark.parametrize("name", ["../evil", "/abs/path", "a/../../b"])
def test_writer_rejects_escaping_names(name: str) -> None:
    with pytest.raises(FormatError):
        estargz.write_estargz(io.BytesIO(small_tar({name: b"x"})), io.BytesIO())


def test_writer_rejects_garbage_and_truncated_tars() -> None:
    with pytest.raises(FormatError):
        estargz.write_estargz(io.BytesIO(b"not a tar" * 100), io.BytesIO())
    tar = small_tar({"f": b"y" * 5000})
    with pytest.raises(FormatError):
        estargz.write_estargz(one_way(tar[:2048]), io.BytesIO())


@pytest.mark.parametrize("prefetch", [None, []])
def test_empty_layer(prefetch: list[str] | None) -> None:
    out = io.BytesIO()
    result = estargz.write_estargz(io.BytesIO(small_tar({})), out, prefetch=prefetch)
    index = parse_blob(out.getvalue())
    assert [e.name for e in index.entries] == ([] if prefetch is None else [NO_PREFETCH_LANDMARK])
    assert result.diff_id == "sha256:" + hashlib.sha256(gzip.decompress(out.getvalue())).hexdigest()


# ---------------------------------------------------------------------------------------------
# Byte facts


GO_FOOTER_0XE8 = ("1f8b08040000000000ff1a00534716003030303030303030303030303030653853544152475a010000ffff"
                  "0000000000000000")


def test_footer_bytes_match_the_go_writer() -> None:
    footer = estargz.footer_bytes(0xE8)
    assert footer.hex() == GO_FOOTER_0XE8
    assert estargz.parse_footer(footer) == estargz.Footer(0xE8, legacy=False)
    assert gzip.decompress(footer) == b""
    legacy = estargz.footer_bytes(0xE8, legacy=True)
    assert len(legacy) == estargz.LEGACY_FOOTER_SIZE and gzip.decompress(legacy) == b""
    assert estargz.parse_footer(b"\x00" * 4 + legacy) == estargz.Footer(0xE8, legacy=True)
    assert estargz.parse_footer(legacy) == estargz.Footer(0xE8, legacy=True)
    assert estargz.toc_range(estargz.Footer(0xE8), 0xE8 + 100 + 51) == (0xE8, 100)
    assert estargz.toc_range(estargz.Footer(0xE8, legacy=True), 0xE8 + 100 + 47) == (0xE8, 100)


def _payload() -> tuple[bytes, int, int]:
    """Two gzip members: a dummy header member, then one member holding b"AAAA" + b"BBBBBB"."""
    first = gzip.compress(b"h" * 512, mtime=0)
    return first + gzip.compress(b"AAAABBBBBB", mtime=0), len(first), len(first + gzip.compress(b"x"))


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_toc_fields_inner_offset_and_metadata() -> None:
    payload, off, _ = _payload()
    doc = {"version": 1, "entries": [
        {"name": "./", "type": "dir", "mode": 0o40755, "modtime": "2023-11-14T22:13:20Z"},
        {"name": "a", "type": "reg", "size": 4, "offset": off, "digest": _sha(b"AAAA"), "mode": 0o100644,
         "uid": 1000, "gid": 1001, "userName": "u", "xattrs": {"user.k": base64.b64encode(b"\x00\xff").decode()}},
        {"name": "b", "type": "reg", "size": 6, "offset": off, "innerOffset": 4, "digest": _sha(b"BBBBBB"),
         "chunkDigest": _sha(b"BBBBBB")},
        {"name": "c", "type": "char", "devMajor": 1, "devMinor": 3, "mode": 0o666},
        {"name": "l", "type": "symlink", "linkName": "/abs/target"},
        {"name": "h", "type": "hardlink", "linkName": "./a"},
        {"name": "p", "type": "fifo"},
        {"name": "z", "type": "reg"},
    ]}
    blob = blob_with_toc(payload, toc_member(doc))
    index = parse_blob(blob)
    root, a, b, c, lnk, h, p, z = index.entries
    assert root.name == "" and root.mode == 0o755 and root.mtime_ns == 1_700_000_000 * 10**9
    assert (a.uid, a.gid, a.mode, a.nlink, dict(a.xattrs)) == (1000, 1001, 0o644, 2, {"user.k": b"\x00\xff"})
    for e, want in ((a, b"AAAA"), (b, b"BBBBBB")):
        (chunk,) = e.chunks
        assert chunk.blob_offset == off and chunk.blob_size == len(payload) - off
        assert chunk.digest == _sha(want)  # a's chunk digest comes from its file digest
        plain = decompress_chunk(chunk, blob[chunk.blob_offset:chunk.blob_offset + chunk.blob_size])
        assert plain == want
        estargz.verify_chunk(chunk, plain)
    with pytest.raises(DigestMismatch):
        estargz.verify_chunk(b.chunks[0], b"BBBBBX")
    assert (c.type, c.dev_major, c.dev_minor) == (EntryType.CHAR, 1, 3)
    assert (lnk.link_target, h.link_target, h.nlink) == ("/abs/target", "a", 2)
    assert p.type is EntryType.FIFO and z.size == 0 and z.chunks == ()


def test_chunked_file_from_toc() -> None:
    data = b"0123456789" * 3
    members = [gzip.compress(data[i:i + 12], mtime=0) for i in (0, 12, 24)]
    head = gzip.compress(b"h" * 512, mtime=0)
    offs = [len(head), len(head) + len(members[0]), len(head) + len(members[0]) + len(members[1])]
    doc = {"version": 1, "entries": [
        {"name": "f", "type": "reg", "size": 30, "offset": offs[0], "chunkSize": 12, "digest": _sha(data),
         "chunkDigest": _sha(data[:12])},
        {"name": "f", "type": "chunk", "offset": offs[1], "chunkOffset": 12, "chunkSize": 12,
         "chunkDigest": _sha(data[12:24])},
        {"name": "f", "type": "chunk", "offset": offs[2], "chunkOffset": 24, "chunkDigest": _sha(data[24:])},
    ]}
    payload = head + b"".join(members)
    blob = blob_with_toc(payload, toc_member(doc))
    (f,) = parse_blob(blob).entries
    assert [(c.file_offset, c.size, c.blob_offset, c.blob_size) for c in f.chunks] == [
        (0, 12, offs[0], len(members[0])), (12, 12, offs[1], len(members[1])), (24, 6, offs[2], len(members[2]))]
    assert [c.digest for c in f.chunks] == [_sha(data[:12]), _sha(data[12:24]), _sha(data[24:])]
    assert f.chunks_for(11, 2) == f.chunks[:2]
    read_all(blob, parse_blob(blob))


def test_toc_digest_mismatch_names_the_layer() -> None:
    payload, off, _ = _payload()
    member = toc_member({"version": 1, "entries": []})
    with pytest.raises(DigestMismatch, match="sha256:layer"):
        estargz.parse_toc(member, blob_size=len(payload) + len(member) + 51, layer_digest="sha256:layer",
                          max_toc_bytes=1 << 20, expected_toc_digest="sha256:" + "1" * 64)


# ---------------------------------------------------------------------------------------------
# Hostile input: fixed corpus


def _base_entries(off: int) -> list[dict[str, Any]]:
    return [{"name": "./", "type": "dir"},
            {"name": "f", "type": "reg", "size": 4, "offset": off, "digest": _sha(b"AAAA")}]


def _hostile_docs(off: int, toc_off: int) -> Iterator[tuple[str, Any]]:
    def with_entry(**fields: Any) -> dict[str, Any]:
        entries = _base_entries(off)
        entries[1] = {**entries[1], **fields}
        return {"version": 1, "entries": entries}

    def plus(*extra: dict[str, Any]) -> dict[str, Any]:
        return {"version": 1, "entries": _base_entries(off) + list(extra)}

    yield "dotdot name", with_entry(name="../f")
    yield "dotdot inside", with_entry(name="a/../../f")
    yield "absolute name", with_entry(name="/etc/f")
    yield "NUL in name", with_entry(name="f\x00g")
    yield "duplicate name", plus({"name": "f", "type": "dir"})
    yield "duplicate via ./", plus({"name": "./f", "type": "symlink", "linkName": "x"})
    yield "offset past TOC", with_entry(offset=toc_off + 10)
    yield "offset at TOC", with_entry(offset=toc_off)
    yield "offset zero", with_entry(offset=0)
    yield "no offset", with_entry(offset=None)
    yield "negative size", with_entry(size=-1)
    yield "string size", with_entry(size="4")
    yield "float size", with_entry(size=4.0)
    yield "bool size", with_entry(size=True)
    yield "absurd size", with_entry(size=1 << 62)
    yield "size over int64", with_entry(size=1 << 70)
    yield "size beyond deflate ratio", with_entry(size=2000 * (toc_off - off))
    yield "negative innerOffset", with_entry(innerOffset=-5)
    yield "huge innerOffset", with_entry(innerOffset=1 << 40)
    yield "chunk first", {"version": 1, "entries": [{"name": "f", "type": "chunk", "offset": off}]}
    yield "chunk after dir", plus({"name": "", "type": "chunk", "offset": off, "chunkOffset": 1})
    yield "chunk of another file", {"version": 1, "entries": [
        {"name": "f", "type": "reg", "size": 8, "offset": off, "chunkSize": 4},
        {"name": "g", "type": "chunk", "offset": off, "chunkOffset": 4}]}
    yield "chunk gap", {"version": 1, "entries": [
        {"name": "f", "type": "reg", "size": 8, "offset": off, "chunkSize": 2},
        {"name": "f", "type": "chunk", "offset": off, "chunkOffset": 4}]}
    yield "chunk overrun", {"version": 1, "entries": [
        {"name": "f", "type": "reg", "size": 4, "offset": off, "chunkSize": 2},
        {"name": "f", "type": "chunk", "offset": off, "chunkOffset": 2, "chunkSize": 9}]}
    yield "chunk beyond size", {"version": 1, "entries": [
        {"name": "f", "type": "reg", "size": 4, "offset": off, "chunkSize": 4},
        {"name": "f", "type": "chunk", "offset": off, "chunkOffset": 4}]}
    yield "empty file with chunks", with_entry(size=0, chunkSize=4)
    yield "chunk after empty file", {"version": 1, "entries": [
        {"name": "f", "type": "reg", "size": 0},
        {"name": "f", "type": "chunk", "offset": off, "chunkOffset": 0, "chunkSize": 4}]}
    yield "hardlink to nothing", plus({"name": "h", "type": "hardlink", "linkName": "nope"})
    yield "hardlink to dir", plus({"name": "h", "type": "hardlink", "linkName": "./"})
    yield "hardlink to root", plus({"name": "h", "type": "hardlink", "linkName": ""})
    yield "hardlink cycle", plus({"name": "h1", "type": "hardlink", "linkName": "h2"},
                                 {"name": "h2", "type": "hardlink", "linkName": "h1"})
    yield "hardlink escaping", plus({"name": "h", "type": "hardlink", "linkName": "../f"})
    yield "symlink without target", plus({"name": "s", "type": "symlink"})
    yield "root is a file", {"version": 1, "entries": [{"name": "./", "type": "reg"}]}
    yield "parent is a file", plus({"name": "f/g", "type": "dir"})
    yield "unknown type", plus({"name": "s", "type": "socket"})
    yield "type missing", plus({"name": "s"})
    yield "bad digest", with_entry(digest="md5:abc")
    yield "bad chunk digest", with_entry(chunkDigest="sha256:XYZ")
    yield "uid too large", with_entry(uid=1 << 40)
    yield "negative dev", plus({"name": "c", "type": "char", "devMajor": -1})
    yield "xattrs not base64", with_entry(xattrs={"user.a": "!!!"})
    yield "xattrs not an object", with_entry(xattrs=["user.a"])
    yield "xattr value not a string", with_entry(xattrs={"user.a": 5})
    yield "empty xattr name", with_entry(xattrs={"": "eA=="})
    yield "modtime garbage", with_entry(modtime="yesterday")
    yield "modtime no zone", with_entry(modtime="2023-11-14T22:13:20")
    yield "modtime not a string", with_entry(modtime=12)
    yield "name not a string", with_entry(name=5)
    yield "entry not an object", {"version": 1, "entries": [5]}
    yield "entries not a list", {"version": 1, "entries": {"a": 1}}
    yield "version 2", {"version": 2, "entries": []}
    yield "version string", {"version": "1", "entries": []}
    yield "version missing", {"entries": []}
    yield "top level list", [1, 2]


def _hostile_raw() -> Iterator[tuple[str, bytes]]:
    yield "NaN", b'{"version": 1, "entries": [{"name": "f", "type": "reg", "size": NaN}]}'
    yield "Infinity", b'{"version": 1, "entries": [], "x": Infinity}'
    yield "deep nesting", b'{"version": 1, "entries": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    yield "invalid utf-8", b'{"version": 1, "entries": [{"name": "\xff", "type": "dir"}]}'
    yield "utf-16", '{"version": 1, "entries": []}'.encode("utf-16")
    yield "empty", b""
    yield "truncated JSON", b'{"version": 1, "entries": [{"name": "f"'
    yield "trailing garbage", b'{"version": 1, "entries": []} x'


@pytest.mark.parametrize("case", [c for c, _ in _hostile_docs(1, 2)] + [c for c, _ in _hostile_raw()])
def test_hostile_toc_is_a_format_error(case: str) -> None:
    payload, off, _ = _payload()
    docs = dict(_hostile_docs(off, len(payload)))
    raws = dict(_hostile_raw())
    member = toc_member(None, raw_json=raws[case]) if case in raws else toc_member(docs[case])
    blob = blob_with_toc(payload, member)
    start = time.monotonic()
    with pytest.raises(FormatError):
        parse_blob(blob)
    assert time.monotonic() - start < 5


def _member_from_body(body: bytes) -> bytes:
    return gzip.compress(body, mtime=0)


def _toc_body(data: bytes) -> bytearray:
    info = tarfile.TarInfo(estargz.TOC_TAR_NAME)
    info.size = len(data)
    return bytearray(info.tobuf(tarfile.USTAR_FORMAT) + data + b"\x00" * (-len(data) % 512 + 1024))


def test_toc_claiming_a_gigabyte_is_refused_before_inflating() -> None:
    payload, _, _ = _payload()
    member = toc_member(None, raw_json=b"{}", claimed_size=1 << 30, tail=b"")
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded, match="1073741824"):
            parse_blob(blob_with_toc(payload, member))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_toc_over_the_configured_cap_is_refused() -> None:
    payload, off, _ = _payload()
    doc = {"version": 1, "entries": [{"name": f"d{i}", "type": "dir"} for i in range(5000)]}
    blob = blob_with_toc(payload, toc_member(doc))
    assert len(parse_blob(blob)) == 5000
    with pytest.raises(LimitExceeded):
        parse_blob(blob, max_toc_bytes=10_000)


def test_toc_gzip_bomb_after_the_json_stays_bounded() -> None:
    payload, _, _ = _payload()
    data = json.dumps({"version": 1, "entries": []}).encode()
    info = tarfile.TarInfo(estargz.TOC_TAR_NAME)
    info.size = len(data)
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    member = z.compress(info.tobuf(tarfile.USTAR_FORMAT) + data)
    zeros = b"\x00" * (1 << 20)
    for _ in range(512):  # 512 MiB of zeros after the JSON, about 500 KiB compressed
        member += z.compress(zeros)
    member += z.flush()
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(FormatError, match="does not end"):
            parse_blob(blob_with_toc(payload, member))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20 and time.monotonic() - start < 5


@pytest.mark.parametrize("mangle", ["name", "checksum", "type", "size-text", "base256", "not-gzip",
                                    "truncated", "crc", "trailing-data"])
def test_bad_toc_member_structure(mangle: str) -> None:
    payload, _, _ = _payload()
    body = _toc_body(json.dumps({"version": 1, "entries": []}).encode())
    if mangle == "name":
        body[0:1] = b"x"
        body[148:156] = b"%06o\x00 " % (sum(body[:148]) + 256 + sum(body[156:512]))
    elif mangle == "checksum":
        body[5] ^= 1
    elif mangle == "type":
        body[156:157] = b"5"
        body[148:156] = b"%06o\x00 " % (sum(body[:148]) + 256 + sum(body[156:512]))
    elif mangle == "size-text":
        body[124:136] = b"zzzzzzzzzzz\x00"
        body[148:156] = b"%06o\x00 " % (sum(body[:148]) + 256 + sum(body[156:512]))
    elif mangle == "base256":
        body[124:136] = b"\x80" + b"\x00" * 10 + b"\x10"
        body[148:156] = b"%06o\x00 " % (sum(body[:148]) + 256 + sum(body[156:512]))
    member = _member_from_body(bytes(body))
    if mangle == "not-gzip":
        member = b"\x00" * len(member)
    elif mangle == "truncated":
        member = member[: len(member) // 2]
    elif mangle == "crc":
        member = member[:-8] + bytes([member[-8] ^ 0xFF]) + member[-7:]
    elif mangle == "trailing-data":
        body += b"junk"
        member = _member_from_body(bytes(body))
    with pytest.raises(FormatError):
        parse_blob(blob_with_toc(payload, member))


def test_toc_member_too_short_or_not_fitting() -> None:
    with pytest.raises(FormatError):
        estargz.parse_toc(b"\x1f\x8b", blob_size=1000, layer_digest="l", max_toc_bytes=1 << 20)
    member = toc_member({"version": 1, "entries": []})
    with pytest.raises(FormatError):
        estargz.parse_toc(member, blob_size=len(member), layer_digest="l", max_toc_bytes=1 << 20)
    with pytest.raises(FormatError):
        estargz.parse_toc(member, blob_size=10**6, layer_digest="l", max_toc_bytes=1 << 20, toc_offset=10**6)


@pytest.mark.parametrize("tail", [
    b"", b"\x00" * 46, b"\x00" * 51, estargz.footer_bytes(5)[:-1],
    estargz.footer_bytes(5).replace(b"STARGZ", b"STARGY"),
    estargz.footer_bytes(5).replace(b"SG", b"SH"),
    estargz.footer_bytes(5).replace(b"\x1a\x00", b"\x1b\x00"),
    estargz.footer_bytes(5).replace(b"0000000000000005", b"-000000000000005"),
    estargz.footer_bytes(5).replace(b"0000000000000005", b"+000000000000005"),
    estargz.footer_bytes(5).replace(b"0000000000000005", b"0x00000000000005"),
    estargz.footer_bytes(5).replace(b"0000000000000005", b"000000000000000g"),
    estargz.footer_bytes(5, legacy=True).replace(b"\x16\x00", b"\x17\x00"),
    b"\x1f\x8b\x08\x00" + estargz.footer_bytes(5)[4:],
])
def test_bad_footers(tail: bytes) -> None:
    with pytest.raises(FormatError):
        estargz.parse_footer(tail)


@pytest.mark.parametrize(("offset", "blob_size"), [(0, 60), (1000, 900), (500, 560), (2**63, 10**6)])
def test_footer_offsets_outside_the_blob(offset: int, blob_size: int) -> None:
    with pytest.raises(FormatError):
        estargz.toc_range(estargz.Footer(offset), blob_size)


# ---------------------------------------------------------------------------------------------
# Hostile input: hypothesis

HYPO = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def _valid_small_blob() -> bytes:
    tar = small_tar({"bin/a": b"hello world\n" * 50, "etc/b": bytes(range(256)) * 40, "c": b""})
    out = io.BytesIO()
    estargz.write_estargz(io.BytesIO(tar), out, chunk_size=4096, prefetch=["etc/b"])
    return out.getvalue()


SMALL_BLOB = _valid_small_blob()


def _parse_and_read(blob: bytes) -> None:
    """Either everything verifies, or a FormatError comes out; anything else fails the test."""
    try:
        index = parse_blob(blob)
        read_all(blob, index)
    except FormatError:
        pass


@HYPO
@given(st.binary(min_size=0, max_size=120))
def test_random_footers(tail: bytes) -> None:
    try:
        footer = estargz.parse_footer(tail)
    except FormatError:
        return
    assert 0 <= footer.toc_offset < 1 << 64


@HYPO
@given(st.data())
def test_bit_flips_anywhere(data: st.DataObject) -> None:
    blob = bytearray(SMALL_BLOB)
    for _ in range(data.draw(st.integers(1, 3))):
        # half of the flips land in the TOC and footer, where parsing happens
        pos = data.draw(st.one_of(st.integers(0, len(blob) - 1),
                                  st.integers(max(0, len(blob) - 400), len(blob) - 1)))
        blob[pos] ^= 1 << data.draw(st.integers(0, 7))
    _parse_and_read(bytes(blob))


@HYPO
@given(st.integers(0, len(SMALL_BLOB) - 1), st.binary(max_size=64))
def test_truncated_or_extended_blobs(cut: int, junk: bytes) -> None:
    _parse_and_read(SMALL_BLOB[:cut])
    _parse_and_read(SMALL_BLOB + junk)


_JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.integers(-5, 5000),
    st.floats(allow_nan=False), st.text(max_size=20), st.sampled_from(["reg", "chunk", "dir", "hardlink",
                                                                     "symlink", "../x", "/a", "f", "./"]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.text(max_size=8), max_size=3),
)
_KEYS = st.sampled_from(["name", "type", "size", "offset", "innerOffset", "chunkOffset", "chunkSize", "mode",
                         "uid", "gid", "linkName", "digest", "chunkDigest", "xattrs", "modtime", "devMajor",
                         "devMinor"])


@HYPO
@given(st.lists(st.tuples(st.integers(0, 10), st.dictionaries(_KEYS, _JSON_VALUES, max_size=5)), max_size=8))
def test_mutated_toc_entries(mutations: list[tuple[int, dict[str, Any]]]) -> None:
    """Take a valid TOC and overwrite random fields of random entries with random JSON values."""
    footer = estargz.parse_footer(SMALL_BLOB[-51:])
    off, length = estargz.toc_range(footer, len(SMALL_BLOB))
    index_json = json.loads(gzip.decompress(SMALL_BLOB[off:off + length])[512:].rstrip(b"\x00"))
    entries = copy.deepcopy(index_json["entries"])
    for i, fields in mutations:
        if i < len(entries):
            entries[i].update(fields)
        else:
            entries.append(fields)
    try:
        member = toc_member({"version": 1, "entries": entries})
    except ValueError:  # json.dumps of a float infinity etc.
        return
    _parse_and_read(SMALL_BLOB[:off] + member + estargz.footer_bytes(off))



@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_long_hard_link_chains_stay_linear(order: str) -> None:
    payload, off, _ = _payload()
    n = 20_000
    links = [{"name": f"h{i}", "type": "hardlink", "linkName": f"h{i - 1}" if i else "f"} for i in range(n)]
    if order == "reverse":
        links.reverse()
    blob = blob_with_toc(payload, toc_member({"version": 1, "entries": _base_entries(off) + links}))
    start = time.monotonic()
    index = parse_blob(blob)
    assert time.monotonic() - start < 10
    assert index["f"].nlink == index["h0"].nlink == index[f"h{n - 1}"].nlink == n + 1
    cyclic = links + [{"name": "c1", "type": "hardlink", "linkName": "c2"},
                      {"name": "c2", "type": "hardlink", "linkName": "c1"}]
    with pytest.raises(FormatError, match="cycle"):
        parse_blob(blob_with_toc(payload, toc_member({"version": 1, "entries": _base_entries(off) + cyclic})))


_SEGMENT = st.text(alphabet="abcé_-.", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))


@st.composite
def random_layer(draw: st.DrawFn) -> bytes:
    """A small tar of dirs, files around chunk boundaries, symlinks and hard links to earlier files."""
    buf = io.BytesIO()
    files: list[str] = []
    used: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for _ in range(draw(st.integers(0, 12))):
            name = "/".join(draw(st.lists(_SEGMENT, min_size=1, max_size=3)))
            if name in used or any(name.startswith(u + "/") or u.startswith(name + "/") for u in used):
                continue
            used.add(name)
            info = tarfile.TarInfo(name)
            info.mtime = draw(st.integers(0, 2**33))
            info.mode = draw(st.integers(0, 0o7777))
            info.uid, info.gid = draw(st.integers(0, 70000)), draw(st.integers(0, 70000))
            kind = draw(st.sampled_from(["reg", "reg", "dir", "symlink", "hardlink", "fifo"]))
            if kind == "hardlink" and files:
                info.type, info.linkname = tarfile.LNKTYPE, draw(st.sampled_from(files))
                tf.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, draw(st.text(min_size=1, max_size=30).filter(
                    lambda s: "\x00" not in s))
                tf.addfile(info)
            elif kind in ("dir", "fifo"):
                info.type = tarfile.DIRTYPE if kind == "dir" else tarfile.FIFOTYPE
                tf.addfile(info)
            else:
                size = draw(st.sampled_from([0, 1, 511, 512, 1023, 1024, 1025, 3000]))
                data = draw(st.binary(min_size=size, max_size=size))
                if draw(st.booleans()):
                    info.pax_headers = {"SCHILY.xattr.user.x": draw(st.text(max_size=10).filter(
                        lambda s: "\x00" not in s))}
                info.size = size
                tf.addfile(info, io.BytesIO(data))
                files.append(name)
    return buf.getvalue()


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(random_layer(), st.sampled_from([1, 512, 1024, 4 << 20]), st.booleans(), st.data())
def test_random_layers_round_trip(tmp_path_factory: pytest.TempPathFactory, tar: bytes, chunk_size: int,
                                  legacy: bool, data: st.DataObject) -> None:
    d = tmp_path_factory.mktemp("rt")
    src = d / "layer.tar"
    src.write_bytes(tar)
    want = corpus.tar_tree(src)
    prefetch = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(sorted(want) or ["x"]), max_size=4)))
    blob = d / "layer.esgz"
    result = write_blob(src, blob, chunk_size=chunk_size, legacy=legacy, prefetch=prefetch)
    _, index = open_blob(blob, result.digest, expected_toc_digest=result.toc_digest)
    assert corpus.index_tree(index, chunk_reader(blob), skip=skip_landmarks) == want
    diff_id, _ = gunzip_to(blob, d / "plain.tar")
    assert diff_id == result.diff_id
    assert corpus.tar_tree(d / "plain.tar", skip=skip_landmarks_and_toc) == want
