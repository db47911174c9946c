"""A human in the loop: a request outside the kernel's allowed domains waits for its
holder's answer, asked through Jupyter's stdin (as JupyterLab and jupyter_client's
``input()`` answer) or a program's callback.

The upstreams and the server's egress settings are test_egress.py's: other.test is within
the server's ceiling but not in the kernel's allowed domains.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import KernelManager
from jupyter_client.blocking.client import BlockingKernelClient

from sandbox_kernel import SandboxSession

from .conftest import KernelStarter
from .test_egress import Upstreams, _fetch, _server_config
from .test_egress import upstreams as upstreams  # the egress tests' upstreams

pytestmark = pytest.mark.integration


@pytest.fixture
def asking_kernel(
    start_kernel: KernelStarter, make_kernelspec: Any, upstreams: Upstreams, workspace: Path, tmp_path: Path
) -> tuple[KernelManager, BlockingKernelClient, Path, str]:
    (workspace / "ca.pem").write_bytes(upstreams.ca_pem)
    name = make_kernelspec(
        "py-asking",
        config={
            "network": "allowlist",
            "allowed_domains": [f"allowed.test:{upstreams.https_port}"],
            "approval": "egress",
            "approval_timeout": "3s",
        },
        env={"SSL_CERT_FILE": "/workspace/ca.pem"},
    )
    audit_log = tmp_path / "audit" / "audit.jsonl"
    km, kc = start_kernel(name, config=_server_config(upstreams, audit_log))
    return km, kc, audit_log, f"https://other.test:{upstreams.https_port}/asked"


def _run(
    kc: BlockingKernelClient, code: str, answer: str | None, allow_stdin: bool = True
) -> tuple[str, list[str]]:
    """Run ``code``; answer each stdin prompt with ``answer`` (None: never); (stdout, prompts)."""
    out: list[str] = []
    prompts: list[str] = []

    def on_output(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])

    def on_stdin(msg: dict[str, Any]) -> None:
        prompts.append(msg["content"]["prompt"])
        if answer is not None:
            kc.input(answer)

    reply = kc.execute_interactive(
        code, timeout=60, output_hook=on_output, stdin_hook=on_stdin, allow_stdin=allow_stdin
    )
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out), prompts


def _approvals(audit_log: Path) -> list[tuple[str, str]]:
    records = [json.loads(line) for line in audit_log.read_text().splitlines()]
    return [(r["answer"], r["by"]) for r in records if r["event"] == "approval"]


def test_the_holder_is_asked_on_stdin_and_the_answer_decides(
    asking_kernel: tuple[KernelManager, BlockingKernelClient, Path, str], upstreams: Upstreams
) -> None:
    _, kc, audit_log, url = asking_kernel
    out, prompts = _run(kc, _fetch(url), "once")
    assert out.startswith("OK"), out
    (prompt,) = prompts
    assert f"Sandbox: allow a connection to other.test:{upstreams.https_port}?" in prompt
    assert "Type once (this time), kernel (from now on, in this kernel) or deny" in prompt
    assert prompt.endswith("no answer within 3 s denies: ")

    out, prompts = _run(kc, _fetch(url), "deny")
    assert len(prompts) == 1, "'once' approved one request only"
    assert out.startswith("FAILED"), out
    assert "was denied at the prompt" in out

    started = time.monotonic()
    out, prompts = _run(kc, _fetch(url), None)
    assert "no answer within 3 s (approval_timeout)" in out, out
    assert time.monotonic() - started < 15

    out, prompts = _run(kc, _fetch(url), "once", allow_stdin=False)
    assert prompts == []
    assert "cannot answer prompts (allow_stdin is false)" in out, out

    out, prompts = _run(kc, _fetch(url), "kernel")
    assert out.startswith("OK"), out
    out, prompts = _run(kc, _fetch(url), "deny")
    assert out.startswith("OK"), "approved for the kernel: not asked again"
    assert prompts == []
    assert _approvals(audit_log) == [
        ("once", "at the prompt"),
        ("deny", "at the prompt"),
        ("deny", "timeout"),
        ("deny", _approvals(audit_log)[3][1]),
        ("kernel", "at the prompt"),
    ]
    assert "allow_stdin is false" in _approvals(audit_log)[3][1]


def test_a_program_answers_through_its_callback_and_outside_the_ceiling_nobody_is_asked(
    asking_kernel: tuple[KernelManager, BlockingKernelClient, Path, str],
) -> None:
    km, kc, audit_log, url = asking_kernel
    asked: list[str] = []

    def handler(request: Any) -> str:
        asked.append(f"{request.host}:{request.port}")
        return "once"

    km.provisioner.approval_handler = handler
    out, prompts = _run(kc, _fetch(url), None)
    assert out.startswith("OK"), out
    assert prompts == []
    assert len(asked) == 1
    out, _ = _run(kc, _fetch("https://evil.test/"), None)
    assert "evil.test:443 is not in this kernel's allowed domains" in out, out
    assert len(asked) == 1, "beyond the server's ceiling, no approval is possible"
    assert _approvals(audit_log) == [("once", "by the approval_handler")]


def test_a_session_answers_through_its_handler_and_what_it_narrowed_stays_closed(
    make_kernelspec: Any, upstreams: Upstreams, workspace: Path, tmp_path: Path
) -> None:
    """A session narrows the kernelspec's allowed domains: what it took out is denied,
    not asked about (it used to become a question); the rest of the ceiling is asked
    about through ``SandboxSession(approval_handler=...)``."""
    port = upstreams.https_port
    (workspace / "ca.pem").write_bytes(upstreams.ca_pem)
    name = make_kernelspec(
        "py-asking",
        config={
            "network": "allowlist",
            "allowed_domains": [f"allowed.test:{port}", f"*.allowed.test:{port}"],
            "approval": "egress",
            "approval_timeout": "3s",
        },
        env={"SSL_CERT_FILE": "/workspace/ca.pem"},
    )
    asked: list[str] = []

    def handler(request: Any) -> str:
        asked.append(f"{request.host}:{request.port}")
        return "once"

    config = _server_config(upstreams, tmp_path / "audit" / "audit.jsonl")
    with SandboxSession(
        name, workspace, config=config, allowed_domains=[f"allowed.test:{port}"], approval_handler=handler
    ) as sandbox:
        removed = sandbox.run(_fetch(f"https://api.allowed.test:{port}/asked")).stdout
        assert removed.startswith("FAILED"), removed
        assert "not in this kernel's allowed domains (its start removed it)" in removed
        assert asked == []
        out = sandbox.run(_fetch(f"https://other.test:{port}/asked")).stdout
        assert out.startswith("OK"), out
        assert asked == [f"other.test:{port}"]


def test_a_session_without_a_handler_is_told_how_to_answer(
    make_kernelspec: Any, upstreams: Upstreams, workspace: Path, tmp_path: Path
) -> None:
    port = upstreams.https_port
    (workspace / "ca.pem").write_bytes(upstreams.ca_pem)
    name = make_kernelspec(
        "py-asking",
        config={"network": "allowlist", "allowed_domains": [f"allowed.test:{port}"], "approval": "egress"},
        env={"SSL_CERT_FILE": "/workspace/ca.pem"},
    )
    config = _server_config(upstreams, tmp_path / "audit" / "audit.jsonl")
    with SandboxSession(name, workspace, config=config) as sandbox:
        out = sandbox.run(_fetch(f"https://other.test:{port}/asked")).stdout
    assert out.startswith("FAILED"), out
    assert "no approval_handler is set" in out, out
    assert "SandboxSession(approval_handler=...)" in out
