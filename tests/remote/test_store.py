"""remote/store.py: a layer stored as its metadata bytes (`save_metadata`, what the daemon does
when the spare parsed them), the index derived from them on load and written beside them later
(`write_derived_index`), and the cache keys file the daemon's garbage collection reads instead
of loading the index."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from snapshotter.errors import FormatError
from snapshotter.formats import estargz
from snapshotter.formats.estargz import write_estargz
from snapshotter.formats.index import LayerIndex
from snapshotter.formats.metadata_parse import ESTARGZ, MetadataParse, parse_metadata
from snapshotter.remote.store import (
    INDEX_FILE,
    KEYS_FILE,
    METADATA_FILE,
    PARSE_FILE,
    LayerMeta,
    LayerStore,
    layer_cache_keys,
    load_keys,
    load_layer_index,
    write_derived_index,
    write_derived_keys,
)
from tests.faults.imagekit import tar_of

LAYER = "sha256:" + "cd" * 32


def _metadata(files: dict[str, bytes]) -> tuple[MetadataParse, bytes]:
    """How an eStargz layer of `files` parses, and its TOC member: what the daemon fetches."""
    out = io.BytesIO()
    write_estargz(io.BytesIO(tar_of(files, dirs=())), out, chunk_size=4096)
    blob = out.getvalue()
    footer = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    offset, length = estargz.toc_range(footer, len(blob))
    return MetadataParse(ESTARGZ, LAYER, len(blob), 1 << 20, toc_offset=footer.toc_offset), \
        blob[offset:offset + length]


def _parsed(files: dict[str, bytes]) -> LayerIndex:
    """The index of an eStargz layer of `files`, as the daemon parses it."""
    return parse_metadata(*_metadata(files))


FILES = {"small": b"s" * 100, "big": os.urandom(20000), "empty": b""}


def _meta(p: MetadataParse, data: bytes, toc_digest: str | None = None) -> LayerMeta:
    return LayerMeta(LAYER, "estargz", p.blob_size, "reg/x:1", toc_digest, p.key(data))


def test_stored_metadata_loads_as_the_index_it_parses_to(tmp_path: Path) -> None:
    layers = LayerStore(tmp_path / "layers")
    old = _parsed({"old": b"o" * 9000})
    layers.save(LayerMeta(LAYER, "estargz", 1, "reg/x:0", old.toc_digest), old)  # an earlier resolve's index
    p, data = _metadata(FILES)
    expected = parse_metadata(p, data)
    meta = _meta(p, data, expected.toc_digest)
    assert layers.save_metadata(meta, p, data) == layers.index_path(LAYER)
    d = layers.layer_dir(LAYER)
    # The earlier index and its keys never outlive it: they would name the old tree.
    assert sorted(f.name for f in d.iterdir()) == ["meta.json", METADATA_FILE, PARSE_FILE]
    assert layers.meta(LAYER) == meta
    assert layers.load(LAYER) == expected == load_layer_index(layers.index_path(LAYER))
    assert layers.cache_keys(LAYER) == layer_cache_keys(expected, LAYER)  # no keys file: from the bytes
    # A later full parse by the daemon replaces the bytes.
    layers.save(LayerMeta(LAYER, "estargz", 1, "reg/x:0", old.toc_digest), old)
    assert sorted(f.name for f in d.iterdir()) == [KEYS_FILE, INDEX_FILE, "meta.json"]
    assert layers.load(LAYER) == old


def test_nothing_to_load_and_damaged_metadata_are_named(tmp_path: Path) -> None:
    layers = LayerStore(tmp_path / "layers")
    with pytest.raises(FileNotFoundError, match=INDEX_FILE):
        layers.load(LAYER)
    p, data = _metadata(FILES)
    layers.save_metadata(_meta(p, data), p, data)
    (layers.layer_dir(LAYER) / PARSE_FILE).write_text("{not json")
    with pytest.raises(FormatError, match=PARSE_FILE):
        layers.load(LAYER)
    layers.save_metadata(_meta(p, data), p, data)
    (layers.layer_dir(LAYER) / METADATA_FILE).write_bytes(data[:40])
    with pytest.raises(FormatError, match=LAYER):
        layers.load(LAYER)


def test_the_derived_index_is_written_once_and_only_for_the_metadata_it_came_from(tmp_path: Path) -> None:
    layers = LayerStore(tmp_path / "layers")
    p, data = _metadata(FILES)
    index = parse_metadata(p, data)
    meta = _meta(p, data, index.toc_digest)
    layers.save_metadata(meta, p, data)
    index_file = layers.index_path(LAYER)
    # A parse of other bytes (the layer was resolved again meanwhile) writes nothing.
    assert not write_derived_index(index_file, index, LAYER, "0" * 64)
    assert not index_file.exists()
    assert write_derived_index(index_file, index, LAYER, meta.parse_key or "")
    assert load_keys((layers.layer_dir(LAYER) / KEYS_FILE).read_bytes()) == layer_cache_keys(index, LAYER)
    (layers.layer_dir(LAYER) / METADATA_FILE).write_bytes(b"damaged")  # not read: the index answers
    assert layers.load(LAYER) == index
    assert not write_derived_index(index_file, index, LAYER, meta.parse_key or "")  # there already
    # A layer stored as an index (no metadata bytes) is never rewritten from elsewhere.
    layers.save(meta, index)
    index_file.unlink()
    assert not write_derived_index(index_file, index, LAYER, meta.parse_key or "")


def test_the_derived_keys_are_written_alone_first_and_the_index_keeps_them(tmp_path: Path) -> None:
    """A mount writes the keys file itself before it exits (the index comes later from its forked
    writer): same conditions as the index, once, and the index written after keeps those keys."""
    layers = LayerStore(tmp_path / "layers")
    p, data = _metadata(FILES)
    index = parse_metadata(p, data)
    meta = _meta(p, data, index.toc_digest)
    layers.save_metadata(meta, p, data)
    index_file, keys_file = layers.index_path(LAYER), layers.layer_dir(LAYER) / KEYS_FILE
    assert not write_derived_keys(index_file, index, LAYER, "0" * 64)  # another parse's: nothing
    assert not keys_file.exists()
    assert write_derived_keys(index_file, index, LAYER, meta.parse_key or "")
    assert load_keys(keys_file.read_bytes()) == layer_cache_keys(index, LAYER) == layers.cache_keys(LAYER)
    assert not index_file.exists()  # the keys alone
    assert not write_derived_keys(index_file, index, LAYER, meta.parse_key or "")  # there already
    written = keys_file.stat().st_mtime_ns
    assert write_derived_index(index_file, index, LAYER, meta.parse_key or "")
    assert layers.load(LAYER) == index and keys_file.stat().st_mtime_ns == written
    # A new resolve's metadata removes the keys with the rest: they named the old parse.
    layers.save_metadata(meta, p, data)
    assert not keys_file.exists() and not index_file.exists()


def test_the_collection_reads_the_keys_file_not_the_index(tmp_path: Path) -> None:
    layers = LayerStore(tmp_path / "layers")
    index = _parsed(FILES)
    expected = layer_cache_keys(index, LAYER)
    assert len(expected) > 5  # "big": its chunks and read units
    layers.save(LayerMeta(LAYER, "estargz", 1, "reg/x:1", index.toc_digest), index)
    assert load_keys((layers.layer_dir(LAYER) / KEYS_FILE).read_bytes()) == expected
    layers.index_path(LAYER).write_bytes(b"damaged")  # not read: the keys file answers
    assert layers.cache_keys(LAYER) == expected
    # Without the keys file (a root written before it existed), the index is read.
    (layers.layer_dir(LAYER) / KEYS_FILE).unlink()
    layers.save(LayerMeta(LAYER, "estargz", 1, "reg/x:1", index.toc_digest), index)
    (layers.layer_dir(LAYER) / KEYS_FILE).unlink()
    assert layers.cache_keys(LAYER) == expected
    assert layers.remove_unreferenced(set()) == [LAYER] and not layers.layer_dir(LAYER).exists()


def test_keys_without_a_keys_file_are_derived_by_a_child_process_not_in_this_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon's collection can come before a mount wrote the keys file; the index it would
    # derive otherwise stays in the daemon's peak memory (some 10 MiB for 11,000 entries).
    import snapshotter.remote.store as store

    layers = LayerStore(tmp_path / "layers")
    p, data = _metadata(FILES)
    index = parse_metadata(p, data)
    layers.save_metadata(_meta(p, data, index.toc_digest), p, data)
    expected = layer_cache_keys(index, LAYER)

    def not_here(*_: object, **__: object) -> None:
        raise AssertionError("derived in the calling process")

    monkeypatch.setattr(store, "load_layer_index", not_here)
    monkeypatch.setattr(store, "parse_metadata", not_here)
    monkeypatch.setattr(store, "layer_cache_keys", not_here)
    assert layers.cache_keys(LAYER) == expected
    assert not (layers.layer_dir(LAYER) / KEYS_FILE).exists()  # the child writes nothing
    # What does not derive is named: damaged bytes, then nothing at all.
    (layers.layer_dir(LAYER) / METADATA_FILE).write_bytes(data[:40])
    with pytest.raises(FormatError, match=f"layer {LAYER}: cannot derive its cache keys"):
        layers.cache_keys(LAYER)
    for name in (METADATA_FILE, PARSE_FILE):
        (layers.layer_dir(LAYER) / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"layer {LAYER}: no cache keys, index or metadata"):
        layers.cache_keys(LAYER)
