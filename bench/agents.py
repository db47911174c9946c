"""What the assistants' ways in add to one round trip: the session API and the MCP server
against a raw jupyter_client client, all on sandboxed kernels, in one run.

Five paths, each on a kernel of its own (the last on none), timed in turns (every round
runs each path once, in an order shuffled per round, so that the machine's load falls on
all of them alike):

* ``local raw``: ``BlockingKernelClient.execute_interactive("1+1")`` on a local ipykernel
  (``--baseline``, default ``python3``): the reference for the ratios;
* ``sandboxed raw``: the same on a sandboxed kernel (``--kernel``), until the reply and
  the idle status are both in;
* ``SandboxSession.run``: ``SandboxSession.run("1+1")`` to its ``Execution`` (which also
  reads the sandbox's CPU time and peak memory on the host, per run);
* ``MCP run_code``: the ``mcp`` package's own client calling ``run_code`` on
  ``jupyter sandbox-kernel mcp`` over stdio, to its structured result (JSON-RPC both
  ways, the server's session API, the result's rendering);
* ``MCP run_code, plain client``: the same server driven by a client that adds nothing of
  its own: JSON-RPC lines written to its stdin and read from its stdout, in this thread
  (what a client in another language, with no validation of its own, costs about): the
  server's share of ``MCP run_code``, apart from the ``mcp`` package's client;
* ``MCP empty tool``: the ``mcp`` package's client calling a tool that returns at once on a server
  made with the ``mcp`` package alone (its ``MCPServer`` on its own stdio transport): the
  floor of the package's client and server over stdio, which ``MCP run_code`` cannot go
  under.

The table gives p50 and p95 in milliseconds, each path's p50 minus the sandboxed raw p50
(what the way in adds), and the ratio to the local raw p50; under it, what MCP adds to
``SandboxSession.run`` and how much of that is the floor. Each kernel has a round trip of
its own, so that difference carries the kernels' spread too; the last lines take it out:
each call's time minus the ``duration`` its own result reports (the session's round trip
to its kernel, in the same process), i.e. what the way in costs around the kernel.

Run from the project root::

    .venv/bin/python bench/agents.py
    .venv/bin/python bench/agents.py --runs 300 --json
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any, cast

from latency import (
    CODE,
    aligned,
    execute_once,
    in_turns_main,
    percentile,
    progress,
    running_kernel,
)
from mcp import ClientSession, StdioServerParameters, stdio_client

from sandbox_kernel import SandboxSession

SK = Path(sys.executable).with_name("jupyter-sandbox-kernel")
PLAIN = "MCP run_code, plain client"
PATHS = ("local raw", "sandboxed raw", "SandboxSession.run", "MCP run_code", PLAIN, "MCP empty tool")
#: The paths on a kernel: the rest have no "p50 - sandboxed raw" of their own.
ON_KERNELS = PATHS[:5]
#: What a call took besides the kernel round trip its result reports.
AROUND = "around its result's duration"

#: The floor's server: one tool that returns at once, the mcp package alone.
EMPTY_SERVER = """
from mcp.server.mcpserver import MCPServer

server = MCPServer("empty")


@server.tool()
async def empty() -> str:
    \"\"\"Returns at once.\"\"\"
    return "ok"


server.run("stdio")
"""


class McpClient:
    """An MCP server over stdio as a subprocess, driven by the ``mcp`` client on an event
    loop of its own thread (anyio wants the client entered and left in one task: that task
    serves the calls, each timed on the loop, not across threads). Its ``call`` is a
    ``run_code`` of :data:`CODE` on ``jupyter-sandbox-kernel mcp --cwd CWD``, or with
    ``empty`` the tool of :data:`EMPTY_SERVER`."""

    def __init__(self, cwd: str, empty: bool = False) -> None:
        self._empty = empty
        #: Per run_code call, milliseconds besides the duration its result reports.
        self.around: list[float] = []
        self._command = [sys.executable, "-c", EMPTY_SERVER] if empty else [str(SK), "mcp", "--cwd", cwd]
        self._loop = asyncio.new_event_loop()
        self._calls: asyncio.Queue[Future[float] | None] | None = None
        self._ready: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True
        )

    def __enter__(self) -> McpClient:
        self._thread.start()
        self._ready.result(timeout=300)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._calls is not None:
            self._loop.call_soon_threadsafe(self._calls.put_nowait, None)
        self._thread.join(timeout=120)
        self._loop.close()

    def call(self) -> float:
        """Milliseconds for one call."""
        if self._calls is None:
            msg = "the MCP client is not running"
            raise RuntimeError(msg)
        done: Future[float] = Future()
        self._loop.call_soon_threadsafe(self._calls.put_nowait, done)
        return done.result(timeout=300)

    async def _serve(self) -> None:
        command, *args = self._command
        params = StdioServerParameters(command=command, args=args, env=dict(os.environ))
        try:
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                self._calls = asyncio.Queue()
                self._ready.set_result(None)
                while (done := await self._calls.get()) is not None:
                    try:
                        done.set_result(await self._once(session))
                    except Exception as exc:  # noqa: BLE001 (handed to the caller)
                        done.set_exception(exc)
        except Exception as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    async def _once(self, session: ClientSession) -> float:
        if self._empty:
            started = time.perf_counter()
            result = await session.call_tool("empty", {}, read_timeout_seconds=None)
            elapsed = (time.perf_counter() - started) * 1000
            if result.is_error:
                msg = f"the empty tool gave {result.content}"
                raise RuntimeError(msg)
            return elapsed
        started = time.perf_counter()
        result = await session.call_tool("run_code", {"code": CODE}, read_timeout_seconds=None)
        elapsed = (time.perf_counter() - started) * 1000
        content = result.structured_content or {}
        if result.is_error or [r.get("text") for r in content.get("results", [])] != ["2"]:
            msg = f"MCP run_code({CODE!r}) gave {content or result.content}"
            raise RuntimeError(msg)
        self.around.append(elapsed - content["duration"] * 1000)
        return elapsed


class PlainMcpClient:
    """``jupyter-sandbox-kernel mcp --cwd CWD`` driven with JSON-RPC lines on its stdin and
    stdout, nothing else: the MCP handshake, then a ``run_code`` of :data:`CODE` per call."""

    def __init__(self, cwd: str) -> None:
        #: Per call, milliseconds besides the duration its result reports.
        self.around: list[float] = []
        self._ids = 0
        argv = [str(SK), "mcp", "--cwd", cwd]
        self._server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # noqa: S603 (our own argv)
        self._stdin, self._stdout = cast(IO[bytes], self._server.stdin), cast(IO[bytes], self._server.stdout)

    def __enter__(self) -> PlainMcpClient:
        client = {"name": "bench", "version": "1"}
        self._request(
            "initialize", {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": client}
        )
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return self

    def __exit__(self, *exc: object) -> None:
        self._stdin.close()  # the end of its stdin: the server stops its kernel and ends
        self._server.wait(timeout=120)

    def call(self) -> float:
        """Milliseconds for one ``run_code``, to its whole answer."""
        started = time.perf_counter()
        answer = self._request("tools/call", {"name": "run_code", "arguments": {"code": CODE}})
        elapsed = (time.perf_counter() - started) * 1000
        content = answer.get("result", {}).get("structuredContent") or {}
        if [r.get("text") for r in content.get("results", [])] != ["2"]:
            msg = f"MCP run_code({CODE!r}) gave {answer}"
            raise RuntimeError(msg)
        self.around.append(elapsed - content["duration"] * 1000)
        return elapsed

    def _send(self, message: dict[str, object]) -> None:
        self._stdin.write(json.dumps(message).encode() + b"\n")
        self._stdin.flush()

    def _request(self, method: str, params: dict[str, object]) -> dict[str, Any]:
        self._ids += 1
        self._send({"jsonrpc": "2.0", "id": self._ids, "method": method, "params": params})
        while True:  # (notifications, e.g. logging, come before the answer)
            line = self._stdout.readline()
            if not line:
                msg = f"the MCP server ended before answering {method}"
                raise RuntimeError(msg)
            answer: dict[str, Any] = json.loads(line)
            if answer.get("id") == self._ids:
                return answer


def session_run(session: SandboxSession, around: list[float]) -> Callable[[], float]:
    """A call of ``SandboxSession.run``; what it took besides its result's duration goes
    to ``around``."""

    def once() -> float:
        started = time.perf_counter()
        result = session.run(CODE)
        elapsed = (time.perf_counter() - started) * 1000
        if result.text != "2":
            msg = f"SandboxSession.run({CODE!r}) gave {result.to_dict()}"
            raise RuntimeError(msg)
        around.append(elapsed - result.duration * 1000)
        return elapsed

    return once


def measure(kernel: str, baseline: str, runs: int, warmup: int, cwd: str) -> dict[str, list[float]]:
    """Milliseconds per path, ``runs`` each, the paths in a shuffled order every round; and
    per way in on a session, what each call took around its result's duration (AROUND)."""
    with ExitStack() as stack:
        progress(
            f"starting a local {baseline} kernel, a {kernel} kernel, a SandboxSession, an MCP server, "
            "an empty MCP server"
        )
        local = stack.enter_context(running_kernel(baseline, cwd))
        sandboxed = stack.enter_context(running_kernel(kernel, cwd))
        session = stack.enter_context(SandboxSession(kernel, cwd))
        mcp = stack.enter_context(McpClient(cwd))
        plain = stack.enter_context(PlainMcpClient(cwd))
        empty = stack.enter_context(McpClient(cwd, empty=True))
        around: list[float] = []
        calls: dict[str, Callable[[], float]] = {
            "local raw": lambda: execute_once(local.client) * 1000,
            "sandboxed raw": lambda: execute_once(sandboxed.client) * 1000,
            "SandboxSession.run": session_run(session, around),
            "MCP run_code": mcp.call,
            PLAIN: plain.call,
            "MCP empty tool": empty.call,
        }
        for _ in range(warmup):
            for call in calls.values():
                call()
        around.clear()
        mcp.around.clear()
        plain.around.clear()
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        order = list(PATHS)
        for done in range(runs):
            random.shuffle(order)
            for path in order:
                times[path].append(calls[path]())
            if (done + 1) % 50 == 0:
                progress(f"  {done + 1}/{runs} rounds")
        progress("stopping the kernels")
    times[f"SandboxSession.run {AROUND}"] = around
    times[f"MCP run_code {AROUND}"] = mcp.around
    times[f"{PLAIN} {AROUND}"] = plain.around
    return times


def format_table(times: dict[str, list[float]]) -> str:
    raw = percentile(times["sandboxed raw"], 50)
    local = percentile(times["local raw"], 50)
    lines = [("path", "p50 ms", "p95 ms", "p50 - sandboxed raw", "p50 / local raw")]
    for path in PATHS:
        p50, p95 = percentile(times[path], 50), percentile(times[path], 95)
        if path in ON_KERNELS:
            lines.append((path, f"{p50:.2f}", f"{p95:.2f}", f"{p50 - raw:+.2f} ms", f"{p50 / local:.2f}x"))
        else:
            lines.append((path, f"{p50:.2f}", f"{p95:.2f}", "", ""))
    session = percentile(times["SandboxSession.run"], 50)
    added = percentile(times["MCP run_code"], 50) - session
    floor = percentile(times["MCP empty tool"], 50)
    session_around = percentile(times[f"SandboxSession.run {AROUND}"], 50)
    mcp_around = percentile(times[f"MCP run_code {AROUND}"], 50)
    plain_around = percentile(times[f"{PLAIN} {AROUND}"], 50)
    footer = [
        f"MCP run_code adds {added:.2f} ms to SandboxSession.run (p50s); the mcp package's own "
        f"client and server over stdio, calling a tool that returns at once, take {floor:.2f} ms.",
        f"Each call {AROUND} (p50): SandboxSession.run {session_around:.2f} ms, MCP run_code "
        f"{mcp_around:.2f} ms (its server runs a SandboxSession); less the session's and the mcp "
        f"package's floor, the MCP server's own work is {mcp_around - session_around - floor:.2f} ms.",
        f"With the plain client, MCP run_code takes {plain_around:.2f} ms {AROUND}: the server and "
        f"the pipes {plain_around - session_around:.2f} ms besides its session; the mcp package's "
        f"client {mcp_around - plain_around:.2f} ms.",
    ]
    return "\n".join([aligned(lines), "", *footer])


def main(argv: list[str] | None = None) -> int:
    return in_turns_main(__doc__, measure, format_table, argv, runs=150, warmup=5, each="path")


if __name__ == "__main__":
    sys.exit(main())
