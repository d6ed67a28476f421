"""Small tar archives for tests: a dict of file names and contents in, tar bytes out."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Mapping, Sequence


def tar_of(files: Mapping[str, bytes], *, dirs: Sequence[str] = (), mtime: int = 0) -> bytes:
    """A PAX tar of `dirs` (mode 0755, first, in order) and then `files` (mode 0644, in the
    mapping's order), every member with modification time `mtime`. Same input, same bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, mtime
            tf.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, mtime
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()
