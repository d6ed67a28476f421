"""Read and write an OCI image layout directory (image-spec `image-layout.md`).

Layout: `DIR/oci-layout` ({"imageLayoutVersion": "1.0.0"}), `DIR/index.json` (an image index
whose entries are tagged with the `org.opencontainers.image.ref.name` annotation) and
`DIR/blobs/sha256/<hex>`. `oci:DIR[:TAG]` names the entry tagged TAG ("latest" when omitted).

Contracts:
- Reads verify content against its digest (whole-blob hashes while streaming); a missing or
  mismatching blob raises ImageError naming the layout and digest.
- Writes are atomic per file (temp file + rename), so a crash never leaves a truncated blob
  under its digest name nor a half-written index.json. `tag()` replaces an existing entry
  with the same ref name and keeps the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from snapshotter.image.model import (
    MAX_JSON_BYTES,
    OCI_INDEX,
    REF_NAME_ANNOTATION,
    ImageError,
    check_descriptor,
    check_digest_syntax,
    decode,
    sha256_digest,
)

LAYOUT_PREFIX = "oci:"
_TAG_RE = re.compile(r"^[\w][\w.+-]{0,127}$")
_COPY = 1 << 20


def is_layout_spec(spec: str) -> bool:
    return spec.startswith(LAYOUT_PREFIX)


def parse_layout_spec(spec: str) -> tuple[Path, str]:
    """`oci:DIR[:TAG]` -> (DIR, TAG). The tag is what follows the last ':' when it looks like one."""
    if not is_layout_spec(spec):
        raise ImageError(f"{spec!r} is not an OCI layout reference (oci:DIR[:TAG])")
    rest = spec[len(LAYOUT_PREFIX):]
    head, sep, tail = rest.rpartition(":")
    if sep and head and "/" not in tail and _TAG_RE.match(tail):
        path, tag = head, tail
    else:
        path, tag = rest, "latest"
    if not path:
        raise ImageError(f"{spec!r}: empty layout directory (want oci:DIR[:TAG])")
    return Path(path), tag


class OciLayout:
    """One layout directory. Nothing is created until the first write."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __str__(self) -> str:
        return f"OCI layout {self.root}"

    # ---- reading -----------------------------------------------------------------------------

    def index(self) -> dict[str, Any]:
        path = self.root / "index.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ImageError(f"{self}: no index.json (not an OCI image layout?)") from None
        except OSError as e:
            raise ImageError(f"{self}: cannot read index.json: {e}") from None
        doc = decode(data, f"{self}: index.json")
        if not isinstance(doc.get("manifests", []), list):
            raise ImageError(f"{self}: index.json 'manifests' is not a list")
        return doc

    def tags(self) -> list[str]:
        out = []
        for m in self.index().get("manifests", []):
            name = (m.get("annotations") or {}).get(REF_NAME_ANNOTATION) if isinstance(m, dict) else None
            if isinstance(name, str):
                out.append(name)
        return out

    def resolve(self, tag: str) -> dict[str, Any]:
        """The index.json descriptor tagged `tag`."""
        for i, m in enumerate(self.index().get("manifests", [])):
            if isinstance(m, dict) and (m.get("annotations") or {}).get(REF_NAME_ANNOTATION) == tag:
                return check_descriptor(m, f"{self}: index.json entry {i}")
        known = ", ".join(self.tags()) or "none"
        raise ImageError(f"{self}: no image tagged {tag!r} (tags: {known}); check the oci:DIR:TAG reference")

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / check_digest_syntax(digest, str(self)).split(":", 1)[1]

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def read_blob(self, digest: str, *, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        """A small blob (manifest, config), verified."""
        path = self.blob_path(digest)
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes + 1)
        except FileNotFoundError:
            raise ImageError(f"{self}: blob {digest} is missing") from None
        if len(data) > max_bytes:
            raise ImageError(f"{self}: blob {digest} is larger than {max_bytes} bytes")
        if sha256_digest(data) != digest:
            raise ImageError(f"{self}: blob {digest} does not match its digest (corrupt layout)")
        return data

    def copy_blob(self, digest: str, out: IO[bytes], progress: Callable[[int], None] | None = None) -> int:
        """Stream blob `digest` into `out` in bounded pieces, verifying it; returns its size."""
        path = self.blob_path(digest)
        h = hashlib.sha256()
        n = 0
        try:
            with open(path, "rb") as f:
                while piece := f.read(_COPY):
                    h.update(piece)
                    out.write(piece)
                    n += len(piece)
                    if progress is not None:
                        progress(len(piece))
        except FileNotFoundError:
            raise ImageError(f"{self}: blob {digest} is missing") from None
        if "sha256:" + h.hexdigest() != digest:
            raise ImageError(f"{self}: blob {digest} does not match its digest (corrupt layout)")
        return n

    # ---- writing -----------------------------------------------------------------------------

    def _init(self) -> None:
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        marker = self.root / "oci-layout"
        if not marker.exists():
            self._atomic_write(marker, json.dumps({"imageLayoutVersion": "1.0.0"}).encode())

    @staticmethod
    def _atomic_write(path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def write_blob(self, data: bytes) -> str:
        digest = sha256_digest(data)
        self._init()
        path = self.blob_path(digest)
        if not path.exists():
            self._atomic_write(path, data)
        return digest

    def add_blob_file(self, src: Path, digest: str) -> None:
        """Copy the file `src` (whose sha256 the caller computed as `digest`) into the layout."""
        self._init()
        path = self.blob_path(digest)
        if path.exists():
            return
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def tag(self, tag: str, desc: dict[str, Any]) -> None:
        """Point `tag` at `desc` in index.json (the descriptor's blob must already be written)."""
        self._init()
        path = self.root / "index.json"
        doc: dict[str, Any] = (self.index() if path.exists()
                               else {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []})
        existing: list[Any] = doc.get("manifests", [])
        entries = [m for m in existing
                   if not (isinstance(m, dict) and (m.get("annotations") or {}).get(REF_NAME_ANNOTATION) == tag)]
        entry = {k: v for k, v in desc.items() if k != "annotations"}
        entry["annotations"] = {**(desc.get("annotations") or {}), REF_NAME_ANNOTATION: tag}
        entries.append(entry)
        doc["manifests"] = entries
        self._atomic_write(path, json.dumps(doc, indent=2).encode())
