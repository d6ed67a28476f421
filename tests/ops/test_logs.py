"""Log lines: one per event, key=value or JSON, values with spaces kept whole, HTTP libraries quiet."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapshotter.logs import QUIET_LOGGERS, JsonFormatter, KeyValueFormatter, q, setup_logging

REPO = Path(__file__).resolve().parents[2]


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("snapshotter.x", logging.WARNING, __file__, 1, msg, args, None)


def test_quoted_values_survive_both_formats() -> None:
    rec = _record("event=grpc method=%s key=%s error=%s", "Prepare", q("ns/1/extract-1 sha256:ab"), q('said "no"'))
    text = KeyValueFormatter().format(rec)
    assert text.count("\n") == 0 and 'key="ns/1/extract-1 sha256:ab"' in text and "level=warning" in text
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["event"] == "grpc" and doc["key"] == "ns/1/extract-1 sha256:ab" and doc["error"] == 'said "no"'
    assert doc["level"] == "warning" and doc["logger"] == "snapshotter.x"


def test_http_libraries_are_held_at_warning_even_at_debug() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, {n: logging.getLogger(n).level for n in QUIET_LOGGERS})
    try:
        setup_logging("debug", "text")
        assert root.level == logging.DEBUG
        for name in ("httpx", "httpcore", "httpcore.http11", "pyfuse3"):
            assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger("snapshotter.fetch").isEnabledFor(logging.DEBUG)
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_daemon_writes_one_event_per_line(tmp_path: Path, fmt: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'log_format = "{fmt}"\nlog_level = "debug"\n')
    log_path = tmp_path / "daemon.log"
    sock = tmp_path / "run" / "sn.sock"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "snapshotter.cli", "serve", "--root", str(tmp_path / "root"),
                                 "--address", str(sock), "--config", str(config)],
                                stdout=out, stderr=out, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 20
        while "event=serving" not in log_path.read_text() and '"event": "serving"' not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    assert len(lines) >= 3  # admin_serving, serving, signal, stopped
    for line in lines:
        if fmt == "json":
            doc = json.loads(line)
            assert {"time", "level", "logger", "event"} <= doc.keys(), line
        else:
            assert line.startswith("time=") and " level=" in line and " event=" in line, line
