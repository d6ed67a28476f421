"""The daemon's TOML settings mapped onto the fetch layer's FetchConfig."""

from __future__ import annotations

from pathlib import Path

from snapshotter.config import Config
from snapshotter.fetch.config import FetchConfig


def fetch_config_from(config: Config) -> FetchConfig:
    """FetchConfig for `config`: registry.* and cache.max_inflight_bytes; docker config defaulting
    to ~/.docker/config.json. The file need not exist yet: the daemon's long-lived client reads it
    when it appears or changes (fetch/auth.py CredentialStore)."""
    reg = config.registry
    docker = Path(reg.docker_config) if reg.docker_config else Path.home() / ".docker" / "config.json"
    return FetchConfig(
        request_timeout=reg.request_timeout,
        read_timeout=min(30.0, reg.request_timeout),
        connect_timeout=min(10.0, reg.request_timeout),
        retries=reg.retries,
        max_parallel_per_registry=max(1, reg.max_parallel),
        max_merge_bytes=max(1, reg.max_merge_bytes),
        max_inflight_bytes=max(1, config.cache.max_inflight_bytes),
        docker_config=docker,
        hosts_config_path=Path(reg.config_path) if reg.config_path else None,
    )
