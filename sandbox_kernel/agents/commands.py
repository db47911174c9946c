"""Shell commands in the sandbox, outside the kernel's Python namespace.

A command runs where the kernel's code runs: the session sends the kernel a cell (as
any run, audited and bounded by the kernel's policy) that starts ``/bin/sh -c command``
with :mod:`subprocess` inside the sandbox, in a namespace of its own, and leaves no
name, history entry or execution count behind. Nothing runs on the host. The child's
stdout and stderr go to temporary files in the sandbox (its ``/tmp``), so a command
that prints gigabytes costs the kernel no memory; their head and tail come back, at
most ``max_output`` bytes each. Past its ``timeout`` the command's whole process group
is killed. The result comes back as one ``application/json`` display under
:data:`RESULT_KEY` (a type the host's output cleaning passes), which
:func:`command_result` reads.

:func:`command_cell` and :func:`command_result` are pure; the session does the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: The key of the ``application/json`` display the command's cell returns its result under.
RESULT_KEY = "sandbox-kernel/command"
#: Bytes of a command's stdout, and of its stderr, a result keeps unless told otherwise.
DEFAULT_MAX_OUTPUT = 256 * 1024
#: Seconds a command may run unless told otherwise (E2B's default too).
DEFAULT_TIMEOUT = 60.0

# Run by the kernel in a namespace of its own: json.loads(SPEC) is the command's spec.
_RUNNER = r"""
import json as _json, os as _os, signal as _signal, subprocess as _subprocess, tempfile as _tempfile
import time as _time
from IPython.display import publish_display_data as _publish


def _kept(stream, limit):
    size = stream.seek(0, 2)
    stream.seek(0)
    if size <= limit:
        return stream.read().decode("utf-8", "replace"), False
    head = stream.read(limit - limit // 2).decode("utf-8", "replace")
    stream.seek(size - limit // 2)
    tail = stream.read().decode("utf-8", "replace") if limit // 2 else ""
    gone = size - limit
    return f"{head}\n[... {gone:,} bytes of output dropped: over max_output={limit:,} ...]\n{tail}", True


def _run(spec):
    result = {"exit_code": None, "stdout": "", "stderr": "", "timed_out": False, "error": None}
    started = _time.monotonic()
    with _tempfile.TemporaryFile() as out, _tempfile.TemporaryFile() as err:
        try:
            child = _subprocess.Popen(
                ["/bin/sh", "-c", spec["command"]],
                stdin=_subprocess.DEVNULL, stdout=out, stderr=err, cwd=spec["cwd"],
                env={**_os.environ, **spec["env"]}, start_new_session=True,
            )
        except OSError as exc:
            result["error"] = f"the command could not start: {type(exc).__name__}: {exc}"
        else:
            try:
                result["exit_code"] = child.wait(timeout=spec["timeout"])
            except _subprocess.TimeoutExpired:
                result["timed_out"] = True
                result["error"] = (
                    f"the command ran longer than its timeout of {spec['timeout']:g} s and was killed"
                )
            finally:
                if child.returncode is None:  # timed out, or the cell was interrupted
                    try:
                        _os.killpg(child.pid, _signal.SIGKILL)
                    except OSError:
                        pass
                    child.wait()
        result["stdout"], cut_out = _kept(out, spec["max_output"])
        result["stderr"], cut_err = _kept(err, spec["max_output"])
    result["truncated"] = cut_out or cut_err
    result["duration"] = _time.monotonic() - started
    _publish({"application/json": {"sandbox-kernel/command": result}, "text/plain": "<command result>"})


_run(_json.loads(SPEC))
"""


# Run before a cell given env=: shows what the variables were, then sets them.
_ENV_SET = r"""
import json as _json, os as _os
from IPython.display import publish_display_data as _publish

_wanted = _json.loads(SPEC)
_saved = {name: _os.environ.get(name) for name in _wanted}
_publish({"application/json": {"sandbox-kernel/env": _saved}, "text/plain": "<saved environment>"})
_os.environ.update(_wanted)
"""
# Run after it: puts them back as they were (None: unset).
_ENV_RESTORE = r"""
import json as _json, os as _os

for _name, _value in _json.loads(SPEC).items():
    if _value is None:
        _os.environ.pop(_name, None)
    else:
        _os.environ[_name] = _value
"""
#: The key of the display the env cell shows the variables' earlier values under.
ENV_KEY = "sandbox-kernel/env"


@dataclass
class CommandResult:
    """What one shell command did in the sandbox."""

    #: The command's exit status; a negative one is the signal that killed it; None when
    #: it did not end by itself (timed out, could not start, the kernel stopped).
    exit_code: int | None = None
    #: Its output as a terminal would show it in the end (see :func:`~.session.rendered`),
    #: at most ``max_output`` bytes of each, head and tail around a marker.
    stdout: str = ""
    stderr: str = ""
    #: Seconds it ran, as the sandbox measured it.
    duration: float = 0.0
    timed_out: bool = False
    #: stdout or stderr was cut at ``max_output``.
    truncated: bool = False
    #: Why it did not run to its end, if it did not: could not start, timed out, the
    #: kernel died or was interrupted.
    error: str | None = None

    @property
    def ok(self) -> bool:
        """It ran to its end with exit status 0."""
        return self.exit_code == 0 and self.error is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def command_cell(
    command: str,
    *,
    timeout: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    max_output: int,
) -> str:
    """The cell that runs ``command`` in the kernel (see the module).

    Raises:
        ValueError: ``command`` is empty, or an argument is not what it should be.
    """
    if not isinstance(command, str) or not command.strip():
        msg = "command must be a non-empty shell command line, e.g. 'ls -la'"
        raise ValueError(msg)
    if timeout is not None and not timeout > 0:
        msg = f"timeout={timeout!r} must be a positive number of seconds, or None for no timeout"
        raise ValueError(msg)
    if max_output < 0:
        msg = f"max_output={max_output!r} must be a number of bytes, 0 or more"
        raise ValueError(msg)
    variables = checked_env(env)
    spec = {"command": command, "timeout": timeout, "cwd": cwd, "env": variables, "max_output": max_output}
    return _cell(_RUNNER, spec)


def checked_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env`` as variables to set, checked.

    Raises:
        ValueError: a name or a value that is no environment variable's.
    """
    variables = dict(env or {})
    for name, value in variables.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            msg = f"env name {name!r} is not an environment variable's name"
            raise ValueError(msg)
        if not isinstance(value, str) or "\0" in value:
            msg = f"env[{name!r}] must be a string without NUL characters"
            raise ValueError(msg)
    return variables


def env_cell(env: Mapping[str, str]) -> str:
    """The cell that sets ``env`` in the kernel for the next cell, showing the variables'
    earlier values (see :func:`saved_env`).

    Raises:
        ValueError: as :func:`checked_env`.
    """
    return _cell(_ENV_SET, checked_env(env))


def saved_env(results: Sequence[Any], env: Mapping[str, str]) -> dict[str, str | None]:
    """What :func:`env_cell`' cell showed the variables of ``env`` were (None: unset);
    {} (nothing to put back) where it showed nothing: it may not have run, and unsetting
    a variable it did not set (PATH, say) would break the kernel."""
    for result in results:
        bundle = getattr(result, "data", {}).get("application/json")
        saved = bundle.get(ENV_KEY) if isinstance(bundle, Mapping) else None
        if isinstance(saved, Mapping):
            return {name: value if isinstance(value := saved.get(name), str) else None for name in env}
    return {}


def restore_cell(saved: Mapping[str, str | None]) -> str:
    """The cell that puts the variables back as ``saved`` says they were."""
    return _cell(_ENV_RESTORE, dict(saved))


def _cell(source: str, spec: Any) -> str:
    """``source`` with ``spec`` as its SPEC, as a cell that execs it in a namespace of its
    own: the kernel's names stay as they were."""
    body = source.replace("SPEC", repr(json.dumps(spec)))
    return f"exec({body!r}, {{'__name__': '__sandbox_kernel__'}})"


def command_result(results: Sequence[Any], error: str | None) -> CommandResult:
    """The :class:`CommandResult` in a command cell's rich ``results`` (``Result``
    objects of the session), or one saying ``error`` (why the cell failed) when there is
    none. The kernel's account is checked for shape, not believed blindly."""
    for result in reversed(results):
        bundle = getattr(result, "data", {}).get("application/json")
        data = bundle.get(RESULT_KEY) if isinstance(bundle, Mapping) else None
        if isinstance(data, Mapping):
            exit_code = data.get("exit_code")
            if not isinstance(exit_code, int) or isinstance(exit_code, bool):
                exit_code = None
            found = CommandResult(
                exit_code=exit_code,
                stdout=str(data.get("stdout") or ""),
                stderr=str(data.get("stderr") or ""),
                duration=float(data["duration"]) if isinstance(data.get("duration"), int | float) else 0.0,
                timed_out=data.get("timed_out") is True,
                truncated=data.get("truncated") is True,
                error=str(data["error"]) if data.get("error") else None,
            )
            if error is not None and found.error is None:
                found.error = error
            return found
    return CommandResult(error=error or "the sandbox returned no result for the command")
