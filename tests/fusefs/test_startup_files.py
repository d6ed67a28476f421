"""fusefs/startup_files.py: which files a container start reads, found through the image's symlinks."""

from __future__ import annotations

from snapshotter.formats.index import EntryType
from snapshotter.fusefs.startup_files import layer_startup_entries, startup_files
from snapshotter.fusefs.tree import MountTree, build_tree
from tests.fusefs.layers import Layer

LIBDIR = "usr/lib/x86_64-linux-gnu"


def _debian(layer: Layer | None = None) -> Layer:
    """Debian 12's merged /usr: /lib64 -> usr/lib64, whose loader links into /lib/x86_64-linux-gnu."""
    return ((layer or Layer()).dir("etc").file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n")
            .file("etc/group", b"root:x:0:\n").file("etc/ld.so.cache", b"cache")
            .file("etc/hostname", b"not read by every start\n")
            .dir("usr").dir("usr/lib").dir(LIBDIR).dir("usr/lib64")
            .symlink("lib", "usr/lib").symlink("lib64", "usr/lib64")
            .file(f"{LIBDIR}/ld-linux-x86-64.so.2", b"\x7fELF loader", mode=0o755)
            .file(f"{LIBDIR}/libc.so.6", b"\x7fELF libc", mode=0o755)
            .file(f"{LIBDIR}/libm.so.6", b"\x7fELF libm", mode=0o755)
            .symlink("usr/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"))


def _paths(tree: MountTree) -> dict[int, list[str]]:
    return {layer: [tree.path_of(n) for n in nodes] for layer, nodes in startup_files(tree).items()}


def test_a_merged_usr_image_gives_user_database_loader_cache_and_libc() -> None:
    tree = build_tree([[_debian().index()]], subtrees=False)
    assert _paths(tree) == {0: ["etc/passwd", "etc/group", "etc/ld.so.cache", f"{LIBDIR}/ld-linux-x86-64.so.2",
                                f"{LIBDIR}/libc.so.6"]}
    assert all(n.type is EntryType.REG for nodes in startup_files(tree).values() for n in nodes)


def test_each_file_comes_from_the_layer_that_serves_it() -> None:
    # A later layer that adds a user replaces /etc/passwd; the loader and libc stay below.
    upper = Layer().dir("etc").file("etc/passwd", b"root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/app:/bin/sh\n")
    tree = build_tree([[_debian().index(), upper.index()]], subtrees=False)
    found = _paths(tree)
    assert found[1] == ["etc/passwd"]
    assert "etc/passwd" not in found[0] and f"{LIBDIR}/libc.so.6" in found[0]


def test_musl_loader_is_its_own_c_library() -> None:
    alpine = (Layer().dir("etc").file("etc/passwd", b"root:x:0:0\n").dir("lib")
              .file("lib/ld-musl-x86_64.so.1", b"\x7fELF musl", mode=0o755)
              .symlink("lib/libc.musl-x86_64.so.1", "ld-musl-x86_64.so.1"))
    tree = build_tree([[alpine.index()]], subtrees=False)
    assert _paths(tree) == {0: ["etc/passwd", "lib/ld-musl-x86_64.so.1"]}


def test_an_image_without_them_gives_nothing_and_loops_or_dangling_links_are_skipped() -> None:
    odd = (Layer().dir("etc").symlink("etc/passwd", "/etc/passwd").symlink("etc/group", "missing")
           .dir("etc/ld.so.cache").symlink("lib64", "lib64/..").dir("lib")
           .symlink("lib/ld-linux-aarch64.so.1", "/nowhere/ld.so"))
    assert startup_files(build_tree([[odd.index()]], subtrees=False)) == {}
    assert startup_files(build_tree([[Layer().file("app", b"static binary").index()]], subtrees=False)) == {}


def test_with_subtrees_the_topmost_run_holding_a_path_wins_and_a_whiteout_hides_lower_runs() -> None:
    # Run 1 deletes /etc/group (an overlay whiteout in its subtree) and replaces /etc/passwd.
    upper = Layer().dir("etc").file("etc/passwd", b"root:x:0:0\n").whiteout("etc/group")
    tree = build_tree([[_debian().index()], [upper.index()]], subtrees=True)
    found = _paths(tree)
    assert found[1] == ["1/etc/passwd"]
    assert found[0] == ["0/etc/ld.so.cache", f"0/{LIBDIR}/ld-linux-x86-64.so.2", f"0/{LIBDIR}/libc.so.6"]


# -- one layer by its own names (the spare's early prefetch, before any tree exists) ----------------

def _names(layer: Layer) -> list[str]:
    return [e.name for e in layer_startup_entries(layer.index())]


def test_one_layer_alone_gives_what_its_single_layer_tree_gives() -> None:
    for layer in (_debian(), Layer().dir("etc").file("etc/passwd", b"root:x:0:0\n").dir("lib")
                  .file("lib/ld-musl-x86_64.so.1", b"\x7fELF musl", mode=0o755)):
        tree = build_tree([[layer.index()]], subtrees=False)
        assert _names(layer) == [p for paths in _paths(tree).values() for p in paths]
    assert _names(_debian()) == ["etc/passwd", "etc/group", "etc/ld.so.cache", f"{LIBDIR}/ld-linux-x86-64.so.2",
                                 f"{LIBDIR}/libc.so.6"]


def test_one_layer_follows_hard_links_and_directories_its_toc_does_not_list() -> None:
    # No directory entries at all (a TOC need not list them); /etc/group is a hard link of
    # /etc/passwd, so one file.
    bare = (Layer().file("etc/passwd", b"root:x:0:0\n").hardlink("etc/group", "etc/passwd")
            .file("lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", b"\x7fELF", mode=0o755)
            .file("lib/x86_64-linux-gnu/libc.so.6", b"\x7fELF libc", mode=0o755)
            .symlink("lib64", "lib/x86_64-linux-gnu"))
    assert _names(bare) == ["etc/passwd", "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
                            "lib/x86_64-linux-gnu/libc.so.6"]


def test_one_layer_without_them_or_with_broken_links_gives_nothing() -> None:
    odd = (Layer().dir("etc").symlink("etc/passwd", "/etc/passwd").symlink("etc/group", "missing")
           .dir("etc/ld.so.cache").symlink("lib64", "lib64/..").dir("lib")
           .symlink("lib/ld-linux-aarch64.so.1", "/nowhere/ld.so"))
    assert _names(odd) == []
    assert _names(Layer().file("app", b"static binary")) == []
    # An upper layer holding only a new /etc/passwd gives just that (the merged tree decides the rest).
    assert _names(Layer().dir("etc").file("etc/passwd", b"root:x:0:0\n")) == ["etc/passwd"]
