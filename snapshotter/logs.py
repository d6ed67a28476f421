"""Logging set-up: one line per event, key=value text or JSON.

Messages are written as "event=NAME key=value ..."; the JSON format parses that back into fields.
Nothing here ever formats credentials: callers log registry hosts, repositories and digests only.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = f"time={ts} level={record.levelname.lower()} logger={record.name} {record.getMessage()}"
        if record.exc_info:
            line += " traceback=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {"time": record.created, "level": record.levelname.lower(), "logger": record.name}
        message = record.getMessage()
        try:
            parts = shlex.split(message)
        except ValueError:
            parts = []
        if parts and all("=" in p for p in parts):
            for part in parts:
                key, value = part.split("=", 1)
                doc[key] = value
        else:
            doc["msg"] = message
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, sort_keys=False)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
