"""A local lab: distribution registry + our snapshotter daemon + a private containerd.

Usage::

    with Lab() as lab:
        ref = lab.push(lab.foundation_image(), "foundation")
        lab.pull(ref)                                    # ctr images pull --plain-http --snapshotter lazy
        out = lab.ctr_run(ref, "c1", "sh", "-c", "cat /etc/layer3.txt").stdout
        lab.ctr("snapshots", "--snapshotter", "lazy", "ls")

Contract:
- Everything lives under one fresh temp dir (`lab.dir`): registry storage, the daemon's root
  (`snroot/`) and socket, containerd's root/state/socket and config, runc state and IO fifos of
  `ctr_run` containers, `certs.d/HOST:PORT/hosts.toml` for the registry (plain HTTP), the OCI
  layout cache (`oci/`) and one log per process (`logs/NAME.log`).
- containerd gets `[proxy_plugins.lazy]` pointing at the daemon's socket and its CRI plugin
  unpacks with `cri_snapshotter` (default `lazy`) with `disable_snapshot_annotations = false`.
- Every wait is bounded; a process that dies or never becomes ready raises `LabError` whose message
  ends with the tails of all logs (`format_logs()` gives them at any time).
- `close()` (also from `__exit__`, on failure too; idempotent) kills containerd's tasks, then stops
  by PID (SIGTERM, SIGKILL after a bound) containerd, the daemon, every process whose command line
  names the lab dir or that runs in the session of a process the lab started (shims, the daemon's
  mount processes), containers runc still lists, and the registry. Then it lazily unmounts every
  mount under the lab dir (deepest first, per /proc/self/mountinfo) and removes the dir unless
  `keep=True` or LAZYLAB_KEEP=1.
- Runs as root on Linux; needs the packages from integration/setup.sh.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from integration import images

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SNAPSHOTTER_BIN = REPO_ROOT / ".venv" / "bin" / "snapshotter"
PROXY_NAME = "lazy"
# ctr, containerd and the shim look up runc and the shim on PATH; CI's PATH may lack the sbin dirs.
_PATH_EXTRA = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

STOP_GRACE_S = 10.0
READY_TIMEOUT_S = 30.0


class LabError(RuntimeError):
    """The lab could not start, a command failed, or a bounded wait ran out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, ok: Callable[[], bool], timeout: float, interval: float = 0.05) -> None:
    """Poll `ok` until it returns True; raise LabError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if ok():
            return
        if time.monotonic() > deadline:
            raise LabError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def unix_socket_accepts(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below `root` in this mount namespace, deepest first."""
    prefix = str(root).rstrip("/")
    found: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 5:
                continue
            # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
            mp = fields[4].encode().decode("unicode_escape")
            if mp == prefix or mp.startswith(prefix + "/"):
                found.append(mp)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def pids_mentioning(needle: str, exclude: set[int]) -> list[int]:
    """PIDs whose command line contains `needle` (e.g. the lab dir), minus `exclude`."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid in exclude:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            pids.append(pid)
    return pids


def mount_processes() -> list[tuple[int, list[bytes], str]]:
    """(pid, argv, working directory) of every snapshotter mount process (`python -m
    snapshotter.fusefs`). A spare handed a mount names no state file: its working directory is
    its mount's directory (ROOT/mounts/<id>); a waiting spare's is ROOT/mounts."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"snapshotter.fusefs" in argv:
                found.append((int(entry), argv, os.readlink(f"/proc/{entry}/cwd")))
        except OSError:
            continue
    return found


def _session_of(pid: int) -> int:
    """Session id of `pid`, or -1 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[3])  # after the command name: state ppid pgrp session ...
    except (OSError, IndexError, ValueError):
        return -1


def pids_in_sessions(sessions: set[int], exclude: set[int]) -> list[int]:
    """PIDs whose session id is in `sessions` (children of processes we started with setsid)."""
    return [
        int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) not in exclude and _session_of(int(e)) in sessions
    ]


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_pids(pids: Sequence[int], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM each pid, wait up to `grace` s for all to exit, then SIGKILL the rest."""
    live = [p for p in pids if _pid_alive(p)]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        live = [p for p in live if _pid_alive(p)]
        time.sleep(0.05)
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while live and time.monotonic() < deadline:
        live = [p for p in live if _pid_alive(p)]
        time.sleep(0.05)


def tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<unreadable: {e}>"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def check_alive(self, lab: Lab) -> None:
        rc = self.popen.poll()
        if rc is not None:
            raise LabError(f"{self.name} exited with status {rc}\n{lab.format_logs()}")


@dataclass
class Lab:
    """The lab; see the module docstring. Construct, then use as a context manager."""

    start_daemon: bool = True
    snapshotter_bin: Path = DEFAULT_SNAPSHOTTER_BIN
    daemon_config: Path | None = None
    daemon_args: Sequence[str] = ()
    namespace: str = "lazytest"
    cri_snapshotter: str = PROXY_NAME  # what the CRI plugin unpacks with (the kubelet path)
    keep: bool = field(default_factory=lambda: os.environ.get("LAZYLAB_KEEP") == "1")
    base_dir: Path | None = None  # parent of the lab dir; default: the system temp dir

    dir: Path = field(init=False)
    registry_host: str = field(init=False, default="")
    procs: list[Proc] = field(init=False, default_factory=list)
    _closed: bool = field(init=False, default=False)
    _image_cache: dict[str, images.BuiltImage] = field(init=False, default_factory=dict)

    # ---- paths --------------------------------------------------------------------------------
    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def snapshotter_root(self) -> Path:
        return self.dir / "snroot"

    @property
    def snapshotter_socket(self) -> Path:
        return self.dir / "sn.sock"

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "ctd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.dir / "containerd.toml"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = env.get("PATH", "") + ":" + _PATH_EXTRA
        # Lets `python -m snapshotter.cli` find the checkout when it is not pip-installed.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        return env

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is not None and not isinstance(ev, LabError):
            # LabError messages already carry the logs.
            with contextlib.suppress(Exception):
                print(self.format_logs(), file=sys.stderr)
        self.close()

    def start(self) -> None:
        base = str(self.base_dir) if self.base_dir else None
        # Short prefix: unix socket paths must stay under 108 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="lazylab-", dir=base))
        self.logs_dir.mkdir()
        try:
            self._start_registry()
            if self.start_daemon:
                self._start_daemon()
            self._start_containerd()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._closed or not hasattr(self, "dir"):
            return
        self._closed = True
        errors: list[str] = []
        # Tasks first (their processes don't name the lab dir, so only containerd can find them),
        # then containerd (it calls the snapshotter), the daemon (it may unmount what it mounted),
        # whatever is left naming the lab dir (shims, the daemon's mount processes), the registry.
        leaders = {p.pid for p in self.procs if p.popen.poll() is None}
        session_members = {pid: _session_of(pid) for pid in pids_in_sessions(leaders, exclude=leaders)}
        with contextlib.suppress(Exception):
            self._kill_tasks()
        for name in ("containerd", "snapshotter"):
            self._stop_named(name)
        self._stop_strays(session_members)
        self._stop_named("registry")
        for mp in mounts_under(self.dir):
            r = subprocess.run(["umount", "-l", mp], capture_output=True, text=True, timeout=30)
            if r.returncode != 0 and mounts_under(Path(mp)):
                r2 = subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True, text=True, timeout=30)
                if r2.returncode != 0:
                    errors.append(f"cannot unmount {mp}: {r.stderr.strip()} / {r2.stderr.strip()}")
        left = mounts_under(self.dir)
        if left:
            errors.append(f"mounts left under {self.dir}: {left}")
        elif not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise LabError("; ".join(errors))

    def _stop_named(self, name: str) -> None:
        for p in [p for p in self.procs if p.name == name]:
            stop_pids([p.pid])
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=1)

    def _stop_strays(self, session_members: dict[int, int]) -> None:
        """Stop what our processes left: anything naming the lab dir (shims, mount processes) or
        found in the session of a process we started (`session_members`: pid -> sid, taken while
        the leaders were alive, re-checked so a reused pid is never hit); then containers runc
        still knows about."""
        mine = {os.getpid()} | {p.pid for p in self.procs if p.popen.poll() is None}
        strays = set(pids_mentioning(str(self.dir) + "/", exclude=mine))
        strays |= {pid for pid, sid in session_members.items() if pid not in mine and _session_of(pid) == sid}
        stop_pids(sorted(strays), grace=5.0)
        # A mount process told to stop may fork its index and metadata-image writer before it ends
        # (fusefs/metamount.py `fork_writer`, no exec: the same command line); one forked after the
        # list above was taken would write into the lab dir while it is removed, leaving part of it.
        stop_pids(pids_mentioning(str(self.dir) + "/", exclude=mine), grace=5.0)
        runc_roots = sorted((self.dir / "runc").glob("*")) if (self.dir / "runc").is_dir() else []
        for root in runc_roots:
            with contextlib.suppress(LabError):
                listed = self.run(["runc", "--root", str(root), "list", "-q"], timeout=10, check=False)
                for cid in listed.stdout.split():
                    self.run(["runc", "--root", str(root), "kill", cid, "KILL"], timeout=10, check=False)
                    self.run(["runc", "--root", str(root), "delete", "-f", cid], timeout=20, check=False)

    def _kill_tasks(self) -> None:
        """SIGKILL and delete every task in every namespace of our containerd (bounded)."""
        if not any(p.name == "containerd" and p.popen.poll() is None for p in self.procs):
            return
        namespaces = self.ctr("namespaces", "ls", "-q", timeout=10).stdout.split()
        for ns in namespaces:
            for task in self.ctr("tasks", "ls", "-q", namespace=ns, timeout=10).stdout.split():
                self.ctr("tasks", "kill", "-a", "-s", "SIGKILL", task, namespace=ns, timeout=10, check=False)
                self.ctr("tasks", "delete", "-f", task, namespace=ns, timeout=20, check=False)

    def _spawn(self, name: str, argv: Sequence[str]) -> Proc:
        log = self.logs_dir / f"{name}.log"
        with open(log, "ab") as f:
            f.write(f"$ {' '.join(argv)}\n".encode())
            f.flush()
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.dir,
                start_new_session=True,  # a Ctrl-C to pytest must not hit it before we stop it
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def _wait_ready(self, proc: Proc, what: str, ok: Callable[[], bool], timeout: float) -> None:
        def check() -> bool:
            proc.check_alive(self)
            return ok()

        try:
            wait_until(what, check, timeout)
        except LabError as e:
            if "exited with status" in str(e):
                raise
            raise LabError(f"{e}\n{self.format_logs()}") from None

    # ---- registry -----------------------------------------------------------------------------
    def _start_registry(self) -> None:
        storage = self.dir / "registry"
        storage.mkdir()
        for attempt in range(3):
            port = free_port()
            cfg = self.dir / "registry.yml"
            cfg.write_text(
                "version: 0.1\n"
                # Info level: one "response completed" line per request (method, URI, status, bytes),
                # which tests use to count what was fetched; the Apache-style access log is off.
                "log:\n  level: info\n  accesslog:\n    disabled: true\n"
                f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
                f"http:\n  addr: 127.0.0.1:{port}\n"
            )
            proc = self._spawn("registry", ["docker-registry", "serve", str(cfg)])
            url = f"http://127.0.0.1:{port}/v2/"
            try:
                self._wait_ready(proc, f"registry at {url}", lambda u=url: _http_ok(u), READY_TIMEOUT_S)  # type: ignore[misc]
            except LabError:
                # Most likely lost the free-port race; retry on another port.
                stop_pids([proc.pid])
                self.procs.remove(proc)
                if attempt == 2:
                    raise
                continue
            self.registry_host = f"127.0.0.1:{port}"
            self._write_hosts_toml()
            return

    @property
    def hosts_dir(self) -> Path:
        """containerd-style `certs.d` dir: `HOST:PORT/hosts.toml` marks the lab registry plain HTTP."""
        return self.dir / "certs.d"

    def _write_hosts_toml(self) -> None:
        d = self.hosts_dir / self.registry_host
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts.toml").write_text(
            f'server = "http://{self.registry_host}"\n\n'
            f'[host."http://{self.registry_host}"]\n'
            '  capabilities = ["pull", "resolve", "push"]\n'
        )

    # ---- our daemon ---------------------------------------------------------------------------
    def restart_daemon(self, sig: int = signal.SIGKILL, *, wipe_root: bool = False) -> None:
        """Stop our daemon with `sig` (SIGKILL: a crash; its mount processes live on), then start it
        again on the same socket and wait until containerd reaches it.

        wipe_root: also stop its mount processes and start on an empty root (cache, indexes,
        metadata gone); only sensible when containerd holds no snapshot of ours.
        """
        for proc in [p for p in self.procs if p.name == "snapshotter"]:
            if proc.popen.poll() is None:
                proc.popen.send_signal(sig)
                proc.popen.wait(timeout=STOP_GRACE_S * 4)
            self.procs.remove(proc)
        if wipe_root:
            root = self.snapshotter_root
            stop_pids(pids_mentioning(str(root) + "/", exclude={os.getpid()}))
            for mp in mounts_under(root):
                subprocess.run(["umount", "-l", mp], capture_output=True, timeout=30)
            if mounts_under(root):
                raise LabError(f"mounts left under {root}: {mounts_under(root)}")
            shutil.rmtree(root, ignore_errors=True)
        self._start_daemon()
        self.wait_daemon_reachable()

    def wait_daemon_reachable(self, timeout: float = 30.0) -> None:
        """Until containerd reaches our daemon: a probe Prepare goes through. containerd's gRPC
        client backs off after losing the plugin's socket, and `ctr snapshots ls` proves nothing
        (containerd answers it from its own metadata)."""
        def probe() -> bool:
            key = f"reach-probe-{time.monotonic_ns()}"
            if self.ctr("snapshots", "--snapshotter", PROXY_NAME, "prepare", key, check=False,
                        timeout=10).returncode != 0:
                return False
            self.ctr("snapshots", "--snapshotter", PROXY_NAME, "rm", key, check=False, timeout=10)
            return True

        wait_until("containerd to reach the restarted daemon", probe, timeout, interval=0.2)

    def daemon_log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.logs_dir.glob("snapshotter*.log")))

    def _start_daemon(self) -> None:
        self.snapshotter_root.mkdir(exist_ok=True)
        argv = [
            *self._daemon_command(),
            "serve",
            "--root",
            str(self.snapshotter_root),
            "--address",
            str(self.snapshotter_socket),
            "--containerd-address",
            str(self.containerd_socket),
        ]
        if self.daemon_config is not None:
            argv += ["--config", str(self.daemon_config)]
        argv += list(self.daemon_args)
        proc = self._spawn("snapshotter", argv)
        self._wait_ready(
            proc,
            f"snapshotter socket {self.snapshotter_socket}",
            lambda: unix_socket_accepts(self.snapshotter_socket),
            READY_TIMEOUT_S,
        )

    def _daemon_command(self) -> list[str]:
        if Path(self.snapshotter_bin).exists():
            return [str(self.snapshotter_bin)]
        # Not pip-installed yet (./ci installs it): run the checkout's package with the venv python.
        venv_python = REPO_ROOT / ".venv" / "bin" / "python"
        if venv_python.exists() and (REPO_ROOT / "snapshotter" / "cli.py").exists():
            return [str(venv_python), "-m", "snapshotter.cli"]
        raise LabError(f"snapshotter not found: {self.snapshotter_bin} (run ./ci to build the venv)")

    # ---- containerd ---------------------------------------------------------------------------
    def containerd_toml(self) -> str:
        d = self.dir
        return f"""\
version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
temp = "{d}/containerd/tmp"
# Snapshotters this machine cannot or need not run; overlayfs and native stay as baselines.
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "{self.containerd_socket}"

[debug]
  level = "debug"

[proxy_plugins]
  [proxy_plugins.{PROXY_NAME}]
    type = "snapshot"
    address = "{self.snapshotter_socket}"

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{d}/containerd/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_selinux = false
    disable_apparmor = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "{self.cri_snapshotter}"
      disable_snapshot_annotations = false
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "{self.hosts_dir}"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{d}/cni/bin"
      conf_dir = "{d}/cni/conf"
"""

    def _start_containerd(self) -> None:
        (self.dir / "containerd").mkdir()
        self.containerd_config.write_text(self.containerd_toml())
        proc = self._spawn("containerd", ["containerd", "--config", str(self.containerd_config)])

        def ready() -> bool:
            if not unix_socket_accepts(self.containerd_socket):
                return False
            r = self.ctr("version", check=False, timeout=10)
            return r.returncode == 0

        self._wait_ready(proc, f"containerd at {self.containerd_socket}", ready, READY_TIMEOUT_S)

    # ---- helpers for tests --------------------------------------------------------------------
    def ctr(
        self,
        *args: str,
        namespace: str | None = None,
        timeout: float = 60.0,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `ctr --address SOCK -n NS ARGS...`; on check and non-zero exit raise LabError."""
        argv = ["ctr", "--address", str(self.containerd_socket), "-n", namespace or self.namespace, *args]
        return self.run(argv, timeout=timeout, check=check, input=input)

    def collect_garbage(self, namespace: str | None = None) -> None:
        """Run a containerd garbage collection pass now and return once it is done, the
        snapshotters' cleanup included (deleting a lease with --sync). containerd's metadata
        layer forgets a deleted snapshot at once and calls the backend's Remove only from a later
        pass; a deletion that lands while a pass is running schedules none (containerd 1.6
        gc/scheduler drops events older than the pass's end), so without this the Remove can
        wait for some other deletion."""
        lease = f"gc-now-{uuid.uuid4().hex[:12]}"
        self.ctr("leases", "create", "--id", lease, namespace=namespace)
        self.ctr("leases", "delete", "--sync", lease, namespace=namespace)

    def ctr_run(
        self,
        ref: str,
        container_id: str,
        *command: str,
        snapshotter: str = PROXY_NAME,
        detach: bool = False,
        extra: Sequence[str] = (),
        timeout: float = 90.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """`ctr run [--rm|-d] --snapshotter S REF ID CMD...` with runc state and IO fifos kept under
        the lab dir (the defaults under /run/containerd are shared with every other containerd)."""
        argv = ["run", "-d" if detach else "--rm", "--snapshotter", snapshotter]
        argv += ["--runc-root", str(self.dir / "runc"), "--fifo-dir", str(self.dir / "fifo"), *extra]
        return self.ctr(*argv, ref, container_id, *command, timeout=timeout, check=check)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command with the lab's environment, bounded by `timeout`, capturing output."""
        try:
            r = subprocess.run(
                list(argv),
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.env,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise LabError(
                f"timed out after {timeout}s: {' '.join(argv)}\nstdout: {_s(e.stdout)}\nstderr: {_s(e.stderr)}"
            ) from None
        if check and r.returncode != 0:
            raise LabError(f"exit {r.returncode}: {' '.join(argv)}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def foundation_image(self) -> images.BuiltImage:
        """The Foundation image, built once per lab into `lab.dir/oci`."""
        if "foundation" not in self._image_cache:
            self._image_cache["foundation"] = images.foundation_image(self.dir / "oci")
        return self._image_cache["foundation"]

    def push(self, image: images.BuiltImage, name: str, tag: str | None = None) -> str:
        """Push an OCI-layout image to the lab registry; returns `127.0.0.1:PORT/NAME:TAG`."""
        ref = f"{self.registry_host}/{name}:{tag or image.tag}"
        self.run(
            [
                "skopeo",
                "copy",
                "--quiet",
                "--preserve-digests",
                "--dest-tls-verify=false",
                image.oci_ref,
                f"docker://{ref}",
            ],
            timeout=120,
        )
        return ref

    def pull(self, ref: str, snapshotter: str = PROXY_NAME, timeout: float = 120.0) -> None:
        self.ctr("images", "pull", "--plain-http", "--snapshotter", snapshotter, ref, timeout=timeout)

    def ctr_remote(
        self, *args: str, namespace: str | None = None, timeout: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`ctr-remote --address SOCK -n NS ARGS...` (stargz-snapshotter's ctr: convert, rpull, optimize)."""
        argv = ["ctr-remote", "--address", str(self.containerd_socket), "-n", namespace or self.namespace, *args]
        return self.run(argv, timeout=timeout, check=check)

    def push_converted(self, src_ref: str, dst_ref: str, fmt: str = "estargz", timeout: float = 300.0) -> str:
        """Pull `src_ref` (no unpack), convert it with ctr-remote (`estargz` or `zstdchunked`),
        push the result to `dst_ref` on the lab registry; returns `dst_ref`."""
        if fmt not in ("estargz", "zstdchunked"):
            raise ValueError(f"unknown format {fmt!r}")
        self.ctr_remote("image", "pull", "--plain-http", src_ref, timeout=timeout)
        self.ctr_remote("image", "convert", f"--{fmt}", "--oci", src_ref, dst_ref, timeout=timeout)
        self.ctr_remote("image", "push", "--plain-http", dst_ref, timeout=timeout)
        return dst_ref

    def rpull(self, ref: str, snapshotter: str = PROXY_NAME, timeout: float = 120.0) -> None:
        """`ctr-remote image rpull`: pull with the remote-snapshot labels set (the lazy path)."""
        self.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", snapshotter, ref, timeout=timeout)

    def log_paths(self) -> dict[str, Path]:
        return {p.stem: p for p in sorted(self.logs_dir.glob("*.log"))} if hasattr(self, "dir") else {}

    def format_logs(self, lines: int = 60) -> str:
        """The last `lines` lines of every process log, with headers; for failure messages."""
        parts = []
        order = {"snapshotter": 0, "containerd": 1, "registry": 2}
        for name, path in sorted(self.log_paths().items(), key=lambda kv: (order.get(kv[0], 3), kv[0])):
            n = min(lines, 15) if name == "registry" else lines  # the registry's log is rarely the story
            parts.append(f"----- {name} ({path}) last {n} lines -----\n{tail(path, n)}")
        return "\n".join(parts)


def _s(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
