"""The raw LZ4 block format (no frame, no size prefix), pure Python.

Nydus stores LZ4_BLOCK chunks as one raw block each. A block is a run of sequences:
token (literal length high nibble, match length - 4 low nibble; a nibble of 15 continues with
bytes of 255 until a byte < 255), the literals, then a 2-byte little-endian match offset
(1..65535 back into the output) and the match. The last sequence has literals only.

Contracts:
- `decompress_block(data, max_output=N)` never holds more than about N + one sequence's literals of
  output and stops as soon as it has N bytes; corrupt input raises FormatError, never IndexError.
- `compress_block(data)` produces a valid block (greedy, hash-table matcher; correctness, not speed
  or ratio, is the point: used by the writer and tests).
"""

from __future__ import annotations

from snapshotter.errors import FormatError

_MIN_MATCH = 4
_LAST_LITERALS = 5  # the spec: the last 5 bytes are always literals
_MF_LIMIT = 12  # the spec: the last match starts at least 12 bytes before the end


def _read_length(data: bytes, pos: int, base: int) -> tuple[int, int]:
    """Extend a nibble length of 15 with continuation bytes; returns (length, new pos)."""
    length = base
    if base == 15:
        while True:
            if pos >= len(data):
                raise FormatError("lz4 block truncated inside a length")
            b = data[pos]
            pos += 1
            length += b
            if b != 255:
                break
    return length, pos


def decompress_block(data: bytes, *, max_output: int) -> bytes:
    """Decompress one raw LZ4 block, stopping once `max_output` bytes are produced."""
    if max_output < 0:
        raise ValueError("max_output must be >= 0")
    out = bytearray()
    pos = 0
    n = len(data)
    if n == 0:
        raise FormatError("lz4 block is empty")
    while pos < n and len(out) < max_output:
        token = data[pos]
        pos += 1
        lit_len, pos = _read_length(data, pos, token >> 4)
        if pos + lit_len > n:
            raise FormatError("lz4 block truncated inside literals")
        out += data[pos:pos + lit_len]
        pos += lit_len
        if pos == n:
            break  # the last sequence carries literals only
        if len(out) >= max_output:
            break
        if pos + 2 > n:
            raise FormatError("lz4 block truncated inside a match offset")
        offset = data[pos] | (data[pos + 1] << 8)
        pos += 2
        if offset == 0 or offset > len(out):
            raise FormatError(f"lz4 block has invalid match offset {offset} at output {len(out)}")
        match_len, pos = _read_length(data, pos, token & 0x0F)
        match_len += _MIN_MATCH
        # Never grow past what the caller asked for (a hostile block may claim gigabytes).
        match_len = min(match_len, max_output - len(out))
        start = len(out) - offset
        if offset >= match_len:
            out += out[start:start + match_len]
        else:
            # Overlapping copy: the match repeats the last `offset` bytes.
            pattern = bytes(out[start:])
            reps, rest = divmod(match_len, offset)
            out += pattern * reps + pattern[:rest]
    return bytes(out[:max_output])


def _write_length(out: bytearray, extra: int) -> None:
    while extra >= 255:
        out.append(255)
        extra -= 255
    out.append(extra)


def _emit(out: bytearray, literals: bytes, offset: int, match_len: int) -> None:
    lit = len(literals)
    ml = match_len - _MIN_MATCH if match_len else 0
    token = (min(lit, 15) << 4) | (min(ml, 15) if match_len else 0)
    out.append(token)
    if lit >= 15:
        _write_length(out, lit - 15)
    out += literals
    if match_len:
        out += offset.to_bytes(2, "little")
        if ml >= 15:
            _write_length(out, ml - 15)


def compress_block(data: bytes) -> bytes:
    """Compress `data` into one raw LZ4 block."""
    out = bytearray()
    n = len(data)
    table: dict[bytes, int] = {}
    anchor = 0
    pos = 0
    limit = n - _MF_LIMIT
    while pos < limit:
        key = data[pos:pos + _MIN_MATCH]
        cand = table.get(key)
        table[key] = pos
        if cand is None or pos - cand > 0xFFFF:
            pos += 1
            continue
        end_limit = n - _LAST_LITERALS
        length = _MIN_MATCH
        while pos + length < end_limit and data[cand + length] == data[pos + length]:
            length += 1
        _emit(out, data[anchor:pos], pos - cand, length)
        pos += length
        anchor = pos
    _emit(out, data[anchor:], 0, 0)
    return bytes(out)
