"""eStargz interop with the real tools: containerd 1.6 and ctr-remote (stargz-snapshotter 0.12).

A private containerd (root, state and sockets under a temp dir) runs for this module and is
stopped by PID afterwards. Checked:
- `ctr-remote image convert --estargz --oci` output parses with our reader into the source tree
  and bytes; our TOC digest equals its annotation and `ctr-remote image get-toc-digest`;
- with a prefetch record file, ctr-remote and our writer lay out entries in the same order;
- a blob from our writer, imported as an image with our diff_id, is unpacked by containerd's
  ordinary overlayfs unpack into the source tree, and ctr-remote reads our TOC digest;
- stargz-snapshotter's own Go reader (`estargz.Open`, `VerifyTOC`, per-chunk verifiers; built
  here from the Debian Go sources) reads our eStargz and legacy stargz blobs into the same tree.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import struct
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from snapshotter.formats import estargz
from snapshotter.formats.index import NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK, Landmark
from tests.containerd_helper import Containerd, start_containerd
from tests.formats import corpus
from tests.formats.test_estargz import chunk_reader, gunzip_to, open_blob, skip_landmarks, write_blob

NS = "esgz-test"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
# The corpus's security.capability value is only a 4-byte header, which the kernel rejects
# (EINVAL) when containerd applies it; use a complete v2 vfs_cap_data (cap_setuid and
# cap_net_bind_service: its 0x80 byte also checks binary PAX values survive).
VALID_CAPABILITY = (b"\x01\x00\x00\x02" + struct.pack("<IIII", 1 << 7 | 1 << 10, 0, 0, 0)).decode(
    "utf-8", "surrogateescape")


# A small Go program of ours over stargz-snapshotter's estargz package (Debian
# golang-github-containerd-stargz-snapshotter-dev, GOPATH mode).
GO_CHECKER = r'''// esgzcheck opens an eStargz blob with stargz-snapshotter's reader, verifies the TOC digest and
// every chunk digest, and prints what it read as JSON.
package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/containerd/stargz-snapshotter/estargz"
	digest "github.com/opencontainers/go-digest"
)

type file struct {
	Type   string `json:"type"`
	SHA256 string `json:"sha256,omitempty"`
	Chunks int    `json:"chunks,omitempty"`
	NLink  int    `json:"nlink"`
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

func main() {
	f, err := os.Open(os.Args[1])
	if err != nil {
		fail(err)
	}
	st, err := f.Stat()
	if err != nil {
		fail(err)
	}
	r, err := estargz.Open(io.NewSectionReader(f, 0, st.Size()))
	if err != nil {
		fail(fmt.Errorf("open: %w", err))
	}
	verifiers, err := r.VerifyTOC(digest.Digest(os.Args[2]))
	if err != nil {
		fail(fmt.Errorf("verify toc: %w", err))
	}
	files := map[string]file{}
	var walk func(name string, e *estargz.TOCEntry)
	walk = func(name string, e *estargz.TOCEntry) {
		out := file{Type: e.Type, NLink: e.NumLink}
		if e.Type == "reg" {
			sr, err := r.OpenFile(name)
			if err != nil {
				fail(err)
			}
			h := sha256.New()
			if _, err := io.Copy(h, sr); err != nil {
				fail(fmt.Errorf("read %s: %w", name, err))
			}
			out.SHA256 = hex.EncodeToString(h.Sum(nil))
			for off := int64(0); off < e.Size; {
				ce, ok := r.ChunkEntryForOffset(name, off)
				if !ok {
					fail(fmt.Errorf("%s: no chunk at %d", name, off))
				}
				v, err := verifiers.Verifier(ce)
				if err != nil {
					fail(fmt.Errorf("%s: %w", name, err))
				}
				if _, err := io.Copy(v, io.NewSectionReader(sr, ce.ChunkOffset, ce.ChunkSize)); err != nil {
					fail(err)
				}
				if !v.Verified() {
					fail(fmt.Errorf("%s: chunk at %d does not verify", name, ce.ChunkOffset))
				}
				out.Chunks++
				off = ce.ChunkOffset + ce.ChunkSize
			}
		}
		files[name] = out
		e.ForeachChild(func(base string, child *estargz.TOCEntry) bool {
			childName := base
			if name != "" {
				childName = name + "/" + base
			}
			walk(childName, child)
			return true
		})
	}
	root, ok := r.Lookup("")
	if !ok {
		fail(fmt.Errorf("no root"))
	}
	walk("", root)
	result := map[string]interface{}{"toc": r.TOCDigest(), "files": files}
	if err := json.NewEncoder(os.Stdout).Encode(result); err != nil {
		fail(err)
	}
}
'''
GOCODE = Path("/usr/share/gocode")


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    # Unix socket paths are limited to 108 bytes; pytest's tmp dirs can be longer.
    d = Path(tempfile.mkdtemp(prefix="esgz-ctd-", dir="/tmp"))
    ctd = start_containerd(d)
    ctd.ns = NS
    try:
        yield ctd
    finally:
        ctd.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def source_tar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus (2 MiB + odd big file), with a security.capability the kernel accepts."""
    d = tmp_path_factory.mktemp("esgz-src")
    raw = corpus.write_corpus_tar(d / "corpus.tar", big_size=(2 << 20) + 777)
    out = d / "layer.tar"
    with tarfile.open(raw) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            if "SCHILY.xattr.security.capability" in m.pax_headers:
                m.pax_headers = {**m.pax_headers, "SCHILY.xattr.security.capability": VALID_CAPABILITY}
            dst.addfile(m, src.extractfile(m) if m.isreg() else None)
    return out


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def _add_blob(tf: tarfile.TarFile, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _add(tf, "blobs/sha256/" + digest[7:], data)
    return digest


def write_oci_archive(path: Path, ref: str, layer: bytes, diff_id: str,
                      annotations: dict[str, str] | None = None) -> str:
    """An OCI image-layout tar with one linux/amd64 image of one gzip layer; returns the manifest digest."""
    with tarfile.open(path, "w") as tf:
        _add(tf, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        layer_desc: dict[str, Any] = {"mediaType": LAYER_GZIP, "digest": _add_blob(tf, layer), "size": len(layer)}
        if annotations:
            layer_desc["annotations"] = annotations
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                             "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": _add_blob(tf, config), "size": len(config)},
            "layers": [layer_desc],
        }).encode()
        digest = _add_blob(tf, manifest)
        index = {"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest, "size": len(manifest),
            "annotations": {"io.containerd.image.name": ref,
                            "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}}]}
        _add(tf, "index.json", json.dumps(index).encode())
    return digest


def import_gzip_source(ctd: Containerd, tmp_path: Path, src: Path, ref: str) -> None:
    raw = src.read_bytes()
    archive = tmp_path / "src-oci.tar"
    write_oci_archive(archive, ref, gzip.compress(raw, 6), "sha256:" + hashlib.sha256(raw).hexdigest())
    ctd.ctr("images", "import", "--no-unpack", str(archive))


def convert_with_ctr_remote(ctd: Containerd, tmp_path: Path, src: Path, name: str,
                            *extra: str) -> tuple[dict[str, Any], Path]:
    """Import src as an image, convert it with ctr-remote; (layer descriptor, layer blob path)."""
    import_gzip_source(ctd, tmp_path, src, f"example.com/esgz/{name}:src")
    ctd.ctr("images", "convert", "--estargz", "--oci", *extra, f"example.com/esgz/{name}:src",
            f"example.com/esgz/{name}:esgz", tool="ctr-remote", timeout=300)
    manifest = ctd.manifest(f"example.com/esgz/{name}:esgz")
    (layer,) = manifest["layers"]
    config = json.loads(ctd.blob(manifest["config"]["digest"]).read_bytes())
    layer["diff_id"] = config["rootfs"]["diff_ids"][0]
    return layer, ctd.blob(layer["digest"])


def test_ctr_remote_blob_reads_with_our_reader(containerd: Containerd, source_tar: Path, tmp_path: Path) -> None:
    layer, blob = convert_with_ctr_remote(containerd, tmp_path, source_tar, "go",
                                          "--estargz-chunk-size", str(512 << 10))
    assert layer["mediaType"] == LAYER_GZIP
    toc_annotation = layer["annotations"][estargz.TOC_DIGEST_ANNOTATION]
    footer, index = open_blob(blob, layer["digest"], expected_toc_digest=toc_annotation)
    assert not footer.legacy
    assert index.toc_digest == toc_annotation
    assert containerd.ctr("images", "get-toc-digest", layer["digest"], tool="ctr-remote").strip() == toc_annotation
    assert index.landmark is Landmark.NO_PREFETCH
    assert corpus.index_tree(index, chunk_reader(blob), skip=skip_landmarks) == corpus.tar_tree(source_tar)
    assert len(index["data/big.bin"].chunks) == 5  # 2 MiB + 777 in 512 KiB chunks
    diff_id, size = gunzip_to(blob, tmp_path / "plain.tar")
    assert diff_id == layer["diff_id"]
    assert str(size) == layer["annotations"][estargz.UNCOMPRESSED_SIZE_ANNOTATION]
    # Our writer with the same settings writes the same TOC JSON, field for field, except for the
    # compressed offsets (Go's gzip and zlib compress differently).
    ours = tmp_path / "ours.esgz"
    write_blob(source_tar, ours, prefetch=[], chunk_size=512 << 10)
    strip = [[{k: v for k, v in e.items() if k != "offset"} for e in toc_entries(b)] for b in (blob, ours)]
    assert strip[0] == strip[1]


def toc_entries(blob: Path) -> list[dict[str, Any]]:
    """The raw TOC JSON entries of a blob."""
    data = blob.read_bytes()
    off, length = estargz.toc_range(estargz.parse_footer(data[-estargz.FOOTER_SIZE:]), len(data))
    tar = gzip.decompress(data[off:off + length])
    size = int(tar[124:136].split(b"\0")[0], 8)
    entries: list[dict[str, Any]] = json.loads(tar[512:512 + size])["entries"]
    return entries


def _no_parent_dirs_tar(path: Path) -> Path:
    """Files without their parent directory entries (ctr-remote then treats them as missing)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in (("usr/bin/tool", b"tool"), ("top", b"top"), ("usr/lib/x", b"x")):
            _add(tf, name, data)
        info = tarfile.TarInfo("link-to-top")
        info.type = tarfile.LNKTYPE
        info.linkname = "top"
        tf.addfile(info)
    return path


@pytest.mark.parametrize(("source", "wanted", "prefetched", "missing"), [
    ("corpus", ["data/text", "/etc/hardlink-to-passwd", "bin/sh", "no/such/file", "opaque/kept"],
     ("data/text", "etc/passwd", "opaque/kept"), ("no/such/file",)),
    ("no-dirs", ["usr/bin/tool", "link-to-top", "./usr/lib/x"], ("top",), ("usr/bin/tool", "./usr/lib/x")),
])
def test_prefetch_layout_matches_ctr_remote(containerd: Containerd, source_tar: Path, tmp_path: Path,
                                            source: str, wanted: list[str], prefetched: tuple[str, ...],
                                            missing: tuple[str, ...]) -> None:
    src = source_tar if source == "corpus" else _no_parent_dirs_tar(tmp_path / "no-dirs.tar")
    record = tmp_path / "record.json"
    record.write_text("".join(json.dumps({"path": p}) + "\n" for p in wanted))
    layer, go_blob = convert_with_ctr_remote(containerd, tmp_path, src, f"prefetch-{source}",
                                             "--estargz-record-in", str(record))
    _, go_index = open_blob(go_blob, layer["digest"])
    ours = tmp_path / "ours.esgz"
    result = write_blob(src, ours, prefetch=wanted)
    _, our_index = open_blob(ours, result.digest)
    assert go_index.landmark is our_index.landmark is Landmark.PREFETCH
    assert [e.name for e in our_index.entries] == [e.name for e in go_index.entries]
    assert our_index.prefetch == go_index.prefetch == prefetched
    assert result.missing_prefetch == missing


@dataclass(frozen=True)
class FsFacts:
    type: str
    mode: int
    uid: int
    gid: int
    mtime: int
    size: int
    link: str
    dev: tuple[int, int]
    xattrs: tuple[tuple[str, bytes], ...]
    sha256: str | None


_KIND = {stat.S_IFDIR: "dir", stat.S_IFREG: "reg", stat.S_IFLNK: "symlink", stat.S_IFCHR: "char",
         stat.S_IFBLK: "block", stat.S_IFIFO: "fifo"}


def fs_tree(root: Path) -> dict[str, tuple[FsFacts, int]]:
    """{name: (facts, inode)} of an unpacked directory, names like corpus.tar_tree's."""
    out: dict[str, tuple[FsFacts, int]] = {}
    paths = [root, *sorted(root.rglob("*"))]
    for p in paths:
        st = p.lstat()
        kind = _KIND[stat.S_IFMT(st.st_mode)]
        name = "" if p == root else str(p.relative_to(root))
        xattrs = tuple(sorted((k, os.getxattr(p, k, follow_symlinks=False))
                              for k in os.listxattr(p, follow_symlinks=False)
                              if not k.startswith("trusted.") and k != "security.selinux"))
        sha = hashlib.sha256(p.read_bytes()).hexdigest() if kind == "reg" else None
        dev = (os.major(st.st_rdev), os.minor(st.st_rdev)) if kind in ("char", "block") else (0, 0)
        out[name] = (FsFacts(kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime),
                             st.st_size if kind == "reg" else 0, os.readlink(p) if kind == "symlink" else "",
                             dev, xattrs, sha), st.st_ino)
    return out


def expected_unpacked(src: Path) -> tuple[dict[str, FsFacts], dict[str, str]]:
    """What a first layer unpacks to: whiteouts and opaque markers vanish (nothing below them),
    hard links become more names of their target. Returns (facts, {link: target})."""
    tree = corpus.tar_tree(src)
    facts: dict[str, FsFacts] = {}
    links: dict[str, str] = {}
    for name, f in tree.items():
        base = name.rsplit("/", 1)[-1]
        if base.startswith(".wh."):
            continue
        if f.type == "hardlink":
            links[name] = f.link
            f = tree[f.link]
        facts[name] = FsFacts(f.type, f.mode, f.uid, f.gid, f.mtime, f.size, f.link, f.dev, f.xattrs, f.sha256)
    return facts, links


def test_containerd_unpacks_our_blob(containerd: Containerd, source_tar: Path, tmp_path: Path) -> None:
    blob = tmp_path / "ours.esgz"
    result = write_blob(source_tar, blob, prefetch=[], chunk_size=1 << 20)
    archive = tmp_path / "ours-oci.tar"
    ref = "example.com/esgz/ours:1"
    write_oci_archive(archive, ref, blob.read_bytes(), result.diff_id, result.annotations())
    # import unpacks with the default (overlayfs) snapshotter and checks the unpacked diff_id
    containerd.ctr("images", "import", str(archive))
    layer = containerd.manifest(ref)["layers"][0]
    assert layer["digest"] == result.digest
    assert containerd.ctr("images", "get-toc-digest", result.digest, tool="ctr-remote").strip() == \
        result.toc_digest
    # the committed snapshot of a one-layer image is named by its chain id = diff_id
    assert result.diff_id in containerd.ctr("snapshots", "ls")
    # A read-only view of a one-layer chain is a bind mount of the committed snapshot's directory;
    # --mounts prints it in the same call (an unleased view may be garbage-collected right after).
    try:
        (mount,) = json.loads(containerd.ctr("snapshots", "view", "--mounts", "esgz-view", result.diff_id))
        assert mount["Type"] == "bind", mount
        got = fs_tree(Path(mount["Source"]))
    finally:
        subprocess.run(["ctr", "-a", str(containerd.sock), "-n", NS, "snapshots", "rm", "esgz-view"],
                       capture_output=True, timeout=60)
    want, links = expected_unpacked(source_tar)
    # landmark and TOC are ordinary files to containerd (as with ctr-remote's blobs)
    assert got.pop(NO_PREFETCH_LANDMARK)[0].sha256 == hashlib.sha256(b"\x0f").hexdigest()
    assert got.pop(estargz.TOC_TAR_NAME)[0].sha256 == result.toc_digest[7:]
    assert PREFETCH_LANDMARK not in got
    # containerd does not restore the snapshot root's mtime
    got_facts = {n: f for n, (f, _) in got.items()}
    root_got, root_want = got_facts.pop(""), want.pop("")
    assert (root_got.type, root_got.mode, root_got.uid, root_got.gid) == \
        (root_want.type, root_want.mode, root_want.uid, root_want.gid)
    assert got_facts == want
    for link, target in links.items():
        assert got[link][1] == got[target][1], f"{link} is not a hard link to {target}"


@pytest.fixture(scope="module")
def go_checker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert shutil.which("go"), "go is not installed (Debian golang-go)"
    assert (GOCODE / "src/github.com/containerd/stargz-snapshotter/estargz").is_dir()
    d = tmp_path_factory.mktemp("gopath")
    (d / "src/esgzcheck").mkdir(parents=True)
    (d / "src/esgzcheck/main.go").write_text(GO_CHECKER)
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": f"{d}:{GOCODE}", "GOCACHE": str(d / "cache"),
           "GOFLAGS": "", "CGO_ENABLED": "0"}
    out = d / "esgzcheck"
    proc = subprocess.run(["go", "build", "-o", str(out), "esgzcheck"], cwd=d, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize(("legacy", "prefetch", "chunk_size"), [
    (False, None, 4 << 20), (False, ["data/text", "etc/hardlink-to-passwd"], 300_000), (True, [], 1 << 20)])
def test_go_reader_reads_our_blobs(go_checker: Path, source_tar: Path, tmp_path: Path, legacy: bool,
                                   prefetch: list[str] | None, chunk_size: int) -> None:
    blob = tmp_path / "ours.esgz"
    result = write_blob(source_tar, blob, legacy=legacy, prefetch=prefetch, chunk_size=chunk_size)
    proc = subprocess.run([str(go_checker), str(blob), result.toc_digest], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    go = json.loads(proc.stdout)
    assert go["toc"] == result.toc_digest
    _, index = open_blob(blob, result.digest)
    want = corpus.tar_tree(source_tar)
    go_files = {n: f for n, f in go["files"].items() if not skip_landmarks(n)}
    assert set(go_files) == set(want)
    for name, facts in want.items():
        g = go_files[name]
        if facts.type == "hardlink":  # Go resolves a hard link to the entry it names
            assert g["type"] == "reg" and g["sha256"] == want[facts.link].sha256
        else:
            assert g["type"] == facts.type, name
            assert g.get("sha256") == (facts.sha256 if facts.type == "reg" else None), name
        ours = index[name]
        if facts.type == "reg":
            assert g.get("chunks", 0) == len(ours.chunks), name
        if facts.type != "dir":  # Go counts a directory's links differently (root is one short)
            assert g["nlink"] == ours.nlink, name
