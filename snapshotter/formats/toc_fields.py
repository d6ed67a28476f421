"""Typed field readers for JSON TOC entries (eStargz's JTOC, and zstd:chunked's, which extends it).
Pure. Each takes a field's value as JSON gave it (None when absent or null) and raises
FormatError naming `what` (the layer and entry, as anything that formats to that text) and the
field `key`.
"""

from __future__ import annotations

import binascii
import calendar
import datetime
import functools
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from snapshotter.errors import FormatError
from snapshotter.formats.index import NO_XATTRS

MAX_INT = (1 << 63) - 1
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_TIME_RE = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)


def int_value(v: Any, key: str, what: object, *, hi: int = MAX_INT) -> int:
    """A non-negative integer field (absent or null: 0) no larger than `hi`."""
    if v is None:
        return 0
    if type(v) is not int or not 0 <= v <= hi:
        raise FormatError(f"{what}: field {key!r} is {v!r}, expected an integer in [0, {hi}]")
    return v


def str_value(v: Any, key: str, what: object) -> str:
    """A string field without NUL bytes (absent or null: "")."""
    if v is None:
        return ""
    if not isinstance(v, str):
        raise FormatError(f"{what}: field {key!r} is {type(v).__name__}, expected a string")
    if "\x00" in v:
        raise FormatError(f"{what}: field {key!r} contains a NUL byte")
    return v


def digest_value(v: Any, key: str, what: object) -> str | None:
    """A "sha256:<64 lowercase hex>" field, or None when absent/empty."""
    v = str_value(v, key, what)
    if not v:
        return None
    if not DIGEST_RE.fullmatch(v):
        raise FormatError(f"{what}: {key} {v!r} is not 'sha256:<64 lowercase hex>'")
    return v


@functools.lru_cache(maxsize=4096)  # a layer's files share few distinct times (one package install)
def rfc3339_ns(text: str) -> int:
    """RFC 3339 text -> ns since the epoch; ValueError naming the problem."""
    m = _TIME_RE.fullmatch(text)
    if not m:
        raise ValueError("is not RFC 3339")
    y, mo, d, h, mi, s = (int(g) for g in m.group(1, 2, 3, 4, 5, 6))
    try:
        datetime.datetime(y, mo, d, h, mi, min(s, 59))
    except ValueError:
        raise ValueError("is not a valid date") from None
    secs = calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0))
    if m.group(9):
        offset = (int(m.group(10)) * 60 + int(m.group(11))) * 60
        secs -= offset if m.group(9) == "+" else -offset
    frac = int((m.group(7) or "0").ljust(9, "0"))
    return secs * 1_000_000_000 + frac


def mtime_ns_value(v: Any, what: object) -> int:
    """"modtime" as RFC 3339 (eStargz: whole seconds; containers/storage: RFC3339Nano) -> ns since
    the epoch; absent: 0."""
    text = str_value(v, "modtime", what)
    if not text:
        return 0
    try:
        return rfc3339_ns(text)
    except ValueError as exc:
        raise FormatError(f"{what}: modtime {text!r} {exc}") from None


def xattrs_value(v: Any, what: object) -> Mapping[str, bytes]:
    """"xattrs": name -> base64 value (Go's []byte in JSON)."""
    if v is None or v == {}:
        return NO_XATTRS
    if not isinstance(v, dict):
        raise FormatError(f"{what}: xattrs is {type(v).__name__}, expected an object")
    out: dict[str, bytes] = {}
    for k, b64 in v.items():
        if not k or "\x00" in k or not isinstance(b64, str):
            raise FormatError(f"{what}: bad xattr {k!r}")
        try:
            out[k] = binascii.a2b_base64(b64.encode("ascii"), strict_mode=True)
        except (binascii.Error, UnicodeEncodeError):
            raise FormatError(f"{what}: xattr {k!r} value is not base64") from None
    return MappingProxyType(out)
