"""The Nydus bootstrap layer: a tar (usually gzip-compressed) holding `image/image.boot`. Pure.

`bootstrap_from_layer(data, max_bootstrap_bytes=N)` returns the bootstrap bytes, reading at most
N decompressed bytes of it; FormatError when the layer holds none.
"""

from __future__ import annotations

import io
import tarfile

from snapshotter.errors import FormatError, LimitExceeded
from snapshotter.formats.inflate import InflateError, gzip_inflater

BOOTSTRAP_NAMES = ("image/image.boot", "./image/image.boot")
_TAR_OVERHEAD = 1 << 20  # headers, padding and other small members around the bootstrap


def _gunzip_bounded(data: bytes, limit: int) -> bytes:
    d = gzip_inflater()
    try:
        out = d.decompress(data, limit + 1)
    except InflateError as exc:
        raise FormatError(f"nydus bootstrap layer: gzip data is corrupt: {exc}") from None
    if len(out) > limit:
        raise LimitExceeded(f"nydus bootstrap layer decompresses to more than {limit} bytes")
    return out


def bootstrap_from_layer(data: bytes, *, max_bootstrap_bytes: int) -> bytes:
    raw = _gunzip_bounded(data, max_bootstrap_bytes + _TAR_OVERHEAD) if data[:2] == b"\x1f\x8b" else data
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
            for member in tf:
                if member.name in BOOTSTRAP_NAMES and member.isreg():
                    if member.size > max_bootstrap_bytes:
                        raise LimitExceeded(f"nydus bootstrap is {member.size} bytes, over {max_bootstrap_bytes}")
                    f = tf.extractfile(member)
                    if f is None:
                        break
                    return f.read()
    except tarfile.TarError as exc:
        raise FormatError(f"nydus bootstrap layer is not a tar: {exc}") from None
    raise FormatError("nydus bootstrap layer has no image/image.boot")
