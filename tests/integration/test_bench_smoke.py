"""The benchmark harness (integration.bench.run) end to end on a tiny image, so it cannot rot:
one run per cell, the Foundation busybox image, the delaying proxy, our eStargz, and Nydus with a
prefetch table recorded by `snapshotter record` (the profiled variants' path).

No wall-clock limits are asserted; the report must have the expected rows and columns with sane
values, and the harness must leave nothing behind (lab dir, mounts, qdisc, proxy).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from integration.bench import run
from integration.lab import REPO_ROOT, free_port, mounts_under, pids_mentioning
from snapshotter.fetch.config import FetchConfig


def test_bench_harness_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    lab_base = tmp_path / "labs"
    lab_base.mkdir()
    argv = [sys.executable, "-m", "integration.bench.run", "--n", "1", "--images", "tiny", "--formats",
            "estargz-ours,nydus-prefetch", "--net", "latency20", "--out", str(out), "--cache", str(tmp_path / "cache")]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), TMPDIR=str(lab_base))
    r = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"

    with open(out / "results.csv", newline="") as f:
        cells = list(csv.DictReader(f))
    assert {(c["workload"], c["variant"]) for c in cells} == {
        (w, v) for w in ("true", "sha256", "warm-read") for v in ("overlayfs", "estargz-ours", "nydus-prefetch")}
    for c in cells:
        assert c["image"] == "tiny" and c["net"] == "latency20" and c["n"] == "1"
        assert 0 < float(c["pull_median_s"]) and 0 < float(c["run_median_s"])
        assert abs(float(c["total_median_s"]) - float(c["pull_median_s"]) - float(c["run_median_s"])) < 0.01
        assert float(c["fetched_median_mb"]) > 0
        assert float(c["total_ratio_vs_overlayfs"]) > 0
    by = {(c["workload"], c["variant"]): c for c in cells}
    full, lazy = by[("sha256", "overlayfs")], by[("sha256", "estargz-ours")]
    assert float(full["total_ratio_vs_overlayfs"]) == 1.0
    # A full pull fetches every layer; the lazy `true` run fetches much less than that.
    assert float(by[("true", "estargz-ours")]["fetched_median_mb"]) < float(full["fetched_median_mb"])
    # The lazy sha256 reads the 3 MB file through our daemon's mount process.
    assert float(lazy["fetched_median_mb"]) >= 3.0
    assert float(lazy["daemon_peak_mib"]) > 0 and float(lazy["mount_peak_mib"]) > 0
    # It read the whole file: the bytes fetched are what was needed (metadata + every chunk), give
    # or take the fixed-size tail read of each layer.
    assert 0.9 <= float(lazy["fetched_vs_needed"]) <= 1.5, lazy
    assert float(by[("true", "estargz-ours")]["needed_median_mb"]) > 0
    # The Nydus image's prefetch table is the profile of `true` (the tiny image's first workload):
    # its run fetches what it reads, the prefetched files, and little else.
    profiled = by[("true", "nydus-prefetch")]
    assert float(profiled["needed_median_mb"]) > 0
    assert 0.9 <= float(profiled["fetched_vs_needed"]) <= 1.5, profiled
    # Warm: the workload timed itself inside the container, for both paths (busybox's `time` has
    # 10 ms resolution, and the tiny file may take less; the harness fails when no time is printed).
    for v in ("overlayfs", "estargz-ours", "nydus-prefetch"):
        assert float(by[("warm-read", v)]["inner_median_s"]) >= 0, by[("warm-read", v)]

    with open(out / "runs.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 9
    md = (out / "report.md").read_text()
    assert "| tiny | sha256 | latency20 | estargz-ours | 1 |" in md and "Linux" in md
    assert "Warm (second run, cache hot)" in md and "| tiny | warm-read | latency20 | estargz-ours | 1 |" in md
    assert "tiny/nydus-prefetch: prefetch profile recorded with `snapshotter record`" in md
    # The memory control ran once (one network, one round), beside the warm read.
    with open(out / "memory_probes.csv", newline="") as f:
        probes = list(csv.DictReader(f))
    assert [(p["net"], p["rep"], p["size"]) for p in probes] == [("latency20", "0", str(run.MEMORY_PROBE_MIN_BYTES))]
    assert float(probes[0]["dropped_s"]) > 0 and float(probes[0]["refilled_s"]) > 0
    assert "Memory control, no container: a 16 MiB file read" in md
    assert "refills the free memory" in md

    # Nothing left behind.
    assert not list(lab_base.glob("lazylab-*")), "the lab dir was not removed"
    assert not mounts_under(tmp_path)
    assert not pids_mentioning(str(out), exclude={os.getpid()}), "the delaying proxy is still running"


def _lo_qdisc() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, timeout=10).stdout


def test_shaping_is_removed_even_on_error() -> None:
    before = _lo_qdisc()
    try:
        with run.shaped(200, free_port(), "port"):
            assert "htb" in _lo_qdisc()
            raise KeyError("boom")
    except KeyError:
        pass
    except run.BenchError as e:
        # Someone else (a benchmark run) is shaping lo right now: we must refuse and touch nothing.
        assert "already has a qdisc" in str(e)
    assert _lo_qdisc() == before


def test_inner_seconds_reads_bash_and_busybox_time() -> None:
    assert run.inner_seconds("11227\n0.734\n") == 0.734  # bash TIMEFORMAT=%R after other output
    assert run.inner_seconds("real\t1m 2.50s\nuser\t0m 0.01s\nsys\t0m 0.20s\n") == 62.5
    with pytest.raises(run.BenchError):
        run.inner_seconds("cat: /bench/big.bin: No such file or directory\n")


def test_needed_bytes_adds_up_the_daemon_log() -> None:
    log = "\n".join([
        "level=info event=lazy_prepare layer=a fetched_bytes=65536 metadata_bytes=40000",
        "level=info event=lazy_prepare layer=b fetched_bytes=1000 metadata_bytes=900",
        "level=info event=resolved_ahead layer=c format=estargz fetched_bytes=65536 metadata_bytes=15129",
        "level=info event=lazy_prepare layer=c fetched_bytes=0 metadata_bytes=0",
        "level=info event=mount_stopped mount=3 pid=9 reads=4 demand_chunk_bytes=5000 registry_bytes=7000",
    ])
    # containerd's own 2600 bytes, the three layers' metadata (c resolved ahead), the chunks reads touched.
    assert run.needed_bytes(log, 2_600) == 2_600 + 40_900 + 15_129 + 5_000


def test_network_names_parse() -> None:
    assert run.parse_net("unshaped") == run.Net("unshaped")
    assert run.parse_net("200mbit") == run.Net("200mbit", rate_mbit=200)
    assert run.parse_net("latency50") == run.Net("latency50", rtt_ms=50.0)


def test_registry_bytes_counts_gets_after_offset(tmp_path: Path) -> None:
    log = tmp_path / "registry.log"
    line = ('time="t" level=info msg="response completed" http.request.method={m} '
            'http.request.uri="/v2/r/blobs/sha256:ab" http.response.status=206 http.response.written={n}\n')
    log.write_text(line.format(m="GET", n=1000))
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write(line.format(m="GET", n=70) + line.format(m="HEAD", n=0) + line.format(m="GET", n=30))
    assert run.registry_bytes(log, offset) == (100, 2)


def test_registry_bytes_can_leave_out_one_user_agent(tmp_path: Path) -> None:
    """containerd's own share of a lazy run: every GET but those of our daemon and mounts."""
    log = tmp_path / "registry.log"
    line = ('time="t" level=info msg="response completed" http.request.method=GET '
            'http.request.uri="/v2/r/blobs/sha256:ab" http.request.useragent={ua} http.response.status=206 '
            'http.response.written={n}\n')
    log.write_text(line.format(ua="containerd/1.6.20+unknown", n=1037) + line.format(ua="snapshotter/0.1", n=9_000_000)
                   + line.format(ua="containerd/1.6.20+unknown", n=560))
    assert run.registry_bytes(log, 0, except_agent=run.OUR_USER_AGENT) == (1597, 2)
    assert run.registry_bytes(log, 0) == (9_001_597, 3)
    assert FetchConfig().user_agent.startswith(run.OUR_USER_AGENT)


def test_summary_ratios() -> None:
    def rr(variant: str, total: float, fetched: int) -> run.RunResult:
        return run.RunResult("img", "true", "unshaped", variant, 0, total / 2, total / 2, total, fetched, 1, 0, 0, 0)

    cells = run.summarize([rr("overlayfs", 4.0, 4_000_000), rr("estargz-ours", 1.0, 1_000_000),
                           rr("overlayfs", 6.0, 6_000_000), rr("estargz-ours", 3.0, 1_000_000)])
    by = {c.variant: c for c in cells}
    assert by["overlayfs"].total_median_s == 5.0 and by["overlayfs"].total_min_s == 4.0
    assert by["estargz-ours"].total_ratio_vs_overlayfs == 0.4
    assert by["estargz-ours"].fetched_ratio_vs_overlayfs == 0.2


def test_the_report_names_the_checkout_the_run_began_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run takes most of an hour and restarts the daemon for every cell, so the report's header
    is the machine and checkout of its start, not of whenever it is written."""
    monkeypatch.setattr(run, "_revision", lambda: "aaaa111")
    report = run.Report(machine=run.machine_info())
    monkeypatch.setattr(run, "_revision", lambda: "bbbb222 + uncommitted changes")
    md = run.markdown(run.Config(), report, [])
    assert "snapshotter at aaaa111." in md and "bbbb222" not in md


def _result(total: float) -> run.RunResult:
    return run.RunResult(image="i", workload="w", net="n", variant="v", rep=0, pull_s=0.0, run_s=total,
                         total_s=total, fetched_bytes=0, requests=0, daemon_peak_kib=0, mount_peak_kib=0,
                         containerd_peak_kib=0, load1=0.0)


def test_a_rep_whose_output_was_lost_runs_once_more_and_says_so() -> None:
    outcomes: list[object] = [run.LostOutput("v i w n rep 0: `ctr run` exited 0 and printed nothing"), _result(1.5)]
    notes: list[str] = []

    def once() -> run.RunResult:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, run.RunResult)
        return outcome

    assert run.with_output_retry(once, notes.append).total_s == 1.5
    assert notes == ["v i w n rep 0: `ctr run` exited 0 and printed nothing; ran again"]


def test_a_loss_that_repeats_or_a_wrong_output_is_not_retried_away() -> None:
    calls: list[int] = []

    def lost() -> run.RunResult:
        calls.append(1)
        raise run.LostOutput("lost")

    with pytest.raises(run.LostOutput):
        run.with_output_retry(lost, lambda text: None)
    assert len(calls) == 1 + run.LOST_OUTPUT_RETRIES

    def wrong() -> run.RunResult:
        calls.append(2)
        raise run.BenchError("unexpected output 'deadbeef'")

    with pytest.raises(run.BenchError, match="deadbeef"):
        run.with_output_retry(wrong, lambda text: None)
    assert calls.count(2) == 1
