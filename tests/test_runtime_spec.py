"""runtime_spec.py: the program a container runs, from its OCI runtime spec."""

from __future__ import annotations

import json

import pytest

from snapshotter.errors import FormatError
from snapshotter.runtime_spec import DEFAULT_PATH, Program, program_from_spec


def _spec(process: object) -> bytes:
    return json.dumps({"ociVersion": "1.0.2", "process": process, "root": {"path": "rootfs"}}).encode()


def test_args_env_and_cwd_make_the_program() -> None:
    spec = _spec({"args": ["python3", "-c", "pass"], "cwd": "/app",
                  "env": ["HOME=/root", "PATH=/opt/venv/bin:/usr/bin", "PATH=/custom:/usr/bin"]})
    assert program_from_spec(spec) == Program("python3", ("/custom", "/usr/bin"), "/app")  # runc: the last wins
    program = Program.from_doc(json.loads(json.dumps(Program("true").to_doc())))
    assert program == Program("true", DEFAULT_PATH, "/")  # no PATH: containerd's default


def test_candidates_follow_exec_lookpath() -> None:
    assert Program("true", ("/usr/local/bin", "/usr/bin", "/usr/bin")).candidates() == \
        ["usr/local/bin/true", "usr/bin/true"]
    assert Program("./run.sh", cwd="/app").candidates() == ["app/run.sh"]
    assert Program("/bin/../usr/bin/env").candidates() == ["usr/bin/env"]
    assert Program("tool", ("", "bin"), cwd="/srv").candidates() == ["srv/tool", "srv/bin/tool"]
    assert Program("x", ("/../../etc",)).candidates() == ["etc/x"]  # never above the image root


@pytest.mark.parametrize("process", [None, {}, {"args": []}, {"args": [""]}, {"args": [7]}, "sh"])
def test_a_spec_that_runs_nothing_gives_none(process: object) -> None:
    assert program_from_spec(_spec(process)) is None


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]"])
def test_a_spec_that_is_not_an_object_is_a_format_error(data: bytes) -> None:
    with pytest.raises(FormatError, match="runtime spec"):
        program_from_spec(data)


@pytest.mark.parametrize("doc", [None, {"name": "", "path": [], "cwd": "/"}, {"name": "x", "path": "/bin", "cwd": "/"},
                                 {"name": "x", "path": [1], "cwd": "/"}, {"name": "x\x00", "path": [], "cwd": "/"}])
def test_a_malformed_request_is_a_format_error(doc: object) -> None:
    with pytest.raises(FormatError, match="program"):
        Program.from_doc(doc)
