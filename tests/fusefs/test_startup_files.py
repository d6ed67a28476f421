"""fusefs/startup_files.py: which files a container start reads, found through the image's symlinks."""

from __future__ import annotations

from snapshotter.formats.index import EntryType
from snapshotter.fusefs.startup_files import layer_startup_entries, program_file, startup_files, startup_files_first
from snapshotter.fusefs.tree import MountTree, build_tree
from snapshotter.runtime_spec import DEFAULT_PATH, Program
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


def _program(tree: MountTree, name: str, path: tuple[str, ...] = DEFAULT_PATH, cwd: str = "/") -> str | None:
    node = program_file(tree, Program(name, path, cwd).candidates())
    return tree.path_of(node) if node is not None else None


def test_a_containers_program_is_found_as_runc_looks_it_up() -> None:
    """PATH order, symlinks followed (merged /usr: /bin -> usr/bin), a name with a slash taken as
    it is (relative to cwd), no execute bit or a directory in the way: the next PATH entry."""
    image = (_debian().dir("usr/bin").symlink("bin", "usr/bin").dir("usr/local").dir("usr/local/bin")
             .file("usr/bin/true", b"\x7fELF true", mode=0o755)
             .file("usr/local/bin/true", b"not executable", mode=0o644)
             .dir("usr/local/sbin").dir("usr/local/sbin/true")
             .file("usr/bin/python3.11", b"\x7fELF python", mode=0o755)
             .symlink("usr/bin/python3", "python3.11")
             .dir("app").file("app/run.sh", b"#!/bin/sh\n", mode=0o755))
    tree = build_tree([[image.index()]], subtrees=True, bare_runs=(0,))
    assert _program(tree, "true") == "0/usr/bin/true"
    assert _program(tree, "python3") == "0/usr/bin/python3.11"
    assert _program(tree, "/bin/true") == "0/usr/bin/true"
    assert _program(tree, "./run.sh", cwd="/app") == "0/app/run.sh"
    assert _program(tree, "../app/run.sh", cwd="/usr") == "0/app/run.sh"
    assert _program(tree, "true", path=("/usr/local/bin",)) is None  # there, but not executable
    assert _program(tree, "missing") is None


def test_an_upper_runs_entry_hides_the_lower_runs_program() -> None:
    """Across runs (subtrees), the topmost run holding the name decides: a whiteout there hides
    the program below, and the lookup goes on in the next PATH directory."""
    base = _debian().dir("usr/bin").dir("bin").file("usr/bin/tool", b"\x7fELF v1", mode=0o755) \
        .file("bin/tool", b"\x7fELF in /bin", mode=0o755)
    top = Layer().dir("usr").dir("usr/bin").whiteout("usr/bin/tool")
    tree = build_tree([[base.index()], [top.index()]], subtrees=True, bare_runs=(0,))
    assert _program(tree, "tool") == "0/bin/tool"
    replaced = Layer().dir("usr").dir("usr/bin").file("usr/bin/tool", b"\x7fELF v2", mode=0o755)
    tree = build_tree([[base.index()], [replaced.index()]], subtrees=True, bare_runs=(0,))
    assert _program(tree, "tool") == "1/usr/bin/tool"


def test_a_recorded_profile_is_reordered_with_its_start_up_files_first() -> None:
    # As `snapshotter record` lists a python start: runc's user database, then the program (exec
    # reads it before its loader), the loader, its cache, libc, then the program's own files.
    recorded = ["etc/group", "etc/passwd", "usr/bin/python3.11", f"{LIBDIR}/ld-linux-x86-64.so.2",
                "etc/ld.so.cache", f"{LIBDIR}/libc.so.6", f"{LIBDIR}/libm.so.6", "usr/lib/python3.11/os.py",
                "lib/ld-musl-x86_64.so.1", "etc/hostname", "opt/libc.so.6.bak"]
    assert startup_files_first(recorded) == [
        "etc/group", "etc/passwd", f"{LIBDIR}/ld-linux-x86-64.so.2", "etc/ld.so.cache", f"{LIBDIR}/libc.so.6",
        "lib/ld-musl-x86_64.so.1",
        "usr/bin/python3.11", f"{LIBDIR}/libm.so.6", "usr/lib/python3.11/os.py", "etc/hostname",
        "opt/libc.so.6.bak"]
    assert startup_files_first(["b", "a"]) == ["b", "a"]
    assert startup_files_first([]) == []
