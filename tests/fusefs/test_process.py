"""process.py without a mount: the state file parser and the file-backed reader."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from snapshotter.errors import ConfigError, DigestMismatch, FetchError
from snapshotter.formats.index import Chunk, Compression, Entry, EntryType
from snapshotter.formats.metadata_parse import parse_metadata
from snapshotter.fusefs.process import FileBlobReader, await_assignment, parse_state

GOOD: dict[str, Any] = {
    "version": 1, "mountpoint": "/mnt/x", "ready_file": "/run/x.ready",
    "runs": [[{"index": "/l/0.json", "reader": {"kind": "file", "blob_path": "/b/0"}, "digest": "sha256:0"}],
             [{"index": "/l/1.json", "reader": {"kind": "registry", "repo": "r"}}]],
}


def test_parse_state_defaults_and_fields() -> None:
    s = parse_state(json.dumps(GOOD).encode())
    assert s.mountpoint == "/mnt/x" and s.subtrees and s.fetch_timeout == 30.0 and s.record_file is None
    assert s.opaque_xattrs == ("trusted.overlay.opaque",)
    assert [[sp.index_path for sp in run] for run in s.runs] == [["/l/0.json"], ["/l/1.json"]]
    assert s.runs[1][0].reader == {"kind": "registry", "repo": "r"} and s.runs[0][0].digest == "sha256:0"


def test_parse_state_accepts_the_daemon_shape() -> None:
    """What snapshotter/remote/mounts.py writes: no version or ready file, layer_digest, a config object."""
    doc = {"mountpoint": "/m", "config": {"root": "/r"},
           "runs": [[{"index": "/i", "layer_digest": "sha256:1", "reader": {"kind": "registry"}}]]}
    s = parse_state(json.dumps(doc).encode())
    assert s.ready_file is None and s.runs[0][0].digest == "sha256:1" and s.doc["config"] == {"root": "/r"}


@pytest.mark.parametrize("change", [
    {"version": 2}, {"runs": []}, {"runs": [[]]}, {"mountpoint": 5}, {"fetch_timeout": 0},
    {"fetch_timeout": True}, {"subtrees": False}, {"runs": [[{"index": "/x"}]]},
    {"runs": [[{"index": "/x", "reader": {}}]]}, {"max_tasks": 0}, {"opaque_xattrs": [1]},
])
def test_parse_state_rejects(change: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        parse_state(json.dumps({**GOOD, **change}).encode())
    with pytest.raises(ConfigError):
        parse_state(b"not json")


def _blob(tmp_path: Path, data: bytes, chunk: int, *, bad_digest_at: int = -1) -> tuple[Path, Entry]:
    blob = bytearray(b"HEADER")
    chunks = []
    for i, off in enumerate(range(0, len(data), chunk)):
        piece = data[off:off + chunk]
        prefix = b"P" * 3  # bytes before the chunk inside its member: inner_offset
        packed = gzip.compress(prefix + piece, mtime=0)
        digest = "sha256:" + hashlib.sha256(piece + (b"!" if i == bad_digest_at else b"")).hexdigest()
        chunks.append(Chunk(off, len(piece), len(blob), len(packed), Compression.GZIP, digest, inner_offset=3))
        blob += packed
    zeros = Chunk(len(data), 100, 0, 0, Compression.GZIP, None, zeros=True)
    path = tmp_path / "blob"
    path.write_bytes(bytes(blob))
    return path, Entry("f", EntryType.REG, size=len(data) + 100, chunks=(*chunks, zeros))


def test_file_reader_reads_any_range(tmp_path: Path) -> None:
    data = bytes(range(256)) * 20
    path, entry = _blob(tmp_path, data, 1000)
    reader = FileBlobReader([str(path)], name="t")
    full = data + bytes(100)

    async def go() -> None:
        for off, size in [(0, 10), (990, 20), (0, len(full)), (4999, 200), (5100, 10), (5119, 1), (0, 10**6)]:
            assert await reader.read(entry, off, size) == full[off:off + size], (off, size)

    trio.run(go)
    reader.close()


def test_file_reader_errors(tmp_path: Path) -> None:
    data = b"abc" * 1000
    path, entry = _blob(tmp_path, data, 1000, bad_digest_at=1)
    reader = FileBlobReader([str(path)], name="t")
    assert trio.run(reader.read, entry, 0, 1000) == data[:1000]
    with pytest.raises(DigestMismatch):
        trio.run(reader.read, entry, 1000, 10)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(FetchError):
        trio.run(FileBlobReader([str(path)]).read, entry, 2500, 10)


def test_spare_assignment_end_of_input_and_garbage() -> None:
    """A spare whose daemon went away reads end of input and exits; a bad line names itself."""
    assert await_assignment(io.BytesIO(b"")) is None
    for bad in (b"not json\n", b'{"log": "/x"}\n', b"[1]\n"):
        with pytest.raises(ConfigError, match="spare mount process: bad assignment"):
            await_assignment(io.BytesIO(bad))


def test_a_stopping_mount_writes_the_cache_keys_itself_and_leaves_the_index_to_its_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MetaWriter.start: for a layer the daemon stored as metadata bytes, the keys file is there
    when start returns (the daemon's collection after the mount's stop reads it instead of
    parsing the bytes); the index is written by the forked writer's first step."""
    import snapshotter.fusefs.metamount as metamount
    from snapshotter.fusefs.process import MetaWriter
    from snapshotter.remote.store import KEYS_FILE, LayerStore, layer_cache_keys
    from tests.remote.test_store import FILES, LAYER, _meta, _metadata

    layers = LayerStore(tmp_path / "layers")
    p, data = _metadata(FILES)
    index = parse_metadata(p, data)
    layers.save_metadata(_meta(p, data, index.toc_digest), p, data)
    index_file = layers.index_path(LAYER)
    state = parse_state(json.dumps({"mountpoint": str(tmp_path / "m"), "runs": [[
        {"index": str(index_file), "layer_digest": LAYER, "parse_key": p.key(data),
         "reader": {"kind": "registry"}}]]}).encode())
    firsts: list[Callable[[], None] | None] = []
    monkeypatch.setattr(metamount, "fork_writer", lambda tree, st, path, first=None: firsts.append(first))
    tree = types.SimpleNamespace(layers=[index])
    MetaWriter(state, tree).start()  # type: ignore[arg-type]  # only its layers are looked at
    keys_file = layers.layer_dir(LAYER) / KEYS_FILE
    assert keys_file.exists() and layers.cache_keys(LAYER) == layer_cache_keys(index, LAYER)
    assert not index_file.exists()
    (first,) = firsts
    assert first is not None
    first()  # what the forked child runs first
    assert layers.load(LAYER) == index
