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
from snapshotter.formats.index import TYPE_CHAR as _CHAR
from snapshotter.formats.index import TYPE_DIR as _DIR
from snapshotter.formats.index import TYPE_HARDLINK as _HARDLINK
from snapshotter.formats.index import TYPE_REG as _REG
from snapshotter.formats.index import TYPE_SYMLINK as _SYMLINK

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


class _NoChildren(dict[str, "Node"]):
    """The building-only child table of every node that is not a directory: empty, and loud if
    anything tries to add to it (only directories' tables are written)."""

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("not a directory: it has no children to change")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]


_NO_KIDS: dict[str, Node] = _NoChildren()


@dataclass(slots=True, eq=False)
class Node:
    """One inode of the merged tree. `build_tree` makes it while merging the layers and fills
    in its place in the tree (inode, name, parent, children) at the end; never changed once
    `build_tree` returns. (Not frozen: a frozen dataclass builds 30% slower, its __init__
    setting each field through object.__setattr__, and a mount builds one Node per file at
    start. One object per inode, from merge to serving: a separate builder object per file
    cost 2.6 MiB and 10-15 ms more for 11,000 files.)

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
    kids, hides_below: used while merging only (a directory's child Nodes by name; whether
      the directory must hide what lies below its run). `kids` is empty once built.
    """

    type: EntryType
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    link_target: str
    dev_major: int
    dev_minor: int
    xattrs: Mapping[str, bytes]
    layer: int | None
    entry: Entry | None
    kids: dict[str, Node]
    whiteout: bool = False
    hides_below: bool = False
    inode: int = 0
    nlink: int = 0  # while merging: how many names reach the node
    name: str = ""
    parent: int = 0
    children: Mapping[str, int] = field(default_factory=lambda: _EMPTY_CHILDREN)
    names: tuple[str, ...] = ()
    opaque: bool = False

    @property
    def st_mode(self) -> int:
        return _TYPE_BITS[self.type] | self.mode

    @property
    def rdev(self) -> int:
        return os.makedev(self.dev_major, self.dev_minor)

    @property
    def is_dir(self) -> bool:
        return self.type is _DIR


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


def _dir_node(layer: int | None = None, *, hides_below: bool = False) -> Node:
    """An implied directory (0755 root:root, mtime 0), or a layer's before its entry is applied."""
    return Node(_DIR, IMPLIED_DIR_MODE, 0, 0, 0, 0, "", 0, 0, _EMPTY_XATTRS, layer, None, {},
                hides_below=hides_below)


def _is_real_dir(node: Node) -> bool:
    return node.type is _DIR and not node.whiteout


def _clean_xattrs(xattrs: Mapping[str, bytes]) -> Mapping[str, bytes]:
    if not xattrs:
        return _EMPTY_XATTRS
    if any(k.startswith(_OVERLAY_XATTR_PREFIXES) for k in xattrs):
        return MappingProxyType({k: v for k, v in xattrs.items() if not k.startswith(_OVERLAY_XATTR_PREFIXES)})
    return xattrs


def _mode_of(entry: Entry) -> int:
    """The entry's permission bits: its own int object (shared across entries by the parsers)
    when it holds nothing else, as the index promises."""
    mode = entry.mode
    return mode if mode <= 0o7777 else mode & 0o7777


def _from_entry(entry: Entry, layer: int) -> Node:
    etype = entry.type
    size = 0
    if etype is _REG:
        size = entry.size
    elif etype is _SYMLINK:
        size = len(os.fsencode(entry.link_target))
    xattrs = _clean_xattrs(entry.xattrs) if entry.xattrs else _EMPTY_XATTRS
    mode = entry.mode  # _mode_of, without the call (once per file)
    if mode > 0o7777:
        mode &= 0o7777
    # Positional, in Node's field order (keywords cost twice the time of the call, once per file).
    return Node(
        etype, mode, entry.uid, entry.gid, entry.mtime_ns, size,
        entry.link_target if etype is _SYMLINK else "", entry.dev_major, entry.dev_minor,
        xattrs, layer, entry, {} if etype is _DIR else _NO_KIDS,
    )


def _set_dir_meta(node: Node, entry: Entry, layer: int) -> None:
    node.mode = _mode_of(entry)
    node.uid, node.gid, node.mtime_ns = entry.uid, entry.gid, entry.mtime_ns
    node.xattrs = _clean_xattrs(entry.xattrs)
    node.layer, node.entry = layer, entry


class _RunMerger:
    """Applies one run's layers, in order, to a tree of Nodes (linked by their `kids`)."""

    def __init__(self, markers: bool) -> None:
        self.markers = markers
        self.root = _dir_node()

    def _dir(self, path: str, layer: int) -> Node:
        """The directory at `path`, creating implied directories (replacing non-dirs) on the way."""
        node = self.root
        for part in (p for p in path.split("/") if p):
            child = node.kids.get(part)
            if child is None or not _is_real_dir(child):
                # Replacing a whiteout or a non-dir means lower runs' `part` must stay hidden.
                child = _dir_node(layer, hides_below=child is not None)
                node.kids[part] = child
            node = child
        return node

    def _find(self, path: str) -> Node | None:
        node: Node | None = self.root
        for part in (p for p in path.split("/") if p):
            if node is None or not _is_real_dir(node):
                return None
            node = node.kids.get(part)
        return node

    def apply(self, index: LayerIndex, layer: int) -> None:
        entries = index.entries
        # Pass 1: whiteouts and opaque markers act on the lower layers only.
        for e in entries:
            if WHITEOUT_PREFIX not in e.name:  # nearly every entry: no need to split its name
                continue
            parent_path, _, base = e.name.rpartition("/")
            if not base.startswith(WHITEOUT_PREFIX):
                continue
            d = self._dir(parent_path, layer)
            if base == OPAQUE_MARKER:
                d.kids.clear()
                d.hides_below = True
                continue
            target = base[len(WHITEOUT_PREFIX):]
            if not target or target in (".", ".."):
                continue
            d.kids.pop(target, None)
            if self.markers:
                d.kids[target] = Node(_CHAR, 0, e.uid, e.gid, e.mtime_ns, 0, "", 0, 0, _EMPTY_XATTRS,
                                      layer, e, _NO_KIDS, whiteout=True)
        # Pass 2: the layer's own entries. `dirs` caches parent lookups; it goes stale only when
        # an entry replaces a directory, and is then dropped.
        made: dict[str, Node] = {}
        dirs: dict[str, Node] = {}
        for e in entries:
            name, etype = e.name, e.type
            parent_path, _, base = name.rpartition("/")
            if base.startswith(WHITEOUT_PREFIX):
                continue
            if name == "":
                if etype is _DIR:
                    _set_dir_meta(self.root, e, layer)
                continue
            if not parent_path and base in _LANDMARKS and etype is _REG:
                continue
            parent = dirs.get(parent_path)
            if parent is None:
                parent = dirs[parent_path] = self._dir(parent_path, layer)
            existing = parent.kids.get(base)
            node: Node | None
            if etype is _DIR:
                if existing is not None and _is_real_dir(existing):
                    _set_dir_meta(existing, e, layer)
                    node = existing
                else:
                    node = _from_entry(e, layer)
                    node.hides_below = existing is not None
            elif etype is _HARDLINK:
                node = made.get(e.link_target) or self._find(e.link_target)
                if node is None or node.type is _DIR or node.whiteout:
                    continue  # dangling or to a directory: containerd's applier fails; we skip it
            else:
                node = _from_entry(e, layer)
            if existing is not None and _is_real_dir(existing) and node is not existing:
                dirs.clear()
            parent.kids[base] = node
            made[name] = node


def _readdir_order(names: Iterable[str]) -> tuple[str, ...]:
    """The names sorted by their bytes (what the kernel's overlay and tar extraction show).
    ASCII names sort the same as strings, without encoding each one (most directories)."""
    names = list(names)
    if all(n.isascii() for n in names):
        return tuple(sorted(names))
    return tuple(sorted(names, key=os.fsencode))


def _freeze(roots: list[Node], subtrees: bool, opaque_xattrs: Sequence[str],
            bare_runs: Collection[int] = ()) -> tuple[dict[int, Node], int, bool]:
    """Number the nodes depth first and fill in their places in the tree (inode, first name,
    parent, children, nlink, opaque marker), dropping the merge's child tables. Returns
    (nodes by inode, file bytes, whether any node has an xattr)."""
    top = _dir_node()
    if subtrees:
        top.kids = {str(i): r for i, r in enumerate(roots)}
    else:
        top = roots[0]
    order: list[tuple[Node, str, int, bool]] = []  # (node, first name, parent inode, marked) in inode order
    next_inode = ROOT_INODE
    stack: list[tuple[Node, str, int, bool]] = [(top, "", ROOT_INODE, subtrees)]
    while stack:
        b, name, parent, marked = stack.pop()
        b.nlink += 1  # names seen (a directory's is set below)
        if b.inode:
            continue
        me = b.inode = next_inode
        next_inode += 1
        order.append((b, name, parent, marked))
        if b.type is _DIR and not b.whiteout:  # _is_real_dir(b), without the call
            names = b.names = _readdir_order(b.kids)
            kids = b.kids
            for child in reversed(names):
                child_marked = marked and not (b is top and subtrees and int(child) in bare_runs)
                stack.append((kids[child], child, me, child_marked))

    nodes: dict[int, Node] = {}
    file_bytes = 0
    has_xattrs = False
    opaque_values = {x: OPAQUE_VALUE for x in opaque_xattrs}
    for b, name, parent, marked in order:
        inode = b.inode
        b.name, b.parent = name, parent
        if b.type is _DIR and not b.whiteout:
            kids = b.kids
            children = {}
            nlink = 2
            for n in b.names:
                c = kids[n]
                children[n] = c.inode
                if c.type is _DIR and not c.whiteout:
                    nlink += 1
            b.nlink = nlink
            if children:
                b.children = MappingProxyType(children)
            b.kids = _NO_KIDS
            # Only a directory that hides what lies below its run needs the marker.
            if marked and b.hides_below and opaque_xattrs and inode != ROOT_INODE:
                b.opaque = True
                b.xattrs = MappingProxyType({**b.xattrs, **opaque_values})
        elif b.type is _REG:
            file_bytes += b.size
        if b.xattrs:
            has_xattrs = True
        nodes[inode] = b
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
    roots: list[Node] = []
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
