"""A layer tar with every entry type, and a way to compare trees.

`write_corpus_tar(path, big_size=...)` writes a tar that holds: dirs, regular files (empty,
small, sparse-looking zero runs, one big incompressible file), symlinks, a hard link pair,
char/block devices, a fifo, xattrs (user. and security.), a >100-char name, a whiteout and an
opaque marker, odd modes and owners.

`tar_tree(path)` and `index_tree(index, read)` both give {name: EntryFacts} so a test can
assert a format round trip keeps the tree and the bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from snapshotter.formats.index import Entry, EntryType, LayerIndex, normalize_name

MTIME = 1_700_000_000
LONG_NAME = "deep/" + "d" * 60 + "/" + "f" * 120 + ".txt"


@dataclass(frozen=True)
class EntryFacts:
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


def _add(tf: tarfile.TarFile, name: str, type_: bytes, data: bytes | BinaryIO | None = None, *,
         size: int | None = None, mode: int = 0o644, uid: int = 0, gid: int = 0, link: str = "",
         dev: tuple[int, int] = (0, 0), xattrs: dict[str, str] | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.mode = mode
    info.uid, info.gid = uid, gid
    info.mtime = MTIME
    info.linkname = link
    info.devmajor, info.devminor = dev
    if xattrs:
        info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
    if isinstance(data, bytes):
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    elif data is not None:
        assert size is not None
        info.size = size
        tf.addfile(info, data)
    else:
        tf.addfile(info)


class _RandomStream(io.RawIOBase):
    """Deterministic incompressible bytes, produced without holding them all in memory."""

    def __init__(self, size: int, seed: bytes) -> None:
        self._left = size
        self._counter = 0
        self._seed = seed
        self._buf = b""

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self._left
        n = min(n, self._left)
        while len(self._buf) < n:
            self._buf += hashlib.shake_256(self._seed + self._counter.to_bytes(8, "little")).digest(1 << 16)
            self._counter += 1
        out, self._buf = self._buf[:n], self._buf[n:]
        self._left -= n
        return out


def write_corpus_tar(path: Path, *, big_size: int = 100 * 1024 * 1024) -> Path:
    """Write the corpus tar to `path` (PAX format) and return the path."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "./", tarfile.DIRTYPE, mode=0o755)
        _add(tf, "bin", tarfile.DIRTYPE, mode=0o755)
        _add(tf, "bin/hello", tarfile.REGTYPE, b"#!/bin/sh\necho hello\n", mode=0o755)
        _add(tf, "bin/suid", tarfile.REGTYPE, b"suid\n", mode=0o4755, uid=1000, gid=1000)
        _add(tf, "bin/sh", tarfile.SYMTYPE, link="hello", mode=0o777)
        _add(tf, "bin/abs-link", tarfile.SYMTYPE, link="/etc/passwd", mode=0o777)
        _add(tf, "etc", tarfile.DIRTYPE, mode=0o755, uid=0, gid=0)
        _add(tf, "etc/passwd", tarfile.REGTYPE, b"root:x:0:0:root:/root:/bin/sh\n")
        _add(tf, "etc/hardlink-to-passwd", tarfile.LNKTYPE, link="etc/passwd")
        _add(tf, "etc/empty", tarfile.REGTYPE, b"", mode=0o600, uid=65534, gid=65534)
        _add(tf, "etc/xattr-file", tarfile.REGTYPE, b"with xattrs\n",
             xattrs={"user.comment": "hello world", "security.capability": "\x01\x00\x00\x02"})
        _add(tf, "dev", tarfile.DIRTYPE, mode=0o755)
        _add(tf, "dev/null", tarfile.CHRTYPE, mode=0o666, dev=(1, 3))
        _add(tf, "dev/loop0", tarfile.BLKTYPE, mode=0o660, dev=(7, 0), gid=6)
        _add(tf, "dev/fifo", tarfile.FIFOTYPE, mode=0o644)
        _add(tf, "deep", tarfile.DIRTYPE, mode=0o755)
        _add(tf, "deep/" + "d" * 60, tarfile.DIRTYPE, mode=0o700)
        _add(tf, LONG_NAME, tarfile.REGTYPE, b"long name\n" * 100)
        _add(tf, "data", tarfile.DIRTYPE, mode=0o755)
        zeros = b"\x00" * (3 * 1024 * 1024) + b"tail" + b"\x00" * 4096
        _add(tf, "data/sparse-like", tarfile.REGTYPE, zeros)
        text = b"".join(b"line %d of a compressible text file\n" % i for i in range(200_000))
        _add(tf, "data/text", tarfile.REGTYPE, text)
        _add(tf, "data/big.bin", tarfile.REGTYPE, _RandomStream(big_size, b"big"), size=big_size)  # type: ignore[arg-type]
        _add(tf, "data/.wh.deleted", tarfile.REGTYPE, b"", mode=0o000)
        _add(tf, "opaque", tarfile.DIRTYPE, mode=0o755)
        _add(tf, "opaque/.wh..wh..opq", tarfile.REGTYPE, b"", mode=0o000)
        _add(tf, "opaque/kept", tarfile.REGTYPE, b"kept\n")
    return path


def _sha256_stream(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


_TAR_TYPES = {
    tarfile.DIRTYPE: "dir", tarfile.REGTYPE: "reg", tarfile.AREGTYPE: "reg", tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink", tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.FIFOTYPE: "fifo",
}


def tar_tree(path: Path, *, skip: Callable[[str], bool] = lambda n: False) -> dict[str, EntryFacts]:
    """The tree a layer tar describes, keyed by normalized name."""
    out: dict[str, EntryFacts] = {}
    with tarfile.open(path, "r:*") as tf:
        for m in tf:
            name = normalize_name(m.name)
            if skip(name):
                continue
            xattrs = tuple(sorted(
                (k[len("SCHILY.xattr."):], v.encode("utf-8", "surrogateescape"))
                for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")
            ))
            sha = None
            if m.isreg():
                f = tf.extractfile(m)
                assert f is not None
                sha = _sha256_stream(f)
            kind = _TAR_TYPES[m.type]
            link = normalize_name(m.linkname) if kind == "hardlink" else m.linkname
            dev = (m.devmajor, m.devminor) if kind in ("char", "block") else (0, 0)
            out[name] = EntryFacts(kind, m.mode & 0o7777, m.uid, m.gid, int(m.mtime),
                                   m.size if kind == "reg" else 0, link, dev, xattrs, sha)
    return out


def index_tree(index: LayerIndex, read: Callable[[Entry], bytes],
               *, skip: Callable[[str], bool] = lambda n: False) -> dict[str, EntryFacts]:
    """The tree a LayerIndex describes; `read(entry)` returns a regular file's whole content."""
    out: dict[str, EntryFacts] = {}
    for e in index.entries:
        if skip(e.name):
            continue
        sha = hashlib.sha256(read(e)).hexdigest() if e.type is EntryType.REG else None
        dev = (e.dev_major, e.dev_minor) if e.type in (EntryType.CHAR, EntryType.BLOCK) else (0, 0)
        out[e.name] = EntryFacts(e.type.value, e.mode & 0o7777, e.uid, e.gid, e.mtime_ns // 1_000_000_000,
                                 e.size if e.type is EntryType.REG else 0, e.link_target, dev,
                                 tuple(sorted(e.xattrs.items())), sha)
    return out


if __name__ == "__main__":  # pragma: no cover - handy for poking at formats by hand
    import sys

    write_corpus_tar(Path(sys.argv[1]), big_size=int(os.environ.get("BIG_SIZE", str(1 << 20))))
