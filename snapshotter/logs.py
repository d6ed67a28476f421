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


def q(value: object) -> str:
    """A log value that stays one token of a key=value line: as is when it has no space, quote,
    '=' or control character; else double-quoted with JSON escapes (shlex-compatible)."""
    text = str(value)
    if text and not any(c.isspace() or c in "\"'=\\" or ord(c) < 32 for c in text):
        return text
    return json.dumps(text)


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


# Third-party HTTP libraries log request URLs at INFO (a redirected blob URL may carry a signed
# query) and raw headers at DEBUG (auth challenges, cookies): never let them through below WARNING.
# Our registry client logs the requests that matter itself, without credentials.
# pyfuse3's debug lines (worker task churn, one per request) drown the events; held back too.
QUIET_LOGGERS = ("httpx", "httpcore", "hpack", "h2", "urllib3", "pyfuse3")


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
