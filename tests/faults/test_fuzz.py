"""Case 10 of docs/faults.md: property-based fuzzing of what arrives from outside.

- snapshotter/remote/labels.py: containerd clients' snapshot labels (any strings);
- snapshotter/snapshots/filters.py: the List filter syntax (any strings);
- the resolve path's eStargz footer + TOC parser on mutated real blobs (bit flips, truncation,
  splices): only FormatError (or its subclasses) may come out, never another exception.
(tests/formats fuzz each format parser on its own inputs.)

These run in the normal suite with hypothesis' default budget; `tests/faults/fuzz_long.py` runs
them (and the format fuzzers) with a long budget.
"""

from __future__ import annotations

import io
import re
from functools import lru_cache

from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.errors import FormatError, InvalidArgument
from snapshotter.formats import estargz
from snapshotter.formats.estargz_writer import write_estargz
from snapshotter.remote import labels as L
from snapshotter.snapshots.filters import match_any, parse_filters
from tests.faults.imagekit import tar_of

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
KEYS = [L.CRI_IMAGE_REF, L.CRI_LAYER_DIGEST, L.CRI_IMAGE_LAYERS, L.CRI_MANIFEST_DIGEST, L.STARGZ_REFERENCE,
        L.STARGZ_DIGEST, L.STARGZ_LAYERS, L.TOC_DIGEST, L.UNCOMPRESSED_SIZE, L.NYDUS_BLOB, L.NYDUS_BOOTSTRAP,
        L.TARGET_SNAPSHOT_REF, L.REMOTE_LABEL]

hexdigest = st.text("0123456789abcdef", min_size=64, max_size=64).map(lambda h: "sha256:" + h)
near_digest = st.one_of(hexdigest, hexdigest.map(str.upper), hexdigest.map(lambda d: d[:-1]),
                        hexdigest.map(lambda d: d + " "), st.text(max_size=80))
label_value = st.one_of(
    st.text(max_size=120),
    near_digest,
    st.lists(near_digest, max_size=4).map(",".join),
    st.sampled_from(["127.0.0.1:5000/x:y", "docker.io/library/busybox:latest", " ", "", "a b", "true", "false"]),
)
label_maps = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=40)), label_value, max_size=10)


@given(label_maps)
def test_label_parser_takes_any_labels(labels: dict[str, str]) -> None:
    try:
        ref = L.layer_ref_from_labels(labels)
    except InvalidArgument as exc:
        assert "label" in str(exc)
        return
    if ref is None:
        return
    assert DIGEST_RE.match(ref.layer_digest)
    assert ref.image_ref and not any(c.isspace() for c in ref.image_ref)
    assert all(DIGEST_RE.match(d) for d in ref.image_layers)
    assert ref.client in ("cri", "stargz")


@given(hexdigest, hexdigest, st.lists(hexdigest, max_size=5), st.booleans())
def test_label_parser_reads_valid_labels(layer: str, manifest: str, layers: list[str], cri: bool) -> None:
    labels = ({L.CRI_IMAGE_REF: "r.io/a/b:c", L.CRI_LAYER_DIGEST: layer, L.CRI_IMAGE_LAYERS: ",".join(layers),
               L.CRI_MANIFEST_DIGEST: manifest} if cri else
              {L.STARGZ_REFERENCE: "r.io/a/b:c", L.STARGZ_DIGEST: layer, L.STARGZ_LAYERS: ",".join(layers)})
    ref = L.layer_ref_from_labels(labels)
    assert ref is not None and ref.layer_digest == layer and list(ref.image_layers) == layers
    assert ref.client == ("cri" if cri else "stargz")


filter_text = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(["kind", "name", "parent", "labels", ".", ",", "==", "!=", "~=", '"', "/", "|",
                              "\\", "a", "x.y", "labels.\"k.v\"", "/[a-", "|.*|", " ", "committed"]),
             max_size=12).map("".join),
)
fields = st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=4)


@given(st.lists(filter_text, max_size=3), fields)
def test_filter_parser_takes_any_text(texts: list[str], values: dict[str, str]) -> None:
    try:
        parsed = parse_filters(texts)
    except InvalidArgument:
        return

    def lookup(path: object) -> tuple[str, bool]:
        key = ".".join(path)  # type: ignore[arg-type]
        return values.get(key, ""), key in values

    assert isinstance(match_any(parsed, lookup), bool)


@lru_cache(maxsize=1)
def _valid_blob() -> tuple[bytes, int]:
    files = {f"/d/f{i}": bytes([i]) * (300 + 77 * i) for i in range(5)}
    out = io.BytesIO()
    write_estargz(io.BytesIO(tar_of(files, dirs=("d",))), out, chunk_size=256, prefetch=None)
    blob = out.getvalue()
    return blob, estargz.parse_footer(blob[-estargz.FOOTER_SIZE:]).toc_offset


def _parse(blob: bytes) -> None:
    footer = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    offset, length = estargz.toc_range(footer, len(blob))
    estargz.parse_toc(blob[offset:offset + length], blob_size=len(blob), layer_digest="sha256:" + "0" * 64,
                      max_toc_bytes=1 << 20, toc_offset=footer.toc_offset)


@settings(max_examples=150)
@given(st.data())
def test_estargz_resolve_parsers_reject_mutated_blobs_cleanly(data: st.DataObject) -> None:
    blob, toc_offset = _valid_blob()
    _parse(blob)  # the unmutated blob parses
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "toc-bytes"]))
    b = bytearray(blob)
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(toc_offset, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        b = b[:data.draw(st.integers(0, len(b) - 1))]
    elif kind == "splice":
        i = data.draw(st.integers(0, len(b)))
        b[i:i] = data.draw(st.binary(max_size=64))
    else:
        i = data.draw(st.integers(toc_offset, len(b) - estargz.FOOTER_SIZE))
        b[i:i + 16] = data.draw(st.binary(min_size=16, max_size=16))
    try:
        _parse(bytes(b))
    except FormatError:
        pass
