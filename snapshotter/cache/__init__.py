"""The shared on-disk chunk cache (see `store` for the invariants)."""

from snapshotter.cache.keys import blob_key, is_digest_key, relative_path
from snapshotter.cache.store import CacheUsage, ChunkCache, Removed, RepairReport

__all__ = [
    "CacheUsage",
    "ChunkCache",
    "Removed",
    "RepairReport",
    "blob_key",
    "is_digest_key",
    "relative_path",
]
