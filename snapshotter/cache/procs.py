"""Process identity for pins: (pid, start time) so a reused pid does not inherit old pins."""

from __future__ import annotations

import os


def start_time(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (from /proc), or None if gone.

    Falls back to "" when /proc is unreadable but the pid exists (then only the pid is checked).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return "" if _pid_exists(pid) else None
    # comm (field 2) may hold spaces and parentheses: split after the last ")".
    rest = stat[stat.rfind(b")") + 2:].split()
    if len(rest) < 20:
        return ""
    state = rest[0]
    if state in (b"Z", b"X"):
        return None
    return rest[19].decode("ascii")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_alive(pid: int, start: str) -> bool:
    """Whether the process that recorded (pid, start) still runs."""
    now = start_time(pid)
    if now is None:
        return False
    return start == "" or now == "" or now == start
