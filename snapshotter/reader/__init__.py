"""Lazy file reads of a layer: cache -> single-flight fetch -> verify -> cache.

The names below are imported from their modules on first use, so that importing one submodule
(the daemon needs only `reader.keys`) does not load the reader itself (0.9 MiB of memory)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from snapshotter.reader.budget import ByteBudget
    from snapshotter.reader.keys import cache_keys, chunk_key
    from snapshotter.reader.layer import LayerReader, ReaderConfig, ReaderStatistics, open_layer_reader
    from snapshotter.reader.neighbours import BlobOrder
    from snapshotter.reader.source import BatchRangeSource, FileRangeSource, RangeSource, RegistryRangeSource

_MODULE_OF = {
    "ByteBudget": "budget",
    "cache_keys": "keys",
    "chunk_key": "keys",
    "LayerReader": "layer",
    "ReaderConfig": "layer",
    "ReaderStatistics": "layer",
    "open_layer_reader": "layer",
    "BlobOrder": "neighbours",
    "BatchRangeSource": "source",
    "FileRangeSource": "source",
    "RangeSource": "source",
    "RegistryRangeSource": "source",
}

__all__ = [
    "BatchRangeSource", "BlobOrder", "ByteBudget", "FileRangeSource", "LayerReader", "RangeSource", "ReaderConfig",
    "ReaderStatistics", "RegistryRangeSource", "cache_keys", "chunk_key", "open_layer_reader",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
