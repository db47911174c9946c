"""The MCP server's tools against a fake session, through the ``mcp`` package's in-process client."""

from __future__ import annotations

import base64
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from mcp import Client
from mcp.types import CallToolResult, ImageContent, TextContent

from sandbox_kernel.errors import ConfigurationError, WorkspaceError
from sandbox_kernel.mcp_server import KernelTools, build_server, strip_ansi

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()


@dataclass
class FakeResult:
    data: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    is_main_result: bool = False


@dataclass
class FakeError:
    ename: str
    evalue: str
    traceback: list[str]


@dataclass
class FakeExecution:
    status: str = "ok"
    stdout: str = ""
    stderr: str = ""
    results: list[FakeResult] = field(default_factory=list)
    error: FakeError | None = None
    duration: float = 0.01
    restarted: bool = False


@dataclass
class FakeFileInfo:
    name: str
    path: str
    size: int
    is_dir: bool
    modified: float


class FakeFiles:
    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}

    async def upload(self, path: str, data: bytes | str) -> str:
        if path.startswith(".."):
            raise WorkspaceError(f"{path!r} leaves the workspace")
        self.stored[path] = data.encode() if isinstance(data, str) else data
        return path

    async def download(self, path: str, max_bytes: int | None = None) -> bytes:
        if path not in self.stored:
            raise WorkspaceError(f"No such file {path!r} in the workspace.")
        return self.stored[path]

    async def list(self, path: str = ".") -> list[FakeFileInfo]:
        return [FakeFileInfo(name, name, len(data), False, 0.0) for name, data in self.stored.items()]


class FakeSession:
    """Runs ``print(x)`` style cells from a table; records what was asked of it."""

    ids = itertools.count()
    started: list[FakeSession] = []

    def __init__(self, kernel_name: str, cwd: str, **policy: Any) -> None:
        if policy.get("memory") == "64g":
            raise ConfigurationError("memory '64g' is more than the kernelspec's ceiling '2g'")
        self.kernel_name, self.cwd, self.policy = kernel_name, cwd, policy
        self.kernel_id = f"kernel-{next(self.ids)}"
        self.files = FakeFiles()
        self.calls: list[str] = []

    async def start(self) -> None:
        self.started.append(self)

    async def run(self, code: str, timeout: float | None = None) -> FakeExecution:
        self.calls.append(code)
        if code == "plot":
            return FakeExecution(results=[FakeResult({"text/plain": "<Figure>", "image/png": PNG})])
        if code == "1/0":
            traceback = ["\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"]
            return FakeExecution("error", error=FakeError("ZeroDivisionError", "division by zero", traceback))
        return FakeExecution(stdout=code + "\n")

    async def interrupt(self) -> None:
        self.calls.append("interrupt")

    async def restart(self) -> None:
        self.calls.append("restart")

    async def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture
def tools() -> KernelTools:
    FakeSession.started = []
    return KernelTools("sandboxed-python", "/work/space", FakeSession)


@asynccontextmanager
async def connect(tools: KernelTools) -> AsyncIterator[Client]:
    """An in-process client; not a fixture, whose teardown would run in another task than anyio wants."""
    async with Client(build_server(tools)) as client:
        yield client


def text(result: CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, TextContent)
    return first.text


async def test_lists_the_tools_with_input_and_output_schemas(tools: KernelTools) -> None:
    async with connect(tools) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert set(tools) == {
            "start_kernel",
            "run_code",
            "upload_file",
            "download_file",
            "list_files",
            "restart_kernel",
            "shutdown_kernel",
        }
        assert tools["run_code"].input_schema["required"] == ["code"]
        assert tools["run_code"].output_schema is not None
        assert "error" in tools["run_code"].output_schema["properties"]


async def test_run_code_starts_one_default_kernel_and_reuses_it(tools: KernelTools) -> None:
    async with connect(tools) as client:
        first = await client.call_tool("run_code", {"code": "a"})
        second = await client.call_tool("run_code", {"code": "b"})
        assert not first.is_error
        assert first.structured_content is not None
        assert second.structured_content is not None
        assert first.structured_content["stdout"] == "a\n"
        assert first.structured_content["kernel_id"] == second.structured_content["kernel_id"]
        assert len(FakeSession.started) == 1
        assert FakeSession.started[0].policy == {}


async def test_images_come_back_as_image_content(tools: KernelTools) -> None:
    async with connect(tools) as client:
        result = await client.call_tool("run_code", {"code": "plot"})
        images = [block for block in result.content if isinstance(block, ImageContent)]
        assert [(image.mime_type, image.data) for image in images] == [("image/png", PNG)]
        assert result.structured_content is not None
        assert result.structured_content["results"] == [
            {"text": "<Figure>", "mime_types": ["image/png", "text/plain"]}
        ]


async def test_a_failing_cell_is_a_result_with_the_error_not_a_failed_call(tools: KernelTools) -> None:
    async with connect(tools) as client:
        result = await client.call_tool("run_code", {"code": "1/0"})
        assert not result.is_error
        assert result.structured_content is not None
        assert result.structured_content["status"] == "error"
        assert result.structured_content["error"] == {
            "ename": "ZeroDivisionError",
            "evalue": "division by zero",
            "traceback": ["ZeroDivisionError: division by zero"],
        }
        assert "ZeroDivisionError" in text(result)


async def test_start_kernel_passes_only_the_narrowing_given(tools: KernelTools) -> None:
    async with connect(tools) as client:
        result = await client.call_tool("start_kernel", {"memory": "256m", "network": "none"})
        assert result.structured_content is not None
        assert FakeSession.started[-1].policy == {"memory": "256m", "network": "none"}
        kernel_id = result.structured_content["kernel_id"]
        ran = await client.call_tool("run_code", {"code": "x", "kernel_id": kernel_id})
        assert ran.structured_content is not None
        assert ran.structured_content["kernel_id"] == kernel_id


async def test_errors_are_tool_errors_that_say_what_to_do(tools: KernelTools) -> None:
    async with connect(tools) as client:
        nothing = await client.call_tool("restart_kernel", {})
        assert nothing.is_error
        assert "no default kernel" in text(nothing)
        wider = await client.call_tool("start_kernel", {"memory": "64g"})
        assert wider.is_error
        assert "ceiling" in text(wider)
        unknown = await client.call_tool("run_code", {"code": "x", "kernel_id": "nope"})
        assert unknown.is_error
        assert "no kernel 'nope'" in text(unknown)
        assert "start_kernel" in text(unknown)
        refused = await client.call_tool("upload_file", {"path": "../x", "content": "y"})
        assert refused.is_error
        assert "leaves the workspace" in text(refused)
        bad = await client.call_tool("upload_file", {"path": "x", "content": "!!", "encoding": "base64"})
        assert bad.is_error
        assert "base64" in text(bad)
        network = await client.call_tool("start_kernel", {"network": "bridge"})
        assert network.is_error
        assert (await client.call_tool("run_code", {"code": "still fine"})).structured_content is not None


async def test_files_round_trip_as_text_or_base64(tools: KernelTools) -> None:
    async with connect(tools) as client:
        await client.call_tool("upload_file", {"path": "a.txt", "content": "héllo"})
        raw = base64.b64encode(b"\xff\x00").decode()
        await client.call_tool("upload_file", {"path": "b.bin", "content": raw, "encoding": "base64"})
        a = await client.call_tool("download_file", {"path": "a.txt"})
        b = await client.call_tool("download_file", {"path": "b.bin"})
        assert a.structured_content == {"path": "a.txt", "size": 6, "encoding": "utf-8", "content": "héllo"}
        assert b.structured_content == {"path": "b.bin", "size": 2, "encoding": "base64", "content": raw}
        listing = await client.call_tool("list_files", {})
        assert listing.structured_content is not None
        assert [entry["name"] for entry in listing.structured_content["files"]] == ["a.txt", "b.bin"]


async def test_a_file_name_that_is_not_utf8_is_listed_escaped_and_still_downloadable(
    tools: KernelTools,
) -> None:
    """Kernel code made ``bad\\xff.txt`` (a byte that is not UTF-8): listing it once made a
    result the transport could not serialize, which ended the server."""
    async with connect(tools) as client:
        await client.call_tool("run_code", {"code": "a"})
        stored = FakeSession.started[0].files.stored
        stored["bad\udcff.txt"] = b"bytes"
        stored["caf\u00e9.txt"] = b"fine"
        listing = await client.call_tool("list_files", {})
        assert not listing.is_error
        listing.model_dump_json()  # as the stdio transport sends it
        text(listing).encode("utf-8")
        assert listing.structured_content is not None
        entries = {entry["name"]: entry for entry in listing.structured_content["files"]}
        assert entries["bad\\xff.txt"]["path"] == "bad\\xff.txt"
        assert entries["bad\\xff.txt"]["undecodable"] is True
        assert entries["caf\u00e9.txt"]["undecodable"] is False
        got = await client.call_tool("download_file", {"path": "bad\\xff.txt"})
        assert got.structured_content == {
            "path": "bad\\xff.txt",
            "size": 5,
            "encoding": "utf-8",
            "content": "bytes",
        }
        stored["bad\\xff.txt"] = b"literal"  # a name that exists as written comes first
        literal = await client.call_tool("download_file", {"path": "bad\\xff.txt"})
        assert literal.structured_content is not None
        assert literal.structured_content["content"] == "literal"
        missing = await client.call_tool("download_file", {"path": "gone\\xff.txt"})
        assert missing.is_error
        assert "No such file" in text(missing)
        assert (await client.call_tool("run_code", {"code": "still serving"})).structured_content is not None


async def test_shutting_the_default_kernel_down_lets_run_code_start_another(tools: KernelTools) -> None:
    async with connect(tools) as client:
        await client.call_tool("run_code", {"code": "a"})
        down = await client.call_tool("shutdown_kernel", {})
        assert down.structured_content is not None
        assert down.structured_content["status"] == "shut down"
        again = await client.call_tool("run_code", {"code": "b"})
        assert again.structured_content is not None
        assert again.structured_content["kernel_id"] != down.structured_content["kernel_id"]
        assert FakeSession.started[0].calls == ["a", "shutdown"]


async def test_every_kernel_is_shut_down_when_the_server_ends(tools: KernelTools) -> None:
    async with Client(build_server(tools)) as client:
        await client.call_tool("run_code", {"code": "a"})
        await client.call_tool("start_kernel", {})
    assert [session.calls[-1] for session in FakeSession.started] == ["shutdown", "shutdown"]


def test_strip_ansi() -> None:
    assert strip_ansi("\x1b[0;31mValueError\x1b[0m: \x1b[1mx\x1b[22m") == "ValueError: x"
