"""Lazy file reads of a layer: cache -> single-flight fetch -> verify -> cache."""

from snapshotter.reader.budget import ByteBudget
from snapshotter.reader.layer import (
    LayerReader,
    ReaderConfig,
    ReaderStatistics,
    cache_keys,
    chunk_key,
    open_layer_reader,
)
from snapshotter.reader.neighbours import BlobOrder
from snapshotter.reader.source import BatchRangeSource, FileRangeSource, RangeSource, RegistryRangeSource

__all__ = [
    "BatchRangeSource",
    "BlobOrder",
    "ByteBudget",
    "FileRangeSource",
    "LayerReader",
    "RangeSource",
    "ReaderConfig",
    "ReaderStatistics",
    "RegistryRangeSource",
    "cache_keys",
    "chunk_key",
    "open_layer_reader",
]
