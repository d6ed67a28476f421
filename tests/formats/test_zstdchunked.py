"""zstd:chunked reader and writer.

- Round trip: corpus tar (one test with the 100 MB file) -> write_zstdchunked -> parse -> every
  chunk decompressed from its own blob range -> same tree and bytes; the whole blob, decompressed
  by a plain zstd decoder, is a tar with the same tree; memory stays bounded while writing.
- Interop, real tools: our own containerd (config, socket, root under tmp dirs, stopped by PID)
  imports an OCI image made from the corpus; `ctr-remote image convert --zstdchunked --oci`
  (stargz-snapshotter 0.12) converts it; we read the converted blob from the content store with
  its manifest annotations. Our writer's image is imported and *unpacked* by that containerd
  (its ordinary zstd path + DiffID check) and the unpacked files are compared with the corpus.
- containers/storage layout: no podman here, so `build_containers_blob` makes one from the
  documented facts (FORMATS.md 2.1: frame per chunk, zeros chunks, compact TOC JSON with
  endOffset/chunkType/tarSplitDigest, tar-split frame, 64-byte footer "GNUlInUx",
  io.github.containers.* annotations). It checks our reader against our reading of the
  sources, not against real podman output.
- Hostile input (hypothesis + a fixed list): only FormatError (and its subclasses) escapes, in
  bounded time.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotter.errors import DigestMismatch, FormatError, LimitExceeded
from snapshotter.formats import zstdchunked as zc
from snapshotter.formats.codec import decompress_chunk
from snapshotter.formats.index import EntryType, Landmark, LayerIndex
from tests.containerd_helper import Containerd, start_containerd
from tests.formats.corpus import index_tree, tar_tree, write_corpus_tar
from tests.tars import tar_of

MAX_TOC = 1 << 20
LAYER = "sha256:" + "ab" * 32


def skip_landmarks(name: str) -> bool:
    return name in (".prefetch.landmark", ".no.prefetch.landmark")


def read_index(blob: bytes, *, annotations: dict[str, str] | None = None,
               max_toc_bytes: int = MAX_TOC) -> LayerIndex:
    """What the snapshotter does: position from annotations (else the footer), then the TOC."""
    pos = zc.manifest_position_from_annotations(annotations or {})
    if pos is None:
        pos = zc.parse_footer(blob[-zc.FOOTER_SIZE:], blob_size=len(blob))
    return zc.parse_manifest(blob[pos.offset:pos.offset + pos.compressed_size], blob_size=len(blob),
                             layer_digest=LAYER, max_toc_bytes=max_toc_bytes,
                             expected_checksum=pos.checksum, position=pos)


def chunk_reader(blob: bytes) -> Callable[[Any], bytes]:
    def read(entry: Any) -> bytes:
        out = bytearray()
        for c in entry.chunks:
            data = decompress_chunk(c, blob[c.blob_offset:c.blob_offset + c.blob_size])
            if c.digest is not None:
                assert "sha256:" + hashlib.sha256(data).hexdigest() == c.digest
            out += data
        if entry.digest is not None:
            assert "sha256:" + hashlib.sha256(out).hexdigest() == entry.digest
        return bytes(out)
    return read


def unzstd_file(blob_path: Path, out_path: Path) -> None:
    with open(blob_path, "rb") as f, open(out_path, "wb") as out:
        reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        while block := reader.read(1 << 20):
            out.write(block)


def unzstd(blob: bytes) -> bytes:
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True).read()


def small_tar(files: dict[str, bytes]) -> bytes:
    return tar_of(files, mtime=1_700_000_000)


def convert(tar: bytes, **kw: Any) -> tuple[bytes, zc.ZstdChunkedResult]:
    out = io.BytesIO()
    result = zc.write_zstdchunked(io.BytesIO(tar), out, **kw)
    return out.getvalue(), result


# ---------------------------------------------------------------------------------------------
# Round trip


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus_tar(tmp_path_factory.mktemp("zc") / "corpus.tar", big_size=5 << 20)


# VmHWM, not ru_maxrss: the latter carries the parent's peak across fork+exec.
_CONVERT_SCRIPT = """
import json, re, sys
from snapshotter.formats.zstdchunked import write_zstdchunked
with open(sys.argv[1], "rb") as src, open(sys.argv[2], "wb") as dst:
    r = write_zstdchunked(src, dst)
hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({"maxrss_kb": hwm, "diff_id": r.diff_id,
                  "blob_digest": r.blob_digest, "blob_size": r.blob_size, "annotations": dict(r.annotations),
                  "uncompressed_size": r.uncompressed_size}))
"""


def test_round_trip_100mb_bounded_memory(tmp_path: Path) -> None:
    src = write_corpus_tar(tmp_path / "corpus.tar")  # data/big.bin is 100 MiB
    blob_path = tmp_path / "layer.zst"
    # In a child process so its peak RSS is the writer's own, not pytest's.
    proc = subprocess.run([sys.executable, "-c", _CONVERT_SCRIPT, str(src), str(blob_path)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["maxrss_kb"] < 64 * 1024, f"writer peaked at {res['maxrss_kb']} KiB for a 100 MiB file"

    with open(src, "rb") as f:
        src_digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    assert res["diff_id"] == src_digest  # prefetch=None keeps the tar byte for byte
    assert res["uncompressed_size"] == src.stat().st_size
    blob = blob_path.read_bytes()
    assert res["blob_size"] == len(blob)
    assert res["blob_digest"] == "sha256:" + hashlib.sha256(blob).hexdigest()

    index = read_index(blob, annotations=res["annotations"])
    assert index.toc_digest == res["annotations"][zc.TOC_DIGEST_KEY]
    assert index.landmark is Landmark.NONE
    big = index["data/big.bin"]
    assert len(big.chunks) == 25 and all(c.size == 4 << 20 for c in big.chunks)
    assert tar_tree(src) == index_tree(index, chunk_reader(blob))

    plain = tmp_path / "plain.tar"
    unzstd_file(blob_path, plain)
    with open(plain, "rb") as f:
        assert "sha256:" + hashlib.file_digest(f, "sha256").hexdigest() == src_digest


def test_round_trip_small_chunks_and_whole_blob(small_corpus: Path, tmp_path: Path) -> None:
    blob, result = convert(small_corpus.read_bytes(), chunk_size=1 << 20, level=1)
    index = read_index(blob)  # from the footer alone
    assert index.toc_digest == result.toc_digest
    assert index.format == "zstd:chunked" and index.blobs == (LAYER,)
    assert len(index["data/big.bin"].chunks) == 5
    assert len(index["data/text"].chunks) == 8  # 7.5 MiB of text
    assert tar_tree(small_corpus) == index_tree(index, chunk_reader(blob))
    passwd = index["etc/passwd"]
    assert passwd.nlink == 2 and index["etc/hardlink-to-passwd"].nlink == 2
    assert index["etc/xattr-file"].xattrs["security.capability"] == b"\x01\x00\x00\x02"

    plain = unzstd(blob)
    assert "sha256:" + hashlib.sha256(plain).hexdigest() == result.diff_id
    (tmp_path / "p.tar").write_bytes(plain)
    assert tar_tree(tmp_path / "p.tar") == tar_tree(small_corpus)


def test_every_chunk_starts_a_frame(small_corpus: Path) -> None:
    """Lazy reads need each chunk's range to begin with a zstd frame holding the payload."""
    blob, _ = convert(small_corpus.read_bytes(), chunk_size=1 << 20)
    index = read_index(blob)
    for e in index.regular_files():
        for c in e.chunks:
            assert blob[c.blob_offset:c.blob_offset + 4] == b"\x28\xb5\x2f\xfd", e.name


def test_prefetch_landmark_and_order(small_corpus: Path, tmp_path: Path) -> None:
    prefetch = ["etc/hardlink-to-passwd", "data/text", "bin/hello"]
    blob, result = convert(small_corpus.read_bytes(), chunk_size=1 << 20, prefetch=prefetch)
    index = read_index(blob, annotations=dict(result.annotations))
    assert index.landmark is Landmark.PREFETCH
    # Hard-link targets come before their links; parent directories before their children.
    assert index.prefetch == ("etc/passwd", "data/text", "bin/hello")
    names = [e.name for e in index.entries]
    assert names[:8] == ["", "etc", "etc/passwd", "etc/hardlink-to-passwd", "data", "data/text", "bin",
                         "bin/hello"]
    assert names[8] == ".prefetch.landmark"
    assert index[".prefetch.landmark"].size == 1
    assert index_tree(index, chunk_reader(blob), skip=skip_landmarks) == tar_tree(small_corpus)
    (tmp_path / "p.tar").write_bytes(unzstd(blob))
    assert tar_tree(tmp_path / "p.tar", skip=skip_landmarks) == tar_tree(small_corpus)
    assert chunk_reader(blob)(index[".prefetch.landmark"]) == b"\x0f"

    blob2, result2 = convert(small_corpus.read_bytes(), prefetch=[])
    index2 = read_index(blob2)
    assert index2.landmark is Landmark.NO_PREFETCH and index2.entries[0].name == ".no.prefetch.landmark"
    assert index2.prefetch == ()
    assert "sha256:" + hashlib.sha256(unzstd(blob2)).hexdigest() == result2.diff_id

    with pytest.raises(ValueError, match="not in the layer"):
        convert(small_corpus.read_bytes(), prefetch=["no/such/file"])


def test_gnu_long_names_and_trailer_kept_byte_for_byte(tmp_path: Path) -> None:
    buf = io.BytesIO()
    long_dir = "l" * 150
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        d = tarfile.TarInfo(long_dir)
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        f = tarfile.TarInfo(long_dir + "/" + "f" * 120)
        f.size = 3000
        tf.addfile(f, io.BytesIO(b"q" * 3000))
        link = tarfile.TarInfo("short")
        link.type = tarfile.SYMTYPE
        link.linkname = "t" * 200
        tf.addfile(link)
    tar = buf.getvalue()
    assert len(tar) % 10240 == 0  # record padding after the end-of-archive blocks
    blob, result = convert(tar, chunk_size=1000)
    assert result.diff_id == _sha(tar) and unzstd(blob) == tar
    index = read_index(blob)
    assert index["short"].link_target == "t" * 200
    assert len(index[long_dir + "/" + "f" * 120].chunks) == 3
    (tmp_path / "t.tar").write_bytes(tar)
    assert index_tree(index, chunk_reader(blob)) == tar_tree(tmp_path / "t.tar")


def test_writer_rejects_bad_tar() -> None:
    tar = small_tar({"a": b"x" * 5000})
    for bad in (tar[:700], tar[:512 + 100], b"\x01" * 512):
        with pytest.raises(FormatError):
            convert(bad)


# ---------------------------------------------------------------------------------------------
# containerd + ctr-remote interop


@pytest.fixture
def containerd() -> Iterator[Containerd]:
    # Unix socket paths are limited to 108 bytes; pytest's tmp_path can be longer.
    base = Path(tempfile.mkdtemp(prefix="zc-ctd-", dir="/tmp"))
    c = start_containerd(base)
    c.ns = "zstdchunked-test"
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


def _sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def oci_archive(path: Path, layer: bytes, media_type: str, diff_id: str, ref: str,
                annotations: dict[str, str] | None = None) -> None:
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                      "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
    desc: dict[str, Any] = {"mediaType": media_type, "digest": _sha(layer), "size": len(layer)}
    if annotations:
        desc["annotations"] = annotations
    man = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                 "digest": _sha(cfg), "size": len(cfg)},
                      "layers": [desc]}).encode()
    idx = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _sha(man), "size": len(man),
        "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]},
        "platform": {"architecture": "amd64", "os": "linux"}}]}).encode()
    with tarfile.open(path, "w") as tf:
        files = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", idx)]
        files += [("blobs/sha256/" + _sha(b)[7:], b) for b in (cfg, man, layer)]
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_reads_ctr_remote_zstdchunked(containerd: Containerd, small_corpus: Path, tmp_path: Path) -> None:
    layer = small_corpus.read_bytes()
    oci_archive(tmp_path / "image.tar", layer, "application/vnd.oci.image.layer.v1.tar", _sha(layer),
                "example.com/zc/src:v1")
    containerd.ctr("images", "import", "--no-unpack", str(tmp_path / "image.tar"))
    containerd.ctr("image", "convert", "--zstdchunked", "--oci", "example.com/zc/src:v1",
                   "example.com/zc/src:zc", tool="ctr-remote")
    manifest = containerd.manifest("example.com/zc/src:zc")
    (desc,) = manifest["layers"]
    assert desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+zstd"
    ann = desc["annotations"]
    blob = containerd.blob(desc["digest"]).read_bytes()
    assert len(blob) == desc["size"]

    pos = zc.manifest_position_from_annotations(ann)
    assert pos is not None and pos.layout is zc.Layout.STARGZ
    footer = zc.parse_footer(blob[-zc.FOOTER_SIZE:], blob_size=len(blob))
    assert (footer.offset, footer.compressed_size, footer.uncompressed_size, footer.layout) == \
        (pos.offset, pos.compressed_size, pos.uncompressed_size, pos.layout)
    index = read_index(blob, annotations=ann)
    assert index.toc_digest == ann[zc.TOC_DIGEST_KEY]
    assert index.landmark is Landmark.NO_PREFETCH
    assert len(index["data/big.bin"].chunks) == 2  # ctr-remote's default 4 MiB chunks
    assert index_tree(index, chunk_reader(blob), skip=skip_landmarks) == tar_tree(small_corpus)
    # The footer-only path (no annotations) gives the same index.
    assert read_index(blob) == index

    plain = unzstd(blob)
    assert len(plain) == int(ann[zc.UNCOMPRESSED_SIZE_KEY])
    (tmp_path / "p.tar").write_bytes(plain)
    assert tar_tree(tmp_path / "p.tar", skip=skip_landmarks) == tar_tree(small_corpus)


def test_containerd_unpacks_our_blob(containerd: Containerd, small_corpus: Path, tmp_path: Path) -> None:
    """containerd's ordinary +zstd path decompresses our blob, checks our DiffID and applies it."""
    # The corpus's security.capability value is not one the kernel accepts; drop it here.
    layer = tmp_path / "layer.tar"
    with tarfile.open(small_corpus) as src, tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            m.pax_headers = {k: v for k, v in m.pax_headers.items() if k != "SCHILY.xattr.security.capability"}
            dst.addfile(m, src.extractfile(m) if m.isreg() else None)
    blob, result = convert(layer.read_bytes(), prefetch=["etc/passwd"])
    oci_archive(tmp_path / "image.tar", blob, "application/vnd.oci.image.layer.v1.tar+zstd", result.diff_id,
                "example.com/zc/ours:v1", dict(result.annotations))
    containerd.ctr("images", "import", "--snapshotter", "overlayfs", str(tmp_path / "image.tar"))
    snaps = containerd.root / "io.containerd.snapshotter.v1.overlayfs" / "snapshots"
    (fs,) = [p / "fs" for p in snaps.iterdir()]
    expected = tar_tree(layer)
    assert len(expected) == len(tar_tree(small_corpus))
    for name, facts in expected.items():
        path = fs / name
        if facts.type == "reg" and ".wh." not in name:
            assert hashlib.sha256(path.read_bytes()).hexdigest() == facts.sha256, name
            assert path.stat().st_mode & 0o7777 == facts.mode, name
        elif facts.type == "symlink":
            assert os.readlink(path) == facts.link, name
    assert (fs / ".prefetch.landmark").read_bytes() == b"\x0f"
    assert os.getxattr(fs / "etc/xattr-file", "user.comment") == b"hello world"
    assert (fs / "etc/passwd").stat().st_ino == (fs / "etc/hardlink-to-passwd").stat().st_ino


# Our own small Go program over stargz-snapshotter 0.12's estargz package (Debian's Go sources):
# open the blob with the zstdchunked decompressor, verify the TOC digest, read every file and
# check every chunk against its chunkDigest, print "name type [sha256]" per entry.
GO_CHECKER = """// Reads a zstd:chunked blob with stargz-snapshotter's estargz reader and prints every file's sha256.
package main

import (
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"sort"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/containerd/stargz-snapshotter/estargz/zstdchunked"
	digest "github.com/opencontainers/go-digest"
)

func main() {
	f, err := os.Open(os.Args[1])
	if err != nil {
		panic(err)
	}
	st, _ := f.Stat()
	sr := io.NewSectionReader(f, 0, st.Size())
	r, err := estargz.Open(sr, estargz.WithDecompressors(new(zstdchunked.Decompressor)))
	if err != nil {
		fmt.Println("OPEN ERROR", err)
		os.Exit(2)
	}
	fmt.Println("toc", r.TOCDigest())
	v, err := r.VerifyTOC(digest.Digest(os.Args[2]))
	if err != nil {
		fmt.Println("VERIFY ERROR", err)
		os.Exit(3)
	}
	var names []string
	var walk func(string, *estargz.TOCEntry)
	walk = func(p string, e *estargz.TOCEntry) {
		e.ForeachChild(func(base string, c *estargz.TOCEntry) bool {
			n := base
			if p != "" {
				n = p + "/" + base
			}
			names = append(names, n)
			walk(n, c)
			return true
		})
	}
	root, _ := r.Lookup("")
	walk("", root)
	sort.Strings(names)
	for _, n := range names {
		e, _ := r.Lookup(n)
		if e.Type != "reg" {
			fmt.Println(n, e.Type)
			continue
		}
		sr, err := r.OpenFile(n)
		if err != nil {
			panic(err)
		}
		h := sha256.New()
		if _, err := io.Copy(h, io.NewSectionReader(sr, 0, e.Size)); err != nil {
			fmt.Println("READ ERROR", n, err)
			os.Exit(4)
		}
		// Check every chunk against its chunkDigest the way the snapshotter's fs does.
		for off := int64(0); off < e.Size; {
			ce, ok := r.ChunkEntryForOffset(n, off)
			if !ok {
				fmt.Println("NO CHUNK", n, off)
				os.Exit(5)
			}
			cv, err := v.Verifier(ce)
			if err != nil {
				fmt.Println("VERIFIER ERROR", n, err)
				os.Exit(6)
			}
			buf := make([]byte, ce.ChunkSize)
			if _, err := sr.ReadAt(buf, ce.ChunkOffset); err != nil && err != io.EOF {
				fmt.Println("CHUNK READ ERROR", n, err)
				os.Exit(7)
			}
			cv.Write(buf)
			if !cv.Verified() {
				fmt.Println("CHUNK NOT VERIFIED", n, ce.ChunkOffset)
				os.Exit(8)
			}
			off = ce.ChunkOffset + ce.ChunkSize
		}
		fmt.Printf("%s reg %x\\n", n, h.Sum(nil))
	}
}
"""


def test_stargz_snapshotter_go_reader_reads_our_blob(small_corpus: Path, tmp_path: Path) -> None:
    go = shutil.which("go")
    gopath = Path("/usr/share/gocode")
    if go is None or not (gopath / "src/github.com/containerd/stargz-snapshotter/estargz").is_dir():
        pytest.skip("needs the go toolchain and golang-github-containerd-stargz-snapshotter-dev")
    (tmp_path / "main.go").write_text(GO_CHECKER)
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": str(gopath), "GOCACHE": str(tmp_path / "gocache"),
           "GOFLAGS": ""}
    build = subprocess.run([go, "build", "-o", str(tmp_path / "zcheck"), str(tmp_path / "main.go")],
                           capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    tree = tar_tree(small_corpus)
    for prefetch in (None, ["etc/passwd", "data/text"]):
        blob, result = convert(small_corpus.read_bytes(), chunk_size=1 << 20, prefetch=prefetch)
        (tmp_path / "layer.zst").write_bytes(blob)
        run = subprocess.run([str(tmp_path / "zcheck"), str(tmp_path / "layer.zst"), result.toc_digest],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        lines = run.stdout.splitlines()
        assert lines[0] == f"toc {result.toc_digest}"
        got = {line.split(" ")[0]: line.split(" ")[1:] for line in lines[1:]}
        expected: dict[str, list[str]] = {}
        for name, facts in tree.items():
            if not name:
                continue
            if facts.type == "hardlink":  # the Go reader resolves links to the file they name
                facts = tree[facts.link]
            expected[name] = ["reg", str(facts.sha256)] if facts.type == "reg" else [facts.type]
        if prefetch:
            expected[".prefetch.landmark"] = ["reg", hashlib.sha256(b"\x0f").hexdigest()]
        assert got == expected


# ---------------------------------------------------------------------------------------------
# containers/storage layout, built from FORMATS.md 2.1


def _rfc3339nano(mtime: float) -> str:
    t = datetime.datetime.fromtimestamp(mtime, datetime.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S") + "Z"


def _pieces(data: bytes, piece: int) -> list[tuple[bytes, bool]]:
    """Split like containers/storage: zero runs >= 1024 bytes are "zeros" chunks; data elsewhere
    (our boundaries are fixed-size instead of rollsum; the format does not care)."""
    out: list[tuple[bytes, bool]] = []
    i = 0
    while i < len(data):
        j = i
        while j < len(data) and data[j] == 0:
            j += 1
        if j - i >= 1024:
            out.append((data[i:j], True))
            i = j
            continue
        k = i
        while k < len(data) and k - i < piece:
            if data[k] == 0 and data[k:k + 1024] == bytes(min(1024, len(data) - k)) and len(data) - k >= 1024:
                break
            k += 1
        k = max(k, i + 1)
        out.append((data[i:k], False))
        i = k
    return out


def build_containers_blob(tar: bytes, *, piece: int = 256 << 10) -> tuple[bytes, dict[str, str]]:
    """A containers/storage-layout zstd:chunked blob and its annotations (FORMATS.md 2.1)."""
    cctx = zstandard.ZstdCompressor(level=3)
    out = bytearray()
    frame = bytearray()

    def close() -> None:
        if frame:
            out.extend(cctx.compress(bytes(frame)))
            frame.clear()

    entries: list[dict[str, Any]] = []
    kinds = {tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink",
             tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.FIFOTYPE: "fifo"}
    pos = 0
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf:
            frame.extend(tar[pos:m.offset_data])
            pos = m.offset_data
            e: dict[str, Any] = {"type": "reg" if m.isreg() else kinds[m.type], "name": m.name}
            for key, value in (("linkName", m.linkname), ("mode", m.mode), ("size", m.size if m.isreg() else 0),
                               ("uid", m.uid), ("gid", m.gid), ("modtime", _rfc3339nano(m.mtime)),
                               ("devMajor", m.devmajor if m.ischr() or m.isblk() else 0),
                               ("devMinor", m.devminor if m.ischr() or m.isblk() else 0)):
                if value:
                    e[key] = value
            xattrs = {k[13:]: base64.b64encode(v.encode("utf-8", "surrogateescape")).decode()
                      for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")}
            if xattrs:
                e["xattrs"] = xattrs
            group = [e]
            if m.isreg() and m.size:
                data = tar[pos:pos + m.size]
                pos += m.size
                e["digest"] = _sha(data)
                chunk_off = 0
                for i, (p, zeros) in enumerate(_pieces(data, piece)):
                    close()
                    c: dict[str, Any] = e if i == 0 else {"type": "chunk", "name": m.name}
                    c.update({"offset": len(out), "chunkSize": len(p), "chunkOffset": chunk_off,
                              "chunkDigest": _sha(p)})
                    if zeros:
                        c["chunkType"] = "zeros"
                    if i:
                        group.append(c)
                    frame.extend(p)
                    close()
                    chunk_off += len(p)
                e["endOffset"] = len(out)
                if len(group) == 1:  # chunk fields only for files with more than one chunk
                    for k in ("chunkSize", "chunkOffset", "chunkDigest", "chunkType"):
                        e.pop(k, None)
                else:
                    e.pop("chunkOffset")  # 0: omitted by omitempty
            entries.extend(group)
    frame.extend(tar[pos:])
    close()
    tar_split = cctx.compress(b'{"type":2,"payload":"","position":0}\n')
    toc = json.dumps({"version": 1, "entries": entries, "tarSplitDigest": _sha(tar_split)},
                     separators=(",", ":")).encode()
    manifest = cctx.compress(toc)
    m_off = len(out) + 8
    out += b"\x50\x2a\x4d\x18" + struct.pack("<I", len(manifest)) + manifest
    ts_off = len(out) + 8
    out += b"\x50\x2a\x4d\x18" + struct.pack("<I", len(tar_split)) + tar_split
    out += b"\x50\x2a\x4d\x18" + struct.pack("<I", 64) + struct.pack(
        "<7Q", m_off, len(manifest), len(toc), 1, ts_off, len(tar_split), 38) + b"GNUlInUx"
    annotations = {
        "io.github.containers.zstd-chunked.manifest-checksum": _sha(manifest),
        "io.github.containers.zstd-chunked.manifest-position": f"{m_off}:{len(manifest)}:{len(toc)}:1",
        "io.github.containers.zstd-chunked.tarsplit-position": f"{ts_off}:{len(tar_split)}:38",
    }
    return bytes(out), annotations


def test_reads_containers_storage_layout(small_corpus: Path, tmp_path: Path) -> None:
    tar = small_corpus.read_bytes()
    blob, ann = build_containers_blob(tar)
    assert unzstd(blob) == tar  # the blob decompresses to the original tar
    pos = zc.manifest_position_from_annotations(ann)
    assert pos is not None and pos.layout is zc.Layout.CONTAINERS and pos.tar_split is not None
    footer = zc.parse_footer(blob[-zc.FOOTER_SIZE:], blob_size=len(blob))
    assert footer.layout is zc.Layout.CONTAINERS and footer.tar_split == pos.tar_split
    assert footer.offset == pos.offset

    for given_ann in (ann, None):
        index = read_index(blob, annotations=given_ann)
        assert index.toc_digest == ann["io.github.containers.zstd-chunked.manifest-checksum"]
        assert index_tree(index, chunk_reader(blob)) == tar_tree(small_corpus)
    sparse = index["data/sparse-like"]
    zeros = [c for c in sparse.chunks if c.zeros]
    assert [c.size for c in zeros] == [3 << 20, 4096]
    assert all(c.blob_size > 0 for c in sparse.chunks)
    # Zeros chunks need no fetch, and their blob range also decodes to zeros.
    for c in zeros:
        assert decompress_chunk(c, b"") == bytes(c.size)
        assert zstandard.ZstdDecompressor().decompressobj().decompress(
            blob[c.blob_offset:c.blob_offset + c.blob_size]) == bytes(c.size)
    # The last chunk of a file ends at endOffset, before the next tar header's bytes.
    big = index["data/big.bin"]
    assert len(big.chunks) == 20
    assert sum(c.blob_size for c in big.chunks) < big.size + 20 * 64
    # Guessing the layout without a position also works (endOffset/tarSplitDigest present).
    raw = blob[pos.offset:pos.offset + pos.compressed_size]
    guessed = zc.parse_manifest(raw, blob_size=len(blob), layer_digest=LAYER, max_toc_bytes=MAX_TOC)
    assert guessed.toc_digest == index.toc_digest and guessed.entries == index.entries


def test_old_containers_storage_keys_and_footer(small_corpus: Path) -> None:
    """2020-era containers/storage: io.containers.* keys and the 40-byte GnUlInUx footer."""
    blob, ann = build_containers_blob(small_corpus.read_bytes())
    pos = zc.manifest_position_from_annotations(ann)
    assert pos is not None
    old = blob[:pos.offset + pos.compressed_size] + b"\x50\x2a\x4d\x18" + struct.pack("<I", 40) + struct.pack(
        "<4Q", pos.offset, pos.compressed_size, pos.uncompressed_size, 1) + b"GnUlInUx"
    index = read_index(old)
    assert index_tree(index, chunk_reader(old)) == tar_tree(small_corpus)
    old_ann = {"io.containers.zstd-chunked.manifest-position": ann[zc.CONTAINERS_POSITION_KEY],
               "io.containers.zstd-chunked.manifest-checksum": ann[zc.CONTAINERS_CHECKSUM_KEY]}
    assert read_index(old, annotations=old_ann).entries == index.entries


# ---------------------------------------------------------------------------------------------
# Hostile input


@pytest.fixture(scope="module")
def sample() -> tuple[bytes, zc.ManifestPosition]:
    files = {"a": b"hello\n" * 50, "dir/b": os.urandom(3000), "z": bytes(5000) + b"x", "e": b""}
    blob, result = convert(small_tar(files), chunk_size=1024)
    return blob, result.position


def only_format_errors(fn: Callable[[], object]) -> object:
    start = time.monotonic()
    try:
        return fn()
    except FormatError as exc:
        return exc
    finally:
        assert time.monotonic() - start < 5


def parse_all(blob: bytes, annotations: dict[str, str] | None = None, max_toc: int = 1 << 16) -> object:
    def run() -> object:
        index = read_index(blob, annotations=annotations, max_toc_bytes=max_toc)
        for e in index.regular_files():
            for c in e.chunks:
                assert 0 <= c.blob_offset and c.blob_offset + c.blob_size <= len(blob)
                decompress_chunk(c, blob[c.blob_offset:c.blob_offset + c.blob_size])
        return index
    return only_format_errors(run)


def manifest_blob(doc: Any, *, raw: bytes | None = None, data: bytes = b"") -> bytes:
    """data + a stargz-layout TOC frame of `doc` (or of raw bytes) + footer."""
    toc = raw if raw is not None else json.dumps(doc).encode()
    comp = zstandard.ZstdCompressor().compress(toc)
    off = len(data) + 8
    return (data + b"\x50\x2a\x4d\x18" + struct.pack("<I", len(comp)) + comp + b"\x50\x2a\x4d\x18"
            + struct.pack("<I", 40) + struct.pack("<4Q", off, len(comp), len(toc), 1) + b"GnUlInUx")


HOSTILE_DOCS: list[Any] = [
    [], 1, None, "x", {"version": 2, "entries": []}, {"version": True, "entries": []},
    {"version": 1, "entries": {}}, {"version": 1, "entries": [1]},
    {"version": 1, "entries": [{"type": "reg", "name": "../x"}]},
    {"version": 1, "entries": [{"type": "reg", "name": "/abs"}]},
    {"version": 1, "entries": [{"type": "weird", "name": "x"}]},
    {"version": 1, "entries": [{"type": "chunk", "name": "x", "offset": 1}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 10}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 10, "offset": 10 ** 12}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": -1}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 2 ** 64}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 1.5}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "mode": True}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x"}, {"type": "reg", "name": "x"}]},
    {"version": 1, "entries": [{"type": "hardlink", "name": "x", "linkName": "y"}]},
    {"version": 1, "entries": [{"type": "hardlink", "name": "x", "linkName": "x"}]},
    {"version": 1, "entries": [{"type": "symlink", "name": "x"}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "modtime": "yesterday"}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "modtime": "2023-02-30T00:00:00Z"}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "xattrs": {"user.a": "!!!"}}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "xattrs": []}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "digest": "md5:00"}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 4, "offset": 1, "chunkType": "holes"}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 10, "offset": 1, "chunkSize": 4},
                               {"type": "chunk", "name": "x", "offset": 2, "chunkOffset": 5}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 10, "offset": 1, "chunkSize": 4},
                               {"type": "chunk", "name": "y", "offset": 2, "chunkOffset": 4}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 10, "offset": 1, "endOffset": 1}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x"}, {"type": "dir", "name": "x/y"}]},
    {"version": 1, "entries": [{"type": "dir", "name": "d"}, {"type": "hardlink", "name": "l", "linkName": "d"}]},
    {"version": 1, "entries": [{"type": "reg", "name": "."}]},
    # The entry rules zstd:chunked shares with eStargz (formats/jtoc.py).
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 0, "chunkSize": 4}]},
    {"version": 1, "entries": [{"type": "reg", "name": "x", "size": 0},
                               {"type": "chunk", "name": "x", "offset": 1, "chunkOffset": 0}]},
]


def test_hostile_fixed_corpus(sample: tuple[bytes, zc.ManifestPosition]) -> None:
    blob, pos = sample
    assert isinstance(parse_all(blob), LayerIndex)
    for doc in HOSTILE_DOCS:
        assert isinstance(parse_all(manifest_blob(doc, data=b"\x00" * 64)), FormatError), doc
    for raw in (b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"version": NaN}',
                b'{"version": 1, "entries": [' + b"9" * 5000 + b"]}", b""):
        assert isinstance(parse_all(manifest_blob(None, raw=raw)), FormatError), raw[:20]

    # A long hard-link chain (each link names the previous one) resolves in linear time.
    n = 30_000
    chain = [{"type": "reg", "name": "f0"}] + [
        {"type": "hardlink", "name": f"f{i}", "linkName": f"f{i - 1}"} for i in range(1, n)]
    index = parse_all(manifest_blob({"version": 1, "entries": chain}), max_toc=8 << 20)
    assert isinstance(index, LayerIndex) and index["f0"].nlink == n and index[f"f{n - 1}"].nlink == n
    cycle = [{"type": "hardlink", "name": "a", "linkName": "b"}, {"type": "hardlink", "name": "b", "linkName": "a"}]
    assert isinstance(parse_all(manifest_blob({"version": 1, "entries": cycle})), FormatError)

    # A zstd bomb: 64 MiB of zeros in a few KiB stops at the limit.
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    with pytest.raises(LimitExceeded):
        zc.parse_manifest(bomb, blob_size=1 << 30, layer_digest=LAYER, max_toc_bytes=1 << 20)
    with pytest.raises(LimitExceeded):
        zc.parse_manifest(b"x" * 100, blob_size=1 << 30, layer_digest=LAYER, max_toc_bytes=50)
    # A frame that asks for a 2 GiB window is refused, not allocated.
    big_window = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        window_log=31, enable_ldm=True)).compress(b"{}" * 10)
    assert isinstance(only_format_errors(lambda: zc.parse_manifest(
        big_window, blob_size=1 << 40, layer_digest=LAYER, max_toc_bytes=1 << 20)), FormatError)
    raw = blob[pos.offset:pos.offset + pos.compressed_size]
    with pytest.raises(DigestMismatch):
        zc.parse_manifest(raw, blob_size=len(blob), layer_digest=LAYER, max_toc_bytes=MAX_TOC,
                          expected_checksum="sha256:" + "0" * 64, position=pos)
    with pytest.raises(LimitExceeded):
        zc.parse_manifest(raw, blob_size=len(blob), layer_digest=LAYER, max_toc_bytes=pos.uncompressed_size - 1,
                          position=pos)
    # Trailing garbage after the TOC frame, and a position that disagrees with the bytes.
    assert isinstance(only_format_errors(lambda: zc.parse_manifest(
        raw + b"junk", blob_size=len(blob), layer_digest=LAYER, max_toc_bytes=MAX_TOC)), FormatError)
    assert isinstance(only_format_errors(lambda: zc.parse_manifest(
        raw[:-1], blob_size=len(blob), layer_digest=LAYER, max_toc_bytes=MAX_TOC, position=pos)), FormatError)

    # Footers: too short, wrong magic, wrong frame header, wrong type, does not fit.
    tail = blob[-zc.FOOTER_SIZE:]
    for bad in (tail[-47:], tail[:-1] + b"X", b"\x00" * 72, tail[:-44] + b"\x00" + tail[-43:],
                tail[:-16] + struct.pack("<Q", 2) + tail[-8:]):
        with pytest.raises(FormatError):
            zc.parse_footer(bad)
    with pytest.raises(FormatError):
        zc.parse_footer(tail, blob_size=100)

    # Annotations.
    for value in ("1:2:3", "a:b:c:1", "1:2:3:2", "-1:2:3:1", "1:2:3:1:5", "9" * 30 + ":1:1:1"):
        with pytest.raises(FormatError):
            zc.manifest_position_from_annotations({zc.STARGZ_POSITION_KEY: value})
    with pytest.raises(FormatError):
        zc.manifest_position_from_annotations({zc.CONTAINERS_POSITION_KEY: "10:10:10:1",
                                               zc.CONTAINERS_CHECKSUM_KEY: "sha256:XYZ"})
    assert zc.manifest_position_from_annotations({"other": "1"}) is None


SETTINGS = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(tail=st.binary(min_size=0, max_size=100))
def test_hypothesis_random_footer(tail: bytes) -> None:
    result = only_format_errors(lambda: zc.parse_footer(tail, blob_size=len(tail)))
    assert isinstance(result, (FormatError, zc.ManifestPosition))


@SETTINGS
@given(data=st.data())
def test_hypothesis_mutated_blob(sample: tuple[bytes, zc.ManifestPosition], data: st.DataObject) -> None:
    blob, pos = sample
    # Mutations concentrated on the tail: footer, TOC frame, last data frames.
    region_start = max(0, pos.offset - 64)
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "footer"]))
    b = bytearray(blob)
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(region_start, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        b = b[:data.draw(st.integers(0, len(b) - 1))]
    elif kind == "splice":
        i = data.draw(st.integers(region_start, len(b)))
        b[i:i + data.draw(st.integers(0, 16))] = data.draw(st.binary(max_size=16))
    else:
        fields = data.draw(st.tuples(*(st.integers(0, 2 ** 64 - 1) | st.integers(0, len(blob))
                                       for _ in range(4))))
        b[-40:-8] = struct.pack("<4Q", *fields)
    result = parse_all(bytes(b))
    assert isinstance(result, (FormatError, LayerIndex))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2 ** 65) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8)
entry_keys = st.sampled_from(["name", "type", "size", "offset", "chunkOffset", "chunkSize", "chunkDigest",
                              "digest", "linkName", "mode", "uid", "modtime", "xattrs", "endOffset",
                              "chunkType", "innerOffset", "devMajor"])
entry_values = st.one_of(
    json_values, st.sampled_from(["reg", "chunk", "dir", "hardlink", "symlink", "zeros", "a", "a/b", "",
                                  "sha256:" + "0" * 64, "2023-11-14T22:13:20.5+01:00"]),
    st.integers(0, 300))


@SETTINGS
@given(entries=st.lists(st.dictionaries(entry_keys, entry_values, max_size=8), max_size=8),
       version=st.sampled_from([1, 1, 1, 2, "1"]))
def test_hypothesis_random_toc(entries: list[dict[str, Any]], version: Any) -> None:
    blob = manifest_blob({"version": version, "entries": entries}, data=os.urandom(256))
    result = parse_all(blob)
    assert isinstance(result, (FormatError, LayerIndex))
    if isinstance(result, LayerIndex):
        for e in result.entries:
            assert e.type is not EntryType.REG or sum(c.size for c in e.chunks) == e.size


@SETTINGS
@given(annotations=st.dictionaries(
    st.sampled_from([zc.STARGZ_POSITION_KEY, zc.CONTAINERS_POSITION_KEY, zc.STARGZ_CHECKSUM_KEY,
                     zc.CONTAINERS_CHECKSUM_KEY, zc.CONTAINERS_TARSPLIT_KEY, "x"]),
    st.text(alphabet="0123456789:sha-abcdef", max_size=30) | st.just("1:2:3:1")))
def test_hypothesis_annotations(annotations: dict[str, str]) -> None:
    result = only_format_errors(lambda: zc.manifest_position_from_annotations(annotations))
    assert result is None or isinstance(result, (FormatError, zc.ManifestPosition))
