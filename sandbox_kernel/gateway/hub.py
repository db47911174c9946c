"""Who is asking, by JupyterHub's word: the gateway as a hub service (the hub shape).

A user's single-user server sends its own hub token (``JUPYTER_GATEWAY_AUTH_TOKEN``, the
spawner's ``api_token``) in the ``Authorization: token <T>`` (or ``Bearer <T>``) header of
each request, and the gateway asks the hub whose it is (``GET /hub/api/user`` with that
token, through JupyterHub's own ``HubAuth.user_for_token``). It lets in only:

- a **user's** token (``kind == "user"``: a service's, an admin's tool's, is refused),
- that carries the scope ``access:services!service=<service_name>``: the hub grants it in
  the ``user`` role and in ``Spawner.server_token_scopes``, and a token minted without it
  gets nothing here.

The user's **groups** (for ``UserPolicy.ceilings``) come from the hub too, asked with the
gateway's *own* service token (``GET /hub/api/users/<name>``), never from the user's token
model: a token minted with fewer scopes hides its groups, and its holder would shed a
restrictive group's ceilings. A group lookup that fails lets nobody in. Both answers are
kept for ``cache_max_age`` seconds (60), so a stopped server's revoked token stops
working within a minute. The name then goes through the same :class:`~.users.UserPolicy`
as the tokens file's users.

No ``?token=`` in the URL, no cookies, no login pages, and never a field the client
sends about itself. The service token is read from a file only root may read
(``api_token_file``), and the gateway does not start without it::

    c.ServerApp.identity_provider_class = "sandbox_kernel.gateway.hub.HubIdentityProvider"
    c.HubIdentityProvider.api_url = "http://127.0.0.1:8081/hub/api"
    c.HubIdentityProvider.api_token_file = "/etc/sandbox-kernel/gateway/hub-service.token"
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jupyter_server.auth.identity import User
from jupyterhub.httpclient import fetch
from jupyterhub.services.auth import HubAuth, check_scopes
from jupyterhub.utils import make_ssl_context, url_path_join
from tornado import web
from traitlets import Instance, Integer, Unicode

from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.gateway.identity import AUTH_HEADER_RE, HeaderTokenIdentityProvider, check_private

DEFAULT_SERVICE_NAME = "sandbox-gateway"
DEFAULT_API_TOKEN_FILE = "/etc/sandbox-kernel/gateway/hub-service.token"  # noqa: S105  # a path
#: Seconds a hub answer is kept (JupyterHub's HubAuth keeps them 300 s by default).
DEFAULT_CACHE_MAX_AGE = 60


class HubIdentityProvider(HeaderTokenIdentityProvider):
    """Users of a JupyterHub, each by their own hub token in the ``Authorization`` header."""

    api_url = Unicode(
        "http://127.0.0.1:8081/hub/api",
        config=True,
        help="""The hub's API URL as the gateway reaches it (JupyterHub's hub_connect_url
        + /hub/api). Use https (and HubAuth.certfile, keyfile, client_ca for the hub's
        internal SSL) when it crosses a network.""",
    )
    api_token_file = Unicode(
        DEFAULT_API_TOKEN_FILE,
        config=True,
        help="""The file holding the gateway's own service token (the api_token of its
        entry in c.JupyterHub.services): root's, mode 0600. The gateway reads users'
        groups with it.""",
    )
    service_name = Unicode(
        DEFAULT_SERVICE_NAME,
        config=True,
        help="""The gateway's name among the hub's services: a user's token must carry the
        scope access:services!service=<service_name>.""",
    )
    cache_max_age = Integer(
        DEFAULT_CACHE_MAX_AGE,
        config=True,
        help="""Seconds the hub's answers (who a token is, a user's groups) are kept: a
        revoked token or a changed group counts within this long.""",
    )
    hub_auth = Instance(HubAuth, help="JupyterHub's client of its API, asking who a token is.")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        path = Path(self.api_token_file)
        try:
            check_private(path, "the gateway's hub service token file")
            service_token = path.read_text().strip()
        except (ConfigurationError, OSError) as exc:
            msg = f"HubIdentityProvider.api_token_file: {exc}"
            raise ConfigurationError(msg) from None
        if not service_token:
            msg = f"HubIdentityProvider.api_token_file: {path} is empty (it holds the gateway's hub token)"
            raise ConfigurationError(msg)
        self.hub_auth = HubAuth(
            parent=self,
            api_url=self.api_url,
            api_token=service_token,
            cache_max_age=self.cache_max_age,
            access_scopes={self.required_scope},
        )
        self._groups: dict[str, tuple[float, tuple[str, ...]]] = {}

    @property
    def required_scope(self) -> str:
        """The scope a user's token needs to use this gateway."""
        return f"access:services!service={self.service_name}"

    async def get_user(self, handler: web.RequestHandler) -> User | None:
        """The hub user whose token the request's ``Authorization`` header carries, or
        None (no such header, or a token the hub does not know).

        Raises:
            HTTPError: 403 for a token that is not a user's, lacks the gateway's scope, or
                is of a user the policy refuses, saying why; 5xx when the hub cannot say.
        """
        match = AUTH_HEADER_RE.match(handler.request.headers.get("Authorization", ""))
        if match is None:
            return None
        model = await self.hub_auth.user_for_token(match.group(1), sync=False)
        if not model:
            return None
        kind, name = model.get("kind"), str(model.get("name", ""))
        if kind != "user":
            self.log.warning("Sandbox gateway: refused a hub %s's token (%s)", kind, name)
            raise web.HTTPError(403, f"only users' hub tokens may use the sandbox gateway, not a {kind}'s")
        if not check_scopes({self.required_scope}, set(model.get("scopes", ()))):
            self.log.warning("Sandbox gateway: refused a token of %s without %s", name, self.required_scope)
            raise web.HTTPError(403, f"this hub token of {name} lacks the scope {self.required_scope}")
        user = self.request_user(name, await self.groups_of(name))
        handler._token_authenticated = True  # type: ignore[attr-defined]  # as jupyter_server's own
        return user

    async def groups_of(self, name: str) -> tuple[str, ...]:
        """User ``name``'s hub groups, asked with the gateway's own token (kept
        ``cache_max_age`` seconds).

        Raises:
            HTTPError: 500 when the hub does not give them (the service's role lacks
                read:users:groups, or the user is gone); 502 when the hub cannot be reached.
        """
        kept = self._groups.get(name)
        now = time.monotonic()
        if kept is not None and now - kept[0] < self.cache_max_age:
            return kept[1]
        url = url_path_join(self.api_url, "users", quote(name, safe=""))
        options: dict[str, Any] = {"headers": {"Authorization": f"token {self.hub_auth.api_token}"}}
        if self.hub_auth.certfile or self.hub_auth.keyfile:
            options["ssl"] = make_ssl_context(
                self.hub_auth.keyfile, self.hub_auth.certfile, cafile=self.hub_auth.client_ca
            )
        try:
            response = await fetch(url, method="GET", raise_for_status=False, **options)
            status, text = response.status, await response.text()
        except Exception as exc:  # noqa: BLE001  # aiohttp's many errors: the hub did not answer
            self.log.error("Sandbox gateway: the hub at %s did not answer: %s", self.api_url, exc)
            raise web.HTTPError(502, f"the sandbox gateway cannot reach the hub at {self.api_url}") from None
        try:
            body = json.loads(text) if status == 200 else None
        except ValueError:
            body = None
        groups = body.get("groups") if isinstance(body, dict) else None
        if not isinstance(groups, list):
            reason = (
                f"the hub gives the sandbox gateway no groups of {name} (HTTP {status}): the service "
                f"{self.service_name} needs a role with read:users:groups and read:users:name"
            )
            self.log.error("Sandbox gateway: %s", reason)
            raise web.HTTPError(500, reason)
        found = tuple(str(group) for group in groups)
        self._groups[name] = (now, found)
        return found
