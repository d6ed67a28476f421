"""remote/store.py: LayerStore.adopt (an index file written elsewhere, by the spare, becomes the
layer's stored index, moved into place or, across file systems, copied and removed) and the
cache keys file the daemon's garbage collection reads instead of loading the index."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest

from snapshotter.formats import estargz
from snapshotter.formats.estargz import write_estargz
from snapshotter.formats.index import LayerIndex
from snapshotter.formats.index_codec import dump_index
from snapshotter.formats.metadata_parse import ESTARGZ, MetadataParse, parse_metadata
from snapshotter.remote import store as store_module
from snapshotter.remote.store import (
    KEYS_FILE,
    LayerMeta,
    LayerStore,
    discard_index_files,
    keys_file_beside,
    layer_cache_keys,
    load_keys,
    write_index_files,
)
from tests.faults.imagekit import tar_of

LAYER = "sha256:" + "cd" * 32


def _index_file(tmp: Path) -> tuple[Path, LayerIndex]:
    index = LayerIndex(format="estargz", entries=(), toc_digest="sha256:" + "1" * 64)
    path = tmp / "from-spare.index"
    path.write_bytes(dump_index(index))
    return path, index


@pytest.mark.parametrize("across_file_systems", [False, True])
def test_adopt_moves_the_file_in_and_writes_meta_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      across_file_systems: bool) -> None:
    layers = LayerStore(tmp_path / "layers")
    legacy = layers.layer_dir(LAYER) / "index.json"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("{}")  # what an earlier release wrote: replaced
    source, index = _index_file(tmp_path)
    if across_file_systems:
        real_replace = os.replace

        def replace(src: object, dst: object) -> None:
            if Path(str(src)) == source:
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            real_replace(src, dst)  # type: ignore[arg-type]

        monkeypatch.setattr(store_module.os, "replace", replace)
    meta = LayerMeta(LAYER, "estargz", 1234, "reg/x:1", index.toc_digest, "k" * 64)
    assert layers.adopt(meta, source) == layers.index_path(LAYER)
    assert not source.exists() and not legacy.exists()
    assert layers.load(LAYER) == index and layers.meta(LAYER) == meta


def test_a_failed_adopt_stores_nothing(tmp_path: Path) -> None:
    layers = LayerStore(tmp_path / "layers")
    with pytest.raises(FileNotFoundError):
        layers.adopt(LayerMeta(LAYER, "estargz", 1, "reg/x:1", None), tmp_path / "missing.index")
    assert layers.meta(LAYER) is None


def _parsed(files: dict[str, bytes]) -> LayerIndex:
    """The index of an eStargz layer of `files`, as the daemon parses it."""
    out = io.BytesIO()
    write_estargz(io.BytesIO(tar_of(files, dirs=())), out, chunk_size=4096)
    blob = out.getvalue()
    footer = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    offset, length = estargz.toc_range(footer, len(blob))
    p = MetadataParse(ESTARGZ, LAYER, len(blob), 1 << 20, toc_offset=footer.toc_offset)
    return parse_metadata(p, blob[offset:offset + length])


FILES = {"small": b"s" * 100, "big": os.urandom(20000), "empty": b""}


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


def test_adopted_files_bring_their_keys_and_stale_keys_never_stay(tmp_path: Path) -> None:
    layers = LayerStore(tmp_path / "layers")
    old, new = _parsed({"old": b"o" * 9000}), _parsed(FILES)
    layers.save(LayerMeta(LAYER, "estargz", 1, "reg/x:1", old.toc_digest), old)
    written = tmp_path / "spare.index"
    write_index_files(written, new, LAYER)
    layers.adopt(LayerMeta(LAYER, "estargz", 2, "reg/x:2", new.toc_digest), written)
    assert not written.exists() and not keys_file_beside(written).exists()
    assert layers.load(LAYER) == new and layers.cache_keys(LAYER) == layer_cache_keys(new, LAYER)
    # An index adopted without keys beside it: the old keys go, the index answers.
    bare = tmp_path / "bare.index"
    bare.write_bytes(dump_index(old))
    layers.adopt(LayerMeta(LAYER, "estargz", 1, "reg/x:1", old.toc_digest), bare)
    assert not (layers.layer_dir(LAYER) / KEYS_FILE).exists()
    assert layers.cache_keys(LAYER) == layer_cache_keys(old, LAYER)
    # Discarded: neither file is left.
    write_index_files(written, new, LAYER)
    discard_index_files(written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layers"]
