"""Content digests as the formats write them: "sha256:<hex>" and "blake3:<hex>".

`compute_digest(algo, data)` and `check_digest(expected, data, what)` are pure. BLAKE3 (Nydus's
default chunk digest) comes from the `blake3` PyPI package, imported on first use.
"""

from __future__ import annotations

import hashlib
import hmac

from snapshotter.errors import DigestMismatch, FormatError

ALGORITHMS = ("sha256", "blake3")


def compute_digest(algo: str, data: bytes) -> str:
    """ "algo:hex" of `data`; algo is "sha256" or "blake3"."""
    if algo == "sha256":
        return "sha256:" + hashlib.sha256(data).hexdigest()
    if algo == "blake3":
        try:
            from blake3 import blake3  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise FormatError("blake3 digests need the 'blake3' package, which is not installed") from None

        return "blake3:" + str(blake3(data).hexdigest())
    raise FormatError(f"unsupported digest algorithm {algo!r}")


def check_digest(expected: str, data: bytes, what: str) -> None:
    """Raise DigestMismatch (naming `what`) unless `data` hashes to `expected` ("algo:hex")."""
    algo, sep, hexpart = expected.partition(":")
    if not sep or algo not in ALGORITHMS:
        raise FormatError(f"{what}: unsupported digest {expected!r}")
    actual = compute_digest(algo, data)
    if not hmac.compare_digest(actual, f"{algo}:{hexpart.lower()}"):
        raise DigestMismatch(f"{what}: digest {actual} does not match expected {expected}")
