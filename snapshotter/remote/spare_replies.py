"""The spare mount process's answers to the preloads that asked for one.

A preload line with an "id" (remote/mounts.py `preload`) asks the spare to say whether the
layer's metadata parsed, on a pipe the daemon gave it (`--reply-fd`), one JSON line per such
preload, as soon as the parse ends:

    {"id": N, "ok": true, "toc_digest": DIGEST_OR_NULL}   parsed
    {"id": N, "ok": false, "why": TEXT}                   not parsed (skipped, failed): parse it yourself

The daemon then stores the metadata bytes (remote/store.py `save_metadata`) instead of parsing
them itself: the parse's memory peak (some 12 MiB for an 11,000-entry TOC) lands in the spare,
which pays it anyway, and not in the daemon too, and containerd's Prepare waits for neither the
daemon's parse nor the writing of an index. A spare that answers "not ok", closes the pipe (it
was handed a mount, or died) or does not answer in time leaves the parse to the daemon, as
before; so does every failed parse, whose error the daemon's own parse reports.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

log = logging.getLogger(__name__)

MAX_UNCLAIMED = 256  # answers nobody waits for (a wait that gave up) are dropped past this


@dataclass(frozen=True)
class SpareParsed:
    """The spare parsed the layer's metadata; toc_digest: its index's."""

    toc_digest: str | None


# The wait for one preload's answer: (timeout seconds) -> the spare's parse, or None (parse it yourself).
SpareWait = Callable[[float], SpareParsed | None]


class SpareReplies:
    """Reads the answers from the read end `fd` of the spare's reply pipe (owned from here on) on
    a thread of its own until the spare closes its end. Thread-safe."""

    def __init__(self, fd: int, pid: int) -> None:
        self._cond = threading.Condition()
        self._answers: dict[int, dict[str, object]] = {}
        self._abandoned: set[int] = set()  # waits that gave up: their answers are nobody's
        self._closed = False
        self._next_id = 0
        self.pid = pid
        self._thread = threading.Thread(target=self._read, args=(os.fdopen(fd, "rb"),),
                                        name=f"spare-replies-{pid}", daemon=True)
        self._thread.start()

    def new_id(self) -> int:
        with self._cond:
            self._next_id += 1
            return self._next_id

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def _read(self, pipe: BinaryIO) -> None:
        try:
            for line in iter(pipe.readline, b""):
                try:
                    doc = json.loads(line)
                    answer_id = doc["id"] if isinstance(doc, dict) else None
                    if type(answer_id) is not int:
                        raise TypeError("not an object with a numeric id")
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("event=spare_reply_bad pid=%d line=%r error=%s", self.pid, line[:200], exc)
                    continue
                with self._cond:
                    if answer_id in self._abandoned:
                        self._abandoned.discard(answer_id)
                        log.info("event=spare_reply_late pid=%d id=%d", self.pid, answer_id)
                        continue
                    if len(self._answers) >= MAX_UNCLAIMED:
                        self._answers.pop(min(self._answers))
                    self._answers[answer_id] = doc
                    self._cond.notify_all()
        except OSError as exc:
            log.warning("event=spare_reply_failed pid=%d error=%s", self.pid, exc)
        finally:
            pipe.close()
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def wait(self, answer_id: int, timeout: float) -> SpareParsed | None:
        """The spare's answer to preload `answer_id`; None when it did not parse it (said so,
        closed the pipe, or `timeout` seconds passed)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while answer_id not in self._answers and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            doc = self._answers.pop(answer_id, None)
            if doc is None and not self._closed:
                if len(self._abandoned) >= MAX_UNCLAIMED:
                    self._abandoned.discard(min(self._abandoned))
                self._abandoned.add(answer_id)
        if doc is not None and doc.get("ok") is True:
            digest = doc.get("toc_digest")
            return SpareParsed(digest if isinstance(digest, str) else None)
        why = "no answer" if doc is None else str(doc.get("why", "not ok"))
        log.info("event=spare_parse_declined pid=%d why=%r", self.pid, why[:200])
        return None
