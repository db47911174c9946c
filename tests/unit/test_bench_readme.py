"""bench/readme.py: the README's "Speed and cost" written from one run's numbers.

The run itself is 40 minutes of real kernels (docs/benchmarks.md); here, what it writes
from given numbers: every figure and ratio from the run's own results, and nothing of
the README outside its markers touched."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def readme_bench(bench_script: Callable[[str], ModuleType]) -> ModuleType:
    return bench_script("readme")


def latency(
    start: float, execute: float, idle_cpu: float, pooled: float, prints: float, mib: float
) -> dict[str, float]:
    return {
        "kernel_info_median_s": start,
        "restart_median_s": start * 2,
        "shutdown_median_s": start / 2,
        "pooled_p50_s": pooled,
        "pooled_narrowed_p50_s": pooled + 0.003,
        "pooled_env_p50_s": pooled + 0.007,
        "execute_p50_ms": execute,
        "execute_p95_ms": execute * 1.5,
        "prints_s": prints,
        "memory_idle_mib": mib,
        "idle_cpu_pct": idle_cpu,
    }


def density_row(
    count: int, frozen: int, running: tuple[float, float, float], frozen_ms: float
) -> dict[str, Any]:
    return {
        "count": count,
        "cpu_running": running,
        "cpu_frozen": (0.0, count / 1000, 0.01),
        "memory_cgroup_mib": 60.0 + count / 10,
        "memory_host_mib": 70.0,
        "one_plus_one_frozen_ms": frozen_ms,
        "frozen": frozen,
    }


def results() -> dict[str, Any]:
    nan = float("nan")
    return {
        "latency": {
            "settings": {"at_once": 10},
            "local": latency(0.2, 4.0, 1.0, pooled=0.3, prints=0.5, mib=80.0),
            "sandboxed": latency(1.2, 5.2, 30.0, pooled=0.06, prints=0.4, mib=100.0),
        },
        "agents": {
            "local raw": [4.0] * 3,
            "sandboxed raw": [5.0] * 3,
            "SandboxSession.run": [5.4] * 3,
            "MCP run_code": [7.6] * 3,
            "MCP run_code, plain client": [6.6] * 3,
            "MCP empty tool": [1.9] * 3,
        },
        "kernel_choices": {
            "local": [10.0, 10.0, 12.0],
            "sandboxed": [14.0, 14.0, 15.0],
            "sandboxed, subshells started": [16.0, 16.0, 18.0],
            "sandboxed, replies queued": [14.4, 14.4, 15.0],
        },
        "roundtrip": {
            "local": [[5.0, 4.0, 0.6]] * 3,
            "bridge": [[12.0, 5.5, 2.0]] * 3,
            "meter": [[11.6, 5.5, 1.9]] * 3,
            "bare": [[11.4, 5.5, 1.8]] * 3,
            "relay": [[11.0, 5.5, 1.4]] * 3,
            "inside": [[13.0, 6.0, 2.5]] * 3,
        },
        "bridge_checks": {"all checks": [12.6] * 3, "no checks": [12.0] * 3},
        "coldstart": {
            "rows": {
                "docker run --rm IMAGE true": {"runsc": [0.36, 0.4, 0.3]},
                "import ipykernel.kernelapp, timed inside": {"host": [0.2] * 3, "runsc": [0.9] * 3},
                "kernelspec argv run directly (VS Code) -> kernel_info reply": {
                    "host": [0.5] * 3,
                    "runsc": [2.1] * 3,
                },
            }
        },
        "wakeups": {
            "host": {
                "getpid": 0.16,
                "event": 52,
                "event_idle": 19,
                "inproc_idle": 12,
                "tcp_process_idle": 163,
            },
            "systrap": {
                "getpid": 0.65,
                "event": 8,
                "event_idle": 54,
                "inproc_idle": 103,
                "tcp_process_idle": 520,
            },
            "ptrace": {
                "getpid": 52,
                "event": 117,
                "event_idle": 123,
                "inproc_idle": 376,
                "tcp_process_idle": 915,
            },
        },
        "zmq_io_thread": {
            "host": {"libzmq libzmq": [1.0] * 3, "libzmq mixed": [0.9] * 3, "own own": [0.8] * 3},
            "gvisor": {"libzmq libzmq": [2.3] * 3, "libzmq mixed": [2.5] * 3, "own own": [1.6] * 3},
        },
        "density": {
            "single_ms": 5.0,
            "local_ms": 4.0,
            "rows": [
                density_row(10, 10, (2.0, 0.2, 0.1), 6.0),
                density_row(50, 48, (2.2, 0.3, 0.1), 7.0),  # two of them not frozen: not a frozen figure
                density_row(250, 250, (nan, nan, nan), 9.0),  # too many to measure running
            ],
        },
    }


LOADS = {"wakeups": 1.25}


def row(section: str, starts: str) -> str:
    (line,) = [line for line in section.splitlines() if line.startswith(f"| {starts}")]
    return line


def test_every_figure_of_the_section_is_the_runs_own(readme_bench: ModuleType) -> None:
    section = readme_bench.render(results(), "2026-12-07 03:00-03:40, load 0.5 before it", LOADS)

    assert "in one run of `bench/readme.py` (2026-12-07 03:00-03:40, load 0.5 before it; ratios" in section
    assert row(section, "start ->").endswith(
        "| 0.20 s; 0.40 s; 0.10 s | 1.20 s; 2.40 s; 0.60 s | 6.00x; 6.00x; 6.00x |"
    )
    assert row(section, "start claimed").endswith(
        "(narrowed, or with `env`: 63, 67 ms) | (cold 0.20 s) | 0.060 s | 0.30x |"
    )
    assert row(section, "`1+1` round trip").endswith("| 4.0 / 6.0 ms | 5.2 / 7.8 ms | 1.30x / 1.30x |")
    assert row(section, "`1+1`, kernels in turns").endswith(
        "| 10.0 / 11.8 ms | 14.0 / 14.9 ms; 16.0 / 17.8 ms | 1.40x / 1.26x; 1.60x / 1.51x |"
    )
    assert row(section, "a cell printing").endswith("| 0.50 s | 0.40 s | 0.80x |")
    assert row(section, "`SandboxSession.run").endswith(
        "floor is 1.9 ms; a plain JSON-RPC client), p50, against raw `jupyter_client` on the same kernel "
        "in turns (5.0 ms) | | raw +0.4 ms, raw +2.6 ms; raw +1.6 ms | |"
    )
    assert row(section, "host memory").endswith("| 80 MiB | 100 MiB | 1.25x |")
    # Per idle kernel: the local figure is for the 10 latency.py started at once; the
    # sandboxed one for the most kernels measured running and then every one of them frozen.
    assert row(section, "host CPU per idle kernel") == (
        "| host CPU per idle kernel (local: 10 kernels; sandboxed: 10, frozen after 30 s quiet, "
        "before it 2.3 %) | 0.10 % | 0.02 % of a core | |"
    )
    assert row(section, "250 idle kernels").endswith(
        "| | 85 MiB of host memory each; one kernel's `1+1` among them (the others frozen) "
        "1.80x its figure alone | |"
    )
    assert (
        "of the 7.0 ms over a local kernel (12.0 against 5.0 ms), ipykernel's own handling is 1.5 ms more"
        in section
    )
    # The way in: the bridge's 2.0 against 0.6 ms; the way out: 12.0 - 5.5 - 2.0 = 4.5 against 0.4.
    assert (
        "1.5 ms more than locally (what its threads' hand-offs cost: `kernel_choices.py`); the way in, "
        "from the client's request to the kernel's `busy`, is 1.4 ms more than locally, and the way out, "
        "from the kernel's `idle` until the client has it and the reply, 4.1 ms more. With nothing of the "
        "host's between a client and the sandbox's sockets, the same kernel takes 11.0 ms (2.20x local; "
        "the way in +0.8 ms, the way out +3.7 ms): the sandbox's own floor. Through a bare byte relay on "
        "the host, the least an observer outside the sandbox can add, it takes 11.4 ms; through the "
        "bridge's meter alone 11.6 ms;" in section
    )
    assert "(signatures, audit, output limit, cleaning: 0.60 ms of a round trip" in section
    assert "pays gVisor's wake-ups itself, takes 13.0 ms." in section
    assert (
        "The kernel sending each `ok` reply as it makes it, not after its `idle`, saves 0.4 ms at p50"
        in section
    )
    assert (
        "(0.36 s) and Python importing ipykernel through gVisor's file system (0.9 s against 0.2 s" in section
    )
    assert "(VS Code) has its first reply after 2.1 s (0.5 s for a local kernel)" in section
    assert "runsc (systrap), microseconds per operation (load 1.2 at its end" in section
    wake = section[section.index("| operation |") :].splitlines()[2:7]
    assert wake == [
        "| a system call (`getpid`) | 0.16 | 0.65 | 4.1x |",
        "| two threads waking each other, busy (`threading.Event`, a round of 2 wakes) "
        "| 52.0 | 8.00 | 0.2x |",
        "| the same after 2 ms idle (how a kernel's threads wait for a message) | 19.0 | 54.0 | 2.8x |",
        "| a ZeroMQ hand-off between two threads and back, after 2 ms idle | 12.0 | 103 | 8.6x |",
        "| a ZeroMQ round trip between two processes, after 2 ms idle | 163 | 520 | 3.2x |",
    ]
    assert (
        "One of them each way is libzmq's I/O thread, between a kernel's thread and its sockets: a "
        "stand-in server sending a `1+1`'s five messages (`zmq_io_thread.py`) answers 0.70 ms sooner "
        "under gVisor when its thread reads and writes its sockets itself (0.20 ms sooner on the host); "
        "with its IOPub messages on its own socket and only its reply left to libzmq it takes 2.50 ms, "
        "against 2.30 ms with every message through libzmq: the one hand-off left pays the whole wake. "
        "Pinning" in section
    )
    assert "nan" not in section.lower()


def test_a_run_kept_from_before_the_io_thread_was_measured_is_written_without_it(
    readme_bench: ModuleType,
) -> None:
    numbers = results()
    del numbers["zmq_io_thread"]

    section = readme_bench.render(numbers, WHEN, LOADS)

    assert "zmq_io_thread" not in section
    assert "the kernel's threads, and back). Pinning a sandbox to one core" in section


def test_a_kernel_quicker_than_a_local_one_is_said_to_be(readme_bench: ModuleType) -> None:
    numbers = results()
    numbers["roundtrip"]["bridge"] = [[12.0, 3.2, 2.0]] * 3  # busy to idle 0.8 ms less than locally

    section = readme_bench.render(numbers, WHEN, LOADS)

    assert "ipykernel's own handling is 0.8 ms less than locally (waits of ipykernel's" in section
    assert "-0.8" not in section


def test_the_section_replaces_only_what_is_between_its_markers(readme_bench: ModuleType) -> None:
    begin, end = readme_bench.BEGIN, readme_bench.END
    readme = f"# Title\n\n## Speed and cost\n\n{begin}\nold figures\nmore\n{end}\n\n## Next\n"

    written = readme_bench.replace_section(readme, "new | figures\n\\1 stays as it is")

    assert written == (
        f"# Title\n\n## Speed and cost\n\n{readme_bench.BEGIN}\nnew | figures\n\\1 stays as it is\n"
        f"{readme_bench.END}\n\n## Next\n"
    )
    assert readme_bench.replace_section(written, "again").count("again") == 1


@pytest.mark.parametrize("broken", ["no markers at all", "{BEGIN}\nonly the first"])
def test_a_readme_without_its_markers_is_left_alone_with_a_clear_error(
    readme_bench: ModuleType, broken: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(readme_bench.BEGIN)):
        readme_bench.replace_section(broken.format(BEGIN=readme_bench.BEGIN), "new")


def test_the_readme_has_the_sections_markers_once(readme_bench: ModuleType) -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(readme_bench.BEGIN) == readme.count(readme_bench.END) == 1
    assert readme.index(readme_bench.BEGIN) > readme.index("## Speed and cost")


def kept_run(tmp_path: Path, numbers: dict[str, Any]) -> Path:
    kept = tmp_path / "run.json"
    tables = {"latency": "metric  local  sandboxed", "density": "N  cpu"}
    kept.write_text(json.dumps({"when": WHEN, "tables": tables, "results": numbers, "loads": LOADS}))
    return kept


WHEN = "2026-12-07 03:00-03:40, load 0.5 before it"


def readme_with_markers(readme_bench: ModuleType, tmp_path: Path) -> Path:
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{readme_bench.BEGIN}\nold\n{readme_bench.END}\n\n## Next\n")
    return readme


def test_a_kept_run_is_written_again_without_running_anything(
    readme_bench: ModuleType, tmp_path: Path
) -> None:
    kept, readme, page = (
        kept_run(tmp_path, results()),
        readme_with_markers(readme_bench, tmp_path),
        tmp_path / "run.md",
    )

    assert (
        readme_bench.main(["--from-results", str(kept), "--write", str(readme), "--record", str(page)]) == 0
    )

    written = readme.read_text()
    assert written.startswith(f"# Title\n\n{readme_bench.BEGIN}\nMeasured on this project's")
    assert written.endswith(f"{readme_bench.END}\n\n## Next\n")
    assert "| `1+1` round trip, p50 / p95, one kernel at a time" in written
    recorded = page.read_text()
    assert f"({WHEN})" in recorded
    assert "## `bench/latency.py`\n\n```\nmetric  local  sandboxed\n```" in recorded
    assert "## `bench/density.py`\n\n```\nN  cpu\n```" in recorded


def test_a_figure_not_measured_writes_nothing(
    readme_bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    numbers = results()
    numbers["latency"]["sandboxed"]["prints_s"] = float("nan")
    kept, readme, page = (
        kept_run(tmp_path, numbers),
        readme_with_markers(readme_bench, tmp_path),
        tmp_path / "run.md",
    )
    before = readme.read_text()

    assert (
        readme_bench.main(["--from-results", str(kept), "--write", str(readme), "--record", str(page)]) == 1
    )

    assert readme.read_text() == before
    assert not page.exists()
    assert "some figures were not measured (nan, above); nothing written" in capsys.readouterr().err


def test_a_readme_without_markers_is_refused_before_anything_runs(
    readme_bench: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(readme_bench.os, "geteuid", lambda: 0)
    monkeypatch.setattr(readme_bench, "run_step", lambda *_: pytest.fail("a script ran"))
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n")

    assert readme_bench.main(["--write", str(readme)]) == 2

    assert readme.read_text() == "# Title\n"
    assert f"cannot write the section into {readme}" in capsys.readouterr().err


def test_a_script_that_fails_stops_the_run_and_keeps_what_ran(
    readme_bench: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The scripts are run as they are, as programs: here two stand-ins, the first printing a
    progress line that looks like JSON, a table, then its JSON; the second failing."""
    monkeypatch.setattr(readme_bench.os, "geteuid", lambda: 0)
    monkeypatch.setattr(readme_bench, "HERE", tmp_path)
    (tmp_path / "latency.py").write_text(
        "print('[03:00] a progress line')\nprint('metric  local')\nprint('{\"local\": 1}')\n"
    )
    (tmp_path / "agents.py").write_text("import sys\nsys.exit(3)\n")
    readme, kept = readme_with_markers(readme_bench, tmp_path), tmp_path / "kept.json"
    before = readme.read_text()

    assert readme_bench.main(["--write", str(readme), "--results", str(kept)]) == 1

    assert readme.read_text() == before
    assert (
        "error: bench/agents.py exited with 3 (its messages are above); nothing written"
        in capsys.readouterr().err
    )
    saved = json.loads(kept.read_text())
    assert saved["results"] == {"latency": {"local": 1}}
    assert saved["tables"] == {"latency": "[03:00] a progress line\nmetric  local"}
