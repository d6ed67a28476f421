"""Snapshot kinds and records, as containerd's snapshots API defines them."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class Kind(enum.IntEnum):
    """Values equal the proto enum containerd.services.snapshots.v1.Kind."""

    UNKNOWN = 0
    VIEW = 1
    ACTIVE = 2
    COMMITTED = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Info:
    """What Stat/List/Update return: name (the key), parent name, kind, times (ns), labels."""

    name: str
    parent: str
    kind: Kind
    created_ns: int
    updated_ns: int
    labels: Mapping[str, str] = field(default_factory=dict)

    def field(self, path: Sequence[str]) -> tuple[str, bool]:
        """Filter adaptor: containerd's adaptSnapshot."""
        if not path:
            return "", False
        head = path[0]
        if head == "kind":
            return self.kind.label, self.kind is not Kind.UNKNOWN
        if head == "name":
            return self.name, True
        if head == "parent":
            return self.parent, True
        if head == "labels":
            if not self.labels:
                return "", False
            key = ".".join(path[1:])
            return (self.labels[key], True) if key in self.labels else ("", False)
        return "", False


@dataclass(frozen=True)
class Snapshot:
    """The storage view of one snapshot: its id (directory name) and its parents' ids, nearest first."""

    id: str
    kind: Kind
    parent_ids: tuple[str, ...]


@dataclass(frozen=True)
class Usage:
    size: int
    inodes: int


@dataclass(frozen=True)
class Mount:
    """containerd.types.Mount."""

    type: str
    source: str
    options: tuple[str, ...] = ()
    target: str = ""


@dataclass(frozen=True)
class LowerDirs:
    """What a snapshot's mounts stack: `dirs`, nearest parent first, and `data`, data-only lower
    layers under them (snapshots/mounts.py)."""

    dirs: tuple[str, ...]
    data: tuple[str, ...] = ()
