"""The mount state file: what the daemon hands a mount process, parsed, and the tree it describes.

Light on purpose (no pyfuse3, trio or HTTP imports): `python -m snapshotter.fusefs.metamount`
loads the same tree as the mount process without them.

State file, version 1:
    {
      "version": 1,                  # optional; other versions are refused
      "mountpoint": "/var/lib/snapshotter/mnt/<id>",       # an existing directory
      "ready_file": "/run/snapshotter/<id>.ready",          # optional; written once mounted and prefetched
                                                            # (process.py), removed on exit
      "record_file": "/run/snapshotter/<id>.record.json",   # optional; first-read order (process.py)
      "subtrees": true,              # root holds "0", "1", ... one dir per run (overlay lowerdirs)
      "opaque_xattrs": ["trusted.overlay.opaque"],          # optional
      "fetch_timeout": 30.0,         # optional; seconds per FUSE read before EIO
      "cache_timeout": 86400.0,      # optional; kernel entry/attr cache seconds
      "max_tasks": 64,               # optional; concurrent FUSE request tasks
      "read_ahead_kb": 1024,         # optional; the mount's kernel read-ahead window (0: kernel default)
      "prefetch_timeout": 10.0,      # optional (else config.prefetch_timeout); see fusefs/prefetch.py
      "meta_image": "/var/lib/snapshotter/metaimages/<key>.erofs",  # optional; where to write the tree's
                                     # metadata image once quiet (process.py MetaWriter), unless it exists
      "runs": [                      # lowest run first; each run lowest layer first
        [{"digest": "sha256:...",                         # for logs ("layer_digest" also accepted)
          "index": "/var/lib/snapshotter/layers/<hex>/index.bin",    # index_codec.dump_index output
          "parse_key": "<hex>",      # optional; MetadataParse.key of the parse that made the index:
                                     # an index the spare parsed under this key is used instead
          "reader": {"kind": "file", "blob_path": "/path/to/blob"}}]  # kind picks a ReaderFactory
      ]
    }
Unknown keys are ignored and the whole document is `MountState.doc`, so a reader factory can
read daemon settings from it (e.g. a "config" object).
Reader kinds: "file" (a local copy of the blob; "blob_paths": [...] for multi-blob layers) is
built in; others are added to process.py's `READER_KINDS` (or passed to `main(reader_kinds=...)`): a
ReaderFactory is `(LayerSpec, LayerIndex, ReaderEnv) -> async context manager of LayerReader`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter.errors import ConfigError, FormatError
from snapshotter.formats.index import LayerIndex
from snapshotter.fusefs.tree import DEFAULT_OPAQUE_XATTRS, MountTree, build_tree
from snapshotter.remote.store import load_layer_index

log = logging.getLogger(__name__)

STATE_VERSION = 1
DEFAULT_READ_AHEAD_KB = 1024  # 1 MiB: the largest FUSE read request (see set_read_ahead)


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the state file."""

    index_path: str
    reader: Mapping[str, Any]
    digest: str = ""
    parse_key: str | None = None


@dataclass(frozen=True)
class MountState:
    """The parsed state file."""

    mountpoint: str
    runs: tuple[tuple[LayerSpec, ...], ...]
    ready_file: str | None = None
    record_file: str | None = None
    subtrees: bool = True
    opaque_xattrs: tuple[str, ...] = DEFAULT_OPAQUE_XATTRS
    fetch_timeout: float = 30.0
    cache_timeout: float = 24 * 3600.0
    max_tasks: int = 64
    bare_runs: tuple[int, ...] = ()  # runs with nothing below them: no overlay markers needed
    read_ahead_kb: int = DEFAULT_READ_AHEAD_KB  # the mount's kernel read-ahead window; 0 = kernel default
    doc: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


def typed_field(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str, default: Any = ...) -> Any:
    """d[key], checked to be a `kind` (bools are not numbers); `default` when missing, if given.
    ConfigError names `what` and the key."""
    if key not in d:
        if default is ...:
            raise ConfigError(f"{what}: missing {key!r}")
        return default
    value = d[key]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ConfigError(f"{what}: {key!r} must be a number")
    if not isinstance(value, kind):
        raise ConfigError(f"{what}: {key!r} has the wrong type ({type(value).__name__})")
    return value


def parse_state(data: bytes, what: str = "state file") -> MountState:
    """The MountState in `data`; ConfigError (naming the key) when it is not a valid state file."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"{what}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{what}: not a JSON object")
    if doc.get("version", STATE_VERSION) != STATE_VERSION:
        raise ConfigError(f"{what}: version {doc.get('version')!r}, expected {STATE_VERSION}")
    runs = []
    for r, run in enumerate(typed_field(doc, "runs", list, what)):
        if not isinstance(run, list) or not run:
            raise ConfigError(f"{what}: run {r} must be a non-empty list of layers")
        specs = []
        for i, layer in enumerate(run):
            lw = f"{what}: run {r} layer {i}"
            if not isinstance(layer, dict):
                raise ConfigError(f"{lw}: not an object")
            reader = typed_field(layer, "reader", dict, lw)
            typed_field(reader, "kind", str, lw + " reader")
            digest = typed_field(layer, "digest", str, lw, "") or typed_field(layer, "layer_digest", str, lw, "")
            specs.append(LayerSpec(index_path=typed_field(layer, "index", str, lw), reader=reader, digest=digest,
                                   parse_key=typed_field(layer, "parse_key", (str, type(None)), lw, None)))
        runs.append(tuple(specs))
    if not runs:
        raise ConfigError(f"{what}: no runs")
    subtrees = typed_field(doc, "subtrees", bool, what, True)
    if not subtrees and len(runs) != 1:
        raise ConfigError(f"{what}: subtrees=false needs exactly one run, got {len(runs)}")
    fetch_timeout = float(typed_field(doc, "fetch_timeout", (int, float), what, 30.0))
    cache_timeout = float(typed_field(doc, "cache_timeout", (int, float), what, 24 * 3600.0))
    max_tasks = typed_field(doc, "max_tasks", int, what, 64)
    if not (math.isfinite(fetch_timeout) and fetch_timeout > 0) or not (cache_timeout >= 0) or max_tasks < 1:
        raise ConfigError(f"{what}: fetch_timeout, cache_timeout or max_tasks out of range")
    opaque = typed_field(doc, "opaque_xattrs", list, what, list(DEFAULT_OPAQUE_XATTRS))
    if not all(isinstance(x, str) for x in opaque):
        raise ConfigError(f"{what}: opaque_xattrs must be strings")
    record_file = typed_field(doc, "record_file", (str, type(None)), what, None)
    ready_file = typed_field(doc, "ready_file", (str, type(None)), what, None)
    read_ahead_kb = typed_field(doc, "read_ahead_kb", int, what, DEFAULT_READ_AHEAD_KB)
    if read_ahead_kb < 0:
        raise ConfigError(f"{what}: read_ahead_kb must not be negative")
    bare_runs = typed_field(doc, "bare_runs", list, what, [])
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(runs) for x in bare_runs):
        raise ConfigError(f"{what}: bare_runs must be run numbers below {len(runs)}")
    return MountState(
        mountpoint=typed_field(doc, "mountpoint", str, what), ready_file=ready_file, runs=tuple(runs),
        record_file=record_file, subtrees=subtrees, opaque_xattrs=tuple(opaque), fetch_timeout=fetch_timeout,
        cache_timeout=cache_timeout, max_tasks=max_tasks, bare_runs=tuple(bare_runs), read_ahead_kb=read_ahead_kb,
        doc=doc,
    )


def _is_prebuilt(state: MountState, keys: tuple[str, ...]) -> bool:
    """Whether `state` asks for the tree build_tree makes of one run of layers with these parse
    keys, default options, run 0 bare."""
    return (len(state.runs) == 1 and tuple(spec.parse_key for spec in state.runs[0]) == keys
            and state.subtrees and state.bare_runs == (0,) and state.opaque_xattrs == DEFAULT_OPAQUE_XATTRS)


def load_tree(state: MountState, preloaded: Mapping[str, LayerIndex] | None = None,
              prebuilt: tuple[tuple[str, ...], MountTree] | None = None) -> MountTree:
    """Load every run's persisted indexes (remote/store.py `load_layer_index`: the index file, or
    the layer's stored metadata parsed) and merge them. FormatError / OSError name the file.
    preloaded: indexes already parsed, by parse key (fusefs/spare.py); a layer whose parse_key is
    among them uses that index instead of loading its file. prebuilt: (parse keys, tree) of a tree
    built ahead from one run of those layers with build_tree's defaults and run 0 bare; returned
    when the state asks for exactly that."""
    if prebuilt is not None and _is_prebuilt(state, prebuilt[0]):
        tree = prebuilt[1]
        log.info("event=tree_built layers=%d inodes=%d preloaded=%d prebuilt=true load_seconds=0.000 "
                 "build_seconds=0.000", len(tree.layers), len(tree), len(prebuilt[0]))
        return tree
    began = time.monotonic()
    runs: list[list[LayerIndex]] = []
    reused = 0
    for run in state.runs:
        indexes = []
        for spec in run:
            if preloaded and spec.parse_key is not None and spec.parse_key in preloaded:
                indexes.append(preloaded[spec.parse_key])
                reused += 1
                continue
            try:
                # No name for the file's bytes: they go as soon as the index is made, not after
                # the tree (of which they would be a sixth).
                indexes.append(load_layer_index(Path(spec.index_path)))
            except FormatError as exc:
                raise FormatError(f"layer index {spec.index_path} ({spec.digest or 'no digest'}): {exc}") from None
        runs.append(indexes)
    loaded = time.monotonic()
    tree = build_tree(runs, subtrees=state.subtrees, opaque_xattrs=state.opaque_xattrs, bare_runs=state.bare_runs)
    log.info("event=tree_built layers=%d inodes=%d preloaded=%d load_seconds=%.3f build_seconds=%.3f",
             len(tree.layers), len(tree), reused, loaded - began, time.monotonic() - loaded)
    return tree
