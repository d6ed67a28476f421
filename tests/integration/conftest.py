"""Fixtures for the integration suite: one lab (registry + our daemon + containerd) per session.

`LAZYLAB_SNAPSHOTTER=overlayfs` runs the same tests against containerd's built-in overlayfs
snapshotter without starting our daemon: a check that the tests themselves encode containerd's
real behaviour. The default, and what CI runs, is our proxy plugin `lazy`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.lab import PROXY_NAME, Lab

_LAB: Lab | None = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def snapshotter_name() -> str:
    return os.environ.get("LAZYLAB_SNAPSHOTTER", PROXY_NAME)


@pytest.fixture(scope="session")
def lab(snapshotter_name: str) -> Iterator[Lab]:
    global _LAB
    with Lab(start_daemon=snapshotter_name == PROXY_NAME, cri_snapshotter=snapshotter_name) as the_lab:
        _LAB = the_lab
        try:
            yield the_lab
        finally:
            _LAB = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Attach the tails of the lab's process logs to every failing integration test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _LAB is not None:
        report.sections.append(("lab logs", _LAB.format_logs(lines=80)))
