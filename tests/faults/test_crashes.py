"""Signals to our processes (cases 4 and 5 of docs/faults.md): the daemon SIGKILLed during a pull,
during reads and during Prepare/Commit/Remove; a mount process SIGKILLed."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc

from integration.lab import wait_until
from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from tests.faults import imagekit
from tests.faults.conftest import (
    FaultLab,
    assert_metadata_consistent,
    cleanup_rpc,
    fallback_line,
    sigkill,
    stale_mounts,
)
from tests.faults.proxy import Rule


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _after_restart_checks(flab: FaultLab) -> None:
    """What must hold after any daemon crash and restart."""
    ls = flab.lab.ctr("snapshots", "--snapshotter", "lazy", "ls", timeout=30)
    assert ls.returncode == 0
    cleanup_rpc(flab.lab)
    assert_metadata_consistent(flab.root)
    wait_until("stale FUSE mounts under the root to be cleared", lambda: not stale_mounts(flab.root), 15)


def test_daemon_sigkill_during_lazy_pull(flab: FaultLab) -> None:
    pushed = imagekit.push_lazy(flab.registry, "kill-pull", imagekit.data_files(seed=41, count=1))
    layer = f"/blobs/{pushed.data_layer}"
    # Resolve requests hang for a while: the daemon is inside Prepare when it dies.
    flab.proxy.add(Rule("delay", path=layer, method="GET", seconds=3.0))
    argv = ["ctr-remote", "--address", str(flab.lab.containerd_socket), "-n", flab.lab.namespace, "image", "rpull",
            "--plain-http", "--snapshotter", "lazy", pushed.ref]
    pull = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=flab.lab.env, text=True)
    try:
        wait_until("the daemon to resolve the layer", lambda: bool(flab.proxy.seen(layer, method="GET")), 30)
        flab.restart_daemon(signal.SIGKILL)
        out, _ = pull.communicate(timeout=60)
    finally:
        if pull.poll() is None:
            pull.kill()
            pull.wait(10)
    flab.proxy.clear()
    _after_restart_checks(flab)
    # The interrupted pull left nothing that stops a new one; the image then runs lazily.
    flab.rpull(pushed.ref)
    code, out = flab.run(pushed.ref, "kill-pull-run", "sha256sum", "/data/f0")
    assert code == 0 and out.split()[0] == sha(pushed.files["/data/f0"]), out
    assert f"layer={pushed.data_layer}" in flab.daemon_log().split("event=serving")[-1]
    _after_restart_checks(flab)


def test_daemon_sigkill_during_reads_keeps_containers_reading(flab: FaultLab) -> None:
    files = imagekit.data_files(seed=42, count=6, size=200_000)
    pushed = imagekit.push_lazy(flab.registry, "kill-reads", files)
    flab.rpull(pushed.ref)
    # Slow chunk answers: reads are in flight in the mount process when the daemon dies.
    flab.proxy.add(Rule("delay", path=f"/blobs/{pushed.data_layer}", seconds=0.3))
    script = "for f in /data/f0 /data/f1 /data/f2 /data/f3 /data/f4 /data/f5; do sha256sum $f >> /sums; done"
    flab.lab.ctr_run(pushed.ref, "kill-reads", "sh", "-c", script + "; sleep 60", detach=True)
    try:
        wait_until("the first uncached reads", lambda: len(flab.proxy.seen(f"/blobs/{pushed.data_layer}")) >= 2, 30)
        flab.restart_daemon(signal.SIGKILL)
        mounts = flab.lab.ctr("snapshots", "--snapshotter", "lazy", "mounts", "/x", "kill-reads").stdout
        upper = mounts.split("upperdir=")[1].split(",")[0].split()[0]

        def done() -> bool:
            try:
                return len(open(f"{upper}/sums").read().splitlines()) == 6
            except OSError:
                return False

        wait_until("the container to read all six files", done, 60)
        sums = dict(line.split()[::-1] for line in open(f"{upper}/sums").read().splitlines())
        assert sums == {name: sha(data) for name, data in files.items()}
    finally:
        flab.kill_tasks("kill-reads")
    _after_restart_checks(flab)


def _churn(socket: str, stop: threading.Event, errors: list[str], prefix: str) -> int:
    """Prepare/Commit/Remove in a loop until `stop` or the daemon goes away; returns rounds done."""
    rounds = 0
    with grpc.insecure_channel(f"unix://{socket}") as ch:
        stub = pb_grpc.SnapshotsStub(ch)
        try:
            while not stop.is_set():
                key, name = f"{prefix}-active-{rounds}", f"{prefix}-committed-{rounds}"
                parent = f"{prefix}-committed-{rounds - 1}" if rounds else ""
                stub.Prepare(pb.PrepareSnapshotRequest(snapshotter="lazy", key=key, parent=parent), timeout=10)
                stub.Commit(pb.CommitSnapshotRequest(snapshotter="lazy", name=name, key=key), timeout=10)
                if rounds >= 2:
                    stub.Remove(pb.RemoveSnapshotRequest(snapshotter="lazy", key=f"{prefix}-v-{rounds - 2}"),
                                timeout=10)
                stub.View(pb.ViewSnapshotRequest(snapshotter="lazy", key=f"{prefix}-v-{rounds}", parent=name),
                          timeout=10)
                rounds += 1
        except grpc.RpcError as exc:
            if not stop.is_set():
                errors.append(str(exc.code()))
    return rounds


def test_daemon_sigkill_during_prepare_commit_remove(flab: FaultLab) -> None:
    for attempt, delay in enumerate((0.15, 0.4, 0.8)):
        stop = threading.Event()
        errors: list[str] = []
        t = threading.Thread(target=_churn, args=(str(flab.lab.snapshotter_socket), stop, errors,
                                                  f"churn{attempt}"))
        t.start()
        time.sleep(delay)
        sigkill(flab.daemon_pid())
        t.join(30)
        assert not t.is_alive()
        stop.set()
        flab.restart_daemon(signal.SIGKILL)
        assert errors, "the churn should have been cut off by the SIGKILL"
        _after_restart_checks(flab)
        # The chain built so far is usable: a new round on top of the last committed snapshot works.
        stop2 = threading.Event()
        errs2: list[str] = []
        t2 = threading.Thread(target=_churn, args=(str(flab.lab.snapshotter_socket), stop2, errs2,
                                                   f"again{attempt}"))
        t2.start()
        time.sleep(0.3)
        stop2.set()
        t2.join(30)
        assert not errs2, errs2


def test_mount_process_sigkill_is_noticed_and_replaced(flab: FaultLab) -> None:
    files = imagekit.data_files(seed=51, count=2)
    pushed = imagekit.push_lazy(flab.registry, "kill-mount", files)
    flab.rpull(pushed.ref)
    assert fallback_line(flab.daemon_log(), pushed.data_layer) is None
    flab.lab.ctr_run(pushed.ref, "kill-mount-a", "sh", "-c", "sha256sum /data/f0 > /a; sleep 60", detach=True)
    try:
        pid_files = list(flab.root.glob("mounts/*/pid"))
        mount_dir = next(p.parent for p in pid_files if (p.parent / "state.json").exists()
                         and pushed.data_layer in (p.parent / "state.json").read_text())
        pid = int((mount_dir / "pid").read_text())
        log_before = len(flab.daemon_log())
        sigkill(pid)
        wait_until("the mount process to die", lambda: not _alive(pid), 10)
        # The daemon notices on its own, before anything uses the image again.
        died = f"event=mount_died mount={mount_dir.name} pid={pid} detected_by=watch"
        wait_until("the daemon to report the dead mount process", lambda: died in flab.daemon_log()[log_before:], 10)
        # `snapshotter status` reports it (the admin socket, when the daemon has one).
        admin = Path(f"{flab.lab.snapshotter_socket}.admin")
        if admin.exists():
            from snapshotter.status import fetch_status

            mounts = {m["id"]: m for m in fetch_status(admin)["mounts"]}
            assert mounts[mount_dir.name]["alive"] is False and mounts[mount_dir.name]["health"] == "dead", mounts
        # A new container of the image gets a working mount.
        code, out = flab.run(pushed.ref, "kill-mount-b", "sha256sum", "/data/f1")
        assert code == 0 and out.split()[0] == sha(files["/data/f1"]), out
        new_pid = int((mount_dir / "pid").read_text())
        assert new_pid != pid and _alive(new_pid)
        log = flab.daemon_log()[log_before:]
        assert log.count(f"event=mount_died mount={mount_dir.name} ") == 1, "reported once"
        assert f"event=mount_started mount={mount_dir.name}" in log
        assert not stale_mounts(flab.root)
    finally:
        flab.kill_tasks("kill-mount-a")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
