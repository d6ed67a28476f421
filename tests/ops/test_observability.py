"""Operations, end to end on a lab: /metrics during a lazy run, `snapshotter status` with a lazy
image and fallen-back layers, the mount reading with the daemon's token, and no credential or
token in any log, state file or status output.

One lab for the module. The lazy image is pulled through a token-auth proxy (Bearer tokens
issued against Basic credentials) in front of the lab registry; the daemon logs at DEBUG and
gets the credentials from a docker config.json. The fallback image (plain gzip) comes from the
lab registry directly.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from integration import images
from integration.lab import Lab, free_port
from tests.fetch.proxies import RegistryProxy

pytestmark = pytest.mark.integration

USER = "opsuser"
PASSWORD = "Pw-" + hashlib.sha256(b"ops-test-password").hexdigest()[:20]
BIG = 9 * 1024 * 1024 + 777  # three 4 MiB eStargz chunks: sequential reads trigger read-ahead
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Env:
    lab: Lab
    proxy: RegistryProxy
    metrics_url: str
    lazy_ref: str
    gzip_ref: str
    layer_digests: list[str]  # of the lazy image, bottom first
    layer_sizes: dict[str, int]
    gzip_digests: list[str]


def _hosts_toml(hosts_dir: Path, host: str) -> None:
    d = hosts_dir / host
    d.mkdir(parents=True, exist_ok=True)
    (d / "hosts.toml").write_text(f'server = "http://{host}"\n\n[host."http://{host}"]\n'
                                  '  capabilities = ["pull", "resolve"]\n')


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("ops")
    hosts = work / "hosts"
    hosts.mkdir()
    docker_config = work / "docker-config.json"
    metrics_port = free_port()
    config = work / "config.toml"
    config.write_text(
        'log_level = "debug"\n'
        f'metrics_address = "127.0.0.1:{metrics_port}"\n'
        "[registry]\n"
        f'config_path = "{hosts}"\n'
        f'docker_config = "{docker_config}"\n'
    )
    with Lab(daemon_config=config) as lab:
        proxy = RegistryProxy(f"http://{lab.registry_host}", bearer=True, token_credentials=(USER, PASSWORD))
        try:
            auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
            docker_config.write_text(json.dumps({"auths": {proxy.host: {"auth": auth}}}))
            _hosts_toml(hosts, proxy.host)
            _hosts_toml(hosts, lab.registry_host)
            layers, _expect = images.foundation_layers()
            big: list[images.Entry] = [images.Dir("data"),
                                       images.File("data/big.bin", images.deterministic_bytes(BIG, seed=11)),
                                       images.File("data/small.txt", b"small file\n")]
            img = images.build_image(lab.dir / "oci", "ops", [*layers, big])
            gzip_ref = lab.push(img, "ops")
            lab.push_converted(gzip_ref, f"{lab.registry_host}/ops:esgz")
            lazy_ref = f"{proxy.host}/ops:esgz"
            manifest = _manifest(lab.registry_host, "ops", "esgz")
            yield Env(lab, proxy, f"http://127.0.0.1:{metrics_port}/metrics", lazy_ref, gzip_ref,
                      [str(x["digest"]) for x in manifest["layers"]],
                      {str(x["digest"]): int(str(x["size"])) for x in manifest["layers"]},
                      [layer.digest for layer in img.layers])
        finally:
            proxy.stop()


def _manifest(host: str, repo: str, tag: str) -> dict[str, list[dict[str, object]]]:
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{tag}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        doc: dict[str, list[dict[str, object]]] = json.load(r)
    return doc


def scrape(url: str) -> tuple[str, dict[str, list[tuple[dict[str, str], float]]]]:
    """The /metrics text and its samples: name -> [(labels, value)]."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return text, samples


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    assert name in samples, f"metric {name} missing; have {sorted(samples)}"
    return sum(v for lv, v in samples[name] if all(lv.get(k) == want for k, want in labels.items()))


def status(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "snapshotter.cli", "status", "--address",
                           str(lab.snapshotter_socket), *args], capture_output=True, text=True, timeout=30,
                          cwd=REPO_ROOT, check=False)


def test_metrics_status_and_no_credentials_in_logs(env: Env) -> None:
    lab = env.lab
    lab.ctr_remote("image", "rpull", "--plain-http", "--user", f"{USER}:{PASSWORD}", "--snapshotter", "lazy",
                   env.lazy_ref)
    assert env.proxy.tokens_issued >= 1, "the lazy pull should have gone through the token proxy"
    tokens_after_pull, refused_after_pull = env.proxy.tokens_issued, _unauthorized(env.proxy)
    # A container that reads through the lazy mount, then stays up while we look.
    script = ("cat /etc/layer1.txt /data/small.txt > /dev/null; sha256sum /data/big.bin > /sum.txt; "
              "echo done > /done; sleep 120")
    lab.ctr_run(env.lazy_ref, "ops-reader", "sh", "-c", script, detach=True)
    try:
        _check_while_running(env)
        # The mount process read everything with the daemon's token (handed to it with its
        # assignment): it met no 401 and asked the token server for nothing.
        assert (env.proxy.tokens_issued, _unauthorized(env.proxy)) == (tokens_after_pull, refused_after_pull)
        assert "event=auth_handoff tokens=1" in "".join(
            p.read_text(errors="replace") for p in (lab.snapshotter_root / "mounts").glob("*/log"))
    finally:
        lab.ctr("tasks", "kill", "-s", "SIGKILL", "ops-reader", check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "ops-reader" in lab.ctr("tasks", "ls", "-q").stdout:
            lab.ctr("tasks", "delete", "ops-reader", check=False)
            time.sleep(0.2)
        lab.ctr("containers", "delete", "ops-reader", check=False)


def _unauthorized(proxy: RegistryProxy) -> int:
    """Registry requests the proxy answered 401 so far."""
    return sum(r.status == 401 for r in proxy.requests if r.path.startswith("/v2/"))


def _check_while_running(env: Env) -> None:
    lab = env.lab
    mounts_dir = lab.snapshotter_root / "mounts"
    expected_sum = hashlib.sha256(images.deterministic_bytes(BIG, seed=11)).hexdigest()

    # -- metrics during the run: wait until the mount process's stats show the whole big file read.
    deadline = time.monotonic() + 60
    while True:
        text, samples = scrape(env.metrics_url)
        served = total(samples, "snapshotter_fuse_read_bytes_total") if "snapshotter_fuse_read_bytes_total" \
            in samples else 0
        if served >= BIG:
            break
        assert time.monotonic() < deadline, f"the mount never served {BIG} bytes:\n{text[-3000:]}"
        time.sleep(0.5)
    reads = total(samples, "snapshotter_fuse_operations_total", op="read")
    lookups = total(samples, "snapshotter_fuse_operations_total", op="lookup")
    # At most 1 MiB per FUSE read (the mount's read-ahead window); fewer reads would mean the
    # counter misses some.
    assert reads >= BIG / (1 << 20) and lookups > 0
    assert total(samples, "snapshotter_fuse_operation_seconds_count", op="read") == reads
    inf_bucket = total(samples, "snapshotter_fuse_operation_seconds_bucket", op="read", le="+Inf")
    assert inf_bucket == reads and total(samples, "snapshotter_fuse_operation_seconds_sum", op="read") > 0
    assert total(samples, "snapshotter_fuse_read_errors_total") == 0
    assert "snapshotter_fuse_operation_errors_total" in samples
    image_labels = {lv["image"] for lv, _ in samples["snapshotter_fuse_read_bytes_total"]}
    assert env.lazy_ref in image_labels

    registry = env.proxy.host
    on_demand = total(samples, "snapshotter_fetched_bytes_total", registry=registry, cause="on_demand")
    background = total(samples, "snapshotter_fetched_bytes_total", registry=registry, cause="background")
    prefetch = total(samples, "snapshotter_fetched_bytes_total", registry=registry, cause="prefetch")
    fetched = on_demand + background + prefetch
    assert on_demand > 0 and background >= 0 and prefetch >= 0
    # Fetched: at least the big file's compressed bytes (incompressible), never more than the layers.
    assert BIG <= fetched <= sum(env.layer_sizes.values())
    assert total(samples, "snapshotter_registry_bytes_received_total", host=registry) >= fetched
    hits = total(samples, "snapshotter_cache_hits_total")
    misses = total(samples, "snapshotter_cache_misses_total")
    assert misses >= 1 and hits >= 1  # 128 KiB FUSE reads of a 4 MiB chunk: one miss, then hits
    assert total(samples, "snapshotter_cache_evictions_total") == 0  # the cap is 50 GiB
    assert "snapshotter_cache_evicted_bytes_total" in samples
    assert total(samples, "snapshotter_cache_bytes") >= BIG and total(samples, "snapshotter_cache_chunks") >= 3
    assert total(samples, "snapshotter_mounts_alive") >= 1
    assert total(samples, "snapshotter_resolve_seconds_count") >= len(env.layer_digests)
    assert total(samples, "snapshotter_resolve_fetched_bytes_total", registry=registry) > 0
    assert total(samples, "snapshotter_layer_prepares_total", outcome="lazy", format="estargz") >= len(
        env.layer_digests)
    assert total(samples, "snapshotter_grpc_calls_total", method="Prepare") >= len(env.layer_digests)
    # A remote prepare answers ALREADY_EXISTS: that is how containerd learns to skip the download.
    assert total(samples, "snapshotter_grpc_errors_total", method="Prepare") >= len(env.layer_digests)
    assert total(samples, "snapshotter_grpc_seconds_count", method="Prepare") >= len(env.layer_digests)

    # The container saw the right bytes.
    mount_ids = sorted(p.name for p in mounts_dir.iterdir() if p.is_dir())
    assert mount_ids, "no mount process"

    # -- a fallback: plain gzip layers, another namespace.
    lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", env.gzip_ref, namespace="opsfb")
    _text, samples = scrape(env.metrics_url)
    assert total(samples, "snapshotter_fallbacks_total", reason="not_lazy") >= len(env.gzip_digests)
    assert total(samples, "snapshotter_layer_prepares_total", outcome="fallback") >= len(env.gzip_digests)
    for digest in env.gzip_digests:
        record = json.loads((lab.snapshotter_root / "layers" / digest.split(":")[1] / "fallback.json").read_text())
        assert record["reason"] == "not_lazy" and record["image"] == env.gzip_ref

    # -- snapshotter status
    r = status(lab, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    by_image = {i["image"]: i for i in doc["images"]}
    lazy = by_image[env.lazy_ref]
    assert [layer["digest"] for layer in lazy["layers"]] == env.layer_digests
    assert all(layer["state"] == "lazy" and layer["format"] == "estargz" for layer in lazy["layers"])
    for layer in lazy["layers"]:
        assert layer["size"] == env.layer_sizes[layer["digest"]]
        assert 0 <= layer["fetched_bytes"] <= layer["size"]
    # The mount's prefetch state per layer (fusefs/prefetch.py), when the mount reports one.
    assert all(isinstance(layer["prefetch"].get("prefetch"), str) for layer in lazy["layers"])
    top = lazy["layers"][-1]
    assert top["fetched_bytes"] >= BIG and top["fetched_bytes_by_cause"]["on_demand"] > 0
    assert lazy["mounts"], "the running container's mount belongs to the lazy image"
    mounts = {m["id"]: m for m in doc["mounts"]}
    live = mounts[lazy["mounts"][0]]
    assert live["alive"] and live["health"] == "ok" and isinstance(live["pid"], int)
    assert Path(f"/proc/{live['pid']}").exists()
    fell_back = by_image[env.gzip_ref]
    assert [layer["digest"] for layer in fell_back["layers"]] == env.gzip_digests
    assert all(layer["state"] == "fallback" and layer["reason"] == "not_lazy" for layer in fell_back["layers"])
    assert doc["cache"]["bytes"] >= BIG and doc["cache"]["max_bytes"] == 50 << 30
    text_status = status(lab)
    assert text_status.returncode == 0, text_status.stderr
    assert "lazy (estargz), fetched" in text_status.stdout
    assert "fell back (not_lazy)" in text_status.stdout and ", prefetch " in text_status.stdout
    assert f"image {env.gzip_ref}" in text_status.stdout and f"image {env.lazy_ref}" in text_status.stdout
    print(text_status.stdout)

    # The container read the file correctly through the lazy mount.
    upper_sum = _container_file(lab, "ops-reader", "sum.txt")
    assert upper_sum.split()[0] == expected_sum

    # -- no credentials or tokens anywhere we write or answer.
    mount_logs = "".join(p.read_text(errors="replace") for p in mounts_dir.glob("*/log"))
    states = "".join(p.read_text(errors="replace") for p in mounts_dir.glob("*/state.json"))
    assert states, "no mount state file"
    daemon_log = lab.daemon_log()
    # At DEBUG both (the mount's own requests log nothing at DEBUG: it authenticated with the daemon's token).
    mount_argv = Path(f"/proc/{live['pid']}/cmdline").read_bytes().split(b"\0")
    assert "level=debug" in daemon_log and b"--log-level" in mount_argv and \
        mount_argv[mount_argv.index(b"--log-level") + 1] == b"debug", "DEBUG logging should be on"
    secrets = [PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode(), *env.proxy.tokens]
    assert len(secrets) >= 3
    for where, content in (("daemon log", daemon_log), ("mount logs", mount_logs), ("mount state files", states),
                           ("status --json", r.stdout), ("status", text_status.stdout), ("metrics", text)):
        for secret in secrets:
            assert secret not in content, f"a credential or token appears in the {where}"
        assert "Authorization" not in content and "Bearer " not in content, where


def _container_file(lab: Lab, container: str, name: str) -> str:
    deadline = time.monotonic() + 30
    while True:
        mounts = lab.ctr("snapshots", "--snapshotter", "lazy", "mounts", "/x", container).stdout
        upper = next((part.split("=", 1)[1] for part in mounts.replace(",", " ").split()
                      if part.startswith("upperdir=")), None)
        assert upper, mounts
        path = Path(upper) / name
        if path.exists() and path.read_text().strip():
            return path.read_text()
        assert time.monotonic() < deadline, f"{name} never appeared in the container"
        time.sleep(0.2)
