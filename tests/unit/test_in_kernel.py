"""The code the kernel runs as it starts (sandbox_kernel/in_kernel.py), in this process
with a stand-in IPython shell. What it does in a real kernel is in the integration tests
(test_limits.py: memory; test_egress.py and test_isolation.py: network)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import urllib.error
from pathlib import Path
from typing import Any

import IPython
import pytest

from sandbox_kernel import in_kernel

THREAD_ENV = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_MAX_THREADS",
    "POLARS_MAX_THREADS",
)


class Shell:
    """What the start-up code uses of IPython's shell, recording what it is given."""

    def __init__(self) -> None:
        self.registered: dict[str, list[Any]] = {}
        self.custom: tuple[tuple[type, ...], Any] | None = None
        self.shown: list[Any] = []

    class _Events:
        def __init__(self, shell: Shell) -> None:
            self.shell = shell

        def register(self, event: str, callback: Any) -> None:
            self.shell.registered.setdefault(event, []).append(callback)

    @property
    def events(self) -> Shell._Events:
        return Shell._Events(self)

    def set_custom_exc(self, types: tuple[type, ...], handler: Any) -> None:
        self.custom = (types, handler)

    def showtraceback(self, exc_tuple: tuple[Any, ...], tb_offset: int | None = None) -> None:
        self.shown.append(("traceback", exc_tuple[1]))

    def _showtraceback(self, etype: type, value: BaseException, stb: list[str]) -> None:
        self.shown.append(("lines", stb))

    def show(self, error: BaseException) -> Any:
        assert self.custom is not None
        types, handler = self.custom
        assert isinstance(error, types)
        handler(self, type(error), error, None)
        return self.shown[-1]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run the start-up code with a policy; this process gets its state back afterwards,
    and the memory watcher's thread is recorded, not started."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    for name in THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", socket.getaddrinfo)
    threads: list[str] = []

    class Thread:
        def __init__(self, target: Any, name: str, daemon: bool) -> None:
            threads.append(name)

        def start(self) -> None:
            pass

    monkeypatch.setattr(threading, "Thread", Thread)

    def start(**policy: Any) -> tuple[Shell, dict[str, object]]:
        shell = Shell()
        monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
        monkeypatch.setenv("SANDBOX_KERNEL_POLICY", json.dumps({"memory": "1g", "cpus": 1.0, **policy}))
        namespace: dict[str, object] = {"__name__": "__main__"}
        exec(compile(Path(in_kernel.__file__).read_text(), "startup.py", "exec"), namespace)  # noqa: S102
        assert set(namespace) <= {"__name__", "__builtins__"}, (
            "start-up code must not litter the user's names"
        )
        return shell, {"threads": threads}

    return start


def test_the_working_folder_goes_back_where_ipython_would_put_it(
    started: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel starts with PYTHONSAFEPATH (nothing from the workspace runs before it is
    up); once up, the notebook's folder imports as in a local kernel, and child processes
    do not inherit PYTHONSAFEPATH."""
    stdlib = ["/usr/lib/python311.zip", "/usr/lib/python3.11", "/usr/lib/python3.11/lib-dynload"]
    monkeypatch.setattr(sys, "path", [*stdlib, "/opt/kernel/lib/python3.11/site-packages"])
    started()
    assert sys.path == [*stdlib, "", "/opt/kernel/lib/python3.11/site-packages"]
    assert "PYTHONSAFEPATH" not in os.environ


def test_a_path_that_has_the_working_folder_is_left_alone(
    started: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", ["", "/usr/lib/python3.11", "/x/site-packages"])
    started()
    assert sys.path == ["", "/usr/lib/python3.11", "/x/site-packages"]


def test_the_wall_clock_limit_is_armed_only_when_set(started: Any) -> None:
    shell, _ = started(exec_timeout=2.5)
    assert {event: len(callbacks) for event, callbacks in shell.registered.items()} == {
        "pre_run_cell": 2,  # the memory watcher's "a cell runs", and the alarm
        "post_run_cell": 2,
    }
    shell, _ = started()
    assert {event: len(callbacks) for event, callbacks in shell.registered.items()} == {
        "pre_run_cell": 1,
        "post_run_cell": 1,
    }


def test_blas_threads_follow_the_cpu_limit_unless_the_kernelspec_env_says(
    started: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    started(cpus=1.5)
    assert [os.environ[name] for name in THREAD_ENV] == ["2"] * 5
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    started(cpus=0.5)
    assert os.environ["OMP_NUM_THREADS"] == "8"
    assert os.environ["OPENBLAS_NUM_THREADS"] == "2", "set by the first start, kept"


def test_a_memory_error_names_the_memory_limit_and_what_is_in_use(started: Any) -> None:
    shell, state = started(memory="512m")
    assert state["threads"] == ["sandbox-kernel-memory"]
    error = MemoryError("Unable to allocate 8.00 GiB")
    kind, shown = shell.show(error)
    assert (kind, shown) == ("traceback", error)
    assert str(error).startswith("memory limit 512m of this sandboxed kernel reached (")
    assert "MiB in use; Unable to allocate 8.00 GiB): the cell was stopped" in str(error)


def test_a_name_that_does_not_resolve_says_the_kernel_has_no_network(started: Any) -> None:
    shell, _ = started(network="none")
    with pytest.raises(socket.gaierror) as raised:
        socket.getaddrinfo("no-such-host.invalid", 443)
    message = (
        "cannot resolve 'no-such-host.invalid': this sandboxed kernel has no network (network policy: none)"
    )
    assert raised.value.strerror == message
    # What urllib and requests make of it: the one line, not the library's traceback.
    wrapped = urllib.error.URLError(raised.value)
    assert shell.show(wrapped) == ("lines", [f"URLError: {message}"])
    inner = OSError(f"<HTTPSConnection>: Failed to resolve 'no-such-host.invalid' ({raised.value})")
    outer = ConnectionError(ValueError("Max retries exceeded", inner))
    outer.__cause__ = raised.value
    assert shell.show(outer) == ("lines", [f"ConnectionError: {message}"])


def test_an_allowlist_kernel_names_its_domains_and_the_proxy_refusal_is_one_line(started: Any) -> None:
    shell, _ = started(network="allowlist", allowed_domains=["pypi.org", "*.example.com"])
    with pytest.raises(
        socket.gaierror, match=r"only HTTP\(S\) to its allowed domains \(pypi.org, \*.example.com\)"
    ):
        socket.getaddrinfo("no-such-host.invalid", 443)
    refusal = OSError(
        "Tunnel connection failed: 403 sandbox-kernel egress denied: evil.test:443 is not in this "
        "kernel's allowed domains"
    )
    kind, lines = shell.show(urllib.error.URLError(refusal))
    assert (kind, len(lines)) == ("lines", 1)
    assert lines[0].startswith(
        "URLError: Tunnel connection failed: 403 sandbox-kernel egress denied: evil.test"
    )


def test_other_errors_keep_their_traceback(started: Any) -> None:
    shell, _ = started()
    error = FileNotFoundError(2, "No such file or directory", "data.csv")
    assert shell.show(error) == ("traceback", error)
