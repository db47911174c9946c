"""The MCP server asks its client about its kernels' requests (elicitation), during the tool
call that runs their code: served in this process to the mcp package's own client, with a
fake session whose cell asks its approval handler from a thread, as a provisioner does."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from mcp import Client
from mcp.client.session import ClientRequestContext
from mcp.types import ElicitRequestParams, ElicitResult, ErrorData

from sandbox_kernel.agents.mcp_approval import ClientApprovals
from sandbox_kernel.agents.mcp_server import KernelTools, build_server
from sandbox_kernel.egress import ApprovalRequest

from .test_mcp_server import FakeExecution, FakeFiles, FakeSession


class AskingSession(FakeSession):
    """A session whose cell "fetch" makes a request its kernel's policy leaves to approval."""

    def __init__(self, kernel_name: str, cwd: str, approval_handler: Any, **policy: Any) -> None:
        super().__init__(kernel_name, cwd, **policy)
        self.approval_handler = approval_handler

    async def run(self, code: str, timeout: float | None = None, env: dict[str, str] | None = None) -> Any:
        if code != "fetch":
            return await super().run(code, timeout, env)
        request = ApprovalRequest(self.kernel_id, "pypi.org", 443, "CONNECT", 5.0)
        word = await asyncio.to_thread(self.approval_handler, request)
        return FakeExecution(stdout=f"answered {word}\n")


def tools_asking() -> tuple[KernelTools, ClientApprovals]:
    FakeSession.started, FakeSession.scripted, FakeSession.workspace = [], {}, FakeFiles()
    approvals = ClientApprovals()
    factory = functools.partial(AskingSession, approval_handler=approvals.ask)
    return KernelTools("sandboxed-python", "/work/space", factory, approvals=approvals), approvals


async def fetch_with(callback: Any) -> dict[str, Any]:
    tools, _ = tools_asking()
    async with Client(build_server(tools), mode="legacy", elicitation_callback=callback) as client:
        result = await client.call_tool("run_code", {"code": "fetch"})
    assert result.structured_content is not None
    return result.structured_content


async def test_the_client_is_asked_in_plain_words_and_its_choice_decides() -> None:
    asked: list[ElicitRequestParams] = []

    async def choose(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
        asked.append(params)
        return ElicitResult(action="accept", content={"answer": "once"})

    out = await fetch_with(choose)
    assert out["stdout"] == "answered once\n"
    assert out["notes"] == ["a connection to pypi.org:443 needed approval: the client answered once"]
    (params,) = asked
    assert params.message == (
        "Sandbox: allow a connection to pypi.org:443? It is not among this kernel's allowed domains. "
        "Choose once (this request), kernel (from now on, in this kernel) or deny; "
        "no answer within 5 s denies."
    )
    schema = params.requested_schema
    assert schema["properties"]["answer"]["enum"] == ["once", "kernel", "deny"]
    assert schema["required"] == ["answer"]


async def test_a_declined_question_or_a_client_that_cannot_be_asked_denies() -> None:
    async def decline(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
        return ElicitResult(action="decline")

    out = await fetch_with(decline)
    assert out["stdout"] == "answered deny\n"
    assert out["notes"] == [
        "a connection to pypi.org:443 needed approval: denied: the client's user chose decline"
    ]

    async def broken(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult | ErrorData:
        return ElicitResult(action="accept", content={"answer": "always"})

    out = await fetch_with(broken)
    assert out["stdout"] == "answered deny\n"
    assert out["notes"] == ["a connection to pypi.org:443 needed approval: denied: asking the client failed"]

    out = await fetch_with(None)  # the client declares no elicitation
    assert out["stdout"] == "answered deny\n"
    assert out["notes"] == [
        "a connection to pypi.org:443 needed approval and was denied: this MCP client cannot be asked "
        "(it declared no elicitation capability)"
    ]


def test_a_request_while_no_call_runs_the_kernels_code_is_denied() -> None:
    approvals = ClientApprovals()
    assert approvals.ask(ApprovalRequest("kernel-0", "pypi.org", 443, "CONNECT", 5.0)) == "deny"


async def test_a_client_of_the_2026_protocol_is_not_asked_and_the_note_says_so() -> None:
    tools, _ = tools_asking()

    async def never(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
        raise AssertionError("asked")

    async with Client(build_server(tools), elicitation_callback=never) as client:  # the modern path
        result = await client.call_tool("run_code", {"code": "fetch"})
    out = result.structured_content
    assert out is not None
    assert out["stdout"] == "answered deny\n"
    assert out["notes"] == [
        "a connection to pypi.org:443 needed approval: denied: this MCP client's connection takes no "
        "question from the server"
    ]
