"""A session's ``approval_handler`` for its kernel on a sandbox gateway.

The gateway keeps the kernel's approval questions for the program of its owner that says it
answers them (see :mod:`sandbox_kernel.gateway.approvals`). :class:`GatewayApprovals` says so
for one session's kernel, waits for questions (a long poll of the owner's route), calls the
program's handler for each, in a thread of its own as a local kernel's provisioner does, and
posts the answer. A handler that raises denies; one that answers after the kernel's
``approval_timeout`` is too late (the gateway has denied the request). Whatever this process
does, the gateway denies once it stops asking: a session that ends lets go
(:meth:`GatewayApprovals.stop`), and one that dies is gone a few seconds later.

Its requests go through an HTTP client of its own, so a poll waiting for questions never
holds up the session's other calls to the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any
from urllib.parse import urlencode

from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.utils import url_path_join
from tornado.escape import url_escape
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPResponse

from sandbox_kernel.channels.approval import ApprovalHandler, meaning
from sandbox_kernel.egress import ApprovalRequest
from sandbox_kernel.errors import SandboxKernelError

log = logging.getLogger(__name__)

#: The owner's routes on a kernel, under the gateway's base URL.
SANDBOX_KERNELS = "api/sandbox-kernel/kernels"
#: Seconds one poll waits for a question (the gateway caps it at 30).
POLL_WAIT = 20.0
#: Seconds before asking again after the gateway could not be reached.
RETRY_AFTER = 2.0


class GatewayApprovals:
    """Answers the approval questions of kernel ``kernel_id`` on this process's gateway with
    ``handler``, from :meth:`start` to :meth:`stop`."""

    def __init__(self, kernel_id: str, handler: ApprovalHandler) -> None:
        self.kernel_id = kernel_id
        self.handler = handler
        self._http = AsyncHTTPClient(force_instance=True)
        self._answerer: str | None = None
        self._polling: asyncio.Task[None] | None = None
        self._answering: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Tell the gateway this session answers for the kernel, and start waiting for questions.

        Raises:
            SandboxKernelError: the gateway refused (an older gateway without the route says so).
        """
        await self._register()
        self._polling = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        """Answer no more: the gateway denies the kernel's open questions, and asks it as
        without a program again. Never raises."""
        polling, self._polling = self._polling, None
        if polling is not None:
            polling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await polling
        for task in list(self._answering):
            task.cancel()
        answerer, self._answerer = self._answerer, None
        if answerer is not None:
            try:
                await self._fetch("", "DELETE", answerer=answerer)
            except (HTTPClientError, OSError) as exc:
                log.info(
                    "Kernel %s: the gateway was not told this session answers no more (%s)",
                    self.kernel_id,
                    exc,
                )
        self._http.close()

    async def _register(self) -> None:
        try:
            answer = await self._fetch("", "POST", b"{}")
        except HTTPClientError as exc:
            if exc.code == 404 and not _message(exc):
                msg = (
                    "the sandbox gateway asks no program about its kernels' requests (no route "
                    f"{SANDBOX_KERNELS}/<id>/approvals): it is older than this client; upgrade "
                    "sandbox-kernel on the gateway, or drop approval_handler="
                )
                raise SandboxKernelError(msg) from None
            msg = (
                f"the sandbox gateway refused this session's approval_handler (HTTP {exc.code}): {_said(exc)}"
            )
            raise SandboxKernelError(msg) from None
        except OSError as exc:
            msg = f"the sandbox gateway could not be reached to register the approval_handler: {exc}"
            raise SandboxKernelError(msg) from None
        self._answerer = str(json.loads(answer.body)["answerer"])

    async def _poll(self) -> None:
        """Wait for questions and answer each, until cancelled (or replaced by another session)."""
        while True:
            answerer = self._answerer
            if answerer is None:
                return
            try:
                answer = await self._fetch("", "GET", answerer=answerer, wait=f"{POLL_WAIT:g}")
            except HTTPClientError as exc:
                if exc.code == 409:  # another session of this user answers for the kernel now
                    log.warning("Kernel %s: %s; this session answers no more", self.kernel_id, _said(exc))
                    self._answerer = None
                    return
                if exc.code == 410:  # our turn lapsed (the gateway lost us a while): take it again
                    log.info("Kernel %s: %s", self.kernel_id, _said(exc))
                    await self._register_again()
                    continue
                if exc.code in (403, 404):  # the kernel is gone
                    return
                log.warning(
                    "Kernel %s: asking the gateway for approval questions failed: %s", self.kernel_id, exc
                )
                await asyncio.sleep(RETRY_AFTER)
                continue
            except OSError as exc:
                log.warning(
                    "Kernel %s: the gateway did not answer for approval questions: %s", self.kernel_id, exc
                )
                await asyncio.sleep(RETRY_AFTER)
                continue
            for question in json.loads(answer.body)["questions"]:
                task = asyncio.ensure_future(self._answer(answerer, question))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)

    async def _register_again(self) -> None:
        try:
            await self._register()
        except SandboxKernelError as exc:
            log.warning("Kernel %s: %s", self.kernel_id, exc)
            await asyncio.sleep(RETRY_AFTER)

    async def _answer(self, answerer: str, question: dict[str, Any]) -> None:
        """Ask the handler about one question (in a thread), and post its answer."""
        request = ApprovalRequest(
            self.kernel_id,
            str(question["host"]),
            int(question["port"]),
            str(question["method"]),
            float(question["timeout"]),
        )
        try:
            word = meaning(await asyncio.to_thread(self.handler, request))
        except Exception:
            log.exception("Kernel %s: the approval handler failed; denied", self.kernel_id)
            word = "deny"
        question_id = str(question["id"])
        try:
            await self._fetch(question_id, "POST", json.dumps({"answer": word}).encode(), answerer=answerer)
        except HTTPClientError as exc:
            if exc.code == 404:
                log.info(
                    "Kernel %s: the answer to %s came too late: %s", self.kernel_id, request.what, _said(exc)
                )
            else:
                log.warning(
                    "Kernel %s: the gateway took no answer to %s: %s", self.kernel_id, request.what, exc
                )
        except OSError as exc:
            log.warning("Kernel %s: the gateway took no answer to %s: %s", self.kernel_id, request.what, exc)

    async def _fetch(self, route: str, method: str, body: bytes | None = None, **query: str) -> HTTPResponse:
        """The gateway's answer to ``method`` on the kernel's approvals route (``route``
        below it), with this process's token and TLS settings.

        Raises:
            HTTPClientError: the gateway refused (599: it could not be reached in time).
        """
        client = GatewayClient.instance()
        url = url_path_join(client.url or "", SANDBOX_KERNELS, url_escape(self.kernel_id), "approvals")
        url = url_path_join(url, route) if route else url
        if query:
            url = f"{url}?{urlencode(query)}"
        kwargs = client.load_connection_args(method=method, body=body)  # type: ignore[no-untyped-call]
        # Long enough for a poll (the settings' default is shorter than a wait).
        kwargs["request_timeout"] = max(float(kwargs.get("request_timeout") or 0), POLL_WAIT + 30)
        # Shielded: a poll cut short by stop() ends at the gateway on its own, and tornado
        # logs an error for a request whose future was cancelled under it.
        fetching = asyncio.ensure_future(self._http.fetch(url, **kwargs))
        fetching.add_done_callback(_retrieved)
        return await asyncio.shield(fetching)


def _retrieved(done: asyncio.Future[HTTPResponse]) -> None:
    """Take a shielded request's outcome, which nobody may wait for any more."""
    if not done.cancelled():
        done.exception()


def _said(exc: HTTPClientError) -> str:
    """What the gateway said in refusing (its JSON ``message``), else the HTTP reason."""
    return _message(exc) or str(exc.message or f"HTTP {exc.code}")


def _message(exc: HTTPClientError) -> str:
    if exc.response is None:
        return ""
    try:
        payload = json.loads(exc.response.body)
    except (ValueError, TypeError):
        return ""
    return str(payload.get("message") or "") if isinstance(payload, dict) else ""
