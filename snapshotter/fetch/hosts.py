"""containerd's registry host configuration (`config_path` directory of hosts.toml files).

Lookup for registry `HOST[:PORT]` under `config_path`: `HOST_PORT_/`, then `HOST:PORT/`, then
`_default/`; the first directory that exists is used. In its `hosts.toml`:

    server = "https://origin"              # optional; default: the registry itself
    capabilities = ["pull", "resolve"]     # of the server (default: all)
    [host."https://mirror:5000"]           # tried first, in file order
      capabilities = ["pull"]
      skip_verify = true
      ca = "ca.pem"                        # or a list; relative to the host directory
      client = [["c.pem", "k.pem"]]
      header = { X-Foo = "bar" }           # or a list of values
      override_path = false

Without hosts.toml (or no directory) the registry itself is the only host: docker.io maps to
https://registry-1.docker.io; a loopback registry (localhost, 127.0.0.0/8, ::1) is tried over
HTTPS without verification and falls back to plain HTTP (`RegistryHost.http_fallback`);
anything else is HTTPS. Plain HTTP elsewhere only where a `server`/`host` URL says http://.
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from snapshotter.errors import ConfigError
from snapshotter.fetch.reference import DOCKER_IO

PULL = "pull"
RESOLVE = "resolve"
PUSH = "push"
ALL_CAPABILITIES = frozenset({PULL, RESOLVE, PUSH})


@dataclass(frozen=True)
class RegistryHost:
    """One endpoint to try for a registry. `is_mirror` is False only for the origin/server."""

    scheme: str
    host: str
    path: str = "/v2"
    capabilities: frozenset[str] = ALL_CAPABILITIES
    skip_verify: bool | None = None
    ca: tuple[Path, ...] = ()
    client_certs: tuple[tuple[Path, Path | None], ...] = ()
    header: tuple[tuple[str, str], ...] = ()
    is_mirror: bool = False
    http_fallback: bool = False

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}{self.path}"

    def tls_key(self) -> tuple[object, ...]:
        """Hosts with equal keys can share an HTTP client (same TLS settings)."""
        return (self.skip_verify, self.ca, self.client_certs)


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1, with or without a port."""
    name = split_host_port(host)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host_port(host: str) -> tuple[str, int | None]:
    if host.startswith("["):
        addr, _, rest = host[1:].partition("]")
        return addr, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    name, sep, port = host.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        return name, int(port)
    return host, None


def host_dir_candidates(config_path: Path, registry: str) -> list[Path]:
    """Directories containerd looks at for `registry`, in order."""
    out: list[Path] = []
    idx = registry.rfind(":")
    if idx > 0:
        out.append(config_path / f"{registry[:idx]}_{registry[idx + 1:]}_")
    out += [config_path / registry, config_path / "_default"]
    return out


def default_host(registry: str) -> RegistryHost:
    if registry == DOCKER_IO:
        return RegistryHost("https", "registry-1.docker.io")
    if is_loopback(registry):
        return RegistryHost("https", registry, skip_verify=True, http_fallback=True)
    return RegistryHost("https", registry)


def load_hosts(config_path: Path | None, registry: str) -> tuple[RegistryHost, ...]:
    """The endpoints to try for `registry`, mirrors first, the origin/server last.

    Raises ConfigError naming the file for unreadable or invalid hosts.toml. (containerd logs and
    ignores a broken file; we refuse it, since silently pulling from the origin hides a typo.)
    """
    if config_path is None:
        return (default_host(registry),)
    for d in host_dir_candidates(config_path, registry):
        if d.is_dir():
            return _load_dir(d, registry)
    return (default_host(registry),)


def _load_dir(d: Path, registry: str) -> tuple[RegistryHost, ...]:
    f = d / "hosts.toml"
    try:
        raw = f.read_bytes()
    except FileNotFoundError:
        return (_with_certs_dir(default_host(registry), d),)
    except OSError as e:
        raise ConfigError(f"{f}: cannot read: {e}") from e
    if not raw.strip():
        return (_with_certs_dir(default_host(registry), d),)
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f}: invalid TOML: {e}") from e
    hosts: list[RegistryHost] = []
    table = doc.get("host", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{f}: `host` must be a table of [host.\"URL\"] sections")
    # tomllib keeps file order, which is the order containerd tries them in.
    for url, section in table.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{f}: [host.{url!r}] must be a table")
        hosts.append(_parse_host(f, url, section, d, is_mirror=True))
    server = doc.get("server", "")
    if not isinstance(server, str):
        raise ConfigError(f"{f}: `server` must be a string")
    root = {k: v for k, v in doc.items() if k not in ("host", "server")}
    if server:
        hosts.append(_parse_host(f, server, root, d, is_mirror=False))
    else:
        base = default_host(registry)
        parsed = _parse_host(f, base.base_url, root, d, is_mirror=False)
        hosts.append(
            RegistryHost(
                base.scheme, base.host, base.path, parsed.capabilities,
                parsed.skip_verify if parsed.skip_verify is not None else base.skip_verify,
                parsed.ca, parsed.client_certs, parsed.header, False, base.http_fallback,
            )
        )
    return tuple(hosts)


def _with_certs_dir(host: RegistryHost, d: Path) -> RegistryHost:
    """Docker's certs.d layout: *.crt are CAs, X.cert (+ X.key) client pairs."""
    cas = tuple(sorted(p for p in d.glob("*.crt") if p.is_file()))
    pairs = tuple(
        (p, p.with_suffix(".key") if p.with_suffix(".key").exists() else None)
        for p in sorted(d.glob("*.cert"))
    )
    if not cas and not pairs:
        return host
    return RegistryHost(host.scheme, host.host, host.path, host.capabilities, host.skip_verify,
                        cas, pairs, host.header, host.is_mirror, host.http_fallback)


def _parse_host(
    f: Path, url: str, section: Mapping[str, Any], base: Path, *, is_mirror: bool
) -> RegistryHost:
    where = f"{f}: [host.{url!r}]" if is_mirror else f"{f}: server {url!r}"
    if "://" not in url:
        url = "https://" + url
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ConfigError(f"{where}: not an http(s) URL")
    override = bool(section.get("override_path", False))
    path = u.path.rstrip("/")
    if path:
        path = "/" + "/".join(p for p in path.split("/") if p)
        if not path.endswith("/v2") and not override:
            path += "/v2"
    elif not override:
        path = "/v2"
    caps_raw = section.get("capabilities")
    if caps_raw is None:
        caps = ALL_CAPABILITIES
    else:
        if not isinstance(caps_raw, list) or not all(isinstance(c, str) for c in caps_raw):
            raise ConfigError(f"{where}: capabilities must be a list of strings")
        caps = frozenset(c.lower() for c in caps_raw)
        unknown = caps - ALL_CAPABILITIES
        if unknown:
            raise ConfigError(f"{where}: unknown capability {sorted(unknown)[0]!r}")
    skip = section.get("skip_verify")
    if skip is not None and not isinstance(skip, bool):
        raise ConfigError(f"{where}: skip_verify must be true or false")
    ca = tuple(_abs(base, p) for p in _str_list(section.get("ca"), where, "ca"))
    client: list[tuple[Path, Path | None]] = []
    raw_client = section.get("client")
    if isinstance(raw_client, str):
        client.append((_abs(base, raw_client), None))
    elif isinstance(raw_client, list):
        for item in raw_client:
            if isinstance(item, str):
                client.append((_abs(base, item), None))
            elif isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item):
                client.append((_abs(base, item[0]), _abs(base, item[1])))
            else:
                raise ConfigError(f"{where}: invalid client entry {item!r}")
    elif raw_client is not None:
        raise ConfigError(f"{where}: client must be a string or a list")
    header: list[tuple[str, str]] = []
    raw_header = section.get("header", {})
    if not isinstance(raw_header, dict):
        raise ConfigError(f"{where}: header must be a table")
    for key, value in raw_header.items():
        for v in _str_list(value, where, f"header {key!r}"):
            header.append((key, v))
    return RegistryHost(u.scheme, u.netloc, path, caps, skip, ca, tuple(client), tuple(header), is_mirror)


def _str_list(value: object, where: str, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{where}: {what} must be a string or a list of strings")


def _abs(base: Path, p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else base / path
