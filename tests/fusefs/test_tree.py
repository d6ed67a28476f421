"""tree.build_tree: the merge rule, hard links, implied dirs, inode numbering, subtree markers."""

from __future__ import annotations

import stat
from types import MappingProxyType

import pytest

from snapshotter.formats.index import EntryType
from snapshotter.fusefs.tree import ROOT_INODE, MountTree, Node, build_tree
from tests.fusefs.layers import T0, Layer


def names(tree: MountTree, path: str) -> list[str]:
    node = tree.resolve(path)
    assert node is not None and node.is_dir, path
    return list(node.names)


def node(tree: MountTree, path: str) -> Node:
    n = tree.resolve(path)
    assert n is not None, f"{path} missing"
    return n


def merged(*layers: Layer) -> MountTree:
    return build_tree([[layer.index() for layer in layers]], subtrees=False)


def test_later_layer_overrides_and_remembers_serving_layer() -> None:
    l0 = Layer().dir("etc").file("etc/a", b"old", mode=0o644).file("etc/b", b"bee")
    l1 = Layer().file("etc/a", b"newer", mode=0o600, uid=5, gid=6)
    t = merged(l0, l1)
    a, b = node(t, "etc/a"), node(t, "etc/b")
    assert (a.layer, a.size, a.mode, a.uid, a.gid) == (1, 5, 0o600, 5, 6)
    assert a.entry is not None and a.entry is t.layers[1]["etc/a"]
    assert (b.layer, b.entry) == (0, t.layers[0]["etc/b"])
    assert names(t, "etc") == ["a", "b"]


def test_whiteout_deletes_subtree_and_is_not_shown() -> None:
    l0 = Layer().dir("d").dir("d/sub").file("d/sub/f", b"x").file("d/keep", b"k").file("top", b"t")
    l1 = Layer().whiteout("d/sub").whiteout("top").whiteout("never-existed")
    t = merged(l0, l1)
    assert names(t, "") == ["d"]
    assert names(t, "d") == ["keep"]
    assert all(".wh." not in p for p, _ in t.walk())


def test_whiteout_applies_to_lower_layers_only() -> None:
    l0 = Layer().file("x", b"lower")
    l1 = Layer().file("x", b"same layer").whiteout("x")  # the OCI rule: x of this layer stays
    t = merged(l0, l1)
    assert node(t, "x").layer == 1 and node(t, "x").size == len(b"same layer")


def test_opaque_hides_lower_children_but_keeps_own() -> None:
    l0 = Layer().dir("o").file("o/1", b"1").dir("o/2").file("o/2/x", b"x").file("other", b"")
    l1 = Layer().dir("o", mode=0o700).file("o/3", b"3").opaque("o")
    t = merged(l0, l1)
    assert names(t, "o") == ["3"]
    assert node(t, "o").mode == 0o700
    assert not node(t, "o").opaque and "trusted.overlay.opaque" not in node(t, "o").xattrs  # no markers
    assert names(t, "") == ["o", "other"]


def test_dir_over_dir_merges_with_upper_metadata_and_file_dir_replacements() -> None:
    l0 = (Layer().dir("d", mode=0o755, uid=1, xattrs=MappingProxyType({"user.a": b"1"})).file("d/old", b"o")
          .file("f2d", b"file").dir("d2f").file("d2f/x", b""))
    l1 = (Layer().dir("d", mode=0o711, uid=2, mtime_ns=T0 + 5, xattrs=MappingProxyType({"user.b": b"2"}))
          .file("d/new", b"n").dir("f2d").file("f2d/in", b"").file("d2f", b"now a file"))
    t = merged(l0, l1)
    d = node(t, "d")
    assert (d.mode, d.uid, d.mtime_ns, dict(d.xattrs)) == (0o711, 2, T0 + 5, {"user.b": b"2"})
    assert names(t, "d") == ["new", "old"]
    assert node(t, "f2d").is_dir and names(t, "f2d") == ["in"]
    assert node(t, "d2f").type is EntryType.REG


def test_hard_links_share_a_node_and_count_names() -> None:
    l0 = (Layer().dir("bin").file("bin/busybox", b"BB", mode=0o755).hardlink("bin/sh", "bin/busybox")
          .hardlink("bin/ls", "bin/busybox"))
    t0 = merged(l0)
    bb, sh, ls = node(t0, "bin/busybox"), node(t0, "bin/sh"), node(t0, "bin/ls")
    assert bb is sh is ls and bb.nlink == 3 and bb.type is EntryType.REG and bb.mode == 0o755
    assert t0.path_of(bb) == "bin/busybox"  # first name in readdir order
    # A later layer replacing one name and deleting another leaves one link.
    l1 = Layer().file("bin/ls", b"real ls").whiteout("bin/sh")
    t1 = merged(l0, l1)
    assert node(t1, "bin/busybox").nlink == 1 and node(t1, "bin/ls").nlink == 1
    assert node(t1, "bin/ls") is not node(t1, "bin/busybox")
    # Hard link in an upper layer to a lower file shares the lower node.
    l2 = Layer().hardlink("bin/bb2", "bin/busybox")
    t2 = merged(l0, l1, l2)
    assert node(t2, "bin/bb2") is node(t2, "bin/busybox") and node(t2, "bin/bb2").nlink == 2
    # Dangling hard links and links to dirs are skipped.
    t3 = merged(Layer().dir("d").hardlink("x", "nope").hardlink("y", "d"))
    assert names(t3, "") == ["d"]


def test_special_files_attributes_and_implied_parents() -> None:
    l0 = (Layer().dir("", mode=0o750, mtime_ns=T0 + 1)
          .symlink("a/b/link", "../target", uid=3)
          .device("dev/null", EntryType.CHAR, 1, 3).device("dev/sda", EntryType.BLOCK, 8, 0, mode=0o660)
          .device("run/fifo", EntryType.FIFO, mode=0o600)
          .file("x", b"", xattrs=MappingProxyType({"user.k": b"v", "security.selinux": b"s"})))
    t = merged(l0)
    root = t.root
    assert root.inode == ROOT_INODE and root.mode == 0o750 and root.mtime_ns == T0 + 1 and root.parent == ROOT_INODE
    a = node(t, "a")
    assert (a.mode, a.uid, a.mtime_ns, a.entry, a.layer) == (0o755, 0, 0, None, 0)  # implied
    link = node(t, "a/b/link")
    assert link.type is EntryType.SYMLINK and link.link_target == "../target" and link.size == 9 and link.uid == 3
    assert stat.S_ISLNK(link.st_mode)
    null = node(t, "dev/null")
    assert stat.S_ISCHR(null.st_mode) and (null.dev_major, null.dev_minor) == (1, 3)
    assert stat.S_ISBLK(node(t, "dev/sda").st_mode) and node(t, "dev/sda").mode == 0o660
    assert stat.S_ISFIFO(node(t, "run/fifo").st_mode)
    assert dict(node(t, "x").xattrs) == {"user.k": b"v", "security.selinux": b"s"}
    # Dir nlink = 2 + subdirs.
    assert root.nlink == 2 + 3 and node(t, "a").nlink == 3


def test_overlay_xattrs_from_layers_are_dropped_and_landmarks_hidden() -> None:
    l0 = (Layer().dir("d", xattrs=MappingProxyType({"trusted.overlay.redirect": b"/etc", "user.ok": b"1",
                                                     "user.overlay.opaque": b"y"}))
          .file(".prefetch.landmark", b"\x0f").file("sub/.prefetch.landmark", b"kept"))
    t = merged(l0)
    assert dict(node(t, "d").xattrs) == {"user.ok": b"1"}
    assert names(t, "") == ["d", "sub"] and names(t, "sub") == [".prefetch.landmark"]


def test_inodes_are_deterministic_and_dense() -> None:
    def make() -> MountTree:
        return build_tree([[Layer().dir("z").file("z/1", b"").file("a", b"").hardlink("b", "a").index()],
                           [Layer().file("q", b"").index()]])
    t1, t2 = make(), make()
    assert [(p, n.inode) for p, n in t1.walk()] == [(p, n.inode) for p, n in t2.walk()]
    assert sorted(t1.nodes) == list(range(1, len(t1) + 1))
    assert [p for p, _ in t1.walk()] == ["", "0", "0/a", "0/b", "0/z", "0/z/1", "1", "1/q"]
    assert node(t1, "0/a").inode == node(t1, "0/b").inode


def test_statistics_count_each_file_once() -> None:
    t = merged(Layer().file("a", b"12345").hardlink("b", "a").file("c", b"xy").symlink("s", "aaaa"))
    assert t.file_bytes == 7
    assert len(t) == 1 + 3  # root, a(=b), c, s


# -- subtrees -------------------------------------------------------------------------------


def test_subtree_whiteouts_become_overlay_char_devices() -> None:
    run0 = [Layer().file("gone", b"g").dir("d").file("d/x", b"").index()]
    run1 = [
        Layer().whiteout("gone").whiteout("d/x").file("mine", b"").whiteout("tmp").index(),
        Layer().file("tmp", b"recreated").whiteout("mine").index(),
    ]
    t = build_tree([run0, run1])
    assert names(t, "") == ["0", "1"]
    assert names(t, "0") == ["d", "gone"]  # run 0 is untouched by run 1
    assert names(t, "1") == ["d", "gone", "mine", "tmp"]
    for p in ("1/gone", "1/d/x", "1/mine"):
        wh = node(t, p)
        assert wh.whiteout and wh.type is EntryType.CHAR and (wh.dev_major, wh.dev_minor) == (0, 0)
        assert wh.st_mode == stat.S_IFCHR and wh.layer is not None
    tmp = node(t, "1/tmp")
    assert tmp.type is EntryType.REG and not tmp.whiteout and tmp.layer == 2
    assert not node(t, "1/d").opaque  # a plain dir merges with the lower runs' d


def test_subtree_opaque_rules() -> None:
    run1 = [
        Layer().dir("o").file("o/mine", b"").opaque("o")       # made opaque
        .whiteout("re")                                         # deleted ...
        .file("f2d", b"file")                                   # a file ...
        .dir("plain").file("plain/p", b"").index(),
        Layer().dir("re").file("re/new", b"")                   # ... and re-created as a dir
        .dir("f2d").file("f2d/in", b"")                         # ... replaced by a dir
        .file("gone/deep/x", b"").index(),                      # implied dirs
        Layer().whiteout("gone").file("gone/again", b"").index(),  # implied dir over a whiteout
    ]
    t = build_tree([[Layer().file("base", b"").index()], run1])
    for p in ("1/o", "1/re", "1/f2d", "1/gone"):
        d = node(t, p)
        assert d.is_dir and d.opaque and d.xattrs["trusted.overlay.opaque"] == b"y", p
    for p in ("1", "1/plain", "0"):
        assert not node(t, p).opaque and "trusted.overlay.opaque" not in node(t, p).xattrs, p
    assert names(t, "1/o") == ["mine"] and names(t, "1/re") == ["new"] and names(t, "1/gone") == ["again"]
    # Other xattr names, e.g. for an overlay mounted with userxattr.
    tu = build_tree([run1], opaque_xattrs=("user.overlay.opaque",))
    assert dict(node(tu, "0/o").xattrs) == {"user.overlay.opaque": b"y"}


def test_subtrees_false_needs_one_run() -> None:
    with pytest.raises(ValueError):
        build_tree([[], []], subtrees=False)


def test_entry_replacing_a_dir_within_one_layer() -> None:
    """tar order inside one layer: dir a, a/x, file a (replaces the dir), a/y (a is a dir again)."""
    l0 = Layer().dir("a", mode=0o700).file("a/x", b"x").file("a", b"file").file("a/y", b"y")
    t = merged(Layer().dir("a").file("a/lower", b""), l0)
    a = node(t, "a")
    assert a.is_dir and a.mode == 0o755 and a.entry is None and names(t, "a") == ["y"]
    ts = build_tree([[l0.index()]])
    assert node(ts, "0/a").opaque  # replaced a non-dir: lower runs' "a" must stay hidden


def test_bare_bottom_run_has_no_overlay_markers() -> None:
    """A run with nothing below it (run 0 of an all-remote image) must look right on its own,
    e.g. bind-mounted as a read-only view: whiteouts applied, no char 0:0 nodes, no opaque xattrs."""
    run0 = [
        Layer().file("gone", b"g").dir("o").file("o/old", b"").index(),
        Layer().whiteout("gone").whiteout("never").opaque("o").file("o/new", b"").index(),
    ]
    run1 = [Layer().whiteout("o").index()]
    t = build_tree([run0, run1], bare_runs=(0,))
    assert names(t, "0") == ["o"]
    assert names(t, "0/o") == ["new"]
    assert not node(t, "0/o").opaque and "trusted.overlay.opaque" not in node(t, "0/o").xattrs
    assert not any(n.whiteout for n in t.nodes.values() if t.path_of(n).startswith("0/"))
    # Run 1 still has something below it, so it keeps its markers.
    assert node(t, "1/o").whiteout


def test_directory_entries_are_in_byte_order_of_their_names() -> None:
    """readdir order is the names' bytes (UTF-8, with undecodable bytes as surrogate escapes),
    which differs from str order once a name holds an escaped byte and a character >= U+E000."""
    ascii_names = ["b", "a", "B", "_", "a0"]
    mixed = ["\ue000", "\udcff", "z", "\xe9"]  # UTF-8: ee 80 80 / ff / 7a / c3 a9
    layer = Layer().dir("ascii").dir("mixed")
    for n in ascii_names:
        layer = layer.file(f"ascii/{n}", b"")
    for n in mixed:
        layer = layer.file(f"mixed/{n}", b"")
    t = merged(layer)
    assert names(t, "ascii") == ["B", "_", "a", "a0", "b"]
    assert names(t, "mixed") == ["z", "\xe9", "\ue000", "\udcff"]
    assert sorted(mixed) != names(t, "mixed"), "the case that tells byte order from str order"


def test_the_built_tree_keeps_no_merge_tables_and_non_directories_take_no_children() -> None:
    """One Node per inode from merge to serving: the merge's child tables are dropped once the
    tree is built (they would hold a second table per directory for the mount's life), and the
    shared empty table of non-directories cannot be written by mistake."""
    l0 = Layer().dir("d").file("d/f", b"x").symlink("d/l", "f").hardlink("d/h", "d/f").whiteout("gone")
    l1 = Layer().dir("d/e").file("d/e/g", b"y").opaque("d")
    for tree in (merged(l0, l1), build_tree([[l0.index()], [l1.index()]], subtrees=True)):
        assert all(not n.kids for n in tree.nodes.values())
        assert {n.inode for n in tree.nodes.values()} == set(tree.nodes)
        file_node = next(n for n in tree.nodes.values() if n.type is EntryType.REG)
        with pytest.raises(TypeError):
            file_node.kids["x"] = file_node
