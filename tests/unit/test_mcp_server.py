"""The MCP server's tools against a fake session, through the ``mcp`` package's in-process client."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import struct
import sys
import threading
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, ClientSession, StdioServerParameters, stdio_client
from mcp.shared.message import SessionMessage
from mcp.types import CallToolResult, ImageContent, JSONRPCResponse, TextContent

from sandbox_kernel.agents.commands import CommandResult
from sandbox_kernel.agents.files import FileTooLargeError, FolderNotEmptyError, MissingFileError
from sandbox_kernel.agents.mcp_files import MAX_DOWNLOAD
from sandbox_kernel.agents.mcp_results import allot, cut, sniff_image
from sandbox_kernel.agents.mcp_server import (
    KEPT_OUTPUTS,
    KernelTools,
    McpLimits,
    build_server,
    strip_ansi,
)
from sandbox_kernel.agents.mcp_transport import (
    OVERSIZED,
    BoundedLines,
    LineWriter,
    WireMessages,
    WireWriter,
)
from sandbox_kernel.errors import ConfigurationError, WorkspaceError


def png_bytes(width: int = 2, height: int = 2) -> bytes:
    """A real PNG: what matplotlib makes, only smaller."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = (b"\x00" + b"\xff\x00\x00" * width) * height
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


#: The classic 1x1 transparent GIF.
GIF = (
    b"GIF89a\x01\x00\x01\x00\x80\x00\x00\xff\xff\xff\x00\x00\x00!\xf9\x04\x01\x00\x00\x00\x00"
    b",\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02D\x01\x00;"
)
PNG = base64.b64encode(png_bytes()).decode()


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
        if max_bytes is not None and len(self.stored.get(path, b"")) > max_bytes:
            raise FileTooLargeError("pass a larger max_bytes", len(self.stored[path]), max_bytes)
        if path not in self.stored:
            raise WorkspaceError(f"No such file {path!r} in the workspace.")
        return self.stored[path]

    async def list(self, path: str = ".") -> list[FakeFileInfo]:
        return [FakeFileInfo(name, name, len(data), False, 0.0) for name, data in sorted(self.stored.items())]

    async def delete(self, path: str, recursive: bool = False) -> None:
        if path == "folder" and not recursive:
            raise FolderNotEmptyError(
                "'folder' is a folder that is not empty: delete it with recursive=True."
            )
        if path == "folder":
            return
        if path not in self.stored:
            raise MissingFileError(f"No such file {path!r} in the workspace.")
        del self.stored[path]


#: What a session's policy() says (the real one reads the provisioner).
POLICY: dict[str, Any] = {
    "memory": "2g",
    "cpus": 1.0,
    "pids": 256,
    "tmp_size": "256m",
    "file_size": "4g",
    "exec_timeout": 0.0,
    "idle_timeout": 0.0,
    "network": "none",
    "allowed_domains": [],
    "approval": "off",
    "output_limit": "10m",
    "lifecycle": "ephemeral",
    "image": "sandbox-kernel/python:latest",
    "workspace": "/workspace",
    "working_folder": "/workspace",
}


class FakeSession:
    """Runs ``print(x)`` style cells from a table; records what was asked of it. Every
    session shares one workspace, as an MCP server's kernels do."""

    ids = itertools.count()
    started: list[FakeSession] = []
    #: What a cell of this code gives, for tests to set.
    scripted: dict[str, FakeExecution] = {}
    workspace = FakeFiles()

    def __init__(self, kernel_name: str, cwd: str, **policy: Any) -> None:
        self.kernel_name, self.cwd, self.policy_asked = kernel_name, cwd, policy
        self.interrupted: asyncio.Event | None = None
        self.kernel_id = f"kernel-{next(self.ids)}"
        self.files = self.workspace
        self.calls: list[str] = []

    async def start(self) -> None:
        await asyncio.sleep(0.01)  # long enough for other starts to come in meanwhile
        if self.policy_asked.get("memory") == "64g":
            raise ConfigurationError("memory '64g' is more than the kernelspec's ceiling '2g'")
        self.started.append(self)

    async def run(
        self, code: str, timeout: float | None = None, env: dict[str, str] | None = None
    ) -> FakeExecution:
        self.calls.append(code)
        if env:
            if "A=B" in env:
                raise ValueError("env name 'A=B' is not an environment variable's name")
            return FakeExecution(stdout=f"{env}\n")
        if code in self.scripted:
            return self.scripted[code]
        if code == "sleep":
            self.interrupted = asyncio.Event()
            await self.interrupted.wait()
            error = FakeError("KeyboardInterrupt", "", ["KeyboardInterrupt"])
            return FakeExecution("error", error=error)
        if code == "value":
            return FakeExecution(
                results=[
                    FakeResult({"text/plain": "'shown'"}),
                    FakeResult({"text/plain": "42"}, is_main_result=True),
                ]
            )
        if code == "crash the host side":
            raise RuntimeError("Kernel didn't respond\nin 30 seconds")
        if code == "plot":
            return FakeExecution(results=[FakeResult({"text/plain": "<Figure>", "image/png": PNG})])
        if code == "1/0":
            traceback = ["\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"]
            return FakeExecution("error", error=FakeError("ZeroDivisionError", "division by zero", traceback))
        return FakeExecution(stdout=code + "\n")

    async def run_command(self, command: str, **options: Any) -> CommandResult:
        self.calls.append(f"$ {command}")
        self.command_options = options
        if not command.strip():
            raise ValueError("command must be a non-empty shell command line, e.g. 'ls -la'")
        if command == "loud":
            return CommandResult(exit_code=0, stdout="o" * 50_000, stderr="e" * 10)
        return CommandResult(
            exit_code=3, stdout=f"ran {command}\n", stderr="\x1b[31mwarn\x1b[0m\n", duration=0.5
        )

    async def interrupt(self) -> None:
        self.calls.append("interrupt")
        if self.interrupted is not None:
            self.interrupted.set()

    async def current_policy(self) -> dict[str, Any]:
        return {**POLICY, "memory": self.policy_asked.get("memory", "2g")}

    async def restart(self) -> None:
        self.calls.append("restart")

    async def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture(autouse=True)
def _fresh_fakes() -> None:
    FakeSession.started = []
    FakeSession.scripted = {}
    FakeSession.workspace = FakeFiles()


@pytest.fixture
def tools() -> KernelTools:
    return KernelTools("sandboxed-python", "/work/space", FakeSession)


def limited(**limits: Any) -> KernelTools:
    return KernelTools("sandboxed-python", "/work/space", FakeSession, McpLimits(**limits))


@asynccontextmanager
async def connect(tools: KernelTools) -> AsyncIterator[Client]:
    """An in-process client; not a fixture, whose teardown would run in another task than anyio wants."""
    async with Client(build_server(tools)) as client:
        yield client


def structured(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, text(result)
    assert result.structured_content is not None
    return result.structured_content


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
            "run_command",
            "upload_file",
            "download_file",
            "list_files",
            "delete_file",
            "interrupt_kernel",
            "list_kernels",
            "get_policy",
            "restart_kernel",
            "shutdown_kernel",
        }
        assert tools["run_code"].input_schema["required"] == ["code"]
        assert "max_output_chars" in tools["run_code"].input_schema["properties"]
        assert {"offset", "limit"} <= set(tools["list_files"].input_schema["properties"])
        assert tools["run_code"].output_schema is not None
        assert {"error", "truncated", "full_output", "notes"} <= set(
            tools["run_code"].output_schema["properties"]
        )
        assert {"total", "more", "next_offset"} <= set(tools["list_files"].output_schema["properties"])


async def test_the_instructions_name_the_workspace_as_the_kernel_sees_it(tools: KernelTools) -> None:
    """They gave the host's path, which does not exist in the kernel: a model that
    followed them got FileNotFoundError."""
    async with connect(tools) as client:
        assert client.instructions is not None
        assert "/workspace" in client.instructions
        assert "/work/space" not in client.instructions
        for tool in ("run_command", "interrupt_kernel", "get_policy"):
            assert tool in client.instructions


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
        assert FakeSession.started[0].policy_asked == {}


async def test_images_come_back_as_image_content(tools: KernelTools) -> None:
    async with connect(tools) as client:
        result = await client.call_tool("run_code", {"code": "plot"})
        images = [block for block in result.content if isinstance(block, ImageContent)]
        assert [(image.mime_type, image.data) for image in images] == [("image/png", PNG)]
        assert result.structured_content is not None
        assert result.structured_content["results"] == [
            {"text": "<Figure>", "mime_types": ["image/png", "text/plain"], "is_main_result": False}
        ]
        assert result.structured_content["text"] is None, "a plot is displayed, not the cell's value"


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
        assert FakeSession.started[-1].policy_asked == {"memory": "256m", "network": "none"}
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
        assert listing.structured_content["total"] == 2
        assert listing.structured_content["more"] is False


async def test_a_file_name_that_is_not_utf8_is_listed_escaped_and_still_downloadable(
    tools: KernelTools,
) -> None:
    """Kernel code made ``bad\\xff.txt`` (a byte that is not UTF-8): listing it once made a
    result the transport could not serialize, which ended the server."""
    async with connect(tools) as client:
        await client.call_tool("run_code", {"code": "a"})
        stored = FakeSession.workspace.stored
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


@pytest.mark.parametrize(
    ("printed", "shown"),
    [
        ("copy\x1b]52;c;cm0gLXJmIH4=\x07 this", "copy this"),  # OSC 52 writes the clipboard, BEL-ended
        ("copy\x1b]52;c;cm0gLXJmIH4=\x1b\\ this", "copy this"),  # ... ST-ended
        ("\x1b]8;;https://evil.example\x1b\\docs.python.org\x1b]8;;\x1b\\", "docs.python.org"),  # OSC 8
        ("\x1b]0;new title\x07ok", "ok"),
        ("\x9d52;c;eA==\x9cok", "ok"),  # 8-bit OSC and ST
        ("\x9b2Jok", "ok"),  # 8-bit CSI: erase the screen
        ("\x1bP+q544e\x1b\\ok", "ok"),  # DCS (a terminal query)
        ("\x1b_apc\x1b\\\x1b^pm\x1b\\\x1bXsos\x1b\\ok", "ok"),
        ("\x1bcreset\x1b(0\x1b7ok", "resetok"),  # RIS, charset, save cursor
        ("a\x85b\x8dc\x9ad", "abcd"),  # C1 controls (\x9f would begin an APC string)
        ("bell\x07 back\x08 nul\x00 del\x7f vt\x0b ff\x0c", "bell back nul del vt ff"),
        ("tab\tnewline\ncarriage\r\n", "tab\tnewline\ncarriage\r\n"),
        ("\x1b]52;c;never terminated", ""),
        ("é ü 中 😀 \u2028", "é ü 中 😀 \u2028"),
    ],
)
def test_strip_ansi_removes_every_terminal_control(printed: str, shown: str) -> None:
    assert strip_ansi(printed) == shown


async def test_control_sequences_leave_no_text_of_a_result(tools: KernelTools) -> None:
    osc52 = "\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUgfCBzaA==\x07"
    FakeSession.scripted["hostile"] = FakeExecution(
        "error",
        stdout=f"out{osc52}\n",
        stderr="err\x9b2J\n",
        results=[FakeResult({"text/plain": f"value{osc52}"})],
        error=FakeError("Value\x1b]0;x\x07Error", f"bad{osc52}", [f"frame{osc52}"]),
    )
    async with connect(tools) as client:
        result = await client.call_tool("run_code", {"code": "hostile"})
        got = structured(result)
        assert (got["stdout"], got["stderr"], got["results"][0]["text"]) == ("out\n", "err\n", "value")
        assert got["error"] == {"ename": "ValueError", "evalue": "bad", "traceback": ["frame"]}
        assert "\x1b" not in text(result)
        assert "\\u001b" not in text(result)


async def test_a_result_is_its_structured_content_as_indented_json_text(tools: KernelTools) -> None:
    FakeSession.scripted["café"] = FakeExecution(stdout="café ☕\n", duration=1.5)
    async with connect(tools) as client:
        result = await client.call_tool("run_code", {"code": "café"})
        assert text(result) == json.dumps(structured(result), indent=2, ensure_ascii=False)


async def test_output_that_is_not_utf8_comes_back_escaped_not_as_a_broken_result(tools: KernelTools) -> None:
    """A lone surrogate (kernel code can print one: JSON carries it) cannot be sent: the
    result holds each such character as \\xNN, in its text and its structured content."""
    FakeSession.scripted["bad"] = FakeExecution(stdout="bad\udcff\n")
    async with connect(tools) as client:
        result = await client.call_tool("run_code", {"code": "bad"})
        assert structured(result)["stdout"] == "bad\\xff\n"
        assert json.loads(text(result)) == structured(result)
        result.model_dump_json()  # as the transport sends it


RUN_CODE_SAMPLES: list[Any] = [
    {},
    {"error": None},
    {"error": {"ename": "E", "evalue": "v", "traceback": []}},
    {"error": {"ename": "E", "evalue": "v"}},
    {"error": "E"},
    {"text": None, "cpu_time": None, "peak_memory": None, "restart_reason": None},
    {"text": 2, "cpu_time": "1", "peak_memory": 1.5, "restart_reason": False},
    {"results": [{"text": "2", "mime_types": ["text/plain"], "is_main_result": True}]},
    {"results": [{"text": "2", "mime_types": ["text/plain"]}]},
    {"results": [None]},
    {"status": None},
    {"status": "maybe"},
    {"full_output": {"stdout": 1}},
]


async def test_the_published_output_schemas_take_exactly_the_results_pydantics_take(
    tools: KernelTools,
) -> None:
    """They are written without references and with "this or null" as one type list, which
    a client checks a third faster; every sample is accepted, or refused, by both alike."""
    from jsonschema import Draft202012Validator
    from pydantic import TypeAdapter

    from sandbox_kernel.agents.mcp_results import RunCodeOutput, plain_schema

    FakeSession.scripted["ok"] = FakeExecution(results=[FakeResult({"text/plain": "2"}, is_main_result=True)])
    async with connect(tools) as client:
        published = {tool.name: tool.output_schema for tool in (await client.list_tools()).tools}
        base = structured(await client.call_tool("run_code", {"code": "ok"}))
    assert "$ref" not in json.dumps(published)
    assert "$defs" not in json.dumps(published)
    assert published["run_code"]["properties"]["text"]["type"] == ["string", "null"]
    original = TypeAdapter(RunCodeOutput).json_schema()
    assert plain_schema(original) == published["run_code"]
    verdicts = []
    for sample in RUN_CODE_SAMPLES:
        instance = {**base, **sample}
        verdict = Draft202012Validator(original).is_valid(instance)
        assert Draft202012Validator(published["run_code"]).is_valid(instance) == verdict, sample
        verdicts.append(verdict)
    assert set(verdicts) == {True, False}
    recursive = {
        "$defs": {"Node": {"properties": {"next": {"$ref": "#/$defs/Node"}}}},
        "$ref": "#/$defs/Node",
    }
    assert plain_schema(recursive) == recursive, "a recursive type keeps its references"


# ---------------------------------------------------------------- bounds: kernels


async def test_kernels_per_server_are_bounded() -> None:
    """500 of 500 start_kernel calls were accepted."""
    async with connect(limited(max_kernels=3)) as client:
        default = structured(await client.call_tool("run_code", {"code": "a"}))["kernel_id"]
        second = structured(await client.call_tool("start_kernel", {}))["kernel_id"]
        structured(await client.call_tool("start_kernel", {}))
        refused = await client.call_tool("start_kernel", {})
        assert refused.is_error
        message = text(refused)
        assert "already runs 3 kernel(s)" in message
        assert "McpLimits.max_kernels = 3" in message
        assert f"{default} (default)" in message
        assert "shutdown_kernel" in message
        assert "\n" not in message
        assert len(FakeSession.started) == 3
        await client.call_tool("shutdown_kernel", {"kernel_id": second})
        structured(await client.call_tool("start_kernel", {}))


async def test_kernels_starting_at_once_count_against_the_bound() -> None:
    async with connect(limited(max_kernels=3)) as client:
        results = await asyncio.gather(*(client.call_tool("start_kernel", {}) for _ in range(20)))
        assert sum(not result.is_error for result in results) == 3
        assert all("max_kernels" in text(result) for result in results if result.is_error)
        assert len(FakeSession.started) == 3


async def test_a_failed_start_frees_its_place() -> None:
    async with connect(limited(max_kernels=1)) as client:
        wider = await client.call_tool("start_kernel", {"memory": "64g"})
        assert wider.is_error
        assert "ceiling" in text(wider)
        structured(await client.call_tool("run_code", {"code": "a"}))


def test_a_limit_below_one_is_refused_naming_it() -> None:
    with pytest.raises(Exception, match=r"McpLimits.max_kernels = 0 must be at least 1"):
        McpLimits(max_kernels=0)


# ---------------------------------------------------------------- bounds: uploads


async def test_an_upload_over_the_limit_is_refused_and_not_kept() -> None:
    """One 256 MiB upload took the server from 92 to 1,665 MiB."""
    async with connect(limited(max_upload="1k")) as client:
        just = base64.b64encode(b"x" * 1024).decode()
        assert (
            structured(
                await client.call_tool(
                    "upload_file", {"path": "ok.bin", "content": just, "encoding": "base64"}
                )
            )["size"]
            == 1024
        )
        over = base64.b64encode(b"x" * 1025).decode()
        refused = await client.call_tool(
            "upload_file", {"path": "big.bin", "content": over, "encoding": "base64"}
        )
        assert refused.is_error
        assert "'big.bin' would be 1,025 bytes: over the 1,024 bytes upload_file takes in one call" in text(
            refused
        )
        assert "McpLimits.max_upload" in text(refused)
        for content in ("y" * 1025, "é" * 513):  # characters, and UTF-8 bytes
            refused = await client.call_tool("upload_file", {"path": "big.txt", "content": content})
            assert refused.is_error
            assert "over the 1,024 bytes" in text(refused)
        assert set(FakeSession.workspace.stored) == {"ok.bin"}


async def test_half_a_character_in_text_content_is_a_clear_error(tools: KernelTools) -> None:
    async with connect(tools) as client:
        refused = await client.call_tool("upload_file", {"path": "x.txt", "content": "a\ud800b"})
        assert refused.is_error
        assert "lone surrogate" in text(refused)
        assert "base64" in text(refused)


def long_lines() -> list[bytes]:
    """Lines an MCP client might send: small, over 100,000 bytes (an id first, an id last),
    a notification over it, and a last one without its line break."""
    big_request = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "upload_file", "arguments": {"path": "x", "content": "A" * 3_000_000}},
    }
    id_last = {"jsonrpc": "2.0", "method": "tools/call", "params": {"c": "B" * 300_000}, "id": "req-9"}
    return [
        b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}\n',
        json.dumps(big_request).encode() + b"\n",
        json.dumps({"jsonrpc": "2.0", "method": "notifications/x", "params": {"c": "C" * 300_000}}).encode()
        + b"\n",
        json.dumps(id_last).encode() + b"\n",
        b'{"jsonrpc": "2.0", "id": 2, "method": "ping"}',  # the last, without a line break
    ]


def watch_drops(reader: BoundedLines) -> list[int]:
    """How much of a line ``reader`` holds each time it starts dropping one."""
    held: list[int] = []
    original = reader._begin_drop

    def watched() -> None:
        held.append(len(reader._buffer))
        original()

    reader._begin_drop = watched  # type: ignore[method-assign]
    return held


def check_long_lines(lines: list[bytes], got: list[bytes], held: list[int]) -> None:
    assert got[0] == lines[0]
    first, second = json.loads(got[1]), json.loads(got[2])
    assert (first["id"], first["method"]) == (7, "tools/call")
    assert first["params"]["_meta"][OVERSIZED]["limit"] == 100_000
    assert first["params"]["_meta"][OVERSIZED]["size"] >= 3_000_000
    assert second["id"] == "req-9", "an id after the params is found in the tail"
    assert json.loads(got[3]) == {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    assert len(got) == 4, "the notification (no id: nobody waits) is dropped"
    assert len(held) == 3
    assert max(held) <= 100_000 + 64 * 1024


def test_long_lines_are_read_through_and_replaced_by_a_stand_in() -> None:
    """The transport never holds a line over the limit: it reads it in pieces, drops it,
    and hands the server a small request with the same id instead."""
    read, write = os.pipe()
    lines = long_lines()
    writer = threading.Thread(target=lambda: [os.write(write, line) for line in lines] and os.close(write))
    writer.start()
    reader = BoundedLines(read, limit=100_000)
    held = watch_drops(reader)
    got = []
    while (line := reader.read_line()) is not None:
        got.append(line)
    writer.join()
    os.close(read)
    check_long_lines(lines, got, held)


class LoopTicks:
    """Counts the turns of the running event loop, to show it was never blocked."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.ticks += 1

    def stop(self) -> int:
        self._task.cancel()
        return self.ticks


async def test_a_pipe_is_read_on_the_event_loop_where_lines_arrive_in_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From a pipe (what an MCP client hands its server) the lines are read without a
    thread, without blocking the loop while a line arrives in pieces (one over the limit
    too, dropped across many reads), the same lines as read blocking; the pipe gets its
    flags back."""
    read, write = os.pipe()
    lines = long_lines()
    data = b"".join(lines)

    def trickle() -> None:  # pieces of 50,000 bytes or fewer, with pauses between them
        for at in range(0, len(data), 49_999):
            os.write(write, data[at : at + 49_999])
            if at // 49_999 % 8 == 0:
                threading.Event().wait(0.002)
        os.close(write)

    reader = BoundedLines(read, limit=100_000)
    held = watch_drops(reader)

    def no_thread(*args: object, **kwargs: object) -> None:
        raise AssertionError("a thread read the pipe")

    monkeypatch.setattr(anyio.to_thread, "run_sync", no_thread)
    ticker = LoopTicks()
    writer = threading.Thread(target=trickle)
    writer.start()
    got = [line async for line in reader]
    writer.join()
    ticks = ticker.stop()
    reader.close()
    assert os.get_blocking(read), "the pipe is blocking again"
    os.close(read)
    check_long_lines(lines, got, held)
    assert ticks > 10, "the loop ran while the lines came in"


async def test_a_message_larger_than_the_pipe_goes_out_whole_without_blocking_the_loop() -> None:
    """The server's stdout waits on the loop while the pipe is full (a client that reads
    slowly), then sends the rest: every byte, in order."""
    read, write = os.pipe()
    out = LineWriter(write)
    message = json.dumps({"result": "x" * 1_000_000}) + "\n"
    received = bytearray()

    def slow_reader() -> None:
        while piece := os.read(read, 4096):
            received.extend(piece)
            if len(received) % (256 * 1024) < 4096:
                threading.Event().wait(0.01)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    ticker = LoopTicks()
    await out.write(message)
    await out.flush()
    ticks = ticker.stop()
    out.close()
    assert os.get_blocking(write), "the pipe is blocking again"
    os.close(write)
    reader.join()
    os.close(read)
    assert received.decode() == message
    assert ticks > 10, "the loop ran while the pipe was full"


async def test_the_wire_hands_on_each_line_as_a_message_or_as_what_is_wrong_with_it() -> None:
    read, write = os.pipe()
    os.write(write, b'{"jsonrpc": "2.0", "id": 1, "method": "ping"}\nnot json\n')
    os.close(write)
    lines = BoundedLines(read, limit=1000)
    got = [item async for item in WireMessages(lines)]
    lines.close()
    os.close(read)
    assert len(got) == 2
    assert isinstance(got[0], SessionMessage)
    assert got[0].message.model_dump(exclude_unset=True) == {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    assert isinstance(got[1], ValueError), "a line that is no message comes as its error"


async def test_a_reply_whose_sender_is_cancelled_midway_still_goes_out_whole() -> None:
    """A message once begun is written to its end (the client reads slowly here): the rest
    of a line left for the next message to push out would keep the client waiting for
    an answer that may never come."""
    read, write = os.pipe()
    out = LineWriter(write)
    wire = WireWriter(out)
    big = JSONRPCResponse(jsonrpc="2.0", id=1, result={"text": "x" * 1_000_000})
    received = bytearray()

    def slow_reader() -> None:
        threading.Event().wait(0.2)  # long after the sender was cancelled
        while piece := os.read(read, 65536):
            received.extend(piece)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    with anyio.move_on_after(0.02) as scope:
        await wire.send(SessionMessage(big))  # the pipe holds 64 KiB: this waits for the reader
    out.close()
    os.close(write)
    reader.join()
    os.close(read)
    assert scope.cancel_called, "the sender was cancelled while the message was written"
    assert received.endswith(b"\n"), "the whole line went out"
    assert json.loads(received)["result"]["text"] == "x" * 1_000_000


async def test_a_client_gone_is_a_broken_stream_to_the_session_not_a_crash() -> None:
    read, write = os.pipe()
    os.close(read)
    out = LineWriter(write)
    wire = WireWriter(out)
    with pytest.raises(anyio.BrokenResourceError):
        await wire.send(SessionMessage(JSONRPCResponse(jsonrpc="2.0", id=1, result={})))
    with pytest.raises(anyio.ClosedResourceError):
        await wire.send(SessionMessage(JSONRPCResponse(jsonrpc="2.0", id=2, result={})))
    out.close()
    os.close(write)


def rss_peak(pid: int) -> int:
    """The most memory ``pid`` held, in bytes (Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


SERVE_FAKES = """
import anyio, sys
from sandbox_kernel.agents.mcp_server import McpLimits, serve_stdio_async
from tests.unit.test_mcp_server import FakeSession
anyio.run(serve_stdio_async, "sandboxed-python", "/work/space", FakeSession, McpLimits(max_upload="1m"))
"""


@pytest.mark.timeout(120)
async def test_a_huge_upload_over_stdio_is_refused_without_the_server_holding_it() -> None:
    """The attack over the real transport: the server's peak memory grew by 6.5 times the
    upload; now it reads no message over its limit, whatever the client sends."""
    root = Path(__file__).parents[2]
    params = StdioServerParameters(
        command=sys.executable, args=["-c", SERVE_FAKES], cwd=str(root), env=dict(os.environ)
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        assert not (await session.call_tool("run_code", {"code": "warm up"})).is_error
        (server,) = [pid for pid in children(os.getpid()) if SERVE_FAKES in cmdline(pid)]
        before = rss_peak(server)
        content = base64.b64encode(os.urandom(96 * 1024 * 1024)).decode()
        refused = await session.call_tool(
            "upload_file",
            {"path": "big.bin", "content": content, "encoding": "base64"},
            read_timeout_seconds=100,
        )
        del content
        assert refused.is_error
        assert "over the 2,446,677 bytes this MCP server reads in one message" in text(refused)
        assert "upload a large file in parts" in text(refused)
        grown = rss_peak(server) - before
        assert grown < 32 * 1024 * 1024, f"the server grew by {grown / 2**20:.0f} MiB"
        small = base64.b64encode(b"fits").decode()
        fits = await session.call_tool(
            "upload_file", {"path": "f.bin", "content": small, "encoding": "base64"}
        )
        assert not fits.is_error, "the server reads on after the message it dropped"


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")


# ---------------------------------------------------------------- bounds: listings


async def test_list_files_comes_in_pages() -> None:
    """list_files returned 100k entries in one 23 MiB reply."""
    FakeSession.workspace.stored.update({f"f{n:05}.txt": b"" for n in range(1000)})
    async with connect(limited(list_limit=100, max_list_limit=500)) as client:
        first = structured(await client.call_tool("list_files", {}))
        assert [entry["name"] for entry in first["files"]][:2] == ["f00000.txt", "f00001.txt"]
        assert (len(first["files"]), first["total"], first["more"], first["next_offset"]) == (
            100,
            1000,
            True,
            100,
        )
        last = structured(await client.call_tool("list_files", {"offset": 950, "limit": 500}))
        assert (len(last["files"]), last["more"], last["next_offset"], last["offset"]) == (
            50,
            False,
            None,
            950,
        )
        assert last["files"][-1]["name"] == "f00999.txt"
        past = structured(await client.call_tool("list_files", {"offset": 5000}))
        assert (past["files"], past["total"], past["more"]) == ([], 1000, False)
        greedy = await client.call_tool("list_files", {"limit": 100_000})
        assert greedy.is_error
        assert "McpLimits.max_list_limit" in text(greedy)
        assert "offset" in text(greedy)


# ---------------------------------------------------------------- bounds: output


def test_allot_keeps_short_texts_whole_and_shares_the_rest() -> None:
    assert allot([10, 20, 30], 100) == [10, 20, 30]
    assert allot([10, 1000, 5000], 100) == [10, 45, 45]
    assert allot([1000, 1000], 100) == [50, 50]
    assert allot([], 100) == []
    assert allot([5, 5], 0) == [0, 0]


def test_cut_keeps_head_and_tail_around_a_marker() -> None:
    text = "".join(f"line {n}\n" for n in range(10_000))
    shown = cut(text, 1000, "stdout", "read the file")
    assert shown.startswith("line 0\nline 1\n")
    assert shown.endswith("line 9999\n")
    assert len(shown) < 1300
    (marker,) = [line for line in shown.splitlines() if line.startswith("[...")]
    assert marker.startswith("[... 97,906 of 98,890 characters (9,888 lines) of stdout cut here")
    assert "of stdout cut here: read the file ...]" in marker
    assert cut("short", 1000, "stdout", "x") == "short"


async def test_a_huge_print_is_cut_to_the_budget_and_saved_whole() -> None:
    """A run_code result was 10.5 MB for a 20 MB print; an LLM's context holds a few tens of KB."""
    printed = "".join(f"row {n}: {'x' * 40}\n" for n in range(200_000))
    FakeSession.scripted["print a lot"] = FakeExecution(
        stdout=printed,
        stderr="a warning\n",
        results=[FakeResult({"text/plain": "'done'"}, is_main_result=True)],
    )
    async with connect(limited(output_chars=5000, max_output_chars=50_000)) as client:
        result = await client.call_tool("run_code", {"code": "print a lot"})
        got = structured(result)
        assert len(text(result)) < 8000
        assert got["truncated"] is True
        assert got["stderr"] == "a warning\n", "short texts are kept whole"
        assert got["results"][0]["text"] == "'done'"
        stdout = got["stdout"]
        assert stdout.startswith("row 0: ")
        assert stdout.endswith("row 199999: " + "x" * 40 + "\n")
        assert len(stdout) < 5000 + 300
        saved = got["full_output"]["stdout"]
        assert saved.startswith(".mcp-output/kernel-0-1-stdout.txt") or saved.endswith("-1-stdout.txt")
        assert f"of {len(printed):,} characters" in stdout
        assert f"all of it is in the workspace file {saved}" in stdout
        assert "max_output_chars (at most 50,000)" in stdout
        assert FakeSession.workspace.stored[saved].decode() == printed
        assert "stderr" not in got["full_output"]

        bigger = structured(
            await client.call_tool("run_code", {"code": "print a lot", "max_output_chars": 50_000})
        )
        assert 45_000 < len(bigger["stdout"]) < 50_300
        assert "larger max_output_chars" not in bigger["stdout"], "nothing larger to ask for"
        greedy = await client.call_tool("run_code", {"code": "print a lot", "max_output_chars": 10**9})
        assert greedy.is_error
        assert "McpLimits.max_output_chars" in text(greedy)


async def test_every_text_of_a_result_shares_the_budget() -> None:
    huge = "v" * 100_000
    FakeSession.scripted["everything"] = FakeExecution(
        "error",
        stdout="o" * 100_000,
        stderr="e" * 100_000,
        results=[FakeResult({"text/plain": huge}) for _ in range(80)],
        error=FakeError("ValueError", huge, ["frame\n" * 20_000, huge]),
    )
    async with connect(limited(output_chars=10_000)) as client:
        result = await client.call_tool("run_code", {"code": "everything"})
        got = structured(result)
        assert len(text(result)) < 60_000, "the budget plus one marker per text"
        assert len(got["results"]) == 50
        assert got["notes"] == ["30 more rich results are not listed (at most 50 are): display fewer"]
        assert len(got["error"]["traceback"]) == 1
        assert "of the traceback cut here" in got["error"]["traceback"][0]
        assert "of the error's value cut here" in got["error"]["evalue"]


async def test_only_the_newest_cut_outputs_are_kept() -> None:
    FakeSession.scripted["long"] = FakeExecution(stdout="z" * 1000)
    async with connect(limited(output_chars=100)) as client:
        for _ in range(KEPT_OUTPUTS + 5):
            structured(await client.call_tool("run_code", {"code": "long"}))
        kept = sorted(FakeSession.workspace.stored, key=lambda name: int(name.split("-")[-2]))
        assert len(kept) == KEPT_OUTPUTS
        assert kept[0].endswith("-6-stdout.txt")


async def test_no_output_file_when_the_folder_setting_is_empty() -> None:
    FakeSession.scripted["long"] = FakeExecution(stdout="z" * 1000)
    async with connect(limited(output_chars=100, output_folder="")) as client:
        got = structured(await client.call_tool("run_code", {"code": "long"}))
        assert got["full_output"] == {}
        assert "run again with a larger max_output_chars" in got["stdout"]
        assert FakeSession.workspace.stored == {}


# ---------------------------------------------------------------- images


@pytest.mark.parametrize(
    ("mime", "data"),
    [
        ("image/png", "not base64 at all!"),
        ("image/png", base64.b64encode(b"just some text").decode()),
        ("image/png", base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()),  # the magic, no header
        ("image/jpeg", PNG),  # a real image of another type
        ("image/gif", base64.b64encode(b"GIF89a, then text").decode()),
        ("image/svg+xml", "<svg onload='alert(1)'/>"),  # not an image type sent as image content
        ("image/png", ["a", "list"]),
    ],
)
async def test_only_real_images_go_out_as_image_content(tools: KernelTools, mime: str, data: Any) -> None:
    """Arbitrary strings went out as image content."""
    FakeSession.scripted["display"] = FakeExecution(
        results=[FakeResult({"text/plain": "<Figure>", mime: data})]
    )
    async with connect(tools) as client:
        result = await client.call_tool("run_code", {"code": "display"})
        assert [block for block in result.content if isinstance(block, ImageContent)] == []
        got = structured(result)
        if mime in ("image/png", "image/jpeg", "image/gif"):
            assert got["notes"] == [
                f"an output claiming to be {mime} is not a valid base64 {mime} image: not shown"
            ]


async def test_wrapped_base64_of_a_real_image_is_sent_in_one_piece(tools: KernelTools) -> None:
    wrapped = "\n".join(PNG[i : i + 20] for i in range(0, len(PNG), 20))
    FakeSession.scripted["display"] = FakeExecution(results=[FakeResult({"image/png": wrapped})])
    async with connect(tools) as client:
        result = await client.call_tool("run_code", {"code": "display"})
        assert [
            (block.mime_type, block.data) for block in result.content if isinstance(block, ImageContent)
        ] == [("image/png", PNG)]


def test_sniff_image_checks_structure_not_only_magic() -> None:
    assert sniff_image(png_bytes()) == "image/png"
    assert sniff_image(GIF) == "image/gif"
    assert sniff_image(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\0" * 20 + b"\xff\xd9") == "image/jpeg"
    webp = b"RIFF" + (26).to_bytes(4, "little") + b"WEBPVP8L" + (13).to_bytes(4, "little") + b"\0" * 14
    assert sniff_image(webp) == "image/webp"
    assert sniff_image(b"GIF89a is how this text file begins\n") is None
    assert sniff_image(b"\x89PNG\r\n\x1a\n" + b"\0" * 40) is None
    assert sniff_image(b"\xff\xd8\xff\xe0 no end marker") is None
    assert sniff_image(b"RIFF\xff\xff\xff\xffWEBPVP8L") is None
    assert sniff_image(b"") is None


async def test_download_sends_image_content_only_for_files_that_are_images(tools: KernelTools) -> None:
    """A text file starting with GIF89a came back as an image block that was not base64."""
    FakeSession.workspace.stored.update(
        {
            "fake.gif": b"GIF89a, said the text file\n",
            "real.gif": GIF,
            "plot.png": png_bytes(),
            "x.png": b"\x89PNG...",
        }
    )
    async with connect(tools) as client:
        fake = await client.call_tool("download_file", {"path": "fake.gif"})
        assert structured(fake)["encoding"] == "utf-8"
        assert [block for block in fake.content if isinstance(block, ImageContent)] == []
        for name, mime in (("real.gif", "image/gif"), ("plot.png", "image/png")):
            real = await client.call_tool("download_file", {"path": name})
            (image,) = [block for block in real.content if isinstance(block, ImageContent)]
            assert image.mime_type == mime
            assert base64.b64decode(image.data, validate=True) == FakeSession.workspace.stored[name]
        junk = await client.call_tool("download_file", {"path": "x.png"})
        assert [block for block in junk.content if isinstance(block, ImageContent)] == []


# ---------------------------------------------------------------- errors


async def test_every_tool_error_is_one_clear_line(tools: KernelTools) -> None:
    """Raw errors escaped: OSError(36) for a long name, tracebacks."""

    async def fail(path: str, data: bytes | str) -> str:
        raise OSError(36, "File name too long", path)

    async with connect(tools) as client:
        crashed = await client.call_tool("run_code", {"code": "crash the host side"})
        assert crashed.is_error
        assert "run_code failed on the host: RuntimeError: Kernel didn't respond in 30 seconds" in text(
            crashed
        )
        FakeSession.workspace.upload = fail  # type: ignore[method-assign]
        raw = await client.call_tool("upload_file", {"path": "n" * 5000, "content": "x"})
        assert raw.is_error
        message = text(raw)
        assert "upload_file failed on the host: OSError: [Errno 36] File name too long" in message
        assert "\n" not in message
        assert len(message) < 2200, "the 5000-character name is cut in the middle"
        for result in (crashed, raw):
            assert "\n" not in text(result)
            assert "Traceback" not in text(result)


async def test_a_session_error_over_several_lines_becomes_one(tools: KernelTools) -> None:
    async def fail(path: str = ".") -> list[Any]:
        raise WorkspaceError("No such folder\n'x\x1b]52;c;eA==\x07'\n  in the workspace.")

    async with connect(tools) as client:
        structured(await client.call_tool("run_code", {"code": "a"}))
        FakeSession.workspace.list = fail  # type: ignore[method-assign]
        listing = await client.call_tool("list_files", {"path": "x"})
        assert listing.is_error
        assert text(listing).endswith("No such folder 'x' in the workspace.")


async def test_arguments_that_do_not_fit_the_schema_are_one_line_too(tools: KernelTools) -> None:
    """The mcp package's own account spans lines and links to pydantic's pages."""
    async with connect(tools) as client:
        for arguments, says in (
            ({}, "code: Field required"),
            ({"code": ["x"]}, "code: Input should be a valid string"),
            (
                {"code": "x", "max_output_chars": 0},
                "max_output_chars: Input should be greater than or equal to 1",
            ),
        ):
            result = await client.call_tool("run_code", arguments)
            assert result.is_error
            assert (
                text(result) == f"run_code was called with arguments that do not fit its input schema: {says}"
            )


async def test_the_cells_value_is_told_apart_from_what_it_displayed(tools: KernelTools) -> None:
    """#23 item 11: results did not say which was the cell's value."""
    async with connect(tools) as client:
        got = structured(await client.call_tool("run_code", {"code": "value"}))
        assert [(result["text"], result["is_main_result"]) for result in got["results"]] == [
            ("'shown'", False),
            ("42", True),
        ]
        assert got["text"] == "42"


async def test_interrupt_kernel_stops_a_running_cell(tools: KernelTools) -> None:
    async with connect(tools) as client:
        await client.call_tool("run_code", {"code": "warm up"})
        async with asyncio.timeout(10):
            running = asyncio.ensure_future(client.call_tool("run_code", {"code": "sleep"}))
            while not structured(await client.call_tool("list_kernels"))["kernels"][0]["busy"]:
                await asyncio.sleep(0.01)
            interrupted = structured(await client.call_tool("interrupt_kernel", {}))
            assert interrupted["status"] == "interrupted"
            stopped = structured(await running)
        assert stopped["error"]["ename"] == "KeyboardInterrupt"
        assert not structured(await client.call_tool("list_kernels"))["kernels"][0]["busy"]


async def test_interrupt_without_a_kernel_says_how_to_start_one(tools: KernelTools) -> None:
    async with connect(tools) as client:
        refused = await client.call_tool("interrupt_kernel", {})
        assert refused.is_error
        assert "run_code without a kernel_id starts it" in text(refused)


async def test_list_kernels_names_the_default_and_each_narrowing(tools: KernelTools) -> None:
    async with connect(tools) as client:
        assert structured(await client.call_tool("list_kernels"))["kernels"] == []
        default = structured(await client.call_tool("run_code", {"code": "a"}))["kernel_id"]
        other = structured(await client.call_tool("start_kernel", {"memory": "256m"}))["kernel_id"]
        listing = structured(await client.call_tool("list_kernels"))
        assert listing["kernels"] == [
            {"kernel_id": default, "default": True, "busy": False, "policy": {}},
            {"kernel_id": other, "default": False, "busy": False, "policy": {"memory": "256m"}},
        ]
        assert (listing["kernel_name"], listing["max_kernels"]) == ("sandboxed-python", 8)
        await client.call_tool("shutdown_kernel", {"kernel_id": other})
        assert [
            kernel["kernel_id"] for kernel in structured(await client.call_tool("list_kernels"))["kernels"]
        ] == [default]


async def test_get_policy_is_the_sessions_with_the_kernel(tools: KernelTools) -> None:
    async with connect(tools) as client:
        other = structured(await client.call_tool("start_kernel", {"memory": "256m"}))["kernel_id"]
        policy = structured(await client.call_tool("get_policy", {"kernel_id": other}))
        assert policy == {**POLICY, "kernel_id": other, "kernel_name": "sandboxed-python", "memory": "256m"}


async def test_delete_file_deletes_and_says_how_to_delete_a_folder(tools: KernelTools) -> None:
    async with connect(tools) as client:
        await client.call_tool("upload_file", {"path": "old.txt", "content": "x"})
        assert structured(await client.call_tool("delete_file", {"path": "old.txt"})) == {
            "path": "old.txt",
            "status": "deleted",
        }
        assert "old.txt" not in FakeSession.workspace.stored
        missing = await client.call_tool("delete_file", {"path": "old.txt"})
        assert missing.is_error
        assert "No such file 'old.txt'" in text(missing)
        folder = await client.call_tool("delete_file", {"path": "folder"})
        assert folder.is_error
        assert "recursive=true" in text(folder)
        assert not (await client.call_tool("delete_file", {"path": "folder", "recursive": True})).is_error


async def test_a_file_too_large_to_download_says_what_to_do_instead(tools: KernelTools) -> None:
    """#23 item 11: the error suggested a max_bytes that download_file does not take."""
    FakeSession.workspace.stored["big.bin"] = bytes(MAX_DOWNLOAD + 1)
    async with connect(tools) as client:
        await client.call_tool("run_code", {"code": "a"})
        big = await client.call_tool("download_file", {"path": "big.bin"})
        assert big.is_error
        assert "max_bytes" not in text(big)
        assert f"{MAX_DOWNLOAD + 1:,} bytes" in text(big)
        assert "run_code" in text(big)


async def test_run_command_returns_exit_code_and_output(tools: KernelTools) -> None:
    """#23 item 12: a shell command in the sandbox, E2B's commands.run."""
    async with connect(tools) as client:
        got = structured(
            await client.call_tool("run_command", {"command": "ls", "cwd": "data", "env": {"A": "b"}})
        )
        assert got == {
            "kernel_id": FakeSession.started[0].kernel_id,
            "exit_code": 3,
            "stdout": "ran ls\n",
            "stderr": "warn\n",
            "duration": 0.5,
            "timed_out": False,
            "truncated": False,
            "error": None,
        }
        assert FakeSession.started[0].command_options == {
            "timeout": 60.0,
            "cwd": "data",
            "env": {"A": "b"},
            "max_output": 20_000,
        }
        loud = structured(
            await client.call_tool("run_command", {"command": "loud", "max_output_chars": 1000})
        )
        assert loud["truncated"] is True
        assert len(loud["stdout"]) < 1200
        assert loud["stderr"] == "e" * 10
        empty = await client.call_tool("run_command", {"command": " "})
        assert empty.is_error
        assert "command must be a non-empty shell command line" in text(empty)


async def test_start_kernel_passes_a_lifetime_and_an_ended_kernel_is_said(tools: KernelTools) -> None:
    async with connect(tools) as client:
        kernel_id = structured(await client.call_tool("start_kernel", {"lifetime": 30}))["kernel_id"]
        (session,) = FakeSession.started
        assert session.policy_asked == {"lifetime": 30}
        session.kernel_id = None  # its lifetime ran out: the session shut itself down
        ended = await client.call_tool("run_code", {"code": "a", "kernel_id": kernel_id})
        assert ended.is_error
        assert "is no longer running (its lifetime ran out)" in text(ended)
        assert structured(await client.call_tool("list_kernels"))["kernels"] == []
        refused = await client.call_tool("start_kernel", {"lifetime": 0})
        assert refused.is_error


async def test_run_code_passes_environment_variables_for_the_cell(tools: KernelTools) -> None:
    async with connect(tools) as client:
        got = structured(await client.call_tool("run_code", {"code": "x", "env": {"TOKEN": "t"}}))
        assert got["stdout"] == "{'TOKEN': 't'}\n"
        bad = await client.call_tool("run_code", {"code": "x", "env": {"A=B": "x"}})
        assert bad.is_error
        assert "is not an environment variable's name" in text(bad)
