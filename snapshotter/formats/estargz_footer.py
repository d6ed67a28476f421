"""eStargz and legacy stargz footers: the empty gzip member at the end of a blob that says where
the TOC member starts.

eStargz (51 bytes): gzip header with FLG=FEXTRA, XLEN=26, one extra subfield 'S','G' of length 22
holding "%016xSTARGZ" (TOC offset in lowercase hex), then an empty stored deflate block and a zero
CRC32/ISIZE. Legacy stargz (47 bytes): the same but the extra field is the 22 bytes directly
(XLEN=22, no subfield header).

Pure: bytes in, objects out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from snapshotter.errors import FormatError

FOOTER_SIZE = 51
LEGACY_FOOTER_SIZE = 47
MAGIC = b"STARGZ"

_GZIP_HEADER = b"\x1f\x8b\x08\x04" + b"\x00\x00\x00\x00" + b"\x00\xff"
_EMPTY_DEFLATE_AND_TRAILER = b"\x01\x00\x00\xff\xff" + b"\x00" * 8
_HEX16 = re.compile(rb"[0-9a-fA-F]{16}")
# The smallest possible gzip member (10-byte header, empty deflate block, 8-byte trailer).
MIN_GZIP_MEMBER = 20


@dataclass(frozen=True, slots=True)
class Footer:
    """A parsed footer. `size` is how many bytes it takes at the end of the blob."""

    toc_offset: int
    legacy: bool = False

    @property
    def size(self) -> int:
        return LEGACY_FOOTER_SIZE if self.legacy else FOOTER_SIZE


def _offset(field: bytes) -> int:
    if len(field) != 22 or field[16:] != MAGIC or not _HEX16.fullmatch(field[:16]):
        raise FormatError(f"stargz footer extra field {field!r} is not '%016xSTARGZ'")
    return int(field[:16], 16)


def _parse51(p: bytes) -> Footer:
    if p[:3] != b"\x1f\x8b\x08" or not p[3] & 0x04:
        raise FormatError("eStargz footer: not a gzip header with FEXTRA")
    if p[10:12] != b"\x1a\x00":
        raise FormatError(f"eStargz footer: XLEN {int.from_bytes(p[10:12], 'little')}, expected 26")
    if p[12:14] != b"SG":
        raise FormatError(f"eStargz footer: subfield id {p[12:14]!r}, expected b'SG'")
    if p[14:16] != b"\x16\x00":
        length = int.from_bytes(p[14:16], "little")
        raise FormatError(f"eStargz footer: subfield length {length}, expected 22")
    return Footer(_offset(p[16:38]), legacy=False)


def _parse47(p: bytes) -> Footer:
    if p[:3] != b"\x1f\x8b\x08" or not p[3] & 0x04:
        raise FormatError("legacy stargz footer: not a gzip header with FEXTRA")
    if p[10:12] != b"\x16\x00":
        raise FormatError(f"legacy stargz footer: XLEN {int.from_bytes(p[10:12], 'little')}, expected 22")
    return Footer(_offset(p[12:34]), legacy=True)


def parse_footer(tail: bytes) -> Footer:
    """Parse the footer from `tail`, the last 51 (or more; at least 47) bytes of a blob.

    Tries the 51-byte eStargz footer first, then the 47-byte legacy one, like the Go reader.
    Raises FormatError naming both failures.
    """
    if len(tail) < LEGACY_FOOTER_SIZE:
        raise FormatError(f"blob tail of {len(tail)} bytes is shorter than any stargz footer")
    errors: list[str] = []
    if len(tail) >= FOOTER_SIZE:
        try:
            return _parse51(bytes(tail[-FOOTER_SIZE:]))
        except FormatError as exc:
            errors.append(str(exc))
    try:
        return _parse47(bytes(tail[-LEGACY_FOOTER_SIZE:]))
    except FormatError as exc:
        errors.append(str(exc))
    raise FormatError("no eStargz or legacy stargz footer: " + "; ".join(errors))


def footer_bytes(toc_offset: int, *, legacy: bool = False) -> bytes:
    """The footer for a TOC member at `toc_offset` (51 bytes, or 47 if `legacy`)."""
    if not 0 <= toc_offset < 1 << 64:
        raise ValueError(f"TOC offset {toc_offset} out of range")
    field = b"%016x" % toc_offset + MAGIC
    extra = field if legacy else b"SG" + len(field).to_bytes(2, "little") + field
    out = _GZIP_HEADER + len(extra).to_bytes(2, "little") + extra + _EMPTY_DEFLATE_AND_TRAILER
    assert len(out) == (LEGACY_FOOTER_SIZE if legacy else FOOTER_SIZE)
    return out


def toc_range(footer: Footer, blob_size: int) -> tuple[int, int]:
    """(offset, length) of the TOC gzip member: from the footer's offset up to the footer."""
    end = blob_size - footer.size
    length = end - footer.toc_offset
    if blob_size < footer.size or length < MIN_GZIP_MEMBER:
        raise FormatError(
            f"stargz footer puts the TOC at offset {footer.toc_offset}, which leaves {length} bytes "
            f"before the {footer.size}-byte footer of a {blob_size}-byte blob"
        )
    return footer.toc_offset, length
