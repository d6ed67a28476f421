"""LayerStore.adopt (remote/store.py): an index file written elsewhere (by the spare) becomes the
layer's stored index, moved into place or, across file systems, copied and removed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from snapshotter.formats.index import LayerIndex
from snapshotter.formats.index_codec import dump_index
from snapshotter.remote import store as store_module
from snapshotter.remote.store import LayerMeta, LayerStore

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
