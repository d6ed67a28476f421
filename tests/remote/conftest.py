"""Fixtures shared by the remote-snapshot tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fetch.registry import RegistryProcess, start_registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    """A real distribution registry on loopback, one per test module."""
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield reg
    finally:
        reg.stop()
