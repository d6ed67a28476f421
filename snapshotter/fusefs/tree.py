"""Merge layer indexes into the read-only tree a mount process serves. Pure: no IO, no pyfuse3.

`build_tree(runs, subtrees=...)` takes runs of layers (each run an ordered list of LayerIndex,
lowest layer first) and returns a `MountTree` of `Node`s keyed by inode number.

Merge rule within a run (what containerd's tar applier / overlayfs unpack produce):
- Layers apply in order; within a layer, its whiteouts and opaque markers apply first and only
  to the lower layers (OCI image-spec: "files present in the same layer as a whiteout file can
  only be hidden by whiteout files in subsequent layers"), then its entries are added.
- A later entry replaces an earlier one of the same path, except dir over dir, which merges:
  children stay, the later layer's metadata (mode, owner, mtime, xattrs) wins.
- `.wh.NAME` deletes NAME and its subtree; `.wh..wh..opq` deletes every child of its directory
  that lower layers created. Neither marker is shown under its own name.
- Hard links point at an entry of the same layer (or, failing that, at the merged tree so far)
  and share that node: one inode, nlink = number of names reaching it in the final tree.
- Parents that a layer does not list are created 0755 root:root, mtime 0 ("implied"),
  replacing a non-directory in the way; an existing directory keeps its attributes. Parent
  paths are not resolved through symlinks (the overlayfs view, which is also what happens
  across runs; containerd's applier would follow such a symlink).
- The eStargz prefetch landmarks at a layer's root are hidden (as stargz-snapshotter does).
- Layer xattrs in the `trusted.overlay.` / `user.overlay.` namespaces are dropped: they steer
  overlayfs (redirects, metacopy) and containerd's applier cannot set them through overlay either.

Subtrees (`subtrees=True`): the mount root holds one directory per run, "0", "1", ..., and the
daemon stacks them as overlay lowerdirs, possibly interleaved with local snapshot dirs. Each run
must then also tell overlayfs what it deletes from the layers *below the run*, which this tree
cannot see:
- A whiteout whose target is not re-created later in the run stays visible as an overlay
  whiteout: a char device 0:0, mode 0, named after the target (even when the target did not
  exist inside the run: it may exist below).
- A directory that, within the run, was made opaque, or replaced a whiteout or a non-directory,
  must hide everything below the run: it carries `trusted.overlay.opaque=y` (the names in
  `opaque_xattrs`). Without this, overlayfs would merge a lower run's old directory into a
  directory the image deleted and re-created.
- Whiteouts and opaque markers still apply inside the run as above.
- Limitation: an opaque marker at a layer's root (`.wh..wh..opq` naming the root) hides the
  run's lower layers but not the lower runs: overlayfs ignores the opaque xattr on a lowerdir's
  root. (No image tool we know writes one.)
With `subtrees=False` there must be exactly one run; the root is its merged tree and whiteouts
are fully applied (nothing lies below).

Inode numbers: the root is 1; the rest are numbered 2, 3, ... in depth-first order over names
sorted bytewise, a hard-linked node taking the number of its first name. The same runs always
give the same numbers, so a restarted mount process serves the same inodes.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from snapshotter.formats.index import (
    NO_PREFETCH_LANDMARK,
    OPAQUE_MARKER,
    PREFETCH_LANDMARK,
    WHITEOUT_PREFIX,
    Entry,
    EntryType,
    LayerIndex,
)

ROOT_INODE = 1
DEFAULT_OPAQUE_XATTRS = ("trusted.overlay.opaque",)
OPAQUE_VALUE = b"y"
IMPLIED_DIR_MODE = 0o755
_OVERLAY_XATTR_PREFIXES = ("trusted.overlay.", "user.overlay.")
_LANDMARKS = (PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK)

_TYPE_BITS = {
    EntryType.DIR: stat.S_IFDIR,
    EntryType.REG: stat.S_IFREG,
    EntryType.SYMLINK: stat.S_IFLNK,
    EntryType.CHAR: stat.S_IFCHR,
    EntryType.BLOCK: stat.S_IFBLK,
    EntryType.FIFO: stat.S_IFIFO,
}
_EMPTY_XATTRS: Mapping[str, bytes] = MappingProxyType({})
_EMPTY_CHILDREN: Mapping[str, int] = MappingProxyType({})


@dataclass(slots=True, eq=False)
class Node:
    """One inode of the merged tree. Never changed once `build_tree` returns (not declared
    frozen only because a frozen dataclass builds 30% slower: its __init__ sets each of the 20
    fields through object.__setattr__, and a mount builds one Node per file at start).

    type: never HARDLINK (hard links are several names of one Node).
    mode: permission bits only; `st_mode` adds the type bits.
    layer: position of the serving layer in `MountTree.layers` (None for implied dirs, the
      subtree directories and the mount root when no layer lists it).
    entry: the layer Entry behind the node (for a regular file: the one whose chunks hold its
      bytes, the link target's entry for hard links); None for implied dirs.
    name: the node's first name in its directory ("" for the root); `MountTree.path_of` gives
      the whole path ("0/etc/passwd" for subtrees), what first-read recording reports. (Kept as
      the name alone: the string is the directory's key already, where a path per node would
      be a string of its own.)
    parent: inode of the directory holding `name` (the root is its own parent).
    children: name -> inode, for directories; `names` lists them sorted (readdir order).
    whiteout: an overlay whiteout marker (char 0:0) synthesized for a subtree.
    opaque: a directory carrying the overlay opaque xattr.
    """

    inode: int
    type: EntryType
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    nlink: int
    name: str
    parent: int
    layer: int | None = None
    entry: Entry | None = None
    link_target: str = ""
    dev_major: int = 0
    dev_minor: int = 0
    xattrs: Mapping[str, bytes] = field(default_factory=lambda: _EMPTY_XATTRS)
    children: Mapping[str, int] = field(default_factory=lambda: _EMPTY_CHILDREN)
    names: tuple[str, ...] = ()
    whiteout: bool = False
    opaque: bool = False

    @property
    def st_mode(self) -> int:
        return _TYPE_BITS[self.type] | self.mode

    @property
    def rdev(self) -> int:
        return os.makedev(self.dev_major, self.dev_minor)

    @property
    def is_dir(self) -> bool:
        return self.type is EntryType.DIR


@dataclass(frozen=True)
class MountTree:
    """The merged tree: nodes by inode, plus the flat list of layers that `Node.layer` indexes.

    layers: every run's layers, run 0 first, each run lowest layer first.
    run_of_layer: for each position in `layers`, which run it belongs to.
    file_bytes: total size of the regular files (each inode counted once).
    has_xattrs: some node carries an xattr (a layer's, or a synthesized opaque marker).
    """

    nodes: Mapping[int, Node]
    layers: tuple[LayerIndex, ...]
    run_of_layer: tuple[int, ...]
    subtrees: bool
    file_bytes: int
    has_xattrs: bool = True

    @property
    def root(self) -> Node:
        return self.nodes[ROOT_INODE]

    def __getitem__(self, inode: int) -> Node:
        return self.nodes[inode]

    def __len__(self) -> int:
        return len(self.nodes)

    def get(self, inode: int) -> Node | None:
        return self.nodes.get(inode)

    def lookup(self, parent: int, name: str) -> Node | None:
        """The child `name` of directory `parent`, or None."""
        node = self.nodes.get(parent)
        if node is None or not node.is_dir:
            return None
        inode = node.children.get(name)
        return None if inode is None else self.nodes[inode]

    def path_of(self, node: Node) -> str:
        """The node's first path relative to the mount root ("" for the root)."""
        parts: list[str] = []
        while node.inode != ROOT_INODE:
            parts.append(node.name)
            node = self.nodes[node.parent]
        return "/".join(reversed(parts))

    def resolve(self, path: str) -> Node | None:
        """The node at `path` (relative to the mount root, no symlinks followed), or None."""
        node: Node | None = self.root
        for part in (p for p in path.split("/") if p):
            if node is None:
                return None
            node = self.lookup(node.inode, part)
        return node

    def walk(self) -> Iterator[tuple[str, Node]]:
        """(path, node) for every name in the tree, depth first, in readdir order."""
        stack: list[tuple[str, Node]] = [("", self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if node.is_dir:
                for name in reversed(node.names):
                    stack.append((posixpath.join(path, name), self.nodes[node.children[name]]))


# ---------------------------------------------------------------------------------------------
# Building


@dataclass(eq=False, slots=True)
class _B:
    """A mutable node while merging."""

    type: EntryType
    mode: int = IMPLIED_DIR_MODE
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    link_target: str = ""
    dev_major: int = 0
    dev_minor: int = 0
    xattrs: Mapping[str, bytes] = field(default_factory=lambda: _EMPTY_XATTRS)
    layer: int | None = None
    entry: Entry | None = None
    children: dict[str, _B] = field(default_factory=dict)
    whiteout: bool = False
    hides_below: bool = False
    # Filled in by _freeze: the inode number (0: not yet), how many names reach the node, and a
    # directory's child names in readdir order.
    inode: int = 0
    names_seen: int = 0
    sorted_names: tuple[str, ...] = ()

    @property
    def is_real_dir(self) -> bool:
        return self.type is EntryType.DIR and not self.whiteout


def _clean_xattrs(xattrs: Mapping[str, bytes]) -> Mapping[str, bytes]:
    if not xattrs:
        return _EMPTY_XATTRS
    if any(k.startswith(_OVERLAY_XATTR_PREFIXES) for k in xattrs):
        return MappingProxyType({k: v for k, v in xattrs.items() if not k.startswith(_OVERLAY_XATTR_PREFIXES)})
    return xattrs


def _from_entry(entry: Entry, layer: int) -> _B:
    size = 0
    if entry.type is EntryType.REG:
        size = entry.size
    elif entry.type is EntryType.SYMLINK:
        size = len(os.fsencode(entry.link_target))
    # Positional, in _B's field order (keywords cost twice the time of the call, once per file).
    return _B(
        entry.type, entry.mode & 0o7777, entry.uid, entry.gid, entry.mtime_ns, size,
        entry.link_target if entry.type is EntryType.SYMLINK else "", entry.dev_major, entry.dev_minor,
        _clean_xattrs(entry.xattrs), layer, entry,
    )


def _set_dir_meta(node: _B, entry: Entry, layer: int) -> None:
    node.mode = entry.mode & 0o7777
    node.uid, node.gid, node.mtime_ns = entry.uid, entry.gid, entry.mtime_ns
    node.xattrs = _clean_xattrs(entry.xattrs)
    node.layer, node.entry = layer, entry


class _RunMerger:
    """Applies one run's layers, in order, to a tree of _B nodes."""

    def __init__(self, markers: bool) -> None:
        self.markers = markers
        self.root = _B(type=EntryType.DIR)

    def _dir(self, path: str, layer: int) -> _B:
        """The directory at `path`, creating implied directories (replacing non-dirs) on the way."""
        node = self.root
        for part in (p for p in path.split("/") if p):
            child = node.children.get(part)
            if child is None or not child.is_real_dir:
                # Replacing a whiteout or a non-dir means lower runs' `part` must stay hidden.
                child = _B(type=EntryType.DIR, layer=layer, hides_below=child is not None)
                node.children[part] = child
            node = child
        return node

    def _find(self, path: str) -> _B | None:
        node: _B | None = self.root
        for part in (p for p in path.split("/") if p):
            if node is None or not node.is_real_dir:
                return None
            node = node.children.get(part)
        return node

    def apply(self, index: LayerIndex, layer: int) -> None:
        split = [(e, *e.name.rpartition("/")[::2]) for e in index.entries]  # (entry, parent, base)
        # Pass 1: whiteouts and opaque markers act on the lower layers only.
        for e, parent_path, base in split:
            if not base.startswith(WHITEOUT_PREFIX):
                continue
            d = self._dir(parent_path, layer)
            if base == OPAQUE_MARKER:
                d.children.clear()
                d.hides_below = True
                continue
            target = base[len(WHITEOUT_PREFIX):]
            if not target or target in (".", ".."):
                continue
            d.children.pop(target, None)
            if self.markers:
                d.children[target] = _B(
                    type=EntryType.CHAR, mode=0, uid=e.uid, gid=e.gid, mtime_ns=e.mtime_ns,
                    layer=layer, entry=e, whiteout=True,
                )
        # Pass 2: the layer's own entries. `dirs` caches parent lookups; it goes stale only when
        # an entry replaces a directory, and is then dropped.
        made: dict[str, _B] = {}
        dirs: dict[str, _B] = {}
        for e, parent_path, base in split:
            if base.startswith(WHITEOUT_PREFIX):
                continue
            if e.name == "":
                if e.type is EntryType.DIR:
                    _set_dir_meta(self.root, e, layer)
                continue
            if not parent_path and base in _LANDMARKS and e.type is EntryType.REG:
                continue
            parent = dirs.get(parent_path)
            if parent is None:
                parent = dirs[parent_path] = self._dir(parent_path, layer)
            existing = parent.children.get(base)
            node: _B | None
            if e.type is EntryType.DIR:
                if existing is not None and existing.is_real_dir:
                    _set_dir_meta(existing, e, layer)
                    node = existing
                else:
                    node = _from_entry(e, layer)
                    node.hides_below = existing is not None
            elif e.type is EntryType.HARDLINK:
                node = made.get(e.link_target) or self._find(e.link_target)
                if node is None or node.type is EntryType.DIR or node.whiteout:
                    continue  # dangling or to a directory: containerd's applier fails; we skip it
            else:
                node = _from_entry(e, layer)
            if existing is not None and existing.is_real_dir and node is not existing:
                dirs.clear()
            parent.children[base] = node
            made[e.name] = node


def _readdir_order(names: Iterable[str]) -> tuple[str, ...]:
    """The names sorted by their bytes (what the kernel's overlay and tar extraction show).
    ASCII names sort the same as strings, without encoding each one (most directories)."""
    names = list(names)
    if all(n.isascii() for n in names):
        return tuple(sorted(names))
    return tuple(sorted(names, key=os.fsencode))


def _freeze(roots: list[_B], subtrees: bool, opaque_xattrs: Sequence[str],
            bare_runs: Collection[int] = ()) -> tuple[dict[int, Node], int, bool]:
    """Number the nodes depth first and build the immutable Nodes. Returns (nodes, file bytes,
    whether any node has an xattr)."""
    top = _B(type=EntryType.DIR)
    if subtrees:
        top.children = {str(i): r for i, r in enumerate(roots)}
    else:
        top = roots[0]
    order: list[tuple[_B, str, int, bool]] = []  # (node, first name, parent inode, marked) in inode order
    next_inode = ROOT_INODE
    stack: list[tuple[_B, str, int, bool]] = [(top, "", ROOT_INODE, subtrees)]
    while stack:
        b, name, parent, marked = stack.pop()
        b.names_seen += 1
        if b.inode:
            continue
        me = b.inode = next_inode
        next_inode += 1
        order.append((b, name, parent, marked))
        if b.type is EntryType.DIR and not b.whiteout:  # b.is_real_dir, without the call
            names = b.sorted_names = _readdir_order(b.children)
            kids = b.children
            for child in reversed(names):
                child_marked = marked and not (b is top and subtrees and int(child) in bare_runs)
                stack.append((kids[child], child, me, child_marked))

    nodes: dict[int, Node] = {}
    file_bytes = 0
    has_xattrs = False
    opaque_values = {x: OPAQUE_VALUE for x in opaque_xattrs}
    for b, name, parent, marked in order:
        inode = b.inode
        if b.type is EntryType.DIR and not b.whiteout:
            names = b.sorted_names
            children = {}
            nlink = 2
            for n in names:
                c = b.children[n]
                children[n] = c.inode
                if c.type is EntryType.DIR and not c.whiteout:
                    nlink += 1
            opaque = marked and b.hides_below and bool(opaque_xattrs) and inode != ROOT_INODE
            xattrs = b.xattrs
            if opaque:
                xattrs = MappingProxyType({**b.xattrs, **opaque_values})
        else:
            names, children, opaque, xattrs = (), {}, False, b.xattrs
            nlink = b.names_seen
            if b.type is EntryType.REG:
                file_bytes += b.size
        if xattrs:
            has_xattrs = True
        # Positional, in Node's field order: keywords make this call 2.5x slower (one per file).
        nodes[inode] = Node(
            inode, b.type, b.mode, b.uid, b.gid, b.mtime_ns, b.size, nlink, name, parent, b.layer, b.entry,
            b.link_target, b.dev_major, b.dev_minor, xattrs,
            MappingProxyType(children) if children else _EMPTY_CHILDREN, names, b.whiteout, opaque,
        )
    return nodes, file_bytes, has_xattrs


def build_tree(
    runs: Sequence[Sequence[LayerIndex]],
    *,
    subtrees: bool = True,
    opaque_xattrs: Sequence[str] = DEFAULT_OPAQUE_XATTRS,
    bare_runs: Collection[int] = (),
) -> MountTree:
    """Merge `runs` (each lowest layer first) into one MountTree; see the module docstring.

    subtrees=True: the root holds "0".."n-1", one merged run each, with overlay whiteout/opaque
    markers. subtrees=False: exactly one run, merged at the root, whiteouts fully applied.
    opaque_xattrs: the xattr names (value b"y") set on opaque subtree dirs; use
    ("user.overlay.opaque",) for an overlay mounted with `userxattr`.
    bare_runs: runs with no layer below them in the image (typically run 0 when the image's lowest
    layer is remote). Their whiteouts are applied fully and they carry no overlay markers, so the
    subtree is also right where containerd mounts it alone (a bind mount for a read-only view).
    """
    if not subtrees and len(runs) != 1:
        raise ValueError(f"a mount without subtrees needs exactly one run, got {len(runs)}")
    layers: list[LayerIndex] = []
    run_of_layer: list[int] = []
    roots: list[_B] = []
    for run_no, run in enumerate(runs):
        merger = _RunMerger(markers=subtrees and run_no not in bare_runs)
        for index in run:
            merger.apply(index, len(layers))
            layers.append(index)
            run_of_layer.append(run_no)
        roots.append(merger.root)
    nodes, file_bytes, has_xattrs = _freeze(roots, subtrees, opaque_xattrs, bare_runs)
    return MountTree(
        nodes=MappingProxyType(nodes), layers=tuple(layers), run_of_layer=tuple(run_of_layer),
        subtrees=subtrees, file_bytes=file_bytes, has_xattrs=has_xattrs,
    )
