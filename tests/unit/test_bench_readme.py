"""bench/readme.py: the README's "Speed and cost" written from one run's numbers.

The run itself is 40 minutes of real kernels (docs/benchmarks.md); here, what it writes
from given numbers: every figure and ratio from the run's own results, and nothing of
the README outside its markers touched."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def readme_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_readme", ROOT / "bench" / "readme.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def latency(start: float, execute: float, idle_cpu: float) -> dict[str, float]:
    return {
        "kernel_info_median_s": start,
        "restart_median_s": start * 2,
        "shutdown_median_s": 0.1,
        "pooled_p50_s": 0.06,
        "pooled_narrowed_p50_s": 0.051,
        "pooled_env_p50_s": 0.054,
        "execute_p50_ms": execute,
        "execute_p95_ms": execute * 1.5,
        "prints_s": 0.4,
        "memory_idle_mib": 100.0,
        "idle_cpu_pct": idle_cpu,
    }


def density_row(count: int, frozen: int, running: tuple[float, float, float]) -> dict[str, Any]:
    return {
        "count": count,
        "cpu_running": running,
        "cpu_frozen": (0.02, 0.03, 0.01),
        "memory_cgroup_mib": 60.0,
        "memory_host_mib": 70.0,
        "one_plus_one_frozen_ms": 9.0,
        "frozen": frozen,
    }


def results() -> dict[str, Any]:
    nan = float("nan")
    return {
        "latency": {
            "settings": {"at_once": 10},
            "local": latency(0.2, 4.0, 1.0),
            "sandboxed": latency(1.2, 5.2, 30.0),
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
        },
        "roundtrip": {
            "local": [[5.0, 4.0]] * 3,
            "bridge": [[12.0, 5.5]] * 3,
            "relay": [[11.0, 5.5]] * 3,
            "inside": [[13.0, 6.0]] * 3,
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
        },
        "density": {
            "single_ms": 5.0,
            "local_ms": 4.0,
            "rows": [
                density_row(10, 10, (2.0, 0.2, 0.1)),
                density_row(50, 50, (2.2, 0.3, 0.1)),
                density_row(250, 250, (nan, nan, nan)),
            ],
        },
    }


def row(section: str, starts: str) -> str:
    (line,) = [line for line in section.splitlines() if line.startswith(f"| {starts}")]
    return line


def test_every_figure_of_the_section_is_the_runs_own(readme_bench: ModuleType) -> None:
    section = readme_bench.render(results(), "2026-12-07 03:00-03:40, load 0.5 before it")

    assert "one run of `bench/readme.py` (2026-12-07 03:00-03:40" in section
    assert row(section, "`1+1` round trip") == (
        "| `1+1` round trip, p50 / p95, one kernel at a time | 4.0 / 6.0 ms | 5.2 / 7.8 ms | 1.30x / 1.30x |"
    )
    assert row(section, "`1+1`, kernels in turns").endswith(
        "| 10.0 / 11.8 ms | 14.0 / 14.9 ms; 16.0 / 17.8 ms | 1.40x / 1.26x; 1.60x / 1.51x |"
    )
    assert row(section, "start ->").endswith(
        "| 0.20 s; 0.40 s; 0.10 s | 1.20 s; 2.40 s; 0.10 s | 6.00x; 6.00x; 1.00x |"
    )
    assert "(narrowed, or with `env`: 51, 54 ms) | (cold 0.20 s) | 0.060 s | 0.30x |" in section
    assert (
        "floor is 1.9 ms; a plain JSON-RPC client), p50 | | raw +0.4 ms, raw +2.6 ms; raw +1.6 ms | |"
        in section
    )
    # Per idle kernel: the local figure is for the 10 started at once; the sandboxed one
    # is the largest count measured frozen, up to 50, and "before" the same count running.
    assert row(section, "host CPU").endswith(
        "(frozen after 30 s quiet; before: 2.6 %), 50 kernels | 0.1 % | 0.06 % of a core | |"
    )
    assert row(section, "250 idle kernels").endswith(
        "| | 70 MiB of host memory each; one kernel's `1+1` 1.80x its figure alone | |"
    )
    assert "of the 7.0 ms over a local kernel, ipykernel's own handling is 1.5 ms more" in section
    assert (
        "bridge 5.5 ms more; a client inside the sandbox on the kernel's own ports takes 13.0 ms" in section
    )
    assert "checks (signatures, audit, output limit, cleaning) cost 0.60 ms" in section
    assert (
        "(0.36 s) and Python importing ipykernel through gVisor's file system (0.9 s against 0.2 s" in section
    )
    assert row(section, "a ZeroMQ hand-off") == (
        "| a ZeroMQ hand-off between two threads and back, after 2 ms idle | 12.0 | 103 | 8.6x |"
    )
    assert "(VS Code) has its first reply after 2.1 s (0.5 s for a local kernel)" in section
    assert row(section, "a system call") == "| a system call (`getpid`) | 0.16 | 0.65 | 4.1x |"
    assert "nan" not in section.lower()


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


def test_a_kept_run_is_written_again_without_running_anything(
    readme_bench: ModuleType, tmp_path: Path
) -> None:
    kept = tmp_path / "run.json"
    when = "2026-12-07 03:00-03:40, load 0.5 before it"
    tables = {"latency": "metric  local  sandboxed", "density": "N  cpu"}
    kept.write_text(json.dumps({"when": when, "tables": tables, "results": results()}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{readme_bench.BEGIN}\nold\n{readme_bench.END}\n\n## Next\n")
    page = tmp_path / "run.md"

    assert (
        readme_bench.main(["--from-results", str(kept), "--write", str(readme), "--record", str(page)]) == 0
    )

    written = readme.read_text()
    assert written.startswith(f"# Title\n\n{readme_bench.BEGIN}\nMeasured on this project's")
    assert written.endswith(f"{readme_bench.END}\n\n## Next\n")
    assert readme_bench.render(results(), when) in written
    recorded = page.read_text()
    assert f"({when})" in recorded
    assert "## `bench/latency.py`\n\n```\nmetric  local  sandboxed\n```" in recorded
    assert "## `bench/density.py`\n\n```\nN  cpu\n```" in recorded
