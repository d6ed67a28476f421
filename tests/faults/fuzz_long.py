"""Long fuzzing run: the hypothesis fuzzers of the fault suite and of the format parsers with the
"long" profile (20 000 examples each unless a test pins its own budget, no deadline).

    .venv/bin/python tests/faults/fuzz_long.py [extra pytest args]

equivalent to `HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest -p no:cacheprovider
tests/faults/test_fuzz.py tests/formats tests/snapshots/test_filters.py --timeout=0`. Expect
tens of minutes; failures print hypothesis' minimal example, and are kept in .hypothesis/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["tests/faults/test_fuzz.py", "tests/formats", "tests/snapshots/test_filters.py"]


def main(argv: list[str]) -> int:
    env = dict(os.environ, HYPOTHESIS_PROFILE="long")
    # tests/faults/conftest.py (loaded first: TARGETS starts there) registers and loads the
    # profile; hypothesis reads the default settings when each test runs, so it covers all.
    cmd = [sys.executable, "-m", "pytest", "-q", "--timeout=0", "-p", "no:cacheprovider", *TARGETS, *argv]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
