"""Prefetch end to end: `snapshotter record` -> `snapshotter convert --prefetch-list` -> rpull ->
run makes one registry request per layer at start-up, and the background fetch fills the cache
under its bandwidth cap so that nothing is fetched afterwards.

Real containerd, registry, ctr-remote and /dev/fuse; the daemon is restarted with a config of
the test's own ([prefetch] section) and restarted with the lab's again at the end.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integration import images
from integration.lab import REPO_ROOT, Lab
from snapshotter.cache import ChunkCache
from snapshotter.remote.mounts import SPARE_LOG as SPARE_LOG_NAME
from tests.integration.test_lazy import _wait_for, daemon_config, manifest_layers

PY = str(REPO_ROOT / ".venv" / "bin" / "python")
APP_FILES = {f"app/f{i:02d}": images.deterministic_bytes(20_000 + 1_000 * i, seed=100 + i) for i in range(40)}
READ = ["app/f03", "app/f17", "app/f29", "app/f08", "app/f33"]
START_CMD = "cat " + " ".join("/" + p for p in READ) + " > /dev/null && echo started"
# The reader fetches a file's small chunks in read units of up to 4 MiB (reader/units.py), and a
# paced background fetch cannot split one: 16 MiB give four paced requests.
BIG = 16 * 1024 * 1024
RATE = 5_000_000  # bytes/s: the big layer takes ~3.4 s in the background


# -- helpers ------------------------------------------------------------------------------------

_KV = re.compile(r'(\S+?)=("(?:[^"\\]|\\.)*"|\S+)')


@dataclass(frozen=True)
class Get:
    digest: str
    status: int
    written: int
    start: float  # epoch seconds the request began (log time - duration)
    end: float


def _duration(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(ns|µs|us|ms|s)", text)
    if not m:
        return 0.0
    return float(m.group(1)) * {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def blob_gets(lab: Lab, repo: str) -> list[Get]:
    """Every blob GET the registry logged for `repo`, in log order, with its timing."""
    out = []
    for line in (lab.logs_dir / "registry.log").read_text(errors="replace").splitlines():
        if 'msg="response completed' not in line:
            continue
        kv = {k: v.strip('"') for k, v in _KV.findall(line)}
        uri = kv.get("http.request.uri", "")
        if kv.get("http.request.method") != "GET" or not uri.startswith(f"/v2/{repo}/blobs/"):
            continue
        end = datetime.datetime.fromisoformat(kv["time"][:26].rstrip("Z") + "+00:00").timestamp()
        out.append(Get(uri.rsplit("/", 1)[1], int(kv.get("http.response.status", 0)),
                       int(kv.get("http.response.written", 0)), end - _duration(kv.get("http.response.duration", "")),
                       end))
    return out


def mount_dir_for(lab: Lab, layer_digest: str) -> Path:
    """The mount-process directory (ROOT/mounts/ID) that serves `layer_digest`."""
    for d in sorted((lab.snapshotter_root / "mounts").iterdir()):
        try:
            state = json.loads((d / "state.json").read_text())
        except (OSError, ValueError):
            continue
        layers = [layer["layer_digest"] for run in state["runs"] for layer in run]
        if (d / "pid").exists() and layer_digest in layers:
            return d
    raise AssertionError(f"no mount process serves {layer_digest}")


def cold_cache(lab: Lab) -> None:
    """Evict every chunk no live process pins from the daemon's chunk cache."""
    cache = ChunkCache(lab.snapshotter_root / "cache", 1 << 40)
    try:
        cache.evict_to(0)
    finally:
        cache.close()


def wait_stats(mount_dir: Path, ok: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
    """The mount process's stats.json once `ok` holds for it (it is rewritten every second)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            doc: dict[str, Any] = json.loads((mount_dir / "stats.json").read_text())
            if ok(doc):
                return doc
        assert time.monotonic() < deadline, f"stats.json of {mount_dir} never satisfied the check"
        time.sleep(0.1)


def snapshotter_cli(lab: Lab, *args: str, timeout: float = 180.0) -> str:
    return lab.run([PY, "-m", "snapshotter.cli", *args], timeout=timeout).stdout


def convert(lab: Lab, src: str, dst: str, *extra: str) -> str:
    snapshotter_cli(lab, "convert", "--format", "estargz", "--plain-http", "--chunk-size", "65536", *extra, src, dst)
    return dst


def layer_digests(lab: Lab, ref: str) -> list[str]:
    return [str(layer["digest"]) for layer in manifest_layers(lab, ref)]


def events(log: str, event: str) -> list[dict[str, str]]:
    return [{k: v.strip('"') for k, v in _KV.findall(line)} for line in log.splitlines() if f"event={event} " in line]


# -- (a) record -> convert --prefetch-list -> run ---------------------------------------------------

@pytest.fixture(scope="module")
def app_gzip(lab: Lab) -> str:
    app: list[images.Entry] = [images.Dir("app")]
    app += [images.File(name, data) for name, data in APP_FILES.items()]
    app.append(images.File("app/unused.bin", images.deterministic_bytes(1 << 20, seed=9)))
    img = images.build_image(lab.dir / "oci", "pf", [images.busybox_entries(), app], cmd=("/bin/sh",))
    return lab.push(img, "pf")


@pytest.fixture(scope="module")
def app_image(lab: Lab, app_gzip: str) -> str:
    return convert(lab, app_gzip, f"{lab.registry_host}/pf:esgz")


def record_argv(lab: Lab, ref: str, output: Path) -> list[str]:
    return ["record", "--address", str(lab.containerd_socket), "--namespace", lab.namespace, "--plain-http",
            "--timeout", "60", "--output", str(output), f"--run-arg=--runc-root={lab.dir / 'runc'}",
            f"--run-arg=--fifo-dir={lab.dir / 'fifo'}", ref, "--", "sh", "-c", START_CMD]


def test_record_refuses_an_image_without_lazy_layers(lab: Lab, app_gzip: str, tmp_path: Path) -> None:
    r = lab.run([PY, "-m", "snapshotter.cli", *record_argv(lab, app_gzip, tmp_path / "p.txt")], timeout=180,
                check=False)
    assert r.returncode == 2 and "none of its layers is lazy" in r.stderr, r.stderr
    assert not (tmp_path / "p.txt").exists()
    assert "snapshotter-record-" not in lab.ctr("containers", "ls", "-q").stdout  # cleaned up


def test_recorded_profile_makes_start_up_one_request_per_layer(lab: Lab, app_image: str, tmp_path: Path) -> None:
    with daemon_config(lab, "[prefetch]\nbackground = false\n"):
        # Record the start-up of the plain eStargz image (its layers carry no prefetch landmark).
        lab.rpull(app_image)
        plain_digests = layer_digests(lab, app_image)
        cold_cache(lab)
        before = len(blob_gets(lab, "pf"))
        profile = tmp_path / "profile.txt"
        snapshotter_cli(lab, *record_argv(lab, app_image, profile))
        baseline = [g for g in blob_gets(lab, "pf")[before:] if g.digest in plain_digests]
        paths = profile.read_text().split()
        assert paths[0] == "/bin/busybox", paths  # sh is busybox: exec reads it first
        assert [p for p in paths if p.startswith("/app/")] == ["/" + p for p in READ]

        # Convert with the profile: the files come first in their layers, then the landmark.
        landmark_ref = convert(lab, app_image, f"{lab.registry_host}/pf:landmark", "--prefetch-list", str(profile))
        digests = layer_digests(lab, landmark_ref)
        lab.rpull(landmark_ref)
        cold_cache(lab)  # the record run cached the same chunks (the cache is content-addressed)
        after_pull = len(blob_gets(lab, "pf"))
        cid = "prefetch-start"
        out = lab.ctr("run", "--snapshotter", "lazy", "--runc-root", str(lab.dir / "runc"), "--fifo-dir",
                      str(lab.dir / "fifo"), landmark_ref, cid, "sh", "-c", START_CMD, timeout=90).stdout
        try:
            assert out.strip() == "started"
            during_run = [g for g in blob_gets(lab, "pf")[after_pull:] if g.digest in digests]
            mount_dir = mount_dir_for(lab, digests[-1])
            mount_log = (mount_dir / "log").read_text()
            stats = wait_stats(mount_dir, lambda doc: doc.get("prefetch", {}).get("prefetch_done") is True)
            layers = {v["layer"]: v for v in stats["prefetch"]["layers"].values()}
            assert {d: layers[d]["prefetch"] for d in digests} == dict.fromkeys(digests, "done")
            assert all(layers[d]["prefetch_requests"] == 1 and layers[d]["background"] == "disabled" for d in digests)
        finally:
            lab.ctr("containers", "delete", cid, check=False)
    prefetches = events(mount_log, "prefetch")
    assert {p["layer"] for p in prefetches} == set(digests)
    assert all(p["status"] == "done" and p["requests"] == "1" for p in prefetches), mount_log
    ready = events(mount_log, "ready")
    # The container started once the prefetch was in flight (or done, had it ended by then): its
    # reads joined the prefetch's fetches, as the request counts below show.
    assert ready and ready[0]["prefetch"] in ("in_flight", "done"), ready
    # At most one request per layer during start-up, all of them the prefetch: every file the
    # command read came from the cache.
    assert len(during_run) <= len(digests), during_run
    assert len(during_run) == sum(int(p["requests"]) for p in prefetches)
    assert all(g.status == 206 for g in during_run)
    assert sum(g.written for g in during_run) == sum(int(p["bytes"]) for p in prefetches)
    assert len(baseline) > 2 * len(digests), f"without the landmark start-up took {len(baseline)} requests"
    print(f"start-up requests: {len(baseline)} without the landmark, {len(during_run)} with it "
          f"({sum(g.written for g in during_run)} bytes)")


def test_record_bounds_the_command_and_keeps_what_it_read(lab: Lab, app_image: str, tmp_path: Path) -> None:
    profile = tmp_path / "profile.txt"
    argv = record_argv(lab, app_image, profile)
    argv[argv.index("--timeout") + 1] = "2"
    argv[-1] = "cat /app/f11 /app/f05 > /dev/null; exec sleep 60"
    started = time.monotonic()
    r = lab.run([PY, "-m", "snapshotter.cli", *argv], timeout=60)
    assert time.monotonic() - started < 30
    assert "killed at the timeout" in r.stderr, r.stderr
    assert [p for p in profile.read_text().split() if p.startswith("/app/")] == ["/app/f11", "/app/f05"]
    assert "snapshotter-record-" not in lab.ctr("containers", "ls", "-q").stdout


# -- (b) background fetch ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_image(lab: Lab) -> str:
    low: list[images.Entry] = [images.Dir("etc"), images.File("etc/low.txt", b"the lower layer\n")]
    high: list[images.Entry] = [images.Dir("data"),
                                images.File("data/big.bin", images.deterministic_bytes(BIG, seed=31))]
    high += [images.File(f"data/s{i}.txt", f"small {i}\n".encode() * 50) for i in range(10)]
    img = images.build_image(lab.dir / "oci", "bgf", [low, high])
    return convert(lab, lab.push(img, "bgf"), f"{lab.registry_host}/bgf:esgz")


def _tree_sha(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath, name)
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def top_chain_id(lab: Lab, ref: str) -> str:
    """The chain id of the image's top layer (the snapshot name containerd commits it as)."""
    host, _, rest = ref.partition("/")
    repo, _, tag = rest.partition(":")

    def get(path: str, accept: str) -> dict[str, object]:
        req = urllib.request.Request(f"http://{host}/v2/{repo}/{path}", headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=10) as r:
            doc: dict[str, object] = json.load(r)
        return doc

    manifest = get(f"manifests/{tag}", "application/vnd.oci.image.manifest.v1+json")
    config = get(f"blobs/{manifest['config']['digest']}", "*/*")  # type: ignore[index]
    chain = ""
    for diff_id in config["rootfs"]["diff_ids"]:  # type: ignore[index]
        chain = diff_id if not chain else "sha256:" + hashlib.sha256(f"{chain} {diff_id}".encode()).hexdigest()
    return chain


def test_background_fetch_fills_the_cache_under_its_cap(lab: Lab, big_image: str) -> None:
    config = f"[prefetch]\nbackground = true\nbackground_delay = 0.0\nbackground_bytes_per_second = {RATE}\n"
    digests = layer_digests(lab, big_image)
    key = "prefetch-background"
    with daemon_config(lab, config):
        lab.rpull(big_image)
        after_pull = len(blob_gets(lab, "bgf"))
        # An active snapshot over the image: its mounts need the image's mount process.
        lab.ctr("snapshots", "--snapshotter", "lazy", "prepare", key, top_chain_id(lab, big_image))
        try:
            mount_dir = mount_dir_for(lab, digests[-1])
            deadline = time.monotonic() + 60
            while True:
                done = [e for e in events((mount_dir / "log").read_text(), "background") if e.get("status") == "done"]
                if {e["layer"] for e in done} == set(digests):
                    break
                assert time.monotonic() < deadline, (mount_dir / "log").read_text()[-3000:]
                time.sleep(0.1)
            background = [g for g in blob_gets(lab, "bgf")[after_pull:] if g.digest in digests]
            # The daemon told the mount process that the loopback registry has no TLS.
            assert "no TLS answer" not in (mount_dir / "log").read_text()
            # Reading the whole image (every file of every layer the mount serves) now makes no
            # registry request.
            shas = _tree_sha(mount_dir / "mnt")
            assert shas["0/data/big.bin"] == hashlib.sha256(images.deterministic_bytes(BIG, seed=31)).hexdigest()
            assert len(shas) >= 12
            assert [g for g in blob_gets(lab, "bgf")[after_pull:] if g.digest in digests] == background
        finally:
            lab.ctr("snapshots", "--snapshotter", "lazy", "rm", key, check=False)
    big = [g for g in background if g.digest == digests[-1]]
    assert all(g.status == 206 for g in big) and len(big) >= 4
    # Paced: request k starts when the bytes of requests 0..k-1 at RATE have taken their time.
    measured = sum(g.written for g in big[:-1]) / (big[-1].start - big[0].start)
    assert abs(measured - RATE) <= 0.1 * RATE, f"measured {measured:.0f} B/s, cap {RATE}"
    (reported,) = [e for e in done if e["layer"] == digests[-1]]
    assert int(reported["bytes"]) == sum(g.written for g in big)
    own_rate = int(reported["bytes"]) / float(reported["seconds"])
    assert abs(own_rate - RATE) <= 0.1 * RATE, reported
    print(f"background: {len(big)} requests, {sum(g.written for g in big)} bytes, registry-measured "
          f"{measured:.0f} B/s, self-reported {own_rate:.0f} B/s, cap {RATE}")


# -- (c) the spare's early prefetch ---------------------------------------------------------------

def test_the_spare_prefetches_a_pulled_layers_start_up_files_before_its_mount_is_assigned(lab: Lab) -> None:
    """On a pull, the spare starts fetching the start-up files of the layer it just parsed before
    it is handed the image's mount (its log says so before the assignment moves its output to
    the mount's log); the mount, started on pull, waits for that and fetches none of them again:
    the registry sent the base layer its tail and the early prefetch's requests, nothing more,
    and the mount counts the early requests and bytes as its prefetch's and its registry's."""
    ns = "early"
    mounts_dir = lab.snapshotter_root / "mounts"
    spare_log = mounts_dir / SPARE_LOG_NAME
    _wait_for("a waiting spare", lambda: "event=spare_waiting" in spare_log.read_text(errors="replace")
              if spare_log.exists() else False)
    unique = os.urandom(8).hex()
    startup = {"etc/passwd": f"root:x:0:0:{unique}:/root:/bin/sh\n".encode(), "etc/group": b"root:x:0:\n",
               "lib/ld-linux-x86-64.so.2": images.deterministic_bytes(300_000, seed=21),
               "lib/libc.so.6": images.deterministic_bytes(500_000, seed=22)}
    base_layer = [*images.busybox_entries(), images.Dir("lib"),
                  *[images.File(name, data, 0o755) for name, data in startup.items()],
                  images.File("etc/not-at-start", images.deterministic_bytes(400_000, seed=23))]
    img = images.build_image(lab.dir / "oci", f"early-{unique}",
                             [base_layer, [images.File("etc/top.txt", f"top {unique}\n".encode())]], cmd=("/bin/sh",))
    ref = lab.push_converted(lab.push(img, "early"), f"{lab.registry_host}/early:esgz-{unique}")
    base = layer_digests(lab, ref)[0]
    gets_before = len(blob_gets(lab, "early"))
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", ref, namespace=ns)
    try:
        # The mount started on pull: its own prefetch line comes once the early one has ended.
        top = layer_digests(lab, ref)[-1]

        def started() -> Path | None:
            with contextlib.suppress(AssertionError):
                return mount_dir_for(lab, top)
            return None

        found = _wait_for("the mount started on pull", started)
        assert isinstance(found, Path)
        mount_dir = found
        _wait_for("the mount's prefetch", lambda: f"event=prefetch layer={base} " in
                  (mount_dir / "log").read_text(errors="replace"))
        before_assignment = spare_log.read_text(errors="replace")
        assert f"event=early_prefetch_started layer={base}" in before_assignment, before_assignment[-2000:]
        logs = before_assignment + (mount_dir / "log").read_text(errors="replace")
        early = [e for e in events(logs, "early_prefetch") if e.get("layer") == base]
        assert len(early) == 1 and early[0]["status"] == "done", logs[-3000:]
        # Its requests were out (the spare's tree build waits for that) before it ended.
        assert 0 <= float(early[0]["sent_seconds"]) <= float(early[0]["seconds"]), early
        assert early[0]["files"] == "4", early  # passwd, group, the loader and libc next to it
        early_requests, early_bytes = int(early[0]["requests"]), int(early[0]["bytes"])
        assert early_requests >= 1 and early_bytes >= 800_000, early
        own = [e for e in events(logs, "prefetch") if e.get("layer") == base]
        assert len(own) == 1 and own[0]["status"] == "done", own
        assert (int(own[0]["requests"]), int(own[0]["bytes"])) == (early_requests, early_bytes), own
        # The registry: the resolve's tail request and the early prefetch's, nothing else.
        base_gets = [g for g in blob_gets(lab, "early")[gets_before:] if g.digest == base]
        assert len(base_gets) == 1 + early_requests, base_gets
        stats = wait_stats(mount_dir, lambda doc: doc.get("registry", {}).get("bytes_received", 0) >= early_bytes)
        assert stats["registry"]["requests"] >= early_requests
    finally:
        lab.ctr("images", "rm", "--sync", ref, namespace=ns, check=False)
