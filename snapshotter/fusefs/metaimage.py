"""The metadata image of a mount: the MountTree as an EROFS image for overlayfs. Pure: tree in, bytes out.

The kernel serves a container's metadata (lookup, stat, readdir, xattrs) from this image instead
of asking the FUSE mount, and overlayfs fetches file bytes from the FUSE mount only when a file is
opened. The container's overlay is mounted with `metacopy=on` and
`lowerdir=<image>/<run>:...::<FUSE mountpoint>` (the FUSE mount is a data-only lower layer):

- The image holds the same tree as the FUSE mount, node for node: same names, modes, owners,
  mtimes, sizes, device numbers, symlink targets, hard links, xattrs, and the overlay markers of
  subtrees (whiteouts as char 0:0, `trusted.overlay.opaque` directories).
- Every regular file is a hole of its size (no data) carrying the overlay xattrs
  `trusted.overlay.metacopy` (empty: "the data is elsewhere") and `trusted.overlay.redirect`
  = "/" + its path in the FUSE mount ("/0/usr/bin/python3" for subtrees), which overlayfs looks
  up in the data-only layer when the file is opened. A hard link's names all point at the first.
- Redirect and metacopy are written with the `trusted.` prefix whatever prefix the tree uses for
  opaque markers: a `userxattr` overlay does not follow metacopy redirects at all, so such a
  daemon must not use metadata images (the caller's decision).

Reading a file of the image directly (not through overlayfs) gives zeros: only ever hand out the
image's directories together with the data-only layer.
"""

from __future__ import annotations

from snapshotter.formats import rafs_layout as L
from snapshotter.formats.index import Compression, EntryType
from snapshotter.formats.rafs_bootstrap import build_bootstrap
from snapshotter.formats.rafs_writer import _Node
from snapshotter.fusefs.tree import ROOT_INODE, MountTree

METACOPY_XATTR = "trusted.overlay.metacopy"
REDIRECT_XATTR = "trusted.overlay.redirect"

def redirect_of(path: str) -> bytes:
    """The redirect xattr value of the file at `path` (relative to the FUSE mount root)."""
    return ("/" + path).encode("utf-8", "surrogateescape")


def build_meta_image(tree: MountTree) -> bytes:
    """The EROFS metadata image of `tree` (see the module docstring)."""
    made: dict[int, _Node] = {}
    paths: dict[int, str] = {ROOT_INODE: ""}
    # Inodes are numbered depth first over first names, so a directory's path is known before
    # its children's, and the first time an inode is met is through its first name.
    for inode in sorted(tree.nodes):
        node = tree.nodes[inode]
        mtime, nsec = divmod(node.mtime_ns, 1_000_000_000)
        xattrs = dict(node.xattrs)
        size = 0
        target = b""
        rdev = 0
        if node.type is EntryType.REG:
            size = node.size
            xattrs[METACOPY_XATTR] = b""
            xattrs[REDIRECT_XATTR] = redirect_of(paths[inode])
        elif node.type is EntryType.SYMLINK:
            target = node.link_target.encode("utf-8", "surrogateescape")
            size = len(target)
        elif node.type in (EntryType.CHAR, EntryType.BLOCK):
            rdev = L.encode_dev(node.dev_major, node.dev_minor)
        made[inode] = _Node(mode=node.st_mode, uid=node.uid, gid=node.gid, mtime=mtime,
                            mtime_nsec=nsec, size=size, xattrs=xattrs, target=target, rdev=rdev)
        if node.type is EntryType.DIR:
            prefix = paths[inode] + "/" if paths[inode] else ""
            for name, child in node.children.items():
                paths.setdefault(child, prefix + name)
    for inode, node in tree.nodes.items():
        if node.type is EntryType.DIR:
            made[inode].children = {name.encode("utf-8", "surrogateescape"): made[child]
                                    for name, child in node.children.items()}
    # chunk_size and compression only fill superblock fields: the image has no chunks.
    return build_bootstrap(made[ROOT_INODE], [], chunk_size=4096, compression=Compression.NONE,
                           digest_algo="sha256", prefetch=(), metadata_only=True)
