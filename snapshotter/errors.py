"""The project's exception tree.

SnapshotterError
 +-- ConfigError           a config file or key is wrong (names file, line, key)
 +-- FormatError           a layer blob / TOC / bootstrap is malformed (names the thing)
 |    +-- LimitExceeded    input exceeds a configured cap (TOC size, bootstrap size, ...)
 |    +-- DigestMismatch   bytes do not match the digest that describes them
 +-- FetchError            a registry could not serve what was asked (names registry, repo, digest, range)
 +-- CacheError            the chunk cache could not store or serve a chunk
"""

from __future__ import annotations


class SnapshotterError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(SnapshotterError):
    """A configuration file is unreadable or holds a bad key or value."""


class FormatError(SnapshotterError, ValueError):
    """Bytes claimed to be a layer format are not valid for it."""


class LimitExceeded(FormatError):
    """Input is larger than a configured cap; parsing stopped before allocating it."""


class DigestMismatch(FormatError):
    """Content does not hash to the digest recorded for it."""


class FetchError(SnapshotterError):
    """A registry request failed after retries, or answered with the wrong bytes."""


class CacheError(SnapshotterError):
    """The chunk cache failed to store or read a chunk."""


class NotFound(SnapshotterError):
    """A snapshot (or its parent) does not exist. gRPC: NOT_FOUND."""


class AlreadyExists(SnapshotterError):
    """A snapshot with that key or name exists already. gRPC: ALREADY_EXISTS."""


class FailedPrecondition(SnapshotterError):
    """The snapshot is in the wrong state for the call (e.g. Commit of a view). gRPC: FAILED_PRECONDITION."""


class InvalidArgument(SnapshotterError):
    """The request is malformed (bad filter, bad field path, oversized label). gRPC: INVALID_ARGUMENT."""
