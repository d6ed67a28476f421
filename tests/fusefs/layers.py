"""Test layers for the FUSE tests, built two ways from one description:

- `Layer.build(blob_path)` -> LayerIndex + a blob file whose chunks are gzip (or zstd) members,
  every chunk carrying its sha256 (what a format reader would produce from an eStargz layer);
- `Layer.materialize(dir)` -> the layer as an overlay lowerdir on a real filesystem (whiteouts as
  char 0:0, opaque dirs with trusted.overlay.opaque=y, as containerd's overlay snapshotter stores
  them), so a kernel overlay mount of the materialized layers is the reference merged tree.

`tree_facts(root)` describes a directory tree (type, mode, owner, mtime, size, link target,
rdev, user.* xattrs, content digest) for comparing a FUSE mount with the kernel reference.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import posixpath
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from snapshotter.formats.index import Chunk, Compression, Entry, EntryType, LayerIndex

T0 = 1_700_000_000_000_000_000


@dataclass
class Layer:
    """A layer description; methods append entries in tar order."""

    chunk_size: int = 4096
    compression: Compression = Compression.GZIP
    entries: list[tuple[Entry, bytes]] = field(default_factory=list)

    def _add(self, name: str, type_: EntryType, data: bytes = b"", **kw: Any) -> Layer:
        kw.setdefault("mtime_ns", T0)
        self.entries.append((Entry(name=name, type=type_, **kw), data))
        return self

    def dir(self, name: str, mode: int = 0o755, **kw: Any) -> Layer:
        return self._add(name, EntryType.DIR, mode=mode, **kw)

    def file(self, name: str, data: bytes, mode: int = 0o644, **kw: Any) -> Layer:
        return self._add(name, EntryType.REG, data, mode=mode, size=len(data), **kw)

    def symlink(self, name: str, target: str, **kw: Any) -> Layer:
        return self._add(name, EntryType.SYMLINK, mode=0o777, link_target=target, **kw)

    def hardlink(self, name: str, target: str) -> Layer:
        return self._add(name, EntryType.HARDLINK, link_target=target)

    def device(self, name: str, kind: EntryType, major: int = 0, minor: int = 0, mode: int = 0o666) -> Layer:
        return self._add(name, kind, mode=mode, dev_major=major, dev_minor=minor)

    def whiteout(self, target: str) -> Layer:
        return self._add(posixpath.join(posixpath.dirname(target), ".wh." + posixpath.basename(target)),
                         EntryType.REG, mode=0)

    def opaque(self, directory: str) -> Layer:
        return self._add(posixpath.join(directory, ".wh..wh..opq"), EntryType.REG, mode=0)

    def index(self) -> LayerIndex:
        """The index without chunks (enough for tree tests, which never read bytes)."""
        return LayerIndex(format="test", entries=tuple(e for e, _ in self.entries))

    def build(self, blob_path: Path, *, corrupt: frozenset[str] = frozenset()) -> LayerIndex:
        """Write the blob; return the index. Files named in `corrupt` get a wrong chunk digest."""
        blob = bytearray()
        out: list[Entry] = []
        for e, data in self.entries:
            if e.type is EntryType.REG and data:
                chunks = []
                for off in range(0, len(data), self.chunk_size):
                    piece = data[off:off + self.chunk_size]
                    packed = (gzip.compress(piece, mtime=0) if self.compression is Compression.GZIP
                              else zstandard.ZstdCompressor().compress(piece))
                    digest = "sha256:" + hashlib.sha256(piece if e.name not in corrupt else piece + b"!").hexdigest()
                    chunks.append(Chunk(off, len(piece), len(blob), len(packed), self.compression, digest))
                    blob += packed
                e = dataclasses.replace(e, chunks=tuple(chunks), digest="sha256:" + hashlib.sha256(data).hexdigest())
            out.append(e)
        blob_path.write_bytes(bytes(blob))
        return LayerIndex(format="test", entries=tuple(out), blobs=("sha256:" + hashlib.sha256(blob).hexdigest(),))

    def materialize(self, root: Path) -> None:
        """Write the layer as an overlay lowerdir under `root` (which must exist)."""
        dirs: list[tuple[Path, Entry]] = []
        implied: list[Path] = []
        for e, data in self.entries:
            p = root / e.name if e.name else root
            _mkparents(root, p.parent, implied)
            base = posixpath.basename(e.name)
            if e.is_opaque_marker:
                os.setxattr(p.parent, "trusted.overlay.opaque", b"y")
                continue
            if e.is_whiteout:
                target = p.parent / base[len(".wh."):]
                os.mknod(target, stat.S_IFCHR | 0, os.makedev(0, 0))
                os.utime(target, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
                continue
            if e.type is EntryType.DIR:
                p.mkdir(exist_ok=True)
                dirs.append((p, e))
            elif e.type is EntryType.REG:
                p.write_bytes(data)
            elif e.type is EntryType.SYMLINK:
                os.symlink(e.link_target, p)
            elif e.type is EntryType.HARDLINK:
                os.link(root / e.link_target, p)
                continue
            elif e.type is EntryType.FIFO:
                os.mkfifo(p)
            else:
                kind = stat.S_IFCHR if e.type is EntryType.CHAR else stat.S_IFBLK
                os.mknod(p, kind | e.mode, os.makedev(e.dev_major, e.dev_minor))
            os.chown(p, e.uid, e.gid, follow_symlinks=False)
            if e.type is not EntryType.SYMLINK:
                os.chmod(p, e.mode)
            for k, v in e.xattrs.items():
                os.setxattr(p, k, v, follow_symlinks=False)
            os.utime(p, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
        for p, e in reversed(dirs):  # after the children, which touch the dir's mtime
            os.utime(p, ns=(e.mtime_ns, e.mtime_ns))
        for p in implied:
            if not any(p == q for q, _ in dirs):
                os.utime(p, ns=(0, 0))


def _mkparents(root: Path, d: Path, implied: list[Path]) -> None:
    """Parents a layer does not list: 0755, mtime 0 (what the tree module's implied dirs report)."""
    if d == root or d.exists():
        return
    _mkparents(root, d.parent, implied)
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    implied.append(d)


@dataclass(frozen=True)
class Facts:
    type: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    link: str
    rdev: int
    xattrs: tuple[tuple[str, bytes], ...]
    sha256: str | None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "dir"), (stat.S_ISREG, "reg"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISCHR, "char"), (stat.S_ISBLK, "block"), (stat.S_ISFIFO, "fifo")):
        if test(mode):
            return name
    return "?"


def tree_facts(root: Path, *, xattr_filter: Callable[[str], bool] = lambda k: k.startswith("user.")
               ) -> dict[str, Facts]:
    out: dict[str, Facts] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, *([""] if dirpath == str(root) else [])]:
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            kind = _kind(st.st_mode)
            sha = None
            if kind == "reg":
                with open(p, "rb") as f:
                    sha = hashlib.sha256(f.read()).hexdigest()
            xattrs: tuple[tuple[str, bytes], ...] = ()
            if kind in ("reg", "dir"):
                xattrs = tuple(sorted((k, os.getxattr(p, k, follow_symlinks=False))
                                      for k in os.listxattr(p, follow_symlinks=False) if xattr_filter(k)))
            out[rel] = Facts(kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                             st.st_mtime_ns, st.st_size if kind in ("reg", "symlink") else 0,
                             os.readlink(p) if kind == "symlink" else "",
                             st.st_rdev if kind in ("char", "block") else 0, xattrs, sha)
    return out
