"""Past the output cap, a real kernel's client reads the head and the tail of what a cell
printed, with a marker between, as an AI assistant driving jupyter_client reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jupyter_client.blocking.client import BlockingKernelClient
from traitlets.config import Config

from .conftest import Execution, KernelStarter, restarting_kernel, run, run_ok

ONE_MIB = Config({"SandboxProvisioner": {"output_limit": "1m"}})
HUGE_PRINT = "print('A' * 3_000_000 + 'MIDDLE' + 'Z' * 3_000_000)"


def run_with_metadata(
    kc: BlockingKernelClient, code: str, metadata: dict[str, Any], timeout: float = 60
) -> Execution:
    """Execute ``code`` with ``metadata`` in the (signed) execute_request, as the session API does."""
    content = {
        "code": code,
        "silent": False,
        "store_history": True,
        "user_expressions": {},
        "allow_stdin": False,
    }
    msg = kc.session.msg("execute_request", content, metadata=metadata)
    kc.shell_channel.send(msg)
    result = Execution()
    while True:
        output = kc.get_iopub_msg(timeout=timeout)
        if output["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        if output["msg_type"] == "status" and output["content"]["execution_state"] == "idle":
            break
        result.hook(output)
    result.reply = kc.get_shell_msg(timeout=timeout)
    return result


def test_a_huge_print_keeps_its_head_and_tail_with_a_marker_between(start_kernel: KernelStarter) -> None:
    _, kc = start_kernel(config=ONE_MIB)
    result = run(kc, HUGE_PRINT, timeout=120)
    assert result.status == "ok"
    head, rest = result.stdout.split("\n[... ", 1)
    marker, tail = rest.split(" ...]\n", 1)
    assert head == "A" * len(head)
    assert len(head) > 900_000
    assert marker.endswith("of output dropped: over this kernel's output limit of 1 MiB per execution")
    assert tail == "Z" * (64 * 1024 - 1) + "\n"
    assert "MIDDLE" not in result.stdout
    assert len(result.stdout) <= 2**20
    assert result.stderr.count("Output truncated: this execution produced more than 1 MiB of output") == 1
    assert run_ok(kc, "print('next cell')") == "next cell\n"  # the budget is per execution


def test_a_run_may_narrow_its_output_limit_in_its_request_metadata(start_kernel: KernelStarter) -> None:
    _, kc = start_kernel(config=ONE_MIB)
    code = "print('A' * 50_000 + 'MIDDLE' + 'Z' * 50_000)"
    result = run_with_metadata(kc, code, {"sandbox_kernel": {"output_limit": 10_000}})
    assert result.status == "ok"
    assert result.stdout.startswith("AAAA")
    assert result.stdout.endswith("\n" + "Z" * 2499 + "\n")  # the last quarter of the budget
    assert "over the output limit of 9.8 KiB set for this execution ...]" in result.stdout
    assert "MIDDLE" not in result.stdout
    assert len(result.stdout) < 10_000
    # A wider limit than the server's, or a malformed one, is ignored: 1 MiB applies.
    for wider in (10 * 2**20, "10m", -1):
        result = run_with_metadata(kc, code, {"sandbox_kernel": {"output_limit": wider}})
        assert result.stdout == "A" * 50_000 + "MIDDLE" + "Z" * 50_000 + "\n"
        assert result.stderr == ""


def test_many_small_prints_end_with_their_last_lines(start_kernel: KernelStarter) -> None:
    _, kc = start_kernel(config=ONE_MIB)
    result = run(kc, "for i in range(300_000):\n    print(i)", timeout=180)
    assert result.status == "ok"
    assert result.stdout.startswith("0\n1\n2\n")
    assert result.stdout.endswith("\n299998\n299999\n")
    assert "of output dropped" in result.stdout
    assert len(result.stdout) <= 2**20


async def test_the_tail_reaches_the_client_when_the_kernel_dies_mid_run(
    workspace: Path, jupyter_dirs: Path
) -> None:
    code = (
        "import os, time\n"
        + HUGE_PRINT.replace(")", ", flush=True)", 1)
        + "\ntime.sleep(2)\nos.kill(os.getpid(), 9)"
    )
    async with restarting_kernel(workspace, config=ONE_MIB) as (_, kc, _):
        outputs: list[dict[str, Any]] = []
        reply = await kc.execute_interactive(code, timeout=120, output_hook=outputs.append)
        assert reply["content"]["ename"] == "KernelDied"
        texts = [(m["content"]["name"], m["content"]["text"]) for m in outputs if m["msg_type"] == "stream"]
        stdout = "".join(text for name, text in texts if name == "stdout")
        assert stdout.startswith("AAAA")
        assert stdout.endswith("Z" * 60_000 + "\n")
        assert "MIDDLE" not in stdout
        # The tail came before the host's notice that the kernel died.
        last_stdout = max(i for i, (name, _) in enumerate(texts) if name == "stdout")
        died = next(i for i, (_, text) in enumerate(texts) if "[sandbox-kernel] the kernel stopped" in text)
        assert last_stdout < died
