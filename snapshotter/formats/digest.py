"""Content digests as the formats write them: "sha256:<hex>" and "blake3:<hex>".

`compute_digest(algo, data)` and `check_digest(expected, data, what)` are pure; `DigestCheck` is
`check_digest` for bytes that come in pieces. BLAKE3 (Nydus's default chunk digest) comes from the
`blake3` PyPI package, imported on first use.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from snapshotter.errors import DigestMismatch, FormatError

ALGORITHMS = ("sha256", "blake3")


def _hasher(algo: str) -> Any:
    """A new hashlib-style object (update, hexdigest) for `algo`."""
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "blake3":
        try:
            from blake3 import blake3  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise FormatError("blake3 digests need the 'blake3' package, which is not installed") from None

        return blake3()
    raise FormatError(f"unsupported digest algorithm {algo!r}")


def compute_digest(algo: str, data: bytes) -> str:
    """ "algo:hex" of `data`; algo is "sha256" or "blake3"."""
    h = _hasher(algo)
    h.update(data)
    return f"{algo}:{h.hexdigest()}"


class DigestCheck:
    """`check_digest` of bytes given in pieces: `update` each in order, then `verify`.
    FormatError at once for an unsupported `expected`."""

    def __init__(self, expected: str, what: str) -> None:
        algo, sep, hexpart = expected.partition(":")
        if not sep or algo not in ALGORITHMS:
            raise FormatError(f"{what}: unsupported digest {expected!r}")
        self.expected, self.what = expected, what
        self._want = f"{algo}:{hexpart.lower()}"
        self._algo = algo
        self._hash = _hasher(algo)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)

    def verify(self) -> None:
        """Raise DigestMismatch (naming `what`) unless the bytes so far hash to `expected`."""
        actual = f"{self._algo}:{self._hash.hexdigest()}"
        if not hmac.compare_digest(actual, self._want):
            raise DigestMismatch(f"{self.what}: digest {actual} does not match expected {self.expected}")


def check_digest(expected: str, data: bytes, what: str) -> None:
    """Raise DigestMismatch (naming `what`) unless `data` hashes to `expected` ("algo:hex")."""
    check = DigestCheck(expected, what)
    check.update(data)
    check.verify()
