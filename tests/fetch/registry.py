"""Test helpers: run the real distribution registry (`docker-registry serve`) and push to it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import httpx

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_htpasswd(path: Path, users: dict[str, str]) -> None:
    """A bcrypt htpasswd file, made with the stdlib `crypt` module (libxcrypt's $2b$)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        lines = [f"{u}:{crypt.crypt(p, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 4))}"
                 for u, p in users.items()]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class RegistryProcess:
    proc: subprocess.Popen[bytes]
    port: int
    root: Path
    log_path: Path
    scheme: str = "http"
    stopped: bool = field(default=False)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    def stop(self, timeout: float = 10.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)

    def wait_cached(self, repository: str, digest: str, timeout: float = 20.0) -> None:
        """Wait (bounded) until this pull-through cache has committed blob `digest` of `repository`.

        The registry (distribution 2.8) stores a proxied blob in a goroutine after it answered;
        its filesystem driver writes the repository's link by truncating the file and writing it
        at commit, so a request that lands in that window can get a 500. A test that needs the
        cache to answer waits for the complete link and for the upload directory to be gone.
        """
        repo_dir = self.root / "docker/registry/v2/repositories" / repository
        link = repo_dir / "_layers" / digest.replace(":", "/", 1) / "link"
        uploads = repo_dir / "_uploads"
        deadline = time.monotonic() + timeout
        while True:
            linked = link.exists() and link.read_text() == digest
            if linked and not (uploads.exists() and any(uploads.iterdir())):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"registry {self.host}: blob {digest} of {repository} not cached "
                                   f"after {timeout}s (link {'complete' if linked else 'missing'})")
            time.sleep(0.02)


def start_registry(workdir: Path, *, htpasswd: Path | None = None, proxy_remote: str | None = None,
                   tls: tuple[Path, Path] | None = None, port: int | None = None,
                   timeout: float = 20.0) -> RegistryProcess:
    """Start `docker-registry serve` on 127.0.0.1 with filesystem storage under workdir.

    Waits (bounded) until /v2/ answers 200 or 401. The caller must `stop()` it.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    root = workdir / "storage"
    lines = [
        "version: 0.1",
        "log:",
        "  level: info",
        "  accesslog:",
        "    disabled: false",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {root}",
        "  delete:",
        "    enabled: true",
        "http:",
        f"  addr: 127.0.0.1:{port}",
        "  secret: test-secret-not-for-production",
    ]
    if tls is not None:
        lines += ["  tls:", f"    certificate: {tls[0]}", f"    key: {tls[1]}"]
    if htpasswd is not None:
        lines += ["auth:", "  htpasswd:", "    realm: test-realm", f"    path: {htpasswd}"]
    if proxy_remote is not None:
        lines += ["proxy:", f"  remoteurl: {proxy_remote}"]
    cfg = workdir / "config.yml"
    cfg.write_text("\n".join(lines) + "\n")
    log_path = workdir / "registry.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    reg = RegistryProcess(proc, port, root, log_path, "https" if tls else "http")
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"registry exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            r = httpx.get(f"{reg.url}/v2/", timeout=1.0, verify=False)
            if r.status_code in (200, 401):
                return reg
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            reg.stop()
            raise RuntimeError(f"registry on {reg.host} not ready after {timeout}s")
        time.sleep(0.05)


def push_blob(base_url: str, repo: str, data: bytes, *, auth: tuple[str, str] | None = None) -> str:
    """Monolithic upload: POST /v2/REPO/blobs/uploads/, then PUT LOCATION?digest=."""
    digest = sha256_digest(data)
    with httpx.Client(auth=auth, timeout=30.0, verify=False) as c:
        r = c.post(f"{base_url}/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, (r.status_code, r.text)
        loc = httpx.URL(base_url).join(r.headers["Location"])
        r = c.put(loc.copy_merge_params({"digest": digest}), content=data,
                  headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 201, (r.status_code, r.text)
    return digest


@dataclass(frozen=True)
class PushedImage:
    registry: str
    repository: str
    tag: str
    manifest_digest: str
    manifest: bytes
    layers: dict[str, bytes]

    @property
    def ref(self) -> str:
        return f"{self.registry}/{self.repository}:{self.tag}"


def push_image(base_url: str, repo: str, tag: str, layers: list[bytes], *,
               auth: tuple[str, str] | None = None) -> PushedImage:
    """Push config + layers + an OCI manifest (the layers need not be real tars)."""
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    config_digest = push_blob(base_url, repo, config, auth=auth)
    layer_digests = [push_blob(base_url, repo, data, auth=auth) for data in layers]
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": OCI_LAYER, "digest": d, "size": len(b)}
                   for d, b in zip(layer_digests, layers, strict=True)],
    }).encode()
    with httpx.Client(auth=auth, timeout=30.0, verify=False) as c:
        r = c.put(f"{base_url}/v2/{repo}/manifests/{tag}", content=manifest,
                  headers={"Content-Type": OCI_MANIFEST})
        assert r.status_code == 201, (r.status_code, r.text)
    host = httpx.URL(base_url).netloc.decode()
    return PushedImage(host, repo, tag, sha256_digest(manifest), manifest,
                       dict(zip(layer_digests, layers, strict=True)))


def make_self_signed(d: Path, ip: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate for `ip` (its own CA), made with the openssl CLI."""
    cert, key = d / "server.pem", d / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", f"/CN={ip}", "-addext", f"subjectAltName=IP:{ip}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key
