#!/usr/bin/env bash
# The project's test command: on a fresh Debian 12 machine, as root, installs everything the
# suite needs (system packages, the venv at .venv, the package and its test tools), checks lint
# and types, then runs the whole test suite (unit, gRPC, formats, fetch, cache, integration with
# real containerd + registry + /dev/fuse). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "scripts/test.sh: run as root (the suite mounts overlay/FUSE/erofs and runs containerd)" >&2
    exit 1
fi

integration/setup.sh

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'

echo "== ruff"; .venv/bin/ruff check snapshotter tests integration
echo "== mypy"; .venv/bin/mypy
echo "== pytest"
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
