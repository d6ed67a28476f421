"""jtoc.json_text: a TOC's UTF-8 JSON as an ASCII-only str that parses to the same document."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.errors import FormatError
from snapshotter.formats import jtoc

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
