"""formats/metadata_parse.py: a parse described as plain data gives, through JSON and in another
call, the index the format's own parser gives, and its key names exactly that result."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import pytest

from snapshotter.errors import FormatError
from snapshotter.formats import estargz
from snapshotter.formats import zstdchunked as zc
from snapshotter.formats.estargz import write_estargz
from snapshotter.formats.metadata_parse import (
    ESTARGZ,
    NYDUS_BLOB,
    NYDUS_BOOTSTRAP,
    ZSTD_CHUNKED,
    MetadataParse,
    parse_metadata,
    position_doc,
)
from snapshotter.formats.nydus import parse_bootstrap
from snapshotter.formats.rafs_writer import write_nydus
from tests.tars import tar_of

LAYER = "sha256:" + "ab" * 32
LIMIT = 64 << 20


MTIME = 1_700_000_000  # the layer tars' member time, as before the shared helper
FILES = {"etc/a.txt": b"alpha\n" * 100, "usr/bin/tool": bytes(range(256)) * 300, "empty": b""}


def _through_json(p: MetadataParse) -> MetadataParse:
    return MetadataParse.from_doc(json.loads(json.dumps(p.to_doc())))


def test_estargz_parse_matches_the_format_parser_and_survives_json() -> None:
    out = io.BytesIO()
    write_estargz(io.BytesIO(tar_of(FILES, mtime=MTIME)), out)
    blob = out.getvalue()
    footer = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    offset, length = estargz.toc_range(footer, len(blob))
    member = blob[offset:offset + length]
    direct = estargz.parse_toc(member, blob_size=len(blob), layer_digest=LAYER, max_toc_bytes=LIMIT,
                               toc_offset=footer.toc_offset)
    p = MetadataParse(ESTARGZ, LAYER, len(blob), LIMIT, toc_offset=footer.toc_offset)
    again = _through_json(p)
    assert again == p
    assert parse_metadata(again, member) == direct
    assert again.key(member) == p.key(member)
    # What shapes the result is in the key; the limit (success only) is not.
    assert MetadataParse(ESTARGZ, LAYER, len(blob), 1, toc_offset=footer.toc_offset).key(member) == p.key(member)
    for other in (MetadataParse(ESTARGZ, "sha256:" + "cd" * 32, len(blob), LIMIT, toc_offset=footer.toc_offset),
                  MetadataParse(ESTARGZ, LAYER, len(blob) + 1, LIMIT, toc_offset=footer.toc_offset),
                  MetadataParse(ESTARGZ, LAYER, len(blob), LIMIT, toc_offset=None)):
        assert other.key(member) != p.key(member)
    assert p.key(member[:-1] + b"x") != p.key(member)


def test_zstdchunked_parse_matches_with_its_position_through_json() -> None:
    out = io.BytesIO()
    zc.write_zstdchunked(io.BytesIO(tar_of(FILES, mtime=MTIME)), out)
    blob = out.getvalue()
    pos = zc.parse_footer(blob[-zc.FOOTER_SIZE:], blob_size=len(blob))
    manifest = blob[pos.offset:pos.offset + pos.compressed_size]
    direct = zc.parse_manifest(manifest, blob_size=len(blob), layer_digest=LAYER, max_toc_bytes=LIMIT, position=pos)
    p = _through_json(MetadataParse(ZSTD_CHUNKED, LAYER, len(blob), LIMIT, position=position_doc(pos)))
    assert parse_metadata(p, manifest) == direct
    assert {e.name for e in direct.regular_files()} >= {"etc/a.txt", "usr/bin/tool"}


def test_nydus_bootstrap_layer_and_blob_layer() -> None:
    blobs: list[io.BytesIO] = []

    def blob_out(_i: int) -> io.BytesIO:
        blobs.append(io.BytesIO())
        return blobs[-1]

    result = write_nydus([io.BytesIO(tar_of(FILES, mtime=MTIME))], blob_out, chunk_size=4096)
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as tf:
        info = tarfile.TarInfo("image/image.boot")
        info.size = len(result.bootstrap)
        tf.addfile(info, io.BytesIO(result.bootstrap))
    layer = gzip.compress(tar.getvalue())
    p = _through_json(MetadataParse(NYDUS_BOOTSTRAP, LAYER, len(layer), LIMIT))
    assert parse_metadata(p, layer) == parse_bootstrap(result.bootstrap, max_bootstrap_bytes=LIMIT)
    blob = parse_metadata(MetadataParse(NYDUS_BLOB, LAYER, 123, 0), b"")
    assert blob.format == NYDUS_BLOB and blob.entries == ()


def test_bad_metadata_is_the_format_error() -> None:
    with pytest.raises(FormatError):
        parse_metadata(MetadataParse(ESTARGZ, LAYER, 1000, LIMIT, toc_offset=100), b"\x1f\x8b garbage")


@pytest.mark.parametrize("doc", [
    None, [], {}, {"kind": "tarball", "layer_digest": LAYER, "blob_size": 1, "limit": 1},
    {"kind": ESTARGZ, "layer_digest": LAYER, "blob_size": -1, "limit": 1},
    {"kind": ESTARGZ, "layer_digest": LAYER, "blob_size": True, "limit": 1},
    {"kind": ESTARGZ, "layer_digest": 7, "blob_size": 1, "limit": 1},
    {"kind": ESTARGZ, "layer_digest": LAYER, "blob_size": 1, "limit": 1, "toc_offset": "0"},
    {"kind": ZSTD_CHUNKED, "layer_digest": LAYER, "blob_size": 1, "limit": 1, "position": [1]},
])
def test_a_malformed_description_is_refused(doc: object) -> None:
    with pytest.raises(FormatError, match="metadata parse"):
        MetadataParse.from_doc(doc)


def test_a_malformed_zstd_position_is_a_format_error() -> None:
    p = MetadataParse(ZSTD_CHUNKED, LAYER, 100, LIMIT, position={"offset": 1})
    with pytest.raises(FormatError, match="zstd:chunked position"):
        parse_metadata(p, b"")
