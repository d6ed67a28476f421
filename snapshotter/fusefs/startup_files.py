"""The files nearly every container start reads, found in a mount's merged tree. Pure: no IO.

Measured on a cold `ctr run IMAGE true` of a Debian image through the mount (the registry's log):
the start read, one after another and each a registry round trip, /etc/passwd and /etc/group
(runc looks the user up in the image), the program, the dynamic loader, /etc/ld.so.cache and
libc.so.6. Only the program depends on what the container runs; the rest is the same for every
dynamically linked program of a glibc image (musl's loader is its C library). Fetching those files
together when the mount starts turns five serial round trips into one that overlaps the container's
set-up.

Lookup: each path is resolved in the image's own view, following symlinks (absolute targets are
relative to the image root; at most `MAX_SYMLINKS` per path, as the kernel's ELOOP limit), so
merged-/usr images (/lib64 -> usr/lib64, whose loader links to /lib/x86_64-linux-gnu/...) resolve
to the regular file that holds the bytes. With several runs (subtrees) the topmost run that holds a
path wins; a local layer stacked between runs may hide it, which only costs a needless fetch.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence

from snapshotter.formats.index import Entry, EntryType, LayerIndex
from snapshotter.fusefs.tree import ROOT_INODE, MountTree, Node

STARTUP_PATHS = ("etc/passwd", "etc/group", "etc/ld.so.cache")
LOADER_DIRS = ("lib64", "lib")
LOADER_PATTERNS = ("ld-linux*.so*", "ld-musl-*.so*")
LIBC_NAME = "libc.so.6"  # glibc's, next to its loader; musl's loader is libc itself
MAX_SYMLINKS = 40


def _is_loader_name(base: str) -> bool:
    """Whether a file's base name is a dynamic loader's (LOADER_PATTERNS)."""
    return any(fnmatch.fnmatchcase(base, pattern) for pattern in LOADER_PATTERNS)


def _run_roots(tree: MountTree) -> list[int]:
    """The inode of each run's root, topmost run first."""
    if not tree.subtrees:
        return [ROOT_INODE]
    runs = len(set(tree.run_of_layer))
    roots = [tree.lookup(ROOT_INODE, str(run)) for run in reversed(range(runs))]
    return [node.inode for node in roots if node is not None and node.is_dir]


def _resolve(tree: MountTree, root: int, path: str) -> Node | None:
    """The node `path` names under `root` with every symlink followed (the last one too), or
    None when a part is missing, a non-directory is in the way or there are too many links."""
    pending = [p for p in path.split("/") if p not in ("", ".")]
    trail = [tree[root]]  # the directories from the root down to the current one
    links = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if len(trail) > 1:
                trail.pop()
            continue
        if not trail[-1].is_dir:
            return None
        child = tree.lookup(trail[-1].inode, part)
        if child is None:
            return None
        if child.type is EntryType.SYMLINK:
            links += 1
            if links > MAX_SYMLINKS:
                return None
            if child.link_target.startswith("/"):
                del trail[1:]
            pending[:0] = [p for p in child.link_target.split("/") if p not in ("", ".")]
            continue
        trail.append(child)
    return trail[-1]


def _regular(node: Node | None) -> Node | None:
    return node if node is not None and node.type is EntryType.REG and node.entry is not None else None


def _run_startup_files(tree: MountTree, root: int) -> Iterator[tuple[str, Node]]:
    """(path as asked, the node it resolves to) for every start-up path present under `root`,
    whatever its type (a whiteout or directory there still hides lower runs' file)."""
    for path in STARTUP_PATHS:
        if (node := _resolve(tree, root, path)) is not None:
            yield path, node
    for directory in LOADER_DIRS:
        parent = _resolve(tree, root, directory)
        if parent is None or not parent.is_dir:
            continue
        for name in parent.names:
            if not _is_loader_name(name):
                continue
            path = f"{directory}/{name}"
            loader = _resolve(tree, root, path)
            if loader is None:
                continue
            yield path, loader
            if name.startswith("ld-linux") and _regular(loader) is not None:
                libc = tree.lookup(loader.parent, LIBC_NAME)
                if libc is not None:
                    yield f"{path} -> {LIBC_NAME}", libc


def startup_files(tree: MountTree) -> dict[int, list[Node]]:
    """Serving layer position -> the regular-file nodes of the start-up files it holds (each
    inode once, in lookup order); layers holding none are absent. Each path is taken from the
    topmost run that has anything under that name."""
    claimed: set[str] = set()
    seen: set[int] = set()
    by_layer: dict[int, list[Node]] = {}
    for root in _run_roots(tree):
        for path, node in _run_startup_files(tree, root):
            if path in claimed:
                continue
            claimed.add(path)
            if _regular(node) is None or node.layer is None or node.inode in seen:
                continue
            seen.add(node.inode)
            by_layer.setdefault(node.layer, []).append(node)
    return by_layer


def _resolve_in_layer(index: LayerIndex, path: str, *, directory: bool = False) -> tuple[str, Entry | None] | None:
    """(name, entry) that `path` names in one layer's index with every symlink followed (absolute
    targets relative to the layer root), or None when it leads nowhere in the layer. A directory
    the index does not list on the way is taken as there (a TOC need not list every one), and so
    is the last part when `directory` asks for one; the entry is then None (as for the root)."""
    pending = [p for p in path.split("/") if p not in ("", ".")]
    parts: list[str] = []
    links = 0
    entry: Entry | None = None
    while pending:
        part = pending.pop(0)
        if part == "..":
            if parts:
                parts.pop()
            continue
        name = "/".join((*parts, part))
        entry = index.get(name)
        if entry is None:
            if not pending and not directory:
                return None
            parts.append(part)
            continue
        if entry.type is EntryType.SYMLINK:
            links += 1
            if links > MAX_SYMLINKS:
                return None
            if entry.link_target.startswith("/"):
                parts = []
            pending[:0] = [p for p in entry.link_target.split("/") if p not in ("", ".")]
            continue
        if pending and entry.type is not EntryType.DIR:
            return None
        parts.append(part)
    name = "/".join(parts)
    return name, (index.get(name) if name else None)


def _regular_in_layer(index: LayerIndex, path: str) -> Entry | None:
    found = _resolve_in_layer(index, path)
    entry = found[1] if found is not None else None
    if entry is not None and entry.type is EntryType.HARDLINK:
        entry = index.get(entry.link_target)
    return entry if entry is not None and entry.type is EntryType.REG else None


def layer_startup_entries(index: LayerIndex) -> list[Entry]:
    """The regular files among the start-up files that one layer holds, by its own names alone
    (each once, in lookup order): what a spare can prefetch before the image's tree exists
    (fusefs/early.py). An upper layer of the image may replace one of them; the merged tree's
    `startup_files` is what the mount itself fetches."""
    found: list[Entry] = []

    def take(entry: Entry | None) -> None:
        if entry is not None and all(entry is not e for e in found):
            found.append(entry)

    for path in STARTUP_PATHS:
        take(_regular_in_layer(index, path))
    # Every loader pattern starts "ld-": one quick pass picks the few names worth matching.
    candidates = [e.name for e in index.entries if "ld-" in e.name]
    for directory in LOADER_DIRS:
        resolved = _resolve_in_layer(index, directory, directory=True)
        if resolved is None or (resolved[1] is not None and resolved[1].type is not EntryType.DIR):
            continue
        prefix = f"{resolved[0]}/" if resolved[0] else ""
        for name in candidates:
            base = name[len(prefix):]
            if not name.startswith(prefix) or "/" in base or not _is_loader_name(base):
                continue
            loader_path = _resolve_in_layer(index, f"{directory}/{base}")
            loader = _regular_in_layer(index, f"{directory}/{base}")
            take(loader)
            if loader is not None and loader_path is not None and base.startswith("ld-linux"):
                parent = loader_path[0].rpartition("/")[0]
                take(_regular_in_layer(index, f"{parent}/{LIBC_NAME}" if parent else LIBC_NAME))
    return found


def is_startup_name(name: str) -> bool:
    """Whether a normalized path (no leading "/", as a prefetch list holds it) names a start-up
    file by the path alone: one of STARTUP_PATHS, or a base name matching LOADER_PATTERNS or equal
    to LIBC_NAME in any directory (a recorded list names the files the loader's symlinks lead to,
    such as usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2)."""
    base = name.rpartition("/")[2]
    return name in STARTUP_PATHS or base == LIBC_NAME or _is_loader_name(base)


def startup_files_first(names: Sequence[str]) -> list[str]:
    """`names` with its start-up files (`is_startup_name`) moved to the front, both parts in their
    own order: the order a converter lays a prefetch list's files out in. A prefetch of the list is
    streamed and decoded in blob order, so every container start then finds the user database, the
    loader, its cache and the C library near the head of the stream, not behind the program's own
    files (a recorded profile names the program right after the user database: exec reads it
    before its loader)."""
    first: list[str] = []
    rest: list[str] = []
    for name in names:
        (first if is_startup_name(name) else rest).append(name)
    return first + rest


def program_file(tree: MountTree, candidates: Sequence[str]) -> Node | None:
    """The file a container's program lookup finds in the merged tree (runtime_spec.py
    `Program.candidates`, tried in order): the first candidate that is, in the topmost run that
    has anything under that name, an executable regular file. Something else there (a directory,
    a whiteout, a file without execute bits) hides the lower runs' entries of that name, and the
    lookup goes on with the next candidate, as runc's does."""
    roots = _run_roots(tree)
    for path in candidates:
        for root in roots:
            node = _resolve(tree, root, path)
            if node is None:
                continue
            found = _regular(node)
            if found is not None and found.mode & 0o111:
                return found
            break
    return None
