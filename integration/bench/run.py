"""Cold-start benchmark: containerd's overlayfs full pull vs our lazy snapshotter, per image format
and network condition.

    sudo .venv/bin/python -m integration.bench.run [--n 5] [--images small|big|all|tiny]
        [--formats estargz-ours,estargz-ctr,nydus] [--net unshaped,200mbit,latency20,latency50]
        [--workloads true,python,sha256] [--out DIR] [--cache DIR] [--results-md PATH]

What one run of a cell does (cell = image x workload x network x variant), always cold:
  all images, containers, snapshots and content removed from containerd (`images rm --sync`,
  checked empty), our daemon restarted on a wiped root (no chunk cache, no layer indexes, no
  mount processes) and left to become idle (its spare mount process waiting), page cache dropped;
  then
  pull:  `ctr images pull --snapshotter overlayfs` (variant `overlayfs`: the gzip image, containerd's
         default full pull + unpack) or `ctr-remote image rpull --snapshotter lazy` (lazy variants);
  run:   `ctr run --rm` of the workload (create + start + wait + delete);
  measured: wall seconds of both, bytes the registry sent (its "response completed" log lines,
  body bytes of GETs), peak RSS (VmHWM) of our daemon and of the image's mount process(es), and
  the peak VmRSS of containerd, sampled every 50 ms.
Cells run in alternating order (reversed every other repetition) so drift hits all variants alike.

Variants (`--formats`; `overlayfs` on the gzip image is always the baseline):
  estargz-ours      `snapshotter convert --format estargz`
  estargz-ctr       ctr-remote's `image convert --estargz --oci`
  estargz-landmark  ours with a recorded prefetch list (needs `snapshotter record`; skipped with a
                    note when that command does not exist)
  zstdchunked-ours  `snapshotter convert --format zstdchunked`
  nydus             `snapshotter convert --format nydus`
  nydus-prefetch    Nydus with the same recorded list as its bootstrap's prefetch table
Networks (`--net`):
  unshaped          loopback as is
  NNNmbit           registry responses capped to NNN Mbit/s: an htb class on `lo` with a u32 filter
                    on the registry's port (`--shaper port`, default: other loopback users on this
                    shared machine are not slowed), or `tc qdisc add dev lo root tbf rate NNNmbit
                    burst 256kb latency 50ms` (`--shaper tbf`, everything on lo). Always deleted.
  latencyNN         NN ms per round trip through a delaying TCP proxy (integration.bench.netproxy)
                    in front of the registry; images are pulled by the proxy's address.
Warm cells (warm-read, warm-find) run the workload once to fill the caches, wait, drop the page
cache, refill the free memory (integration/bench/freemem.py: this VM's balloon gives freed memory
back to its host, and reads onto such memory are several times slower) and time the second run
inside the container. With warm-read, each round of each network ends with a memory control
(freemem.py): a file as big as the warm read's, read with no container after a drop, without and
with the refill.
Outputs in --out: runs.csv (every run), results.csv (per cell: median, min, max), memory_probes.csv,
report.md (the Markdown table with date, `uname -a`, CPU) and results.png if matplotlib is importable.

Cleanup: the lab (registry, daemon, containerd, mount processes, mounts) is torn down, the qdisc
deleted and the proxy stopped on every exit path, including Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import FrameType

from integration.bench.freemem import MemoryProbe, describe, free_page_reporting, probe_memory, refill_free_memory
from integration.bench.images import DEFAULT_CACHE, BuildError, ImageCache
from integration.lab import Lab, LabError, stop_pids, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
BASELINE = "overlayfs"
LAZY_FORMATS = ("estargz-ours", "estargz-ctr", "estargz-landmark", "zstdchunked-ours", "nydus", "nydus-prefetch")
# Variants converted from a recorded prefetch profile -> the format they are converted to.
PROFILED = {"estargz-landmark": "estargz-ours", "nydus-prefetch": "nydus"}
PYTHON_SNIPPET = (
    "import json, sqlite3, email, email.mime.text, http.client, urllib.request, xml.etree.ElementTree, "
    "decimal, asyncio, logging, argparse; c = sqlite3.connect(':memory:'); "
    "print(c.execute('select 40 + 2').fetchone()[0])"
)
# image -> workload -> (argv, expected stdout check: None = exit status only, "sha256:<path>" = sum)
WORKLOADS: dict[str, dict[str, tuple[tuple[str, ...], str | None]]] = {
    "tiny": {"true": (("true",), None), "sha256": (("sha256sum", "/big/blob.bin"), "sha256:/big/blob.bin")},
    "small": {"true": (("true",), None), "python": (("python3", "-c", PYTHON_SNIPPET), "42")},
    "big": {
        "true": (("true",), None),
        "python": (("python3", "-c", PYTHON_SNIPPET), "42"),
        "sha256": (("sha256sum", "/bench/big.bin"), "sha256:/bench/big.bin"),
    },
}
# Warm workloads (second run, cache hot): image -> workload -> argv of the priming run. The cell
# pulls, runs the priming command (which fills our chunk cache as any first run would), drops the
# page cache, then runs the workload's argv, which prints its own elapsed seconds on stderr (bash's
# TIMEFORMAT=%R, or busybox's "real 0m 0.12s"); that in-container time is what the warm table compares.
_FIND = "find / -xdev -printf '%s\\n' | wc -l"  # every name, and a stat of each (the size)
WARM_PRIME: dict[str, dict[str, tuple[str, ...]]] = {
    "tiny": {"warm-read": ("sh", "-c", "cat /big/blob.bin > /dev/null")},
    "small": {"warm-find": ("sh", "-c", f"{_FIND} > /dev/null")},
    "big": {"warm-read": ("sh", "-c", "cat /bench/big.bin > /dev/null"),
            "warm-find": ("sh", "-c", f"{_FIND} > /dev/null")},
}
WORKLOADS["tiny"]["warm-read"] = (("sh", "-c", "time cat /big/blob.bin > /dev/null"), None)
WORKLOADS["small"]["warm-find"] = (("bash", "-c", f"TIMEFORMAT=%R; time ({_FIND})"), None)
WORKLOADS["big"]["warm-read"] = (("bash", "-c", "TIMEFORMAT=%R; time cat /bench/big.bin > /dev/null"), None)
WORKLOADS["big"]["warm-find"] = (("bash", "-c", f"TIMEFORMAT=%R; time ({_FIND})"), None)
WARM_READ_BYTES = {"tiny": None, "big": 256 << 20}  # the file warm-read reads (tiny: the lab image's blob)
SAMPLE_INTERVAL = 0.05
STEP_TIMEOUT = 1800.0


class BenchError(RuntimeError):
    pass


class LostOutput(BenchError):
    """`ctr run` exited 0 and printed nothing where the workload prints. containerd 1.6's client
    closes a task's IO before its copy goroutines have drained it (task.Delete: io.Close, Cancel,
    then Wait), so a line printed just before the container exits can be lost on the way. Seen
    once in a full run of 225 lazy runs (s74: the cold sha256 of ctr-remote's eStargz at +50 ms)."""


LOST_OUTPUT_RETRIES = 1  # a rep whose output was lost runs once more (cold again), noted in the report


def with_output_retry(run_once: Callable[[], RunResult], note: Callable[[str], None],
                      retries: int = LOST_OUTPUT_RETRIES) -> RunResult:
    """run_once(), and again, at most `retries` more times, when it raised LostOutput: each retry is
    `note`d (the report says so). Any other error, or a loss that repeats, propagates."""
    for attempt in range(retries + 1):
        try:
            return run_once()
        except LostOutput as exc:
            if attempt == retries:
                raise
            note(f"{exc}; ran again")
    raise AssertionError("unreachable")


# ---- network conditions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Net:
    name: str
    rate_mbit: int | None = None
    rtt_ms: float = 0.0


def parse_net(name: str) -> Net:
    if name == "unshaped":
        return Net(name)
    if m := re.fullmatch(r"(\d+)mbit", name):
        return Net(name, rate_mbit=int(m.group(1)))
    if m := re.fullmatch(r"latency(\d+(?:\.\d+)?)", name):
        return Net(name, rtt_ms=float(m.group(1)))
    raise argparse.ArgumentTypeError(f"unknown network condition {name!r} (unshaped, NNNmbit, latencyNN)")


@contextlib.contextmanager
def shaped(rate_mbit: int, port: int, mode: str) -> Iterator[None]:
    """Cap the registry's bandwidth on lo for the duration; the root qdisc we add is always deleted."""
    existing = _run(["tc", "qdisc", "show", "dev", "lo"]).stdout
    if "noqueue" not in existing and existing.strip():
        raise BenchError(f"lo already has a qdisc (someone else is shaping?): {existing.strip()}")
    if mode == "tbf":
        cmds = [["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "256kb",
                 "latency", "50ms"]]
    else:
        cmds = [
            ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "0"],
            ["tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", f"{rate_mbit}mbit",
             "ceil", f"{rate_mbit}mbit", "burst", "256kb", "cburst", "256kb", "quantum", "60000"],
            ["tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
             "sport", str(port), "0xffff", "flowid", "1:10"],
        ]
    added = False
    try:
        for i, cmd in enumerate(cmds):
            r = _run(cmd)
            if r.returncode != 0:
                raise BenchError(f"{shlex.join(cmd)}: {r.stderr.strip()}")
            added = added or i == 0
        yield
    finally:
        if added:
            r = _run(["tc", "qdisc", "del", "dev", "lo", "root"])
            if r.returncode != 0:
                print(f"WARNING: could not delete the qdisc on lo: {r.stderr.strip()}", file=sys.stderr)


@contextlib.contextmanager
def delay_proxy(upstream: str, rtt_ms: float, work: Path) -> Iterator[str]:
    """Start integration.bench.netproxy in front of `upstream`; yields its HOST:PORT; stops it by PID."""
    port_file = work / f"proxy-{rtt_ms:g}.port"
    port_file.unlink(missing_ok=True)
    log = open(work / f"proxy-{rtt_ms:g}.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "integration.bench.netproxy", "--upstream", upstream, "--rtt-ms", str(rtt_ms),
         "--port-file", str(port_file), "--stats-file", str(work / f"proxy-{rtt_ms:g}.stats")],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), start_new_session=True,
    )
    try:
        wait_until("the delaying proxy", lambda: port_file.exists() or proc.poll() is not None, 30)
        if proc.poll() is not None:
            raise BenchError(f"the delaying proxy exited with {proc.returncode}; see {log.name}")
        yield f"127.0.0.1:{port_file.read_text().strip()}"
    finally:
        stop_pids([proc.pid], grace=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        log.close()


# ---- measurements -------------------------------------------------------------------------------------


def _status_kib(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Sampler(threading.Thread):
    """Peak memory, sampled: VmHWM of the daemon and of every mount process under ROOT/mounts,
    VmRSS of containerd (it lives across cells, so its own VmHWM would not be per cell)."""

    def __init__(self, daemon_pid: int, containerd_pid: int, mounts_dir: Path) -> None:
        super().__init__(daemon=True)
        self.daemon_pid = daemon_pid
        self.containerd_pid = containerd_pid
        self.mounts_dir = mounts_dir
        self.daemon_kib = 0
        self.mount_kib = 0
        self.containerd_kib = 0
        self._stop_event = threading.Event()

    def sample(self) -> None:
        self.daemon_kib = max(self.daemon_kib, _status_kib(self.daemon_pid, "VmHWM"))
        self.containerd_kib = max(self.containerd_kib, _status_kib(self.containerd_pid, "VmRSS"))
        for pid_file in self.mounts_dir.glob("*/pid"):
            with contextlib.suppress(OSError, ValueError):
                self.mount_kib = max(self.mount_kib, _status_kib(int(pid_file.read_text().strip()), "VmHWM"))

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_INTERVAL):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
        self.sample()


_KV = re.compile(r'(\S+?)=("(?:[^"\\]|\\.)*"|\S+)')


OUR_USER_AGENT = "snapshotter/"  # how our daemon and mounts introduce themselves (FetchConfig.user_agent)


def registry_bytes(log: Path, offset: int, *, except_agent: str | None = None) -> tuple[int, int]:
    """(body bytes, requests) of the GETs the registry logged after byte `offset` of its log;
    with `except_agent`, only those whose user agent does not start with it."""
    total = requests = 0
    with open(log, "rb") as f:
        f.seek(offset)
        for raw in f:
            line = raw.decode(errors="replace")
            if 'msg="response completed' not in line:
                continue
            kv = {k: v.strip('"') for k, v in _KV.findall(line)}
            if except_agent is not None and kv.get("http.request.useragent", "").startswith(except_agent):
                continue
            if kv.get("http.request.method") == "GET" and kv.get("http.request.uri", "").startswith("/v2/"):
                total += int(kv.get("http.response.written", 0))
                requests += 1
    return total, requests


_REAL = re.compile(r"real\s+(?:(\d+)m\s*)?([\d.]+)s")


def inner_seconds(stderr: str) -> float:
    """The elapsed seconds a warm workload printed: bash TIMEFORMAT=%R ("1.234") or busybox
    ("real\t0m 1.23s"). BenchError when there is none."""
    if m := _REAL.search(stderr):
        return int(m.group(1) or 0) * 60 + float(m.group(2))
    for line in reversed(stderr.strip().splitlines()):
        with contextlib.suppress(ValueError):
            return float(line.strip())
    raise BenchError(f"the workload printed no elapsed time: {stderr[-300:]!r}")


def _field_sum(lines: Sequence[str], event: str, key: str) -> int:
    pat = re.compile(rf"\b{re.escape(key)}=(\d+)")
    return sum(int(m.group(1)) for line in lines if f"event={event} " in line for m in [pat.search(line)] if m)


def needed_bytes(daemon_log: str, containerd_own: int) -> int:
    """What a perfect lazy fetcher needed: the registry bytes containerd (and ctr-remote) fetched
    themselves (manifests, config: `registry_bytes(..., except_agent=OUR_USER_AGENT)`), plus, from
    our daemon's log of the run, the format metadata of each layer (footer + TOC / bootstrap) and
    the compressed chunks that reads touched. Lines: event=lazy_prepare metadata_bytes= and
    event=resolved_ahead metadata_bytes= (a layer resolved while the one below was prepared), and
    event=mount_stopped demand_chunk_bytes=. (containerd's share used to be what the registry sent
    minus what the daemon and the mount said they received: a mount stopped while a prefetch was
    still arriving made that share, and so "needed", megabytes too big.)"""
    lines = daemon_log.splitlines()
    return containerd_own + _field_sum(lines, "lazy_prepare", "metadata_bytes") + \
        _field_sum(lines, "resolved_ahead", "metadata_bytes") + _field_sum(lines, "mount_stopped", "demand_chunk_bytes")


# ---- one run ----------------------------------------------------------------------------------------


@dataclass
class RunResult:
    image: str
    workload: str
    net: str
    variant: str
    rep: int
    pull_s: float
    run_s: float
    total_s: float
    fetched_bytes: int
    requests: int
    daemon_peak_kib: int
    mount_peak_kib: int
    containerd_peak_kib: int
    load1: float = 0.0  # 1-minute load average when the run started
    inner_s: float = 0.0  # warm workloads: the seconds the workload timed itself inside the container
    needed_bytes: int = 0  # lazy: containerd's own requests + format metadata + chunks that reads touched


def _run(argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _cpu_ticks(pid: int) -> int:
    """utime + stime of `pid` in clock ticks (0 once it is gone)."""
    try:
        fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields_[11]) + int(fields_[12])


# Seconds every variant waits after its warm first run (and our mounts going idle) before the page
# cache is dropped: the first lazy run has just written its chunks (and a whole copy of a big file,
# fusefs/direct.py), some 0.5 GB, and this VM's disk reads slower for a few seconds after a burst of
# writes, synced or not (warm reads of 0.2-0.46 s with no settle, 0.10-0.21 s with 5 s, overlayfs
# 0.10-0.12 s either way, 2026-12-05; on another machine 0.20-0.45 s with 5 s and 0.10 s with 30 s,
# overlayfs 0.10-0.14 s, s31 and s31w30). A node's next container comes much later than that.
# (Some of what looked like the disk there was the host taking freed memory back, freemem.py;
# the settle stays so that the first run's writes are done before the drop.)
WARM_SETTLE = 5.0
MEMORY_PROBE_MIN_BYTES = 16 << 20  # the memory control's file where an image's warm read has no size here
# Bytes of free memory a warm cell's measured run gets refilled (freemem.py): twice what it reads.
REFILL_MIN_BYTES = 64 << 20


def refill_bytes(image: str) -> int:
    return max(REFILL_MIN_BYTES, 2 * (WARM_READ_BYTES.get(image) or 0))


def wait_mounts_idle(mounts_dir: Path, *, quiet: float = 0.5, timeout: float = 15.0) -> float:
    """Wait until every serving mount process (ROOT/mounts/*/pid) has used no CPU for `quiet`
    seconds, at most `timeout`; the seconds waited. What a first run left running (storing a big
    file whole for direct reads, writing the metadata image) then ends before the page cache is
    dropped, as it would long before a node's next container."""
    began = time.monotonic()
    last: dict[int, int] | None = None
    while time.monotonic() - began < timeout:
        pids = []
        for pid_file in mounts_dir.glob("*/pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(pid_file.read_text().strip()))
        now = {pid: _cpu_ticks(pid) for pid in pids}
        if now == last:
            break
        last = now
        time.sleep(quiet)
    return time.monotonic() - began


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cold_reset(lab: Lab) -> None:
    """Nothing of any image left in containerd or our daemon; page cache dropped."""
    for cid in lab.ctr("containers", "ls", "-q").stdout.split():
        lab.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False)
        lab.ctr("tasks", "delete", "-f", cid, check=False, timeout=30)
        lab.ctr("containers", "delete", cid, check=False)
    refs = lab.ctr("images", "ls", "-q").stdout.split()
    if refs:
        lab.ctr("images", "rm", "--sync", *refs, timeout=300)

    def leftovers() -> list[str]:
        found = []
        for sn in ("overlayfs", "lazy"):
            lines = lab.ctr("snapshots", "--snapshotter", sn, "ls", check=False).stdout.splitlines()[1:]
            found += [f"{sn}:{line.split()[0]}" for line in lines if line.strip()]
        found += [f"content:{d}" for d in lab.ctr("content", "ls", "-q").stdout.split()]
        return found

    try:
        wait_until("containerd's garbage collection", lambda: not leftovers(), 30, interval=0.2)
    except LabError:
        raise BenchError(f"not cold: left after removing all images: {leftovers()[:10]}") from None
    fresh_daemon(lab)
    drop_page_cache()


SPARE_WAIT = 30.0  # seconds a restarted daemon's spare mount process gets to finish its start-up


def fresh_daemon(lab: Lab) -> None:
    """Our daemon again on an empty root (cache, indexes, metadata; containerd holds no lazy
    snapshot at this point), reachable by containerd and idle before the clock starts: its spare
    mount process has done its Python start-up (`event=spare_waiting` in its log), as on a node
    whose daemon has been running. Without this, the spare's start-up (about 0.5 s of CPU, right
    after the restart) ran during the measured pull, which a long-running daemon never sees."""
    lab.restart_daemon(signal.SIGTERM, wipe_root=True)
    spare_log = lab.snapshotter_root / "mounts" / "spare.log"

    def spare_waiting() -> bool:
        try:
            return "event=spare_waiting" in spare_log.read_text(errors="replace")
        except OSError:
            return False

    try:
        wait_until("the daemon's spare mount process", spare_waiting, SPARE_WAIT, interval=0.05)
    except LabError:
        print(f"WARNING: no spare mount process waiting after {SPARE_WAIT:.0f}s (see {spare_log}); "
              "measuring anyway", file=sys.stderr)


def _pid_of(lab: Lab, name: str) -> int:
    return next(p.pid for p in lab.procs if p.name == name and p.popen.poll() is None)


def keep_mount_logs(lab: Lab, dest: Path) -> None:
    """Copy every log under the daemon's ROOT/mounts (the spare's, each mount process's) into
    dest/mounts: taken when the clock stops, as a mount's directory goes when the mount stops."""
    mounts = lab.snapshotter_root / "mounts"
    # Not a recursive walk: each mount's directory holds its FUSE mount point.
    for log in [*mounts.glob("*.log"), *mounts.glob("*/log")]:
        target = dest / "mounts" / log.relative_to(mounts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # a mount stopping meanwhile takes its log with it
            shutil.copyfile(log, target)


def keep_run_logs(lab: Lab, dest: Path, offsets: dict[str, int], marks: dict[str, float]) -> None:
    """Copy into `dest` the part of each lab log (daemon, containerd, registry) written since
    `offsets` were taken, and the run's clock `marks` (wall-clock seconds, so they line up with
    the logs' timestamps)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, path in lab.log_paths().items():
        with open(path, "rb") as f:
            f.seek(offsets.get(name, 0))
            (dest / f"{name}.log").write_bytes(f.read())
    (dest / "marks.json").write_text(json.dumps(marks, indent=1) + "\n")


def one_run(lab: Lab, *, image: str, workload: str, net: str, variant: str, rep: int, ref: str,
            argv: Sequence[str], expect: str | None, warm_settle: float = WARM_SETTLE,
            keep_logs: Path | None = None) -> RunResult:
    cold_reset(lab)
    load1 = os.getloadavg()[0]
    reg_log = lab.logs_dir / "registry.log"
    offset = reg_log.stat().st_size
    log_offsets = {name: path.stat().st_size for name, path in lab.log_paths().items()}
    marks: dict[str, float] = {}
    daemon_log_at = len(lab.daemon_log())
    sampler = Sampler(_pid_of(lab, "snapshotter"), _pid_of(lab, "containerd"), lab.snapshotter_root / "mounts")
    sampler.start()
    lazy = variant != BASELINE
    snapshotter = "lazy" if lazy else "overlayfs"
    prime = WARM_PRIME.get(image, {}).get(workload)
    try:
        t0 = time.monotonic()
        marks["pull_start"] = time.time()
        if lazy:
            lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", ref, timeout=STEP_TIMEOUT)
        else:
            lab.ctr("images", "pull", "--plain-http", "--snapshotter", "overlayfs", ref, timeout=STEP_TIMEOUT)
        if prime is not None:  # a warm workload: the first run fills the caches, then the page cache goes
            lab.ctr_run(ref, f"prime-{uuid.uuid4().hex[:10]}", *prime, snapshotter=snapshotter, timeout=STEP_TIMEOUT)
            wait_mounts_idle(lab.snapshotter_root / "mounts")
            time.sleep(warm_settle)
            drop_page_cache()
            refill_free_memory(lab.dir, refill_bytes(image))
        t1 = time.monotonic()
        marks["run_start"] = time.time()
        done = lab.ctr_run(ref, f"bench-{uuid.uuid4().hex[:10]}", *argv, snapshotter=snapshotter, timeout=STEP_TIMEOUT)
        out = done.stdout
        t2 = time.monotonic()
        marks["run_end"] = time.time()
    finally:
        sampler.stop()
    if expect is not None and expect.strip() not in out:
        if not out.strip():  # ctr_run checks the exit status: it was 0
            raise LostOutput(f"{variant} {image} {workload} {net} rep {rep}: `ctr run` exited 0 and printed nothing "
                             f"(wanted {expect!r})")
        raise BenchError(f"{variant} {image} {workload}: unexpected output {out[:300]!r} (wanted {expect!r})")
    inner = inner_seconds(done.stderr) if prime is not None else 0.0
    kept = keep_logs / f"{image}-{workload}-{net}-{variant}-{rep}" if keep_logs is not None else None
    if kept is not None:
        keep_mount_logs(lab, kept)
    needed = 0
    if lazy:  # the mount reports what reads touched when it stops: stop it (the clock has stopped)
        lab.ctr("images", "rm", "--sync", ref, timeout=300)
        wait_until("the image's mount to stop", lambda: "event=mount_stopped" in lab.daemon_log()[daemon_log_at:],
                   60, interval=0.1)
    time.sleep(0.2)  # the registry logs a response after sending it
    fetched, requests = registry_bytes(reg_log, offset)
    if lazy:
        containerd_own, _ = registry_bytes(reg_log, offset, except_agent=OUR_USER_AGENT)
        needed = needed_bytes(lab.daemon_log()[daemon_log_at:], containerd_own)
    if kept is not None:
        keep_run_logs(lab, kept, log_offsets, marks)
    return RunResult(image, workload, net, variant, rep, round(t1 - t0, 3), round(t2 - t1, 3), round(t2 - t0, 3),
                     fetched, requests, sampler.daemon_kib if lazy else 0, sampler.mount_kib if lazy else 0,
                     sampler.containerd_kib, round(load1, 2), round(inner, 3), needed)


# ---- images into the lab ------------------------------------------------------------------------------


def snapshotter_has_record() -> bool:
    r = _run([str(REPO_ROOT / ".venv" / "bin" / "snapshotter"), "--help"])
    return bool(re.search(r"\brecord\b", r.stdout))


def prepare_images(lab: Lab, cache: ImageCache, image: str, variants: Sequence[str], notes: list[str],
                   work: Path) -> dict[str, str]:
    """Build/convert what is missing in the cache, push every variant to the lab registry.
    Returns variant -> tag (variants that cannot be made are left out, with a note)."""
    oci = cache.layout(image)
    repo = f"bench-{image}"
    tags: dict[str, str] = {BASELINE: "gzip"}
    for v in variants:
        if v in ("estargz-ours", "zstdchunked-ours", "nydus"):
            tags[v] = cache.convert_ours(image, v)
        elif v in PROFILED:
            if not snapshotter_has_record():
                notes.append(f"{v} skipped: `snapshotter record` does not exist yet")
                continue
            prefetch = record_prefetch_list(lab, cache, image, work)
            tags[v] = cache.convert_ours(image, PROFILED[v], prefetch_list=prefetch)
            recorded = len(prefetch.read_text().splitlines())
            notes.append(f"{image}/{v}: prefetch profile recorded with `snapshotter record` of the "
                         f"{prefetch.stem.removeprefix('prefetch-')} workload ({recorded} "
                         "files), so that workload runs exactly what was recorded; the others show the cost of "
                         "prefetching files they do not need")
        elif v == "estargz-ctr":
            if not cache.has(image, "estargz-ctr"):
                src = _push(lab, oci, "gzip", repo)
                dst = f"{lab.registry_host}/{repo}:estargz-ctr"
                cache.log(f"converting {image} with ctr-remote (image convert --estargz --oci)")
                lab.push_converted(src, dst, "estargz", timeout=STEP_TIMEOUT)
                cache.store_from_registry(image, "estargz-ctr", dst, lambda a: lab.run(a, timeout=STEP_TIMEOUT))
                for ref in lab.ctr("images", "ls", "-q").stdout.split():
                    lab.ctr("images", "rm", "--sync", ref, timeout=300)
            tags[v] = "estargz-ctr"
        else:
            raise BenchError(f"unknown format {v!r}")
    for tag in sorted(set(tags.values())):
        _push(lab, oci, tag, repo)
    return tags


def record_prefetch_list(lab: Lab, cache: ImageCache, image: str, work: Path) -> Path:
    """`snapshotter record` of the image's python workload (else its first), on the lazy eStargz
    image, cold; the profile is cached next to the image."""
    name, (argv, _) = next(((w, v) for w, v in WORKLOADS[image].items() if w == "python"),
                           next(iter(WORKLOADS[image].items())))
    out = cache.dir(image) / f"prefetch-{name}.txt"
    if out.exists():
        return out
    cache.convert_ours(image, "estargz-ours")
    ref = _push(lab, cache.layout(image), "estargz-ours", f"bench-{image}")
    cold_reset(lab)
    cache.log(f"recording a prefetch profile of {image}: {shlex.join(argv)}")
    lab.run([str(REPO_ROOT / ".venv" / "bin" / "snapshotter"), "record", "--address", str(lab.containerd_socket),
             "-n", lab.namespace, "--plain-http", "--timeout", "120", f"--run-arg=--runc-root={lab.dir / 'runc'}",
             f"--run-arg=--fifo-dir={lab.dir / 'fifo'}", "-o", str(out.with_suffix(".part")), ref, "--", *argv],
            timeout=STEP_TIMEOUT)
    out.with_suffix(".part").rename(out)
    return out


def _push(lab: Lab, oci: Path, tag: str, repo: str) -> str:
    ref = f"{lab.registry_host}/{repo}:{tag}"
    lab.run(["skopeo", "copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false", f"oci:{oci}:{tag}",
             f"docker://{ref}"], timeout=STEP_TIMEOUT)
    return ref


# ---- the whole benchmark ----------------------------------------------------------------------------


@dataclass
class Config:
    n: int = 5
    images: tuple[str, ...] = ("big",)
    formats: tuple[str, ...] = ("estargz-ours",)
    nets: tuple[Net, ...] = (Net("unshaped"),)
    workloads: tuple[str, ...] | None = None  # None: all of each image's workloads
    out: Path = Path("bench-out")
    cache: Path = DEFAULT_CACHE
    shaper: str = "port"
    results_md: Path | None = None
    warm_settle: float = WARM_SETTLE
    keep_logs: Path | None = None
    command: str = ""


@dataclass
class Report:
    runs: list[RunResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory_probes: list[MemoryProbe] = field(default_factory=list)  # one per network and round with a warm read
    # The machine and checkout when the run began (the daemon is restarted for each run, so it
    # runs what the checkout holds at that moment); None: read them when the report is written.
    machine: dict[str, str] | None = None


def run_bench(cfg: Config) -> Report:
    report = Report(machine=machine_info())
    cfg.out.mkdir(parents=True, exist_ok=True)
    report.notes.append(_load("at the start"))
    cache = ImageCache(cfg.cache, log=lambda s: print(s, flush=True))
    for image in cfg.images:  # build before any lab is up: debootstrap and conversion need no lab
        cache.layout(image)
        for v in cfg.formats:
            if v in ("estargz-ours", "zstdchunked-ours", "nydus"):
                cache.convert_ours(image, v)
    with Lab(namespace="bench") as lab:
        for image in cfg.images:
            tags = prepare_images(lab, cache, image, cfg.formats, report.notes, cfg.out)
            variants = [BASELINE] + [v for v in cfg.formats if v in tags]
            workloads = [w for w in WORKLOADS[image] if cfg.workloads is None or w in cfg.workloads]
            if not workloads:
                report.notes.append(f"{image}: none of the workloads {cfg.workloads} apply")
                continue
            cells = [(w, v) for w in workloads for v in variants]
            for net in cfg.nets:
                with _network(lab, net, cfg) as host:
                    for rep in range(cfg.n):
                        order = cells if rep % 2 == 0 else list(reversed(cells))
                        for workload, variant in order:
                            argv, check = WORKLOADS[image][workload]
                            expect = cache.file_sha256(image, check.split(":", 1)[1]) \
                                if check and check.startswith("sha256:") else check
                            ref = f"{host}/bench-{image}:{tags[variant]}"
                            res = with_output_retry(
                                functools.partial(one_run, lab, image=image, workload=workload, net=net.name,
                                                  variant=variant, rep=rep, ref=ref, argv=argv, expect=expect,
                                                  warm_settle=cfg.warm_settle, keep_logs=cfg.keep_logs),
                                lambda text: _print_note(report, text))
                            report.runs.append(res)
                            print(f"{image} {workload:7} {net.name:9} {variant:16} rep {rep}: pull {res.pull_s:.2f}s "
                                  f"run {res.run_s:.2f}s total {res.total_s:.2f}s "
                                  f"fetched {res.fetched_bytes / 1e6:.1f} MB", flush=True)
                            write_outputs(cfg, report)  # keep partial results on disk
                        if "warm-read" in workloads:
                            # Right after a reset, as a warm cell's first run starts.
                            cold_reset(lab)
                            size = WARM_READ_BYTES.get(image) or MEMORY_PROBE_MIN_BYTES
                            dropped, refilled = probe_memory(lab.dir, size, cfg.warm_settle, refill_bytes(image),
                                                             drop_page_cache)
                            report.memory_probes.append(MemoryProbe(net.name, rep, size, round(dropped, 3),
                                                                    round(refilled, 3)))
        cold_reset(lab)
    report.notes.append(_load("at the end"))
    assert report.machine is not None
    now = _revision()
    if now != report.machine["revision"]:
        report.notes.append(f"the checkout changed during the run: snapshotter at {report.machine['revision']} "
                            f"when it began, {now} when it ended")
    write_outputs(cfg, report)
    return report


def _print_note(report: Report, text: str) -> None:
    """A note for the report that also shows on the console as the run goes."""
    report.notes.append(text)
    print(f"note: {text}", flush=True)


def _load(when: str) -> str:
    one, five, fifteen = os.getloadavg()
    return (f"load average {when}: {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs "
            "(anything else running on the machine shows up in the timings)")


@contextlib.contextmanager
def _network(lab: Lab, net: Net, cfg: Config) -> Iterator[str]:
    """Yields the registry host to pull from under `net`."""
    if net.rtt_ms:
        with delay_proxy(lab.registry_host, net.rtt_ms, cfg.out) as host:
            if net.rate_mbit:
                raise BenchError("combined latency + bandwidth is not supported")
            yield host
    elif net.rate_mbit:
        with shaped(net.rate_mbit, int(lab.registry_host.rsplit(":", 1)[1]), cfg.shaper):
            yield lab.registry_host
    else:
        yield lab.registry_host


# ---- reporting --------------------------------------------------------------------------------------


@dataclass
class CellSummary:
    image: str
    workload: str
    net: str
    variant: str
    n: int
    pull_median_s: float
    pull_min_s: float
    pull_max_s: float
    run_median_s: float
    run_min_s: float
    run_max_s: float
    total_median_s: float
    total_min_s: float
    total_max_s: float
    fetched_median_mb: float
    requests_median: float
    daemon_peak_mib: float
    mount_peak_mib: float
    containerd_peak_mib: float
    total_ratio_vs_overlayfs: float | None
    fetched_ratio_vs_overlayfs: float | None
    inner_median_s: float = 0.0
    inner_min_s: float = 0.0
    inner_max_s: float = 0.0
    inner_ratio_vs_overlayfs: float | None = None
    needed_median_mb: float = 0.0
    fetched_vs_needed: float | None = None  # registry bytes / (containerd's own + metadata + chunks read)


def summarize(runs: Sequence[RunResult]) -> list[CellSummary]:
    keys: list[tuple[str, str, str, str]] = []
    for r in runs:
        k = (r.image, r.workload, r.net, r.variant)
        if k not in keys:
            keys.append(k)
    cells: list[CellSummary] = []
    for k in keys:
        rs = [r for r in runs if (r.image, r.workload, r.net, r.variant) == k]

        def med(xs: Sequence[float]) -> float:
            return round(statistics.median(xs), 3)

        pulls, execs, totals = [r.pull_s for r in rs], [r.run_s for r in rs], [r.total_s for r in rs]
        cells.append(CellSummary(
            *k, len(rs), med(pulls), min(pulls), max(pulls), med(execs), min(execs), max(execs),
            med(totals), min(totals), max(totals), round(statistics.median([r.fetched_bytes for r in rs]) / 1e6, 2),
            statistics.median([r.requests for r in rs]),
            round(max(r.daemon_peak_kib for r in rs) / 1024, 1), round(max(r.mount_peak_kib for r in rs) / 1024, 1),
            round(max(r.containerd_peak_kib for r in rs) / 1024, 1), None, None))
        inners, needs = [r.inner_s for r in rs], [r.needed_bytes for r in rs]
        c = cells[-1]
        c.inner_median_s, c.inner_min_s, c.inner_max_s = med(inners), min(inners), max(inners)
        c.needed_median_mb = round(statistics.median(needs) / 1e6, 3)
        ratios = [r.fetched_bytes / r.needed_bytes for r in rs if r.needed_bytes > 0]
        c.fetched_vs_needed = round(statistics.median(ratios), 3) if ratios else None
    base = {(c.image, c.workload, c.net): c for c in cells if c.variant == BASELINE}
    for c in cells:
        b = base.get((c.image, c.workload, c.net))
        if b is not None and b.total_median_s > 0:
            c.total_ratio_vs_overlayfs = round(c.total_median_s / b.total_median_s, 3)
        if b is not None and b.fetched_median_mb > 0:
            c.fetched_ratio_vs_overlayfs = round(c.fetched_median_mb / b.fetched_median_mb, 4)
        if b is not None and b.inner_median_s > 0:
            c.inner_ratio_vs_overlayfs = round(c.inner_median_s / b.inner_median_s, 3)
    return cells


def is_warm(cell: CellSummary) -> bool:
    return cell.workload in WARM_PRIME.get(cell.image, {})


def machine_info() -> dict[str, str]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kib = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "uname": _version(["uname", "-a"]),
        "cpu": f"{cpu} x {os.cpu_count()}",
        "memory": f"{mem_kib / 1024 / 1024:.1f} GiB",
        "containerd": _version(["containerd", "--version"]),
        "ctr-remote": "stargz-snapshotter " + _version(["dpkg-query", "-W", "-f=${Version}", "stargz-snapshotter"]),
        "revision": _revision(),
    }


def _revision() -> str:
    """The checkout's commit, and whether the working tree differs from it (read-only git)."""
    head = _version(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"])
    dirty = _version(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"])
    return f"{head}{' + uncommitted changes' if dirty else ''}"


def _version(argv: Sequence[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return _run(argv, timeout=10).stdout.strip()
    return "?"


def _span(med: float, lo: float, hi: float, n: int) -> str:
    return f"{med:.2f}" if n == 1 else f"{med:.2f} ({lo:.2f}–{hi:.2f})"


def markdown(cfg: Config, report: Report, cells: Sequence[CellSummary]) -> str:
    info = report.machine or machine_info()
    lines = [
        "# Cold start benchmark",
        "",
        f"Ran {info['date']} on `{info['uname']}`; CPU: {info['cpu']}; memory {info['memory']}; "
        f"{info['containerd']}; {info['ctr-remote']}; snapshotter at {info['revision']}.",
        "",
        f"Command: `{cfg.command or 'integration.bench.run'}`",
        "",
        "Every run is cold (images, snapshots, content removed; our daemon restarted on an empty root; page cache "
        "dropped). Times are seconds, median (min–max) over n runs; pull = `ctr images pull` (overlayfs, full "
        "download + unpack) or `ctr-remote image rpull` (lazy); run = `ctr run --rm` of the workload; fetched = body "
        "bytes the registry sent (its log); RSS = peak VmHWM of our daemon / the image's mount process; ratio = "
        "total time (and bytes) of the variant / overlayfs, same image, workload and network.",
        "",
        "| image | workload | network | variant | n | pull s | run s | total s | fetched MB | RSS daemon / mount MiB "
        "| total vs overlayfs | bytes vs overlayfs | fetched / needed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        if is_warm(c):
            continue
        rss = f"{c.daemon_peak_mib:.0f} / {c.mount_peak_mib:.0f}" if c.variant != BASELINE else "–"
        ratio = f"{c.total_ratio_vs_overlayfs:.2f}" if c.total_ratio_vs_overlayfs is not None else "–"
        bratio = f"{c.fetched_ratio_vs_overlayfs:.3f}" if c.fetched_ratio_vs_overlayfs is not None else "–"
        if c.variant == BASELINE:
            ratio = bratio = "1"
        needed = f"{c.fetched_vs_needed:.2f}" if c.fetched_vs_needed is not None else "–"
        lines.append(
            f"| {c.image} | {c.workload} | {c.net} | {c.variant} | {c.n} "
            f"| {_span(c.pull_median_s, c.pull_min_s, c.pull_max_s, c.n)} "
            f"| {_span(c.run_median_s, c.run_min_s, c.run_max_s, c.n)} "
            f"| {_span(c.total_median_s, c.total_min_s, c.total_max_s, c.n)} "
            f"| {c.fetched_median_mb:.1f} | {rss} | {ratio} | {bratio} | {needed} |"
        )
    lines += ["", "fetched / needed: registry bytes over what the run needed at least: containerd's own requests "
              "(manifests, config), each layer's footer + TOC (or Nydus bootstrap), and the compressed chunks "
              "that reads touched (prefetched chunks nobody read count as waste)."]
    warm = [c for c in cells if is_warm(c)]
    if warm:
        lines += [
            "", "Warm (second run, cache hot): the image is pulled, a first container runs the workload (filling "
            "our chunk cache), the harness waits until the image's mount process has used no CPU for 0.5 s (at "
            f"most 15 s) and then {cfg.warm_settle:g} s more (every variant), syncs and drops the page cache, "
            "refills the free memory (a sparse file at least twice as big as the read, read and removed; see "
            "the memory control below), then the measured container runs it; the seconds are "
            "timed inside the container (no pull, no container start).", "",
            "| image | workload | network | variant | n | in-container s | read MB/s | vs overlayfs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in warm:
            size = WARM_READ_BYTES.get(c.image) if c.workload == "warm-read" else None
            speed = f"{size / c.inner_median_s / 1e6:.0f}" if size and c.inner_median_s > 0 else "–"
            ratio = "1" if c.variant == BASELINE else (
                f"{c.inner_ratio_vs_overlayfs:.2f}" if c.inner_ratio_vs_overlayfs is not None else "–")
            lines.append(f"| {c.image} | {c.workload} | {c.net} | {c.variant} | {c.n} "
                         f"| {_span(c.inner_median_s, c.inner_min_s, c.inner_max_s, c.n)} | {speed} | {ratio} |")
        if report.memory_probes:
            lines += ["", describe(report.memory_probes, cfg.warm_settle, free_page_reporting())]
    workloads = sorted({(c.image, c.workload) for c in cells})
    lines += ["", "Workloads: " + "; ".join(
        f"{img}/{w} = `{shlex.join(WORKLOADS[img][w][0])}`" for img, w in workloads) + "."]
    if report.notes:
        lines += ["", "Notes:", *[f"- {n}" for n in report.notes]]
    return "\n".join(lines) + "\n"


def write_outputs(cfg: Config, report: Report) -> list[CellSummary]:
    cells = summarize(report.runs)
    with open(cfg.out / "runs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([fl.name for fl in fields(RunResult)])
        for r in report.runs:
            w.writerow(list(asdict(r).values()))
    with open(cfg.out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([fl.name for fl in fields(CellSummary)])
        for c in cells:
            w.writerow(["" if v is None else v for v in asdict(c).values()])
    if report.memory_probes:
        with open(cfg.out / "memory_probes.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([fl.name for fl in fields(MemoryProbe)])
            for p in report.memory_probes:
                w.writerow(list(asdict(p).values()))
    md = markdown(cfg, report, cells)
    (cfg.out / "report.md").write_text(md)
    if cfg.results_md is not None:
        cfg.results_md.write_text(md)
    _chart(cfg.out / "results.png", cells)
    return cells


def _chart(path: Path, cells: Sequence[CellSummary]) -> None:
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        return
    if not cells:
        return
    groups = sorted({(c.image, c.workload, c.net) for c in cells}, key=str)
    variants = list(dict.fromkeys(c.variant for c in cells))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(6, len(groups) * 1.4), 4))
    for i, v in enumerate(variants):
        ys = [next((c.total_median_s for c in cells if (c.image, c.workload, c.net) == g and c.variant == v), 0)
              for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], ys, width, label=v)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
    ax.set_xticklabels(["\n".join(g) for g in groups], fontsize=7)
    ax.set_ylabel("total seconds (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- CLI --------------------------------------------------------------------------------------------


def _csv_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="python -m integration.bench.run",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--n", type=int, default=5, help="runs per cell (default 5)")
    p.add_argument("--images", default="big", help="small, big, all (= small,big) or tiny; comma-separated")
    p.add_argument("--formats", default="estargz-ours",
                   help=f"lazy variants, comma-separated, or 'all': {', '.join(LAZY_FORMATS)} (default estargz-ours)")
    p.add_argument("--net", default="unshaped", help="unshaped, NNNmbit, latencyNN; comma-separated")
    p.add_argument("--workloads", default="",
                   help="subset of true,python,sha256,warm-read,warm-find (default: all that apply)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"image cache (default {DEFAULT_CACHE})")
    p.add_argument("--shaper", choices=("port", "tbf"), default="port")
    p.add_argument("--results-md", type=Path, help="also write the Markdown report here")
    p.add_argument("--warm-settle", type=float, default=WARM_SETTLE,
                   help=f"seconds a warm cell waits after its first run, every variant alike (default {WARM_SETTLE:g})")
    p.add_argument("--keep-logs", type=Path, metavar="DIR",
                   help="keep each run's logs (daemon, mounts, containerd, registry; clock marks) "
                        "in DIR/IMAGE-WORKLOAD-NET-VARIANT-REP")
    a = p.parse_args(argv)
    images = ["small", "big"] if a.images == "all" else _csv_list(a.images)
    for im in images:
        if im not in WORKLOADS:
            p.error(f"unknown image {im!r}")
    formats = list(LAZY_FORMATS) if a.formats == "all" else _csv_list(a.formats)
    for f in formats:
        if f not in LAZY_FORMATS:
            p.error(f"unknown format {f!r} (known: {', '.join(LAZY_FORMATS)})")
    if a.n < 1:
        p.error("--n must be at least 1")
    if not 0 <= a.warm_settle <= 600:
        p.error("--warm-settle must be between 0 and 600 seconds")
    try:
        nets = tuple(parse_net(x) for x in _csv_list(a.net))
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    return Config(
        n=a.n, images=tuple(images), formats=tuple(formats), nets=nets,
        workloads=tuple(_csv_list(a.workloads)) or None, out=a.out, cache=a.cache, shaper=a.shaper,
        results_md=a.results_md, warm_settle=a.warm_settle, keep_logs=a.keep_logs,
        command="python -m integration.bench.run " + shlex.join(list(argv if argv is not None else sys.argv[1:])),
    )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every cleanup context above


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    if os.geteuid() != 0:
        print("integration.bench.run: must run as root (containerd, FUSE, tc, drop_caches)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    # A shell starts background jobs with SIGINT ignored; a benchmark must still stop (and clean up) on it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        report = run_bench(cfg)
    except (BenchError, BuildError, LabError) as e:
        print(f"integration.bench.run: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("integration.bench.run: interrupted (lab, qdisc and proxy removed); partial results in "
              f"{cfg.out}", file=sys.stderr)
        return 130
    print((cfg.out / "report.md").read_text())
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
