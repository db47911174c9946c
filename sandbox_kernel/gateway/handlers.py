"""The gateway's routes: jupyter_server's kernel API, with each kernel its owner's.

Loaded as the gateway's ``extra_services``, so these come before jupyter_server's own
routes of the same paths. ``POST /api/kernels`` reads the body a user's server sends
(``{"name", "env": {"KERNEL_WORKING_DIR": ...}}``, see jupyter_server's
``GatewayKernelManager.start_kernel``), takes the folder as a request that
:func:`~.users.check_cwd` judges, and starts the kernel for the authenticated user. None of
the client's ``env`` reaches the kernel. An optional ``"sandbox"`` object narrows the
kernel's policy as ``start_kernel(memory=...)`` does (``memory``, ``cpus``, ``network`` ...).

Every route on one kernel checks its owner again, whatever Authorizer is configured.

The owner's own routes on a kernel, under ``/api/sandbox-kernel/kernels/<id>/`` (beside the
status bar's ``GET /api/sandbox-kernel/kernels/<id>``), for programs (the session API, MCP):

- ``POST .../pause``: save the idle kernel to disk, memory included, and stop its sandbox
  (the provisioner's pause, as ``jupyter sandbox-kernel pause`` and an idle timeout do); any
  client's next message resumes it. 409 if it cannot be paused now (it keeps running).
- ``POST .../resume``: start a paused kernel again, variables and all.
  Both answer ``{"state": "running"|"paused", "paused": {"checkpoint", "size", "since"}|null}``.
- ``GET .../usage``: ``{"state", "cpu_seconds", "memory": {"used", "peak", "limit"}}`` from
  the host cgroups of its sandbox (see :mod:`~.readings`; null while it has no process).
- ``GET .../audit?since=ISO-TIME``: ``{"lines": [...], "more": bool}``, this kernel's lines of
  the gateway's audit log later than ``since`` (at most :data:`~.readings.MAX_AUDIT_LINES`;
  with ``"more": true``, ask again from the last line's ``time``).
- ``GET|PUT|DELETE .../files?path=P`` (download the file's bytes; upload the request's body,
  answering ``{"path": where the kernel sees it}``; delete, ``&recursive=true`` for a
  folder that is not empty) and ``GET .../files/list?path=P`` (``{"files": [{"name",
  "path", "size", "is_dir", "modified", "undecodable"}]}``): the kernel's workspace through
  :class:`~sandbox_kernel.agents.files.WorkspaceFiles`, with all its checks (no link
  followed, no ``..``, no special file; what it writes is the kernel's uid's). ``P`` is
  relative to the kernel's working folder, or absolute in the sandbox; a name that is not
  UTF-8 is listed with ``\\xNN`` escapes (``undecodable``), accepted back as listed.
  A refused path is 400, a missing file 404, a folder not empty 409, a file over
  :data:`~sandbox_kernel.agents.files.DEFAULT_MAX_BYTES` 413.
- ``POST .../approvals``: the caller's program answers the kernel's approval questions from
  now on (``{"answerer": ID, "lease": s, "wait": s}``); ``GET .../approvals?answerer=ID&wait=S``
  waits up to ``S`` s for questions (``{"questions": [{"id", "host", "port", "method",
  "timeout", "waited"}]}``); ``POST .../approvals/<question>?answerer=ID`` with ``{"answer":
  "once"|"kernel"|"deny"}`` answers one (204; 404 if it no longer waits);
  ``DELETE .../approvals?answerer=ID`` lets go. 409 for a session another one replaced, 410
  for one whose turn lapsed (it registers again). See :mod:`~.approvals`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any, TypeVar

from jupyter_client.jsonutil import json_default
from jupyter_client.kernelspec import NoSuchKernel
from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.kernelspecs.handlers import KernelSpecResourceHandler
from jupyter_server.services.kernels.handlers import KernelActionHandler, KernelHandler, MainKernelHandler
from jupyter_server.services.kernels.websocket import KernelWebsocketHandler
from jupyter_server.services.kernelspecs.handlers import kernel_name_regex
from jupyter_server.utils import url_escape, url_path_join
from tornado import web

from sandbox_kernel.agents.files import WorkspaceFiles, from_printable, printable, workspace_files
from sandbox_kernel.errors import (
    ConfigurationError,
    FileTooLargeError,
    FolderNotEmptyError,
    MissingFileError,
    PauseError,
    SandboxKernelError,
    WorkspaceError,
)
from sandbox_kernel.gateway.approvals import LEASE, MAX_WAIT, ApprovalQueue, NotTheAnswerer
from sandbox_kernel.gateway.authorizer import owns
from sandbox_kernel.gateway.readings import audit_lines, parse_since, usage
from sandbox_kernel.gateway.users import GatewayUser, UserRefused, check_cwd
from sandbox_kernel.jupyter.lab import KERNEL_STATUS_PATH, KernelSandboxHandler, MemoryGauge
from sandbox_kernel.plan.limits import size_bytes
from sandbox_kernel.plan.plan import NARROWABLE
from sandbox_kernel.plan.users import START_ARGUMENT
from sandbox_kernel.provisioner import SandboxProvisioner

#: As jupyter_server's kernel routes have it (``services/kernels/handlers.py``).
KERNEL_ID = r"(?P<kernel_id>\w+-\w+-\w+-\w+-\w+)"
T = TypeVar("T")
#: Where the owner's own routes on a kernel are (``.../<id>/pause`` ...).
SANDBOX_KERNELS = "api/sandbox-kernel/kernels"


class _OwnerOnly(JupyterHandler):
    """A route on one kernel: only its owner gets past ``prepare`` (403 for anyone else,
    and for an unknown id, so a refusal tells nothing of other users' kernels)."""

    async def prepare(self, *args: Any, **kwargs: Any) -> None:
        await super().prepare(*args, **kwargs)
        kernel_id = self.path_kwargs.get("kernel_id")
        if kernel_id is not None and not owns(self, self.current_user, kernel_id):
            raise web.HTTPError(403, f"you have no kernel {kernel_id}")


class OwnKernelHandler(_OwnerOnly, KernelHandler):
    """``GET``/``DELETE /api/kernels/<id>``, the owner's only."""


class OwnKernelActionHandler(_OwnerOnly, KernelActionHandler):
    """``POST /api/kernels/<id>/{interrupt,restart}``, the owner's only. A restart starts
    the kernel for its user as the gateway's policy has them now (their ceilings, their
    groups'), not as when it first started (long ago, for a kernel adopted since)."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        user, kernels = self.current_user, self.kernel_manager
        km = kernels.get_kernel(kernel_id) if kernel_id in kernels else None
        launch = getattr(km, "_launch_args", None)  # jupyter_client's: what a restart starts with
        if action == "restart" and isinstance(user, GatewayUser) and isinstance(launch, dict):
            launch[START_ARGUMENT] = user.sandbox_user
        await ensure_async(super().post(kernel_id, action))  # typed "Awaitable or None" upstream


class OwnKernelWebsocketHandler(_OwnerOnly, KernelWebsocketHandler):
    """``GET /api/kernels/<id>/channels`` (the websocket), the owner's only."""

    async def open(self, kernel_id: str) -> None:
        # A kernel's messages are small frames, several per cell: with Nagle's algorithm on
        # (tornado leaves it on for websockets), each waited for the client's delayed ACK.
        self.set_nodelay(True)
        await super().open(kernel_id)  # type: ignore[no-untyped-call]  # untyped upstream


class OwnKernelSandboxHandler(_OwnerOnly, KernelSandboxHandler):
    """``GET /api/sandbox-kernel/kernels/<id>`` (see :mod:`sandbox_kernel.jupyter.lab`), the owner's only."""


class _OwnSandboxHandler(_OwnerOnly, APIHandler):
    """A route of the owner's on one sandboxed kernel (see the module's docstring)."""

    auth_resource = "kernels"

    def sandbox(self, kernel_id: str) -> SandboxProvisioner:
        """The provisioner of the owner's kernel ``kernel_id``.

        Raises:
            HTTPError: 404 if it has none (it is starting, or gone meanwhile).
        """
        kernels = self.kernel_manager
        km = kernels.get_kernel(kernel_id) if kernel_id in kernels else None
        provisioner = getattr(km, "provisioner", None)
        if not isinstance(provisioner, SandboxProvisioner):
            raise web.HTTPError(404, f"kernel {kernel_id} has no sandbox now")
        return provisioner


class KernelPauseHandler(_OwnSandboxHandler):
    """``POST /api/sandbox-kernel/kernels/<id>/{pause,resume}``."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        """Pause or resume the kernel.

        Raises:
            HTTPError: 409 if it could not be paused (it keeps running) or resumed (it is
                stopped, its workspace intact; a restart starts it fresh); 404 without a sandbox.
        """
        provisioner = self.sandbox(kernel_id)
        try:
            if action == "pause":
                await provisioner.pause()
            else:
                await provisioner.resume()
        except PauseError as exc:
            raise web.HTTPError(409, str(exc)) from None
        except SandboxKernelError as exc:
            raise web.HTTPError(500, str(exc)) from None
        paused = provisioner.paused
        self.finish({"state": provisioner.sleep_state, "paused": paused.to_dict() if paused else None})


class KernelUsageHandler(_OwnSandboxHandler):
    """``GET /api/sandbox-kernel/kernels/<id>/usage``."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        """The kernel's use of CPU and memory (see :func:`~.readings.usage`)."""
        provisioner = self.sandbox(kernel_id)
        container_id, pid = provisioner.container_id, None
        if container_id is not None and provisioner.paused is None and provisioner.exit_code is None:
            try:
                pid = await provisioner.backend.main_pid(container_id)
            except SandboxKernelError:
                pid = None
        used = await asyncio.to_thread(usage, pid)
        used["memory"]["limit"] = size_bytes("memory", provisioner.policy.memory)
        self.finish({"state": provisioner.sleep_state, **used})


class KernelAuditHandler(_OwnSandboxHandler):
    """``GET /api/sandbox-kernel/kernels/<id>/audit?since=``."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        """The kernel's audit lines after ``since``.

        Raises:
            HTTPError: 400 for a ``since`` that is not a time with its zone; 404 if the
                gateway keeps no audit log.
        """
        provisioner = self.sandbox(kernel_id)
        try:
            since = parse_since(self.get_query_argument("since", None))
        except ValueError as exc:
            raise web.HTTPError(400, f"since: {exc}") from None
        policy = provisioner.policy
        if not policy.audit_log:
            raise web.HTTPError(404, "the gateway keeps no audit log (SandboxProvisioner.audit_log is empty)")
        lines, more = await asyncio.to_thread(
            audit_lines, policy.audit_log, policy.audit_log_backups, kernel_id, since
        )
        self.finish(json.dumps({"lines": lines, "more": more}, default=json_default))


#: The HTTP status of each refusal of the files API (any other: 400).
FILE_ERRORS: tuple[tuple[type[WorkspaceError], int], ...] = (
    (MissingFileError, 404),
    (FolderNotEmptyError, 409),
    (FileTooLargeError, 413),
)


class _KernelFilesBase(_OwnSandboxHandler):
    async def in_workspace(self, kernel_id: str, call: Callable[[WorkspaceFiles, str], T]) -> T:
        """``call(files, path)`` in a thread, for the kernel's workspace and the query's
        ``path``; where that fails and the path has ``\\xNN`` escapes (as a listing shows a
        name that is not UTF-8), ``call`` of the path they stand for.

        Raises:
            HTTPError: the files API's refusal (see :data:`FILE_ERRORS`), as it words it.
        """
        provisioner = self.sandbox(kernel_id)
        path = self.get_query_argument("path", ".")
        try:
            files = await workspace_files(await provisioner.get_provisioner_info(), provisioner.backend)
            try:
                return await asyncio.to_thread(call, files, path)
            except WorkspaceError:
                raw = from_printable(path)
                if raw == path:
                    raise
                with contextlib.suppress(WorkspaceError):
                    return await asyncio.to_thread(call, files, raw)
                raise
        except WorkspaceError as exc:
            status = next((code for kind, code in FILE_ERRORS if isinstance(exc, kind)), 400)
            raise web.HTTPError(status, str(exc)) from None


class KernelFilesHandler(_KernelFilesBase):
    """``GET|PUT|DELETE /api/sandbox-kernel/kernels/<id>/files?path=``."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        """The file's bytes."""
        content = await self.in_workspace(kernel_id, lambda files, path: files.download(path))
        self.finish(content, set_content_type="application/octet-stream")

    @web.authenticated
    @authorized
    async def put(self, kernel_id: str) -> None:
        """Write the request's body to the file (replacing it at once); where the kernel sees it."""
        body = self.request.body
        where = await self.in_workspace(kernel_id, lambda files, path: files.upload(path, body))
        self.finish({"path": printable(where)})

    @web.authenticated
    @authorized
    async def delete(self, kernel_id: str) -> None:
        """Remove the file, or the folder (with ``recursive=true``, and all it holds)."""
        recursive = self.get_query_argument("recursive", "false").lower() in ("1", "true", "yes")
        await self.in_workspace(kernel_id, lambda files, path: files.delete(path, recursive))
        self.set_status(204)
        self.finish()


class KernelFileListHandler(_KernelFilesBase):
    """``GET /api/sandbox-kernel/kernels/<id>/files/list?path=``."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        """The folder's files and folders, by name."""
        infos = await self.in_workspace(kernel_id, lambda files, path: files.list(path))
        entries = []
        for info in infos:
            name, path = printable(info.name), printable(info.path)
            entries.append(
                {
                    "name": name,
                    "path": path,
                    "size": info.size,
                    "is_dir": info.is_dir,
                    "modified": info.modified,
                    "undecodable": info.undecodable,
                }
            )
        self.finish({"files": entries})


class _ApprovalsBase(_OwnSandboxHandler):
    def queue(self, kernel_id: str) -> ApprovalQueue:
        """The kernel's approval queue.

        Raises:
            HTTPError: 410 if no program answers for the kernel now (it registers again).
        """
        queue = self.sandbox(kernel_id).approval_handler
        if not isinstance(queue, ApprovalQueue):
            raise web.HTTPError(
                410, f"no program answers approvals for kernel {kernel_id} now: register first"
            )
        return queue

    def answerer(self) -> str:
        return self.get_query_argument("answerer", "")


def _refused(exc: NotTheAnswerer) -> web.HTTPError:
    return web.HTTPError(409 if exc.replaced else 410, str(exc))


class KernelApprovalsHandler(_ApprovalsBase):
    """``POST|GET|DELETE /api/sandbox-kernel/kernels/<id>/approvals``."""

    _closed: asyncio.Event | None = None

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        """Make the caller's program the one that answers the kernel's approval questions."""
        provisioner = self.sandbox(kernel_id)
        queue = provisioner.approval_handler
        if not isinstance(queue, ApprovalQueue):

            def gone(ended: ApprovalQueue) -> None:
                if provisioner.approval_handler is ended:
                    provisioner.approval_handler = None  # asked as without a program again

            queue = ApprovalQueue(kernel_id, on_gone=gone)
            provisioner.approval_handler = queue
        self.finish({"answerer": queue.register(), "lease": LEASE, "wait": MAX_WAIT})

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        """The questions waiting for the program, once there are some or after ``wait`` s.

        Raises:
            HTTPError: 400 for a ``wait`` that is not a number; 409 or 410 (see the module).
        """
        try:
            wait = float(self.get_query_argument("wait", "0"))
        except ValueError:
            raise web.HTTPError(400, "wait: give the seconds to wait for a question") from None
        queue = self.queue(kernel_id)
        self._closed = asyncio.Event()
        try:
            questions = await queue.wait(self.answerer(), wait, self._closed)
        except NotTheAnswerer as exc:
            raise _refused(exc) from None
        self.finish({"questions": questions})

    def on_connection_close(self) -> None:
        """The program's poll ended early: it no longer counts as waiting."""
        if self._closed is not None:
            self._closed.set()
        super().on_connection_close()

    @web.authenticated
    @authorized
    async def delete(self, kernel_id: str) -> None:
        """The program answers no more: the kernel's open questions are denied."""
        queue = self.sandbox(kernel_id).approval_handler
        if isinstance(queue, ApprovalQueue):
            queue.release(self.answerer())
        self.set_status(204)
        self.finish()


class KernelApprovalAnswerHandler(_ApprovalsBase):
    """``POST /api/sandbox-kernel/kernels/<id>/approvals/<question>``."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, question_id: str) -> None:
        """Answer the question.

        Raises:
            HTTPError: 400 for a body without an ``answer``; 404 if the question no longer
                waits (answered, or past the kernel's approval_timeout); 409 or 410.
        """
        body = self.get_json_body()
        word = body.get("answer") if isinstance(body, dict) else None
        if not isinstance(word, str):
            raise web.HTTPError(400, 'the body must be {"answer": "once"|"kernel"|"deny"}')
        try:
            waited = self.queue(kernel_id).answer(self.answerer(), question_id, word)
        except NotTheAnswerer as exc:
            raise _refused(exc) from None
        if not waited:
            raise web.HTTPError(
                404,
                f"question {question_id} no longer waits (answered, or past the kernel's approval_timeout)",
            )
        self.set_status(204)
        self.finish()


class GatewayKernelSpecResourceHandler(KernelSpecResourceHandler):
    """``GET /kernelspecs/<name>/<file>`` (logos): 403 without a token, as every route,
    rather than jupyter_server's redirect to a login page the gateway does not have."""

    def get_login_url(self) -> str:
        raise web.HTTPError(403)


def _start_request(model: Any) -> tuple[str | None, str | None, str | None, dict[str, Any]]:
    """(kernel name, folder asked for, kernel id, narrowing) of a POST body.

    Raises:
        HTTPError: 400 for a body that is not one.
    """
    if model is None:
        model = {}
    if not isinstance(model, dict):
        raise web.HTTPError(400, "the body must be a JSON object")
    env = model.get("env") or {}
    narrowing = model.get("sandbox") or {}
    if not isinstance(env, dict) or not isinstance(narrowing, dict):
        raise web.HTTPError(400, '"env" and "sandbox" must be JSON objects')
    unknown = sorted(set(narrowing) - set(NARROWABLE))
    if unknown:
        raise web.HTTPError(
            400, f'"sandbox" may narrow only {", ".join(NARROWABLE)}; not {", ".join(unknown)}'
        )
    fields = (model.get("name"), env.get("KERNEL_WORKING_DIR"), model.get("kernel_id"))
    if not all(value is None or isinstance(value, str) for value in fields):
        raise web.HTTPError(400, '"name", "kernel_id" and env.KERNEL_WORKING_DIR must be strings')
    return (*fields, narrowing)


class GatewayMainKernelHandler(MainKernelHandler):
    """``GET /api/kernels`` (the caller's kernels) and ``POST /api/kernels`` (start one)."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        """The caller's kernels."""
        kernels = await ensure_async(self.kernel_manager.list_kernels())  # type: ignore[no-untyped-call]
        mine = [model for model in kernels if owns(self, self.current_user, model["id"])]
        self.finish(json.dumps(mine, default=json_default))

    @web.authenticated
    @authorized
    async def post(self) -> None:
        """Start a kernel for the caller (or, with ``kernel_id``, return one of theirs).

        Raises:
            HTTPError: 400 for a bad body or policy; 403 for a folder, kernel id or user
                the gateway refuses; 404 for a kernelspec that is not a sandboxed one.
        """
        km = self.kernel_manager
        name, requested, kernel_id, narrowing = _start_request(self.get_json_body())
        user = self.current_user
        if not isinstance(user, GatewayUser):
            raise web.HTTPError(403, "the gateway starts kernels only for its own authenticated users")
        if kernel_id is not None:
            if not owns(self, user, kernel_id):
                raise web.HTTPError(403, f"you have no kernel {kernel_id}")
        else:
            name = name or km.default_kernel_name
            try:
                await ensure_async(self.kernel_spec_manager.get_kernel_spec(name))
            except NoSuchKernel:
                raise web.HTTPError(404, f"no sandboxed kernelspec {name!r} on this gateway") from None
            try:
                cwd = await asyncio.to_thread(check_cwd, user.sandbox_user, requested)
                kernel_id = await km.start_kernel(
                    kernel_name=name, cwd=str(cwd), sandbox_user=user.sandbox_user, **narrowing
                )
            except (UserRefused, WorkspaceError) as exc:
                raise web.HTTPError(403, str(exc)) from None
            except ConfigurationError as exc:
                raise web.HTTPError(400, str(exc)) from None
            except SandboxKernelError as exc:
                raise web.HTTPError(500, str(exc)) from None
        model = await ensure_async(km.kernel_model(kernel_id))  # type: ignore[no-untyped-call]
        self.set_header("Location", url_path_join(self.base_url, "api", "kernels", url_escape(kernel_id)))
        self.set_status(201)
        self.finish(json.dumps(model, default=json_default))


default_handlers: list[tuple[Any, ...]] = [
    (r"/api/kernels", GatewayMainKernelHandler),
    (rf"/api/kernels/{KERNEL_ID}", OwnKernelHandler),
    (rf"/api/kernels/{KERNEL_ID}/(?P<action>restart|interrupt)", OwnKernelActionHandler),
    (rf"/api/kernels/{KERNEL_ID}/channels", OwnKernelWebsocketHandler),
    (f"/{KERNEL_STATUS_PATH}", OwnKernelSandboxHandler, {"gauge": MemoryGauge()}),
    (rf"/{SANDBOX_KERNELS}/{KERNEL_ID}/(?P<action>pause|resume)", KernelPauseHandler),
    (rf"/{SANDBOX_KERNELS}/{KERNEL_ID}/usage", KernelUsageHandler),
    (rf"/{SANDBOX_KERNELS}/{KERNEL_ID}/audit", KernelAuditHandler),
    (rf"/{SANDBOX_KERNELS}/{KERNEL_ID}/files", KernelFilesHandler),
    (rf"/{SANDBOX_KERNELS}/{KERNEL_ID}/files/list", KernelFileListHandler),
    (rf"/{SANDBOX_KERNELS}/{KERNEL_ID}/approvals", KernelApprovalsHandler),
    (
        rf"/{SANDBOX_KERNELS}/{KERNEL_ID}/approvals/(?P<question_id>[0-9a-f]{{32}})",
        KernelApprovalAnswerHandler,
    ),
    (rf"/kernelspecs/{kernel_name_regex}/(?P<path>.*)", GatewayKernelSpecResourceHandler),
]
