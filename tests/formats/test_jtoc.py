"""jtoc.json_text: a TOC's UTF-8 JSON as an ASCII-only str that parses to the same document.
jtoc.decode_toc: the typed decoder answers alone only where json.loads (the reference) reads alike.
jtoc.read_entries: entries the typed decoder checked come out as the reference reads them."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.errors import FormatError
from snapshotter.formats import estargz, jtoc
from snapshotter.formats.estargz_writer import write_estargz
from snapshotter.formats.index import normalize_name

names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
docs = st.fixed_dictionaries({"version": st.just(1), "entries": st.lists(
    st.fixed_dictionaries({"name": names, "type": st.sampled_from(["reg", "dir"]), "size": st.integers(0, 10)}),
    max_size=30)})


@settings(max_examples=200, deadline=None)
@given(doc=docs, pad=st.integers(0, 3))
def test_same_document_from_an_ascii_only_text(doc: dict[str, object], pad: int) -> None:
    data = (" " * pad + json.dumps(doc, ensure_ascii=False)).encode()
    text = jtoc.json_text(data, "layer x")
    assert text.isascii()
    assert json.loads(text) == json.loads(data.decode()) == doc


def test_runs_across_piece_boundaries_and_beyond_the_bmp() -> None:
    edge = jtoc._PIECE  # the boundary the scan works in
    for offset in (edge - 3, edge - 2, edge - 1, edge, 2 * edge - 1):
        name = "é" * 3 + "€🐍" + "x"
        prefix = '{"version": 1, "entries": [{"name": "'
        filler = "a" * (offset - len(prefix.encode()))
        data = (prefix + filler + name + '"}]}').encode()
        assert json.loads(jtoc.json_text(data, "w"))["entries"][0]["name"] == filler + name


def test_escaped_backslash_before_a_non_ascii_character_is_kept() -> None:
    data = '{"version": 1, "entries": [{"name": "a\\\\é"}]}'.encode()  # JSON text: "a\\é"
    assert json.loads(jtoc.json_text(data, "w"))["entries"][0]["name"] == "a\\é"


@pytest.mark.parametrize("data", [
    '{"version": 1, "entries": [{"name": "a\\é"}]}'.encode(),  # \é is no JSON escape
    b'{"version": 1, "entries": [{"name": "\xff"}]}',  # not UTF-8
    b'{"version": 1, "entries": [{"name": "\xc3"}]}',  # a cut UTF-8 sequence
])
def test_invalid_text_is_a_format_error_naming_the_layer(data: bytes) -> None:
    with pytest.raises(FormatError, match="layer sha256:abc"):
        jtoc.load_toc_json(jtoc.json_text(data, "layer sha256:abc"), "layer sha256:abc")


# -- decode_toc: typed decoder vs the json.loads reference ---------------------------------------

FIELDS = sorted(jtoc.RawEntry.__struct_fields__)
values = st.one_of(
    st.integers(-2, 2), st.integers(-(2 ** 70), 2 ** 70),
    st.sampled_from([(1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63]),
    st.booleans(), st.none(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4),
    st.sampled_from(["reg", "dir", "chunk", "a\x00", "sha256:" + "a" * 64, "2024-01-02T03:04:05Z"]),
    st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3), st.integers()), max_size=2),
    st.lists(st.integers(), max_size=2),
)
raw_entries = st.one_of(st.dictionaries(st.sampled_from([*FIELDS, "other"]), values, max_size=8), values)
toc_docs = st.fixed_dictionaries(
    {"version": st.sampled_from([1, 1, 1, 2, True, 1.0, None]), "entries": st.lists(raw_entries, max_size=6)},
    optional={"tarSplitDigest": values})
# Text spliced in after the document's opening brace: what the typed decoder skips or reads otherwise.
SPLICES = [b"", b'"zz": "\xff", ', b'"zz": NaN, ', b'"zz": "\\ud800", ', b'"version": 2, ', b'"entries": 7, ',
           b'"zz": 1e999, ', b'"zz": [[[]]], ']


def _outcome(decode: object, data: bytes) -> object:
    try:
        return decode(data, "layer x")  # type: ignore[operator]
    except FormatError:
        return "FormatError"


@settings(max_examples=600, deadline=None)
@given(doc=toc_docs, ascii_only=st.booleans(), splice=st.sampled_from(SPLICES))
def test_typed_decoder_answers_alone_only_where_json_loads_reads_alike(
        doc: dict[str, object], ascii_only: bool, splice: bytes) -> None:
    text = json.dumps(doc, ensure_ascii=ascii_only).encode()
    data = text[:1] + splice + text[1:]
    reference = _outcome(jtoc.decode_toc_loose, data)
    typed = jtoc.typed_toc(data)
    if typed is not None:
        assert typed == reference
    assert _outcome(jtoc.decode_toc, data) == reference


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    buf.seek(0)
    return buf


def test_ordinary_tocs_take_the_typed_decoder() -> None:
    """The speed is in the typed decoder: a TOC as converters write it must not need the fallback."""
    def info(name: str, kind: bytes, **kw: object) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mtime, ti.mode = kind, 1_700_000_000, 0o755
        for k, v in kw.items():
            setattr(ti, k, v)
        return ti

    src = _tar([(info("etc", tarfile.DIRTYPE), b""), (info("fifo", tarfile.FIFOTYPE), b""),
                (info("dev-sda", tarfile.BLKTYPE, devmajor=8, devminor=0), b""),
                (info("etc/passwd", tarfile.REGTYPE, pax_headers={"SCHILY.xattr.user.a": "b"}), b"root:x:0:0\n"),
                (info("etc/big", tarfile.REGTYPE), bytes(range(256)) * 600),
                (info("etc/link", tarfile.SYMTYPE, linkname="passwd"), b""),
                (info("etc/hard", tarfile.LNKTYPE, linkname="etc/passwd"), b""),
                (info("dev-null", tarfile.CHRTYPE, devmajor=1, devminor=3), b""),
                (info("ünïcode-名前", tarfile.REGTYPE), b"x")])
    out = io.BytesIO()
    write_estargz(src, out, chunk_size=64 << 10)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue()[:-51]), mode="r:gz", ignore_zeros=True) as tf:
        member = next(m for m in tf.getmembers() if m.name == "stargz.index.json")
        data = tf.extractfile(member).read()  # type: ignore[union-attr]
    typed = jtoc.typed_toc(data)
    assert typed is not None
    assert typed == jtoc.decode_toc_loose(data, "layer x")
    kinds = {e.type for e in typed.entries if e is not None}
    assert kinds == {"dir", "reg", "chunk", "symlink", "hardlink", "char", "block", "fifo"}
    # One string per type, not one per entry (memory of a 100k-entry TOC).
    regs = [e for e in typed.entries if e is not None and e.type == "reg"]
    assert len(regs) > 1 and all(e.type is regs[0].type for e in regs)


def test_a_one_chunk_files_two_equal_digests_are_one_string() -> None:
    """A one-chunk file's chunkDigest equals its digest: the index keeps one string of the two."""
    src = _tar([(tarfile.TarInfo(f"f{i}"), b"x%d" % i) for i in range(3)])
    out = io.BytesIO()
    write_estargz(src, out)
    blob = out.getvalue()
    footer = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    offset, length = estargz.toc_range(footer, len(blob))
    index = estargz.parse_toc(blob[offset:offset + length], blob_size=len(blob), layer_digest="sha256:" + "0" * 64,
                              max_toc_bytes=1 << 20)
    files = [e for e in index.entries if e.name.startswith("f")]
    assert len(files) == 3
    for e in files:
        assert len(e.chunks) == 1 and e.digest is not None
        assert e.chunks[0].digest == e.digest and e.chunks[0].digest is e.digest


# -- read_entries: what the typed decoder checked is not checked again, with the same outcome ------

plain_names = st.sampled_from(["a", "a/", "a/b", "a/b/", "a//", "./a", "./a/", "/", "/a/", ".", "./", "..",
                               "a/../b", "a/./", "a/.b/", "a/.b", "a\x00/", "a/b//", "ä/", ""])
# Values the typed decoder accepts (what it refuses, the test above covers), most of them well-formed:
# the checks left to read_entries must give the reference's entries, or its error.
field_values = {
    "name": st.one_of(plain_names, st.text(max_size=4)),
    "type": st.sampled_from(["reg", "reg", "reg", "dir", "dir", "chunk", "symlink", "hardlink", "char", "fifo", ""]),
    "size": st.sampled_from([0, 1, 5, 5, 5]),
    "mode": st.sampled_from([0o644, 0o644, 0o40755]),
    "uid": st.sampled_from([0, 0, 1000, (1 << 32) - 1]),
    "modtime": st.sampled_from(["", "2024-01-02T03:04:05Z", "2024-01-02T03:04:05Z", "2024-13-02T03:04:05Z",
                                "2024-01-02T03:04:05Z\x00"]),
    "linkName": st.sampled_from(["", "", "", "a", "a\x00", "../x"]),
    "digest": st.sampled_from(["sha256:" + "a" * 64, "sha256:" + "a" * 64, "sha256:" + "b" * 64, "sha256:A", "", None]),
    "chunkDigest": st.sampled_from(["sha256:" + "a" * 64, "sha256:" + "a" * 64, "sha256:" + "c" * 64, "md5:x", "",
                                    None]),
    "offset": st.sampled_from([10, 10, 20, 0]),
    "chunkOffset": st.sampled_from([0, 0, 0, 1, 3]),
    "chunkSize": st.sampled_from([0, 0, 1, 2]),
    "innerOffset": st.sampled_from([0, 0, 4]),
    "chunkType": st.sampled_from(["", "", "zeros", "other"]),
    "endOffset": st.sampled_from([0, 30]),
}
_required = ("name", "type")
entry_docs = st.lists(
    st.fixed_dictionaries({k: field_values[k] for k in _required},
                          optional={k: v for k, v in field_values.items() if k not in _required}),
    max_size=6, unique_by=lambda entry: str(entry["name"]).strip("/"))


def _read(doc: jtoc.TocDocument, dialect: jtoc.JtocDialect, checked: bool) -> object:
    try:
        return jtoc.read_entries(doc.entries, "layer x", dialect, checked=checked)
    except FormatError as exc:
        return str(exc)


@settings(max_examples=600, deadline=None)
@given(entries=entry_docs, dialect=st.sampled_from([jtoc.ESTARGZ, jtoc.ZSTD_CHUNKED]))
def test_entries_of_a_typed_document_read_as_the_reference_reads_them(
        entries: list[dict[str, object]], dialect: jtoc.JtocDialect) -> None:
    data = json.dumps({"version": 1, "entries": entries}).encode()
    typed = jtoc.typed_toc(data)
    if typed is None:
        return  # the loose reader alone answers (the test above)
    assert typed.checked
    reference = jtoc.decode_toc_loose(data, "layer x")
    assert not reference.checked
    assert _read(typed, dialect, True) == _read(reference, dialect, False)


@pytest.mark.parametrize("name", ["a/", "a/b/", "a//", "./a/", "/", "/a/", "./", "a/./", "a/.b/", "a\x00/",
                                  "a/b//", "../", "a/../", "ä/"])
def test_a_directory_name_with_its_trailing_slash_is_normalized(name: str) -> None:
    raws: list[jtoc.RawEntry | None] = [jtoc.RawEntry(name=name, type="dir")]
    try:
        expected: object = normalize_name(name)
    except FormatError:
        expected = FormatError
    try:
        got: object = jtoc.read_entries(raws, "layer x", jtoc.ESTARGZ, checked=True).pending[0].name
    except FormatError:
        got = FormatError
    assert got == expected
