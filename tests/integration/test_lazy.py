"""The product, end to end: containerd pulls lazy images through `lazy`, no layer is downloaded,
containers run, and every file they see is the file an ordinary overlayfs pull would give.

Real containerd 1.6, the real registry, real /dev/fuse, ctr-remote for eStargz made by the
reference tool.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from integration import cri, images
from integration.lab import Lab, mount_processes
from snapshotter.formats.index_codec import load_index
from snapshotter.formats.metadata_parse import MetadataParse, parse_metadata
from snapshotter.remote.mounts import SPARE_LOG as SPARE_LOG_NAME

RICH_BIG = 6 * 1024 * 1024 + 12345  # several 4 MiB eStargz chunks, and an odd tail


def rich_layer() -> bytes:
    """A layer with what a plain busybox image lacks: owners, modes, xattrs, devices, a fifo,
    hard links across dirs, symlinks, empty and large files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        def add(name: str, kind: bytes, data: bytes = b"", **kw: object) -> None:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.mtime = 1_700_000_000
            info.mode = int(kw.pop("mode", 0o644))  # type: ignore[call-overload]
            for k, v in kw.items():
                setattr(info, k, v)
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tf.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("rich", tarfile.DIRTYPE, mode=0o755)
        add("rich/owned", tarfile.REGTYPE, b"owned by 1234:5678\n", uid=1234, gid=5678, mode=0o640)
        add("rich/setuid", tarfile.REGTYPE, b"#!/bin/sh\n", mode=0o4755)
        add("rich/xattr", tarfile.REGTYPE, b"xattrs\n",
            pax_headers={"SCHILY.xattr.user.comment": "lazy", "SCHILY.xattr.user.empty": ""})
        add("rich/empty", tarfile.REGTYPE, b"")
        add("rich/null", tarfile.CHRTYPE, mode=0o666, devmajor=1, devminor=3)
        add("rich/blk", tarfile.BLKTYPE, mode=0o600, devmajor=7, devminor=9)
        add("rich/fifo", tarfile.FIFOTYPE, mode=0o600)
        add("rich/sub", tarfile.DIRTYPE, mode=0o700, uid=42, gid=42)
        add("rich/sub/link-to-owned", tarfile.LNKTYPE, linkname="rich/owned", uid=1234, gid=5678, mode=0o640)
        add("rich/abs-symlink", tarfile.SYMTYPE, linkname="/etc/passwd", mode=0o777)
        add("rich/big.bin", tarfile.REGTYPE, images.deterministic_bytes(RICH_BIG, seed=7))
    return buf.getvalue()


@dataclass(frozen=True)
class Pushed:
    gzip_ref: str
    esgz_ref: str
    image: images.BuiltImage


@pytest.fixture(scope="module")
def pushed(lab: Lab) -> Pushed:
    layers, _expect = images.foundation_layers()
    img = images.build_image(lab.dir / "oci", "rich", [*layers, rich_layer()],
                             cmd=("/bin/sh", "-c", "cat /etc/layer3.txt"))
    gzip_ref = lab.push(img, "rich")
    esgz_ref = lab.push_converted(gzip_ref, f"{lab.registry_host}/rich:esgz")
    return Pushed(gzip_ref, esgz_ref, img)


# -- helpers ------------------------------------------------------------------------------------

_KV = re.compile(r'(\S+?)=("(?:[^"\\]|\\.)*"|\S+)')


def blob_gets(lab: Lab, repo: str) -> list[tuple[str, int, int]]:
    """(digest, status, bytes written) of every blob GET the registry logged for `repo`."""
    out = []
    for path in lab.logs_dir.glob("registry*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if 'msg="response completed' not in line:
                continue
            kv = {k: v.strip('"') for k, v in _KV.findall(line)}
            uri = kv.get("http.request.uri", "")
            if kv.get("http.request.method") == "GET" and uri.startswith(f"/v2/{repo}/blobs/"):
                out.append((uri.rsplit("/", 1)[1], int(kv.get("http.response.status", 0)),
                            int(kv.get("http.response.written", 0))))
    return out


def manifest_layers(lab: Lab, ref: str) -> list[dict[str, object]]:
    import json
    import urllib.request

    host, _, rest = ref.partition("/")
    repo, _, tag = rest.partition(":")
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{tag}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        layers: list[dict[str, object]] = json.load(r)["layers"]
    return layers


@dataclass(frozen=True)
class Facts:
    type: str
    mode: int
    uid: int
    gid: int
    size: int
    link: str
    rdev: int
    xattrs: tuple[tuple[str, bytes], ...]
    sha256: str | None


def tree_facts(root: Path) -> dict[str, Facts]:
    """Every path under root with type, mode, owner, size, link target, device, xattrs, sha256."""
    out: dict[str, Facts] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            xattrs = tuple(sorted((k, os.getxattr(p, k, follow_symlinks=False))
                                  for k in os.listxattr(p, follow_symlinks=False) if not k.startswith("trusted.")))
            sha = None
            if stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                sha = h.hexdigest()
            out[str(p.relative_to(root))] = Facts(
                {stat.S_IFDIR: "dir", stat.S_IFREG: "reg", stat.S_IFLNK: "symlink", stat.S_IFCHR: "char",
                 stat.S_IFBLK: "block", stat.S_IFIFO: "fifo"}.get(kind, str(kind)),
                stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size if stat.S_ISREG(st.st_mode) else 0,
                os.readlink(p) if stat.S_ISLNK(st.st_mode) else "", st.st_rdev, xattrs, sha)
    return out


def image_chain_id(lab: Lab, ref: str) -> str:
    """The chain id of the image's top layer, from its config's diff_ids (containerd's identity.ChainID)."""
    import json
    import urllib.request

    host, _, rest = ref.partition("/")
    repo, _, tag = rest.partition(":")
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{tag}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        config_digest = json.load(r)["config"]["digest"]
    with urllib.request.urlopen(f"http://{host}/v2/{repo}/blobs/{config_digest}", timeout=10) as r:
        diff_ids = json.load(r)["rootfs"]["diff_ids"]
    chain = diff_ids[0]
    for d in diff_ids[1:]:
        chain = "sha256:" + hashlib.sha256(f"{chain} {d}".encode()).hexdigest()
    return str(chain)


@pytest.fixture
def mounted(lab: Lab) -> Iterator[list[tuple[str, str, Path, str | None]]]:
    """Read-only views of images, mounted by hand; unmounted and removed afterwards."""
    done: list[tuple[str, str, Path, str | None]] = []
    yield done
    for key, snapshotter, target, namespace in done:
        subprocess.run(["umount", "-R", str(target)], check=False, timeout=30)
        lab.ctr("snapshots", "--snapshotter", snapshotter, "rm", key, namespace=namespace, check=False)


@contextlib.contextmanager
def daemon_config(lab: Lab, text: str) -> Iterator[None]:
    """Run the lab's daemon with config `text` inside the block, with the lab's own after it."""
    path = Path(tempfile.mkstemp(prefix="config-", suffix=".toml", dir=lab.dir)[1])
    path.write_text(text)
    old = lab.daemon_config
    lab.daemon_config = path
    lab.restart_daemon(signal.SIGTERM)
    try:
        yield
    finally:
        lab.daemon_config = old
        lab.restart_daemon(signal.SIGTERM)


def mount_image(lab: Lab, mounted: list[tuple[str, str, Path, str | None]], ref: str, snapshotter: str,
                namespace: str | None = None) -> Path:
    """Mount the pulled image `ref` from `snapshotter` as a container would see it (an active
    snapshot over the image, nothing written). Not `ctr images mount`: containerd 1.6's ctr ignores
    its --snapshotter flag there and always uses overlayfs; not `ctr snapshots view`: that sets no
    gc.root label, so containerd's garbage collector removes the view at once."""
    import json

    target = Path(tempfile.mkdtemp(prefix=f"view-{snapshotter}-", dir=lab.dir))
    key = f"view-{target.name}"
    out = lab.ctr("snapshots", "--snapshotter", snapshotter, "prepare", "--mounts", key, image_chain_id(lab, ref),
                  namespace=namespace).stdout
    (m,) = json.loads(out)
    if m["Type"] == "bind":  # a view over a single lower dir (e.g. one run of remote layers)
        cmd = ["mount", "--rbind", m["Source"], str(target)]
    else:
        assert m["Type"] == "overlay", m
        cmd = ["mount", "-t", "overlay", "overlay", "-o", ",".join(m["Options"]), str(target)]
    subprocess.run(cmd, check=True, timeout=30)
    mounted.append((key, snapshotter, target, namespace))
    return target


# -- tests --------------------------------------------------------------------------------------

def test_rpull_estargz_fetches_only_metadata_then_runs(lab: Lab, pushed: Pushed) -> None:
    layers = manifest_layers(lab, pushed.esgz_ref)
    sizes = {str(layer["digest"]): int(str(layer["size"])) for layer in layers}
    before = len(blob_gets(lab, "rich"))
    started = time.monotonic()
    lab.rpull(pushed.esgz_ref)
    pull_seconds = time.monotonic() - started
    during_pull = blob_gets(lab, "rich")[before:]
    layer_gets = [g for g in during_pull if g[0] in sizes]
    assert layer_gets, "the lazy pull should read footers and TOCs"
    assert all(status == 206 for _d, status, _n in layer_gets), f"whole-blob GETs during rpull: {layer_gets}"
    for digest, size in sizes.items():
        fetched = sum(n for d, _s, n in layer_gets if d == digest)
        assert fetched < size or size < 70_000, f"layer {digest}: fetched {fetched} of {size} bytes"
    log = lab.daemon_log()
    assert sum(f"layer={d}" in log and "event=lazy_prepare" in log for d in sizes) == len(sizes)
    # Every layer is a committed remote snapshot: nothing was unpacked.
    snaps = lab.ctr("snapshots", "--snapshotter", "lazy", "ls").stdout
    assert snaps.count("Committed") >= len(sizes)

    out = lab.ctr_run(pushed.esgz_ref, "lazy-run-1", "sh", "-c",
                      "cat /etc/layer1.txt /data/layer2.txt /etc/layer3.txt /rich/owned; "
                      "test ! -e /etc/doomed.txt && echo doomed-gone; ls /opaque").stdout
    assert "from layer 1, overwritten by layer 2" in out and "from layer 2" in out and "from layer 3" in out
    assert "owned by 1234:5678" in out and "doomed-gone" in out
    assert "lower-a.txt" not in out and "upper.txt" in out
    # The big files were never read, so their layers were never fetched whole.
    after_run = [g for g in blob_gets(lab, "rich")[before:] if g[0] in sizes]
    assert all(status == 206 for _d, status, _n in after_run)
    biggest = max(sizes, key=lambda d: sizes[d])
    assert sum(n for d, _s, n in after_run if d == biggest) < sizes[biggest] / 2
    print(f"rpull {pull_seconds:.2f}s, {len(layer_gets)} range requests during pull")


def test_lazy_tree_is_byte_identical_to_overlayfs(lab: Lab, pushed: Pushed,
                                                  mounted: list[tuple[str, str, Path, str | None]]) -> None:
    lab.rpull(pushed.esgz_ref)
    lab.pull(pushed.esgz_ref, snapshotter="overlayfs")
    lazy = tree_facts(mount_image(lab, mounted, pushed.esgz_ref, "lazy"))
    full = tree_facts(mount_image(lab, mounted, pushed.esgz_ref, "overlayfs"))
    # The TOC and the landmark are eStargz's own metadata entries: containerd's plain unpack writes
    # them out as files, the lazy mount (like stargz-snapshotter's) does not show them.
    assert set(full) - set(lazy) <= {"stargz.index.json", ".prefetch.landmark", ".no.prefetch.landmark"}
    assert set(lazy) <= set(full)
    diffs = {p: (lazy[p], full[p]) for p in lazy if lazy[p] != full[p]}
    assert not diffs, f"{len(diffs)} paths differ, e.g. {next(iter(diffs.items()))}"
    # The comparison covered what matters.
    assert full["rich/owned"].uid == 1234 and full["rich/xattr"].xattrs
    assert full["rich/null"].type == "char" and full["rich/fifo"].type == "fifo"
    assert full["rich/big.bin"].size == RICH_BIG
    assert "etc/doomed.txt" not in full and "opaque/lower-a.txt" not in full


def test_hard_links_share_an_inode_through_the_lazy_mount(lab: Lab, pushed: Pushed,
                                                          mounted: list[tuple[str, str, Path, str | None]]) -> None:
    lab.rpull(pushed.esgz_ref)
    root = mount_image(lab, mounted, pushed.esgz_ref, "lazy")
    a, b = os.lstat(root / "rich/owned"), os.lstat(root / "rich/sub/link-to-owned")
    assert a.st_ino == b.st_ino and a.st_nlink == 2


def test_plain_gzip_layers_fall_back_and_still_run(lab: Lab, pushed: Pushed) -> None:
    # A namespace of its own: no layer of this image is unpacked there yet, so every one is prepared.
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", pushed.gzip_ref, namespace="fallback")
    log = lab.daemon_log()
    for layer in pushed.image.layers:
        line = next((x for x in log.splitlines() if "event=fallback" in x and f"layer={layer.digest}" in x
                     and f"image={pushed.gzip_ref} " in x), None)
        assert line is not None, f"no fallback line for {layer.digest}"
        assert "level=warning" in line and "reason=not_lazy" in line and "seconds=" in line
    out = lab.ctr("run", "--rm", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir",
                  str(lab.dir / "fifo"), pushed.gzip_ref, "fallback-run", "sh", "-c", "cat /etc/layer3.txt",
                  namespace="fallback").stdout
    assert out == "from layer 3\n"


def test_cri_pull_is_lazy(lab: Lab, pushed: Pushed) -> None:
    digests = [str(layer["digest"]) for layer in manifest_layers(lab, pushed.esgz_ref)]
    cri.pull(lab.containerd_socket, pushed.esgz_ref)
    snaps = lab.ctr("snapshots", "--snapshotter", "lazy", "ls", namespace="k8s.io").stdout
    infos = [lab.ctr("snapshots", "--snapshotter", "lazy", "info", line.split()[0], namespace="k8s.io").stdout
             for line in snaps.splitlines()[1:] if line.strip()]
    remote = [i for i in infos if '"containerd.io/snapshot/remote": "estargz"' in i]
    assert len(remote) == len(digests), "every layer pulled through CRI should be a remote snapshot"
    assert all('"containerd.io/snapshot/cri.layer-digest"' in i for i in remote)


def _drop_page_cache() -> None:
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def test_container_keeps_reading_across_daemon_sigkill(lab: Lab, pushed: Pushed) -> None:
    lab.rpull(pushed.esgz_ref)
    expected = hashlib.sha256(images.deterministic_bytes(RICH_BIG, seed=7)).hexdigest()
    # Reads the big file in a loop for ~6 s, logging each checksum inside the container.
    script = "i=0; while [ $i -lt 120 ]; do sha256sum /rich/big.bin >> /loop.log; i=$((i+1)); sleep 0.05; done"
    lab.ctr_run(pushed.esgz_ref, "reader-loop", "sh", "-c", script, detach=True)
    try:
        time.sleep(1.0)
        lab.restart_daemon()  # SIGKILL: the mount process serving the container lives on
        for _ in range(5):
            _drop_page_cache()  # make the loop's next reads go through FUSE again
            time.sleep(0.5)
        out = lab.ctr_run(pushed.esgz_ref, "after-restart", "sha256sum", "/rich/big.bin").stdout
        assert out.split()[0] == expected, "a new container of the image works after the restart"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "RUNNING" in lab.ctr("tasks", "ls").stdout:
            time.sleep(0.2)
        mounts = lab.ctr("snapshots", "--snapshotter", "lazy", "mounts", "/x", "reader-loop").stdout
        upper = re.search(r"upperdir=([^,\s]+)", mounts)
        assert upper, mounts
        sums = Path(upper.group(1), "loop.log").read_text().split("\n")
        sums = [line.split()[0] for line in sums if line.strip()]
        assert len(sums) == 120, f"the loop stopped early: {len(sums)} reads"
        assert set(sums) == {expected}
    finally:
        lab.ctr("tasks", "kill", "-s", "SIGKILL", "reader-loop", check=False)
        time.sleep(0.5)
        lab.ctr("tasks", "delete", "reader-loop", check=False)
        lab.ctr("containers", "delete", "reader-loop", check=False)


def _fuse_mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1].startswith("fuse") and fields[4].startswith(prefix):
            found.append(fields[4])
    return found


def _spare_pids(mounts_dir: Path) -> list[int]:
    """Waiting spare mount processes of this lab's daemon (started in ROOT/mounts, `--spare`)."""
    return [pid for pid, argv, cwd in mount_processes() if b"--spare" in argv and cwd == str(mounts_dir)]


def _wait_for(what: str, probe: Callable[[], object], timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_a_big_file_read_once_is_read_from_disk_by_later_overlays(lab: Lab, pushed: Pushed,
                                                                  mounted: list[tuple[str, str, Path, str | None]]
                                                                  ) -> None:
    """Direct reads (fusefs/direct.py): once a big file has been read to its end through an
    overlay over the metadata image, the mount stores it whole in the cache and links it into its
    direct directory; an overlay mounted after that reads it (the same bytes) with no FUSE read."""
    ns = "direct"
    with daemon_config(lab, f"[cache]\ndirect_read_min_bytes = {1 << 20}\n"):
        others = set(_erofs_mounts_under(lab.snapshotter_root))
        lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", pushed.esgz_ref, namespace=ns)
        try:
            mount_image(lab, mounted, pushed.esgz_ref, "lazy", namespace=ns)  # starts the image's mount
            meta = Path(str(_wait_for("the metadata image to be mounted", lambda: [
                m for m in _erofs_mounts_under(lab.snapshotter_root) if m not in others], timeout=60)[0]))
            mount_dir = meta.parent
            direct = mount_dir / "direct"
            stats = mount_dir / "stats.json"

            def fuse_reads() -> int:
                return int(json.loads(stats.read_bytes())["fuse"]["ops"].get("read", {}).get("count", 0))

            first = mount_image(lab, mounted, pushed.esgz_ref, "lazy", namespace=ns)
            options = next(line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                           if f" {first} " in line)
            assert f"::{direct}::" in options, options
            expected = images.deterministic_bytes(RICH_BIG, seed=7)
            assert (first / "rich/big.bin").read_bytes() == expected  # through FUSE: nothing linked yet
            _wait_for("big.bin to be linked into the direct directory", lambda: list(direct.glob("*/rich/big.bin")))
            (link,) = direct.glob("*/rich/big.bin")
            assert link.read_bytes() == expected and link.stat().st_nlink == 2  # the cache's entry and this
            small = next(direct.rglob("owned"), None)
            assert small is None, "a small file was linked"
            Path("/proc/sys/vm/drop_caches").write_text("1\n")  # nothing of big.bin left in the page cache
            second = mount_image(lab, mounted, pushed.esgz_ref, "lazy", namespace=ns)
            time.sleep(1.2)  # the mount rewrites its stats file every second
            before = fuse_reads()
            assert (second / "rich/owned").read_text() == "owned by 1234:5678\n"  # a small file: through FUSE
            time.sleep(1.2)
            after_small = fuse_reads()
            assert after_small > before
            assert (second / "rich/big.bin").read_bytes() == expected
            time.sleep(1.2)
            assert fuse_reads() == after_small, "big.bin was read through the FUSE mount"
            assert json.loads(stats.read_bytes())["direct"]["files"] == 1
        finally:
            for key, sn, target, namespace in mounted:
                subprocess.run(["umount", "-R", str(target)], check=False, timeout=30)
                lab.ctr("snapshots", "--snapshotter", sn, "rm", key, namespace=namespace, check=False)
            mounted.clear()
            lab.ctr("images", "rm", "--sync", pushed.esgz_ref, namespace=ns, check=False)


def test_the_spare_mount_process_serves_the_next_image(lab: Lab, pushed: Pushed) -> None:
    """The process started ahead becomes the image's mount process (no Python start-up on the
    container's path), a new spare replaces it, and a daemon SIGKILL leaves both alone: the
    mount is adopted (recognised by its working directory) and the spare exits."""
    ns = "spare"
    mounts_dir = lab.snapshotter_root / "mounts"
    spare = _wait_for("a spare mount process", lambda: _spare_pids(mounts_dir))
    assert isinstance(spare, list) and len(spare) == 1, spare
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", pushed.esgz_ref, namespace=ns)
    base = ["run", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir", str(lab.dir / "fifo")]
    lab.ctr(*base, "-d", pushed.esgz_ref, "spare-keeper", "sleep", "60", namespace=ns)
    try:
        served = [int(p.read_text()) for p in mounts_dir.glob("*/pid")]
        assert spare[0] in served, f"the image is served by {served}, not by the spare {spare[0]}"
        mount_dir = next(p.parent for p in mounts_dir.glob("*/pid") if int(p.read_text()) == spare[0])
        assert os.readlink(f"/proc/{spare[0]}/cwd") == str(mount_dir)
        again = _wait_for("the next spare", lambda: _spare_pids(mounts_dir))
        assert isinstance(again, list) and again != spare

        log_at = len(lab.daemon_log())
        lab.restart_daemon()  # SIGKILL
        adopted = f"event=mount_adopted mount={mount_dir.name} pid={spare[0]}"
        _wait_for(adopted, lambda: adopted in lab.daemon_log()[log_at:])  # adoption runs off the start-up path
        _wait_for("the old spare to exit", lambda: not any(Path(f"/proc/{p}").exists() for p in again))
        out = lab.ctr(*base, "--rm", pushed.esgz_ref, "spare-second", "cat", "/etc/layer3.txt", namespace=ns).stdout
        assert out == "from layer 3\n"
        assert int((mount_dir / "pid").read_text()) == spare[0], "the adopted mount process kept serving"
    finally:
        lab.ctr("tasks", "kill", "-s", "SIGKILL", "spare-keeper", namespace=ns, check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "RUNNING" in lab.ctr("tasks", "ls", namespace=ns).stdout:
            time.sleep(0.1)
        lab.ctr("tasks", "delete", "spare-keeper", namespace=ns, check=False)
        lab.ctr("containers", "delete", "spare-keeper", namespace=ns, check=False)
        lab.ctr("images", "rm", "--sync", pushed.esgz_ref, namespace=ns, check=False)


def _remove_keeper(lab: Lab, keeper: str, ref: str, ns: str) -> None:
    """Kill and delete the container `keeper` (it kept an image's mount serving), then the image."""
    lab.ctr("tasks", "kill", "-s", "SIGKILL", keeper, namespace=ns, check=False)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "RUNNING" in lab.ctr("tasks", "ls", namespace=ns).stdout:
        time.sleep(0.1)
    lab.ctr("tasks", "delete", keeper, namespace=ns, check=False)
    lab.ctr("containers", "delete", keeper, namespace=ns, check=False)
    lab.ctr("images", "rm", "--sync", ref, namespace=ns, check=False)


def test_the_spare_parses_a_new_images_layers_while_the_daemon_does(lab: Lab) -> None:
    """Every layer of an image new to the daemon is handed to the spare as it is resolved; the
    spare parses them and builds the image's tree before it is handed the mount, which then
    serves from that tree (no index file loaded, no tree built on the container's path) and
    shows the image as an overlayfs pull would."""
    ns = "preload"
    mounts_dir = lab.snapshotter_root / "mounts"
    spare = _wait_for("a spare mount process", lambda: _spare_pids(mounts_dir))
    assert isinstance(spare, list)
    # Done with its start-up: preloads that queue up before then are skipped once its mount waits.
    _wait_for("the spare to wait", lambda: f"event=spare_waiting pid={spare[0]}" in
              (mounts_dir / SPARE_LOG_NAME).read_text(errors="replace"))
    unique = os.urandom(8).hex()  # new layer digests: nothing resolved before, so every layer is parsed
    img = images.build_image(lab.dir / "oci", f"preload-{unique}",
                             [[*images.busybox_entries(), images.File(f"etc/base-{unique}", b"base\n")],
                              [images.File("etc/top.txt", f"top {unique}\n".encode()),
                               images.Whiteout(f"etc/base-{unique}")]],
                             cmd=("/bin/sh",))
    ref = lab.push_converted(lab.push(img, "preload"), f"{lab.registry_host}/preload:esgz-{unique}")
    log_at = len(lab.daemon_log())
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", ref, namespace=ns)
    base = ["run", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir", str(lab.dir / "fifo")]
    lab.ctr(*base, "-d", ref, "preload-keeper", "sleep", "60", namespace=ns)  # keeps the mount (and its log)
    try:
        out = lab.ctr(*base, "--rm", ref, "preload-1", "sh", "-c", f"cat /etc/top.txt; ls /etc/base-{unique}",
                      namespace=ns, check=False)
        assert out.stdout.startswith(f"top {unique}\n") and "No such file" in out.stderr, (out.stdout, out.stderr)
        daemon_log = lab.daemon_log()[log_at:]
        prepared = re.findall(r"event=lazy_prepare .*?layer=(sha256:[0-9a-f]{64})", daemon_log)
        assert len(prepared) == 2, daemon_log[-2000:]
        started = re.search(r"event=mount_started mount=(\d+) pid=(\d+)", daemon_log)
        assert started is not None
        mount_log = (mounts_dir / SPARE_LOG_NAME).read_text() + "".join(
            p.read_text() for p in mounts_dir.glob("*/log"))
        for digest in prepared:  # each layer handed to the spare as it was resolved, parsed there,
            # and answered: the daemon stored its metadata bytes instead of parsing too; once the
            # mount is quiet, it writes the index it parsed beside them (remote/store.py)
            assert re.search(rf"event=preloaded layer={digest} .*answered=yes", mount_log), mount_log[-2000:]
            layer_dir = lab.snapshotter_root / "layers" / digest.removeprefix("sha256:")
            stored = _wait_for(f"the mount to write the index of {digest}",
                               lambda d=layer_dir: (d / "index.bin").exists() and d / "index.bin", timeout=30)
            assert isinstance(stored, Path)
            how = MetadataParse.from_doc(json.loads((layer_dir / "parse.json").read_bytes()))
            derived = parse_metadata(how, (layer_dir / "metadata.bin").read_bytes())
            assert load_index(stored.read_bytes()) == derived and derived.entries, stored
            assert (layer_dir / "cache-keys").exists()
        assert "event=spare_parse_declined" not in daemon_log, daemon_log[-2000:]
        assert not list((mounts_dir / "preload").iterdir()), "files left in the preload dir"
        assert "event=tree_built_ahead layers=2" in mount_log
        assert re.search(r"event=tree_built layers=2 .*prebuilt=true", mount_log), mount_log[-2000:]
    finally:
        _remove_keeper(lab, "preload-keeper", ref, ns)


def test_the_program_a_new_container_runs_is_fetched_when_containerd_creates_it(lab: Lab) -> None:
    """containerd's /containers/create event (remote/container_watch.py) makes the daemon read
    the container's spec and ask the image's mount to fetch its program, looked up in the
    spec's PATH through the image's symlinks (fusefs/program_prefetch.py): the mount fetches
    it from the registry, and the container runs as without."""
    ns = "program"
    mounts_dir = lab.snapshotter_root / "mounts"
    unique = os.urandom(8).hex()  # a program no earlier test cached
    tool = images.File(f"opt/tool-{unique}/busybox", images.BUSYBOX.read_bytes() + unique.encode(), 0o755)
    img = images.build_image(lab.dir / "oci", f"program-{unique}", [[*images.busybox_entries(), tool]],
                             cmd=("/bin/sh",))
    ref = lab.push_converted(lab.push(img, "program"), f"{lab.registry_host}/program:esgz-{unique}")
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", ref, namespace=ns)
    base = ["run", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir", str(lab.dir / "fifo")]
    log_at = len(lab.daemon_log())
    lab.ctr(*base, "-d", ref, "program-keeper", "sleep", "60", namespace=ns)  # keeps the mount (and its log)
    try:
        out = lab.ctr(*base, "--rm", ref, "program-1", f"/{tool.path}", "echo", "ran", namespace=ns)
        assert out.stdout == "ran\n", out
        daemon_log = lab.daemon_log()[log_at:]
        asked = {m.group(2): m.group(1) for m in re.finditer(
            rf"event=program_requested snapshotter=lazy container_snapshot={ns}/\d+/program-\S+ mount=(\d+) "
            r"program=(\S+) asked=yes", daemon_log)}
        assert set(asked) == {"sleep", f"/{tool.path}"}, daemon_log[-3000:]
        mount_log = mounts_dir / asked["sleep"] / "log"
        found = _wait_for("the mount to fetch the programs", lambda: len(re.findall(
            r"event=program_prefetch .*status=done", mount_log.read_text(errors="replace"))) == 2 and
            mount_log.read_text(errors="replace"), timeout=30)
        assert isinstance(found, str)
        # sleep: an applet, found in PATH through its symlink (bin/sleep -> busybox)
        assert re.search(r"event=program_prefetch name=sleep path=0/bin/busybox status=done", found), found
        fetched = re.search(rf"event=program_prefetch name=/{tool.path} path=0/{tool.path} status=done "
                            r"bytes=(\d+) requests=(\d+)", found)
        assert fetched is not None and int(fetched.group(1)) > 0 and int(fetched.group(2)) >= 1, found
    finally:
        _remove_keeper(lab, "program-keeper", ref, ns)


def test_mount_process_stops_with_the_last_container(lab: Lab, pushed: Pushed) -> None:
    # Other tests' images may still be mounted (pulled, never run: stopped after 60 s unused).
    others = set(_fuse_mounts_under(lab.snapshotter_root))
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", pushed.esgz_ref, namespace="unmount")
    base = ["run", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir", str(lab.dir / "fifo")]
    lab.ctr(*base, "-d", pushed.esgz_ref, "keeper", "sleep", "30", namespace="unmount")
    try:
        mounts = [m for m in _fuse_mounts_under(lab.snapshotter_root) if m not in others]
        assert len(mounts) == 1, "a running lazy container is served by one FUSE mount"
        out = lab.ctr(*base, "--rm", pushed.esgz_ref, "second", "cat", "/etc/layer3.txt", namespace="unmount").stdout
        assert out == "from layer 3\n"
        assert [m for m in _fuse_mounts_under(lab.snapshotter_root) if m not in others] == mounts, \
            "containers of one image share one mount"
    finally:
        lab.ctr("tasks", "kill", "-s", "SIGKILL", "keeper", namespace="unmount", check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "RUNNING" in lab.ctr("tasks", "ls", namespace="unmount").stdout:
            time.sleep(0.1)
        lab.ctr("tasks", "delete", "keeper", namespace="unmount", check=False)
        lab.ctr("containers", "delete", "keeper", namespace="unmount", check=False)
    lab.collect_garbage("unmount")  # containerd removes the snapshot from our backend in a GC pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and [m for m in _fuse_mounts_under(lab.snapshotter_root) if m in mounts]:
        time.sleep(0.2)
    remaining = [m for m in _fuse_mounts_under(lab.snapshotter_root) if m in mounts]
    if remaining:
        mount_id = Path(remaining[0]).parent.name
        ours = lab.ctr("snapshots", "--snapshotter", "lazy", "ls", namespace="unmount").stdout
        lines = [line for line in lab.daemon_log().splitlines() if f"mount={mount_id} " in line]
        pytest.fail(f"mount left after the image's last container went away: {remaining}\n"
                    f"containers: {lab.ctr('containers', 'ls', namespace='unmount').stdout}\n"
                    f"snapshots: {ours}\ndaemon log of mount {mount_id}:\n" + "\n".join(lines[-20:]))
    lab.ctr("images", "rm", "--sync", pushed.esgz_ref, namespace="unmount")
    assert not [m for m in _fuse_mounts_under(lab.snapshotter_root) if m in mounts]


@pytest.mark.parametrize("fmt", ["estargz", "nydus"])
def test_our_converted_images_run_lazily_with_the_source_tree(lab: Lab, pushed: Pushed, fmt: str,
                                                              mounted: list[tuple[str, str, Path, str | None]]) -> None:
    dst = f"{lab.registry_host}/rich-ours:{fmt}"
    lab.run([str(lab.snapshotter_bin), "convert", "--format", fmt, "--plain-http", pushed.gzip_ref, dst], timeout=300)
    digests = [str(layer["digest"]) for layer in manifest_layers(lab, dst)]
    ns = f"ours-{fmt}"
    before = len(blob_gets(lab, "rich-ours"))
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", dst, namespace=ns)
    log = lab.daemon_log()
    for d in digests:
        assert any("event=lazy_prepare" in x and f"layer={d}" in x for x in log.splitlines()), f"{d} not lazy"
    pulled = [g for g in blob_gets(lab, "rich-ours")[before:] if g[0] in digests]
    assert all(status == 206 for _d, status, _n in pulled) or fmt == "nydus", pulled
    base = ["run", "--rm", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir",
            str(lab.dir / "fifo")]
    out = lab.ctr(*base, dst, f"run-{fmt}", "sh", "-c", "cat /etc/layer3.txt /rich/owned; sha256sum /rich/big.bin",
                  namespace=ns).stdout
    expected_big = hashlib.sha256(images.deterministic_bytes(RICH_BIG, seed=7)).hexdigest()
    assert "from layer 3" in out and "owned by 1234:5678" in out and expected_big in out

    # The tree equals the source image's, as containerd's ordinary overlayfs pull unpacks it.
    lazy = tree_facts(mount_image(lab, mounted, dst, "lazy", namespace=ns))
    lab.pull(pushed.gzip_ref, snapshotter="overlayfs")
    full = tree_facts(mount_image(lab, mounted, pushed.gzip_ref, "overlayfs"))
    assert set(lazy) == set(full)
    diffs = {p: (lazy[p], full[p]) for p in full if lazy[p] != full[p]}
    assert not diffs, f"{len(diffs)} paths differ, e.g. {next(iter(diffs.items()))}"


def _erofs_mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    return [f[4] for f in (line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines())
            if f[f.index("-") + 1] == "erofs" and f[4].startswith(prefix)]


def test_later_containers_get_metadata_from_the_kernel(lab: Lab, pushed: Pushed,
                                                      mounted: list[tuple[str, str, Path, str | None]]) -> None:
    """Once an image's mount serves, its metadata image is built and mounted; the next snapshot
    over the image is an overlay of it over the FUSE mount (data-only), shows the tree an
    overlayfs pull shows, and its stats and listings make no FUSE request."""
    ns = "metaimage"
    others = set(_erofs_mounts_under(lab.snapshotter_root))
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", pushed.esgz_ref, namespace=ns)
    lab.pull(pushed.esgz_ref, snapshotter="overlayfs")
    base = ["run", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir", str(lab.dir / "fifo")]
    # The first container starts before the image is built; its mount stops with it, the image stays.
    out = lab.ctr(*base, "--rm", pushed.esgz_ref, "meta-first", "cat", "/etc/layer3.txt", namespace=ns).stdout
    assert out == "from layer 3\n"
    hexes = [str(layer["digest"]).split(":")[1] for layer in manifest_layers(lab, pushed.esgz_ref)]

    def built() -> bool:  # a metadata image of this image's layers (an earlier test may have built it)
        for sources in (lab.snapshotter_root / "metaimages").glob("*.sources.json"):
            text = sources.read_text()
            if all(h in text for h in hexes) and sources.with_name(sources.name.replace(".sources.json",
                                                                                        ".erofs")).exists():
                return True
        return False

    _wait_for("the metadata image to be built", built)

    def fuse_requests() -> int:
        ops = json.loads(stats.read_bytes())["fuse"]["ops"]
        return sum(int(op["count"]) for op in ops.values())

    try:
        view = mount_image(lab, mounted, pushed.esgz_ref, "lazy", namespace=ns)
        (meta,) = [m for m in _erofs_mounts_under(lab.snapshotter_root) if m not in others]
        stats = Path(meta).parent / "stats.json"
        options = next(line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f" {view} " in line)
        assert "metacopy=on" in options and f"{meta}/0" in options, options
        doc = json.loads(subprocess.run([sys.executable, "-m", "snapshotter.cli", "status", "--json", "--address",
                                         str(lab.snapshotter_socket)], capture_output=True, text=True, timeout=30,
                                        check=True).stdout)
        assert {m["id"]: m["metadata_image"] for m in doc["mounts"]}[Path(meta).parent.name] is True
        time.sleep(1.2)  # the mount rewrites its stats file every second
        before = fuse_requests()
        names = [os.path.join(d, n) for d, ds, fs in os.walk(view) for n in ds + fs]
        for p in names:
            os.lstat(p)
        time.sleep(1.2)
        assert fuse_requests() == before, "a walk with a stat of every name reached the FUSE mount"
        lazy = tree_facts(view)
        full_root = mount_image(lab, mounted, pushed.esgz_ref, "overlayfs")
        full = tree_facts(full_root)
        assert set(full) - set(lazy) <= {"stargz.index.json", ".prefetch.landmark", ".no.prefetch.landmark"}
        diffs = {p: (lazy[p], full[p]) for p in lazy if lazy[p] != full[p]}
        assert not diffs, f"{len(diffs)} paths differ, e.g. {next(iter(diffs.items()))}"
        assert lazy["rich/big.bin"].size == RICH_BIG and lazy["rich/owned"].uid == 1234
        # A container started now runs over it; a chmod and a write go to its own upper dir.
        out = lab.ctr(*base, "--rm", pushed.esgz_ref, "meta-second", "sh", "-c",
                      "cat /etc/layer3.txt; chmod 600 /etc/layer1.txt; stat -c %a /etc/layer1.txt; "
                      "cat /etc/layer1.txt; echo new >> /data/layer2.txt; tail -n 1 /data/layer2.txt",
                      namespace=ns).stdout
        layer1 = (full_root / "etc/layer1.txt").read_text()
        assert out == f"from layer 3\n600\n{layer1}new\n", out
    finally:
        for key, sn, target, namespace in mounted:  # the views hold snapshots over the image
            subprocess.run(["umount", "-R", str(target)], check=False, timeout=30)
            lab.ctr("snapshots", "--snapshotter", sn, "rm", key, namespace=namespace, check=False)
        mounted.clear()
    lab.ctr("images", "rm", "--sync", pushed.esgz_ref, namespace=ns)
    _wait_for("the metadata image to be unmounted with its mount",
              lambda: meta not in _erofs_mounts_under(lab.snapshotter_root), timeout=90)
