"""Foundation: containerd pulls, unpacks and runs a multi-layer image through our snapshotter.

Real containerd 1.6, runc, the distribution registry and our daemon, all from the session lab.
The image (integration/images.py) has four layers: busybox + /etc files; files, a hard link and a
symlink; a whiteout and an opaque dir; a few-MB file. Tests run in file order and share one pull;
test_rm_* removes the whole chain and pulls again; the CRI test works in containerd's `k8s.io`
namespace. `LAZYLAB_SNAPSHOTTER=overlayfs` runs the same assertions on containerd's overlayfs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integration import cri
from integration.images import BuiltImage, FoundationExpect
from integration.lab import Lab, LabError, mounts_under, wait_until

TOUCH_LABEL = "containerd.io/snapshot/lazytest.mark"


def chain_ids(diff_ids: list[str]) -> list[str]:
    """OCI ChainIDs: chain[0] = diff[0]; chain[i] = sha256(chain[i-1] + " " + diff[i])."""
    chain = [diff_ids[0]]
    for d in diff_ids[1:]:
        chain.append("sha256:" + hashlib.sha256(f"{chain[-1]} {d}".encode()).hexdigest())
    return chain


@dataclass(frozen=True)
class Pulled:
    ref: str
    image: BuiltImage
    expect: FoundationExpect
    chain: list[str]  # ChainIDs = committed snapshot names, bottom first


class Snap:
    """`ctr snapshots --snapshotter NAME ...` for one lab."""

    def __init__(self, lab: Lab, name: str, namespace: str | None = None) -> None:
        self.lab, self.name, self.namespace = lab, name, namespace

    def __call__(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.lab.ctr(
            "snapshots", "--snapshotter", self.name, *args, namespace=self.namespace, check=check, timeout=timeout
        )

    def ls(self) -> dict[str, tuple[str, str]]:
        """key -> (parent or "", kind)."""
        rows: dict[str, tuple[str, str]] = {}
        for line in self("ls").stdout.splitlines()[1:]:
            f = line.split()
            if len(f) == 3:
                rows[f[0]] = (f[1], f[2])
            elif len(f) == 2:
                rows[f[0]] = ("", f[1])
        return rows

    def info(self, key: str) -> dict[str, object]:
        info: dict[str, object] = json.loads(self("info", key).stdout)
        return info

    def usage(self, key: str) -> tuple[int, int]:
        """(size in bytes, as ctr rounds it; inodes)."""
        lines = self("usage", key).stdout.splitlines()
        assert len(lines) == 2, lines
        m = re.fullmatch(r"(\S+)\s+([\d.]+) (B|KiB|MiB|GiB)\s+(\d+)\s*", lines[1])
        assert m and m.group(1) == key, lines
        unit = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(3)]
        return int(float(m.group(2)) * unit), int(m.group(4))

    def prepare_mounts(self, key: str, parent: str, *, view: bool = False) -> list[dict[str, Any]]:
        out = self("view" if view else "prepare", "--mounts", key, parent).stdout
        mounts: list[dict[str, Any]] = json.loads(out)
        return mounts


def mount_all(lab: Lab, mounts: list[dict[str, Any]], target: Path) -> None:
    """Mount a snapshot's mount list at `target` the way containerd would (one mount expected)."""
    assert len(mounts) == 1, mounts
    m = mounts[0]
    target.mkdir(parents=True, exist_ok=True)
    options = [str(o) for o in (m.get("options") or m.get("Options") or [])]
    mtype = str(m.get("type") or m.get("Type"))
    source = str(m.get("source") or m.get("Source"))
    argv = ["mount"]
    if mtype != "bind" and not {"bind", "rbind"} & set(options):
        argv += ["-t", mtype]
    if options:
        argv += ["-o", ",".join(options)]
    lab.run([*argv, source, str(target)], timeout=30)


def umount(lab: Lab, target: Path) -> None:
    lab.run(["umount", str(target)], timeout=30)
    assert not mounts_under(target)


@pytest.fixture(scope="module")
def snap(lab: Lab, snapshotter_name: str) -> Snap:
    return Snap(lab, snapshotter_name)


@pytest.fixture(scope="module")
def pulled(lab: Lab, snapshotter_name: str) -> Pulled:
    image = lab.foundation_image()
    assert image.expect is not None
    ref = lab.push(image, "foundation")
    lab.pull(ref, snapshotter=snapshotter_name)
    return Pulled(ref, image, image.expect, chain_ids([layer.diff_id for layer in image.layers]))


@pytest.fixture
def scratch(lab: Lab) -> Iterator[Path]:
    """A mount-point dir under the lab; anything left mounted there is unmounted afterwards."""
    d = lab.dir / "mnt" / uuid.uuid4().hex[:8]
    d.mkdir(parents=True)
    try:
        yield d
    finally:
        for mp in mounts_under(d):
            subprocess.run(["umount", "-l", mp], timeout=30, check=False)


def test_proxy_and_cri_plugins_load(lab: Lab, snapshotter_name: str) -> None:
    rows = [line.split() for line in lab.ctr("plugins", "ls").stdout.splitlines()[1:]]
    status = {(r[0], r[1]): r[-1] for r in rows if len(r) >= 3}
    assert status[("io.containerd.snapshotter.v1", "lazy")] == "ok"
    assert status[("io.containerd.grpc.v1", "cri")] == "ok"
    assert status[("io.containerd.snapshotter.v1", snapshotter_name)] == "ok"


def test_pull_commits_one_snapshot_per_layer(lab: Lab, snap: Snap, pulled: Pulled) -> None:
    images = lab.ctr("images", "ls").stdout
    assert pulled.ref in images and pulled.image.manifest_digest in images
    rows = snap.ls()
    committed = {k: v for k, v in rows.items() if v[1] == "Committed"}
    assert set(committed) == set(pulled.chain)
    for i, key in enumerate(pulled.chain):
        assert committed[key][0] == (pulled.chain[i - 1] if i else "")
    assert not [k for k, v in rows.items() if v[1] != "Committed"], rows


def test_run_sees_every_layer_whiteouts_and_opaque_dirs(lab: Lab, snapshotter_name: str, pulled: Pulled) -> None:
    e = pulled.expect
    script = "\n".join(
        [
            *(f'echo "file {p}=$(cat {p})"' for p in e.texts),
            f'echo "sym=$(readlink {e.symlink[0]})"',
            f'echo "symread=$(cat {e.symlink[0]})"',
            f'echo "hardino=$(stat -c %i {e.hardlink[0]}) $(stat -c %i {e.hardlink[1]})"',
            f'echo "hardnlink=$(stat -c %h {e.hardlink[1]})"',
            f'echo "hardread=$(cat {e.hardlink[0]})"',
            f"if [ -e {e.deleted} ]; then echo deleted=present; else echo deleted=absent; fi",
            *(
                f'if [ -e {p} ]; then echo "lower {p}=present"; else echo "lower {p}=absent"; fi'
                for p in e.opaque_lower
            ),
            f'echo "opaque=$(ls -A {e.opaque_dir} | tr "\\n" " ")"',
            "echo \"whiteouts=$(find / -xdev -name '.wh.*' | wc -l)\"",
            f'echo "big=$(stat -c %s {e.big_file}) $(sha256sum {e.big_file} | cut -d" " -f1)"',
            "echo done",
        ]
    )
    cid = f"fnd-run-{uuid.uuid4().hex[:8]}"
    r = lab.ctr_run(pulled.ref, cid, "sh", "-c", script, snapshotter=snapshotter_name)
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    for path, text in e.texts.items():
        assert out[f"file {path}"] == text.rstrip("\n"), path
    assert out["sym"] == e.symlink[1]
    assert out["symread"] == e.texts[e.hardlink[1]].rstrip("\n")
    ino_link, ino_target = out["hardino"].split()
    assert ino_link == ino_target
    assert out["hardnlink"] == "2"
    assert out["hardread"] == e.texts[e.hardlink[1]].rstrip("\n")
    assert out["deleted"] == "absent"
    for p in e.opaque_lower:
        assert out[f"lower {p}"] == "absent"
    assert out["opaque"].split() == sorted(e.opaque_upper)
    assert out["whiteouts"] == "0"
    assert out["big"] == f"{e.big_size} {e.big_sha256}"
    assert r.stdout.splitlines()[-1] == "done"


def test_container_writes_stay_in_its_own_snapshot(lab: Lab, snap: Snap, snapshotter_name: str, pulled: Pulled) -> None:
    def run(script: str) -> str:
        cid = f"fnd-w-{uuid.uuid4().hex[:8]}"
        return lab.ctr_run(pulled.ref, cid, "sh", "-c", script, snapshotter=snapshotter_name).stdout

    first = run(
        "echo changed > /etc/layer3.txt && rm /data/layer2.txt && echo new > /new.txt && "
        "cat /etc/layer3.txt /new.txt && ls /data"
    )
    assert first.split() == ["changed", "new", "layer2-hard.txt", "layer2-sym"]
    second = run("cat /etc/layer3.txt; cat /data/layer2.txt; [ -e /new.txt ] && echo leaked || echo clean")
    assert second.splitlines() == ["from layer 3", "from layer 2", "clean"]
    # --rm removed the containers' active snapshots; the image's chain is untouched.
    assert set(snap.ls()) == set(pulled.chain)


def test_info_reports_kind_parent_and_labels(snap: Snap, pulled: Pulled) -> None:
    for i, key in enumerate(pulled.chain):
        info = snap.info(key)
        assert info["Kind"] == "Committed"
        assert info["Name"] == key
        assert info.get("Parent", "") == (pulled.chain[i - 1] if i else "")
    top = pulled.chain[-1]
    # Labels under containerd.io/snapshot/ are passed through to the snapshotter's Update.
    snap("label", top, f"{TOUCH_LABEL}=foundation")
    labels = snap.info(top).get("Labels") or {}
    assert isinstance(labels, dict) and labels.get(TOUCH_LABEL) == "foundation"
    snap("label", top, f"{TOUCH_LABEL}=")
    labels = snap.info(top).get("Labels") or {}
    assert isinstance(labels, dict) and TOUCH_LABEL not in labels
    missing = snap("info", "no-such-snapshot", check=False)
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_usage_is_nonzero_for_unpacked_layers(snap: Snap, pulled: Pulled) -> None:
    sizes = {key: snap.usage(key) for key in pulled.chain}
    for key, (size, inodes) in sizes.items():
        assert size > 0 and inodes > 0, (key, size, inodes)
    busybox_size = Path("/bin/busybox").stat().st_size
    assert sizes[pulled.chain[0]][0] >= busybox_size * 0.9  # ctr prints one decimal of MiB
    assert sizes[pulled.chain[-1]][0] >= pulled.expect.big_size * 0.9
    table = snap("usage").stdout
    assert all(key in table for key in pulled.chain)


def test_prepare_mount_commit_view(lab: Lab, snap: Snap, pulled: Pulled, scratch: Path) -> None:
    top = pulled.chain[-1]
    active, committed, view = (f"fnd-{n}-{uuid.uuid4().hex[:6]}" for n in ("active", "committed", "view"))
    mounts = snap.prepare_mounts(active, top)
    rows = snap.ls()
    assert rows[active] == (top, "Active")

    rw = scratch / "rw"
    mount_all(lab, mounts, rw)
    try:
        assert (rw / "etc/layer3.txt").read_text() == "from layer 3\n"
        assert not (rw / "etc/doomed.txt").exists()
        (rw / "committed.txt").write_text("written in an active snapshot\n")
        (rw / "etc/layer1.txt").unlink()
    finally:
        umount(lab, rw)

    snap("commit", committed, active)
    rows = snap.ls()
    assert active not in rows
    assert rows[committed] == (top, "Committed")
    info = snap.info(committed)
    assert info["Kind"] == "Committed" and info["Parent"] == top
    size, inodes = snap.usage(committed)
    assert size > 0 and inodes > 0

    ro = scratch / "ro"
    mount_all(lab, snap.prepare_mounts(view, committed, view=True), ro)
    try:
        assert (ro / "committed.txt").read_text() == "written in an active snapshot\n"
        assert not (ro / "etc/layer1.txt").exists()
        assert (ro / "data/layer2.txt").read_text() == "from layer 2\n"
        with pytest.raises(OSError):
            (ro / "nope.txt").write_text("read-only")
    finally:
        umount(lab, ro)
    assert snap.ls()[view] == (committed, "View")

    snap("rm", view)
    snap("rm", committed)
    assert set(snap.ls()) == set(pulled.chain)


def test_rm_refuses_parents_and_removes_leaves(lab: Lab, snap: Snap, snapshotter_name: str, pulled: Pulled) -> None:
    leaf = f"fnd-leaf-{uuid.uuid4().hex[:6]}"
    snap("prepare", leaf, pulled.chain[-1])
    refused = snap("rm", pulled.chain[-1], check=False)
    assert refused.returncode != 0 and "child" in refused.stderr, refused.stderr
    assert pulled.chain[-1] in snap.ls()

    snap("rm", leaf)
    assert leaf not in snap.ls()
    gone = snap("info", leaf, check=False)
    assert gone.returncode != 0 and "not found" in gone.stderr
    wait_backend_removed(lab, snapshotter_name, [leaf])

    # Removing the image's top snapshot leaves its parents unreferenced: containerd's GC walks the
    # snapshotter and removes them, children first, through the snapshotter's Walk and Remove.
    snap("rm", pulled.chain[-1])
    wait_until("the chain to be garbage collected", lambda: snap.ls() == {}, timeout=30)
    wait_backend_removed(lab, snapshotter_name, pulled.chain)

    # A fresh pull unpacks the chain again from the local content store.
    lab.pull(pulled.ref, snapshotter=snapshotter_name)
    assert set(snap.ls()) == set(pulled.chain)
    with pytest.raises(LabError, match="child"):
        snap("rm", pulled.chain[0])


def wait_backend_removed(
    lab: Lab, snapshotter_name: str, names: list[str], *, namespace: str | None = None, timeout: float = 30
) -> None:
    """Wait until containerd logged a successful backend Remove (its GC's `removed snapshot`) of each.

    containerd's metadata layer drops a snapshot from its own db at once and calls the backend's
    Remove later, from the GC; the debug log line is the only outside sign that Remove succeeded.
    A removal that lands while a GC pass is already walking the backend can be left for the next
    pass (containerd 1.6 schedules none for it), so every few seconds we run one (`Lab.collect_garbage`).
    """
    log = lab.logs_dir / "containerd.log"
    ns = namespace or lab.namespace

    def removed() -> set[str]:
        done = set()
        text = log.read_text(errors="replace")
        for m in re.finditer(r'msg="removed snapshot" key="?([^"\s]+)"? snapshotter="?([^"\s]+)', text):
            key_ns, _, name = m.group(1).split("/", 2)
            if m.group(2) == snapshotter_name and key_ns == ns:
                done.add(name)
        return done

    deadline = time.monotonic() + timeout
    while not set(names) <= removed() and time.monotonic() < deadline:
        with contextlib.suppress(LabError):
            wait_until("a GC pass", lambda: set(names) <= removed(), timeout=min(5.0, timeout))
        if not set(names) <= removed():
            lab.collect_garbage(ns)
    if not set(names) <= removed():
        gc_lines = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if re.search(r"garbage|remove snapshot|removed snapshot|failed to remove", line)
        ]
        raise LabError(
            f"containerd GC did not remove {sorted(set(names) - removed())} from {snapshotter_name} "
            f"within {timeout}s; its GC log lines:\n" + "\n".join(gc_lines[-40:])
        )


def test_cri_pull_unpacks_through_the_snapshotter_with_layer_labels(
    lab: Lab, snapshotter_name: str, pulled: Pulled
) -> None:
    """The kubelet's path: CRI PullImage unpacks with the snapshotter named in the CRI config and
    `disable_snapshot_annotations = false`, so every layer's snapshot carries the cri.* labels."""
    ref = lab.push(pulled.image, "cri-foundation")
    image_id = cri.pull(lab.containerd_socket, ref)
    assert image_id == pulled.image.config_digest
    status = cri.image_status(lab.containerd_socket, ref)
    assert status is not None and status.id == image_id
    assert ref in status.repo_tags and status.size > 0

    k8s = Snap(lab, snapshotter_name, namespace="k8s.io")
    rows = k8s.ls()
    assert set(rows) == set(pulled.chain) and all(kind == "Committed" for _, kind in rows.values())
    for key, layer in zip(pulled.chain, pulled.image.layers, strict=True):
        labels = k8s.info(key).get("Labels") or {}
        assert isinstance(labels, dict)
        assert labels.get("containerd.io/snapshot/cri.layer-digest") == layer.digest, labels
        assert labels.get("containerd.io/snapshot/cri.image-ref") == ref
        assert labels.get("containerd.io/snapshot/cri.manifest-digest") == pulled.image.manifest_digest

    # RemoveImage drops the image; containerd's GC then removes the chain through Walk/Remove.
    cri.remove(lab.containerd_socket, ref)
    assert cri.image_status(lab.containerd_socket, ref) is None
    wait_until("the CRI image's snapshots to be collected", lambda: k8s.ls() == {}, timeout=30)
    wait_backend_removed(lab, snapshotter_name, pulled.chain, namespace="k8s.io")
