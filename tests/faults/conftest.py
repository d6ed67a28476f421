"""The fault suite: real containerd + registry + our daemon, faults injected by a proxy that only
the daemon talks to, and by signals to our processes.

Every test under tests/faults gets the `faults` marker (`pytest -m faults` runs the suite alone).
`flab` is one session lab whose daemon resolves and reads through `flab.proxy` with short
timeouts (see DAEMON_CONFIG); tests needing another daemon config (tmpfs root) make their own.

Hypothesis: `HYPOTHESIS_PROFILE=long` selects a long fuzzing profile (see fuzz_long.py); without
it the profile is left alone, so the rest of the suite keeps its settings.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import sqlite3
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from integration.lab import Lab, LabError, mount_processes, mounts_under, pids_mentioning
from snapshotter.cache.keys import group_key
from snapshotter.reader.units import UNIT_BYTES
from tests.faults.imagekit import CHUNK
from tests.faults.proxy import FaultProxy

settings.register_profile("long", max_examples=20_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])

RESOLVE_TIMEOUT = 4.0
FETCH_TIMEOUT = 3.0
MAX_TOC_BYTES = 8 << 20

DAEMON_CONFIG = """\
resolve_timeout = {resolve}
fetch_timeout = {fetch}
log_level = "info"

[registry]
config_path = "{hosts}"
request_timeout = 2.0
retries = 1
# Off for the same reason as the background fill below: a burst of misses would fetch the
# files stored after the ones a test reads.
amplify_bytes = 0

[cache]
max_bytes = {cache_max}

[limits]
max_toc_bytes = {max_toc}

[prefetch]
# Off: a test's "uncached file" must stay uncached until the test reads it.
background = false
"""

_ACTIVE: list[Lab] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.faults)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Attach the tails of the labs' logs (and mount process logs) to every failing fault test."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for lab in list(_ACTIVE):
            with contextlib.suppress(Exception):
                mount_logs = "\n".join(f"--- {p} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
                                       for p in sorted(lab.snapshotter_root.glob("mounts/*/log")))
                report.sections.append((f"lab {lab.dir}", lab.format_logs(lines=60) + "\n" + mount_logs))


@dataclass
class FaultLab:
    """A Lab whose daemon reaches the registry only through `proxy`."""

    lab: Lab
    proxy: FaultProxy
    hosts_dir: Path

    @property
    def root(self) -> Path:
        return self.lab.snapshotter_root

    @property
    def registry(self) -> str:
        return self.lab.registry_host

    def rpull(self, ref: str, timeout: float = 60.0) -> None:
        self.lab.rpull(ref, timeout=timeout)

    def run(self, ref: str, cid: str, *cmd: str, timeout: float = 60.0, check: bool = False) -> tuple[int, str]:
        """`ctr run --rm`; returns (exit code, stdout+stderr)."""
        r = self.lab.ctr_run(ref, cid, *cmd, timeout=timeout, check=check)
        return r.returncode, r.stdout + r.stderr

    def restart_daemon(self, sig: int = signal.SIGKILL) -> None:
        """Kill (default SIGKILL) and start the daemon; returns once containerd reaches it again."""
        self.lab.restart_daemon(sig)

    def wait_reachable(self) -> None:
        self.lab.wait_daemon_reachable()

    def daemon_log(self) -> str:
        return self.lab.daemon_log()

    def daemon_pid(self) -> int:
        return next(p.pid for p in self.lab.procs if p.name == "snapshotter" and p.popen.poll() is None)

    def mount_pids(self, mount_id: str | None = None) -> list[int]:
        """Mount processes of this daemon (of image mount `mount_id` only, if given): started with a
        state file under ROOT/mounts, or spares handed one (their working directory is the mount's)."""
        where = f"{self.root}/mounts/{mount_id}/" if mount_id else f"{self.root}/mounts/"
        found = set(pids_mentioning(where, exclude={os.getpid()}))
        found.update(pid for pid, _argv, cwd in mount_processes() if (cwd + "/").startswith(where))
        return sorted(found)

    def kill_tasks(self, *cids: str) -> None:
        for cid in cids:
            self.lab.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False, timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(c in self.lab.ctr("tasks", "ls", "-q", timeout=10).stdout
                                                  for c in cids):
            for cid in cids:
                self.lab.ctr("tasks", "delete", "-f", cid, check=False, timeout=10)
            time.sleep(0.1)
        for cid in cids:
            self.lab.ctr("containers", "delete", cid, check=False, timeout=20)


def write_hosts(hosts_dir: Path, registry: str, proxy: FaultProxy) -> None:
    d = hosts_dir / registry
    d.mkdir(parents=True, exist_ok=True)
    (d / "hosts.toml").write_text(f'server = "http://{proxy.host}"\n')


def daemon_config(path: Path, hosts_dir: Path, *, cache_max: int = 1 << 30) -> Path:
    hosts_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(DAEMON_CONFIG.format(resolve=RESOLVE_TIMEOUT, fetch=FETCH_TIMEOUT, hosts=hosts_dir,
                                         cache_max=cache_max, max_toc=MAX_TOC_BYTES))
    return path


@contextlib.contextmanager
def fault_lab(tmp: Path, *, cache_max: int = 1 << 30, lab_class: type[Lab] = Lab) -> Iterator[FaultLab]:
    hosts = tmp / "hosts"
    cfg = daemon_config(tmp / "daemon.toml", hosts, cache_max=cache_max)
    with FaultProxy() as proxy, lab_class(daemon_config=cfg) as lab:
        proxy.upstream = lab.registry_host
        write_hosts(hosts, lab.registry_host, proxy)
        _ACTIVE.append(lab)
        try:
            yield FaultLab(lab, proxy, hosts)
        finally:
            _ACTIVE.remove(lab)


@pytest.fixture(scope="session")
def flab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultLab]:
    with fault_lab(tmp_path_factory.mktemp("flab")) as fl:
        yield fl


@pytest.fixture(autouse=True)
def _clean_proxy(request: pytest.FixtureRequest) -> Iterator[None]:
    """No fault outlives its test; a stopped proxy is started again."""
    yield
    if "flab" in request.fixturenames:
        fl: FaultLab = request.getfixturevalue("flab")
        fl.proxy.clear()
        fl.proxy.start()


# -- consistency checks shared by tests ----------------------------------------------------------

def fallback_line(log: str, layer: str) -> str | None:
    return next((x for x in log.splitlines() if "event=fallback" in x and f"layer={layer}" in x), None)


def cache_files(root: Path) -> dict[str, Path]:
    """Committed chunk files of the cache under the daemon root: key -> path."""
    out: dict[str, Path] = {}
    chunks = root / "cache" / "chunks"
    if not chunks.is_dir():
        return out
    for p in chunks.rglob("*"):
        if p.is_file() and not p.name.startswith(".tmp."):
            out[f"{p.parent.parent.name}:{p.name}"] = p
    return out


def file_cache_keys(data: bytes, chunk: int = CHUNK) -> set[str]:
    """The cache keys a mount keeps a file of the test images under: its one chunk's digest,
    or the key of the read unit that groups its chunks (reader/units.py: a file of several
    chunks stored back to back, within one 4 MiB window, is one unit)."""
    digests = ["sha256:" + hashlib.sha256(data[i:i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    if len(digests) <= 1:
        return set(digests)
    assert len(data) <= UNIT_BYTES, "a test file of more than one read unit"
    return {group_key(digests)}


def assert_cache_holds_only_verified_bytes(root: Path, files: Mapping[str, bytes] = MappingProxyType({})) -> int:
    """Every sha256 chunk file's content hashes to its name, and every read unit's file of one
    of `files` holds that file's bytes (units of other files are not checked: their key names
    the parts' digests, not the content); returns how many cache files were checked."""
    units = {k: data for data in files.values() if len(data) > CHUNK for k in file_cache_keys(data)}
    checked = 0
    for key, p in cache_files(root).items():
        if key.startswith("group:"):
            if key not in units:
                continue
            assert p.read_bytes() == units[key], f"cache file {p} holds wrong bytes"
            checked += 1
            continue
        algo, _, hexd = key.partition(":")
        if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
            continue
        assert hashlib.sha256(p.read_bytes()).hexdigest() == hexd, f"cache file {p} holds wrong bytes"
        checked += 1
    return checked


def assert_metadata_consistent(root: Path, attempts: int = 10) -> None:
    """metadata.db passes SQLite's integrity check; every parent exists; every snapshot dir has a
    row (after Cleanup) and every row its dir.

    containerd may be removing snapshots meanwhile (its GC removes those it does not know, such
    as the ones tests make over gRPC), so rows and dirs are compared at a quiet moment: the check
    is retried a few times before it fails."""
    problem = ""
    for _ in range(attempts):
        db = sqlite3.connect(f"file:{root / 'metadata.db'}?mode=ro", uri=True, timeout=10)
        try:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            rows = {r[0]: r[1] for r in db.execute("SELECT id, parent FROM snapshots")}
        finally:
            db.close()
        dirs = {int(p.name) for p in (root / "snapshots").iterdir() if p.name.isdigit()} \
            if (root / "snapshots").is_dir() else set()
        orphans = {i: p for i, p in rows.items() if p is not None and p not in rows}
        if orphans:
            problem = f"snapshots whose parent row is gone: {orphans}"
        elif not dirs <= set(rows):
            problem = f"snapshot dirs without a row: {sorted(dirs - set(rows))}"
        elif not set(rows) <= dirs:
            problem = f"snapshots whose directory is gone: {sorted(set(rows) - dirs)}"
        else:
            return
        time.sleep(0.3)
    raise AssertionError(problem)


def cleanup_rpc(lab: Lab) -> None:
    """Call the daemon's Cleanup over gRPC (what containerd's GC does)."""
    import grpc

    from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
    from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix://{lab.snapshotter_socket}") as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        pb_grpc.SnapshotsStub(ch).Cleanup(pb.CleanupRequest(snapshotter="lazy"), timeout=30)


def gc_backend(lab: Lab) -> list[str]:
    """What containerd's GC does for a snapshot it no longer knows (e.g. after a failed Remove):
    Remove it from the daemon. Returns the keys removed."""
    import grpc

    from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
    from snapshotter._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc

    known = set(lab.ctr("snapshots", "--snapshotter", "lazy", "ls", timeout=30).stdout.split())
    removed = []
    with grpc.insecure_channel(f"unix://{lab.snapshotter_socket}") as ch:
        stub = pb_grpc.SnapshotsStub(ch)
        infos = [i for resp in stub.List(pb.ListSnapshotsRequest(snapshotter="lazy"), timeout=30) for i in resp.info]
        by_name = {i.name: i for i in infos}
        # Children first, so that parents are free to go.
        for info in sorted(infos, key=lambda i: -_depth(i.name, by_name)):
            if info.name.split("/", 2)[-1] not in known:
                stub.Remove(pb.RemoveSnapshotRequest(snapshotter="lazy", key=info.name), timeout=30)
                removed.append(info.name)
    return removed


def _depth(name: str, by_name: dict[str, Any]) -> int:
    d = 0
    while name in by_name and by_name[name].parent and d < 1000:
        name, d = by_name[name].parent, d + 1
    return d


def stale_mounts(root: Path) -> list[str]:
    """FUSE mounts under the daemon root that no longer answer (ENOTCONN)."""
    bad = []
    for mp in mounts_under(root):
        try:
            os.stat(mp)
        except OSError:
            bad.append(mp)
    return bad


def sigkill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


__all__ = ["FaultLab", "LabError", "fault_lab"]
