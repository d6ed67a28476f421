"""Fixtures: one real distribution registry for the session, with a pushed test image."""

from __future__ import annotations

import random

import pytest

from snapshotter.fetch import FetchConfig
from tests.fetch.registry import PushedImage, RegistryProcess, push_image

FAST = FetchConfig(retries=2, backoff_initial=0.01, backoff_max=0.05, connect_timeout=2.0,
                   read_timeout=5.0, request_timeout=15.0)


@pytest.fixture(scope="session")
def origin(registry: RegistryProcess) -> RegistryProcess:
    """The session's registry, as the origin that mirrors and proxies in these tests stand for."""
    return registry


@pytest.fixture(scope="session")
def image(origin: RegistryProcess) -> PushedImage:
    rnd = random.Random(1234)
    return push_image(origin.url, "test/app", "v1", [rnd.randbytes(300_000), rnd.randbytes(5_000)])


@pytest.fixture
def big_layer(image: PushedImage) -> tuple[str, bytes]:
    digest, data = max(image.layers.items(), key=lambda kv: len(kv[1]))
    return digest, data
