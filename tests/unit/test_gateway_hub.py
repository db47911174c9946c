"""The sandbox gateway with JupyterHub as its users' source (``HubIdentityProvider``), served
for real against a small hub API served here over HTTP (``GET /hub/api/user`` and
``/hub/api/users/<name>``, as JupyterHub 6 answers them), with the fake backend for kernels."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from sandbox_kernel.gateway.hub import HubIdentityProvider

from .test_gateway import UIDS, Gateway, free_port, new_app
from .test_gateway import gateway_args as gateway_args  # the tokens gateway's folders and kernelspecs
from .test_gateway import serve as serve
from .test_gateway import short_tmp as short_tmp

SERVICE = "sandbox-gateway"
SCOPE = f"access:services!service={SERVICE}"
SERVICE_TOKEN = "the-gateways-own-service-token"


@dataclass
class FakeHub:
    """What the gateway asks of JupyterHub: whose a token is, and a user's groups."""

    tokens: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    asked: Counter[str] = field(default_factory=Counter)
    give_groups: bool = True
    url: str = ""

    def token(self, token: str, name: str, kind: str = "user", scopes: tuple[str, ...] = (SCOPE,)) -> str:
        # As /hub/api/user answers a narrow server token: no groups (the token cannot read them).
        self.tokens[token] = {"kind": kind, "name": name, "scopes": [*scopes, f"read:users:name!user={name}"]}
        return token


class _HubUser(web.RequestHandler):
    def initialize(self, hub: FakeHub) -> None:
        self.hub = hub

    def get(self) -> None:
        self.hub.asked["user"] += 1
        token = self.request.headers.get("Authorization", "").partition(" ")[2]
        if token not in self.hub.tokens:
            raise web.HTTPError(403)
        self.finish(self.hub.tokens[token])


class _HubUsers(web.RequestHandler):
    def initialize(self, hub: FakeHub) -> None:
        self.hub = hub

    def get(self, name: str) -> None:
        self.hub.asked[f"users/{name}"] += 1
        if self.request.headers.get("Authorization") != f"token {SERVICE_TOKEN}":
            raise web.HTTPError(403)
        if name not in self.hub.groups:
            raise web.HTTPError(404)
        model: dict[str, Any] = {"kind": "user", "name": name}
        if self.hub.give_groups:  # only with the role's read:users:groups
            model["groups"] = self.hub.groups[name]
        self.finish(model)


@pytest.fixture
async def hub() -> AsyncIterator[FakeHub]:
    fake = FakeHub(groups={"alice": ["interns"], "bob": []})
    app = web.Application(
        [(r"/hub/api/user", _HubUser, {"hub": fake}), (r"/hub/api/users/(.+)", _HubUsers, {"hub": fake})]
    )
    sock, port = bind_unused_port()
    server = HTTPServer(app)
    server.add_sockets([sock])
    fake.url = f"http://127.0.0.1:{port}/hub/api"
    yield fake
    server.stop()


@pytest.fixture
def token_file(short_tmp: Path) -> Path:
    path = short_tmp / "hub-service.token"
    path.write_text(SERVICE_TOKEN + "\n")
    path.chmod(0o600)
    return path


def hub_args(hub: FakeHub, token_file: Path, *extra: str) -> list[str]:
    return [
        "--ServerApp.identity_provider_class=sandbox_kernel.gateway.hub.HubIdentityProvider",
        f"--HubIdentityProvider.api_url={hub.url}",
        f"--HubIdentityProvider.api_token_file={token_file}",
        f"--HubIdentityProvider.service_name={SERVICE}",
        *extra,
    ]


@pytest.fixture
async def hub_gateway(
    serve: Callable[..., Awaitable[Gateway]], hub: FakeHub, token_file: Path
) -> AsyncIterator[Gateway]:
    """A gateway whose users are the hub's alice (in group interns) and bob."""
    served = await serve(*hub_args(hub, token_file))
    provider = served.app.identity_provider
    assert isinstance(provider, HubIdentityProvider)
    provider.policy.ceilings = {"group:interns": {"max_memory": "1g"}}
    served.tokens = {name: hub.token(f"hub-token-of-{name}", name) for name in UIDS}
    yield served
    from jupyterhub.httpclient import JupyterHubHTTPClient

    await JupyterHubHTTPClient.loop_instance().close()  # the hub client's session, of this test's loop


def message(response: Any) -> str:
    return str(json.loads(response.body)["message"])


async def test_a_hub_users_token_gets_their_own_kernels_with_the_hubs_groups(
    hub_gateway: Gateway, hub: FakeHub
) -> None:
    kernel_id = await hub_gateway.start("alice")
    user = hub_gateway.km.get_kernel(kernel_id).provisioner.user
    assert (user.name, user.uid, user.groups) == ("alice", UIDS["alice"], ("interns",))
    assert user.ceilings == {"max_memory": "1g"}, "her group's ceilings, from the hub, not from her token"
    assert hub_gateway.km.owner(kernel_id) == "alice"
    bearer = await hub_gateway.fetch(
        "/api/kernels", headers={"Authorization": f"Bearer {hub_gateway.tokens['alice']}"}
    )
    assert [k["id"] for k in json.loads(bearer.body)] == [kernel_id]
    assert "Set-Cookie" not in bearer.headers

    # bob, with his own valid hub token: nothing of hers
    assert json.loads((await hub_gateway.fetch("/api/kernels", "bob")).body) == []
    assert (await hub_gateway.fetch(f"/api/kernels/{kernel_id}", "bob")).code == 403
    assert (await hub_gateway.fetch(f"/api/kernels/{kernel_id}", "bob", method="DELETE")).code == 403


@pytest.mark.parametrize(
    ("kind", "scopes", "expected"),
    [
        ("service", (SCOPE,), "only users' hub tokens may use the sandbox gateway, not a service's"),
        ("user", ("access:services!service=another-gateway",), f"lacks the scope {SCOPE}"),
        ("user", ("users:activity!user=alice",), f"lacks the scope {SCOPE}"),
    ],
    ids=["service", "another-service", "no-scope"],
)
async def test_a_token_that_is_not_a_users_or_lacks_the_scope_is_refused_saying_why(
    hub_gateway: Gateway, hub: FakeHub, kind: str, scopes: tuple[str, ...], expected: str
) -> None:
    token = hub.token("narrow", "alice", kind=kind, scopes=scopes)
    for path, method, body in [("/api/kernels", "GET", None), ("/api/kernels", "POST", "{}")]:
        response = await hub_gateway.fetch(
            path, headers={"Authorization": f"token {token}"}, method=method, body=body
        )
        assert (response.code, expected in message(response)) == (403, True), message(response)
    assert hub_gateway.km.list_kernel_ids() == []


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "token unknown-to-the-hub"}, {"Authorization": "Basic YWxpY2U6eA=="}],
    ids=["none", "unknown", "basic"],
)
async def test_a_request_without_a_known_hub_token_in_its_header_is_refused(
    hub_gateway: Gateway, headers: dict[str, str]
) -> None:
    assert (await hub_gateway.fetch("/api/kernels", headers=headers)).code == 403
    assert (await hub_gateway.fetch("/api/kernels", headers=headers, method="POST", body="{}")).code == 403
    token = hub_gateway.tokens["alice"]
    assert (await hub_gateway.fetch(f"/api/kernels?token={token}", headers=headers)).code == 403
    assert hub_gateway.km.list_kernel_ids() == []


async def test_the_hubs_answers_are_kept_a_while_and_a_revoked_token_then_fails(
    hub_gateway: Gateway, hub: FakeHub
) -> None:
    provider = hub_gateway.app.identity_provider
    assert isinstance(provider, HubIdentityProvider)
    assert provider.cache_max_age == 60
    for _ in range(3):
        assert (await hub_gateway.fetch("/api/kernels", "alice")).code == 200
    assert (hub.asked["user"], hub.asked["users/alice"]) == (1, 1)
    # A minute on: the hub is asked again, and a token it no longer knows lets nobody in.
    del hub.tokens[hub_gateway.tokens["alice"]]
    hub.groups["alice"] = ["interns", "team1"]
    provider.hub_auth.cache.clear()
    provider._groups = {name: (at - 61, groups) for name, (at, groups) in provider._groups.items()}
    assert (await hub_gateway.fetch("/api/kernels", "alice")).code == 403
    assert await provider.groups_of("alice") == ("interns", "team1")


async def test_without_the_users_groups_from_the_hub_nobody_gets_in(
    hub_gateway: Gateway, hub: FakeHub
) -> None:
    hub.give_groups = False  # the service's role lacks read:users:groups
    response = await hub_gateway.fetch("/api/kernels", "alice", method="POST", body="{}")
    assert response.code == 500
    assert "needs a role with read:users:groups" in message(response)
    assert hub_gateway.km.list_kernel_ids() == []


async def test_a_hub_user_the_policy_refuses_gets_a_reason(hub_gateway: Gateway, hub: FakeHub) -> None:
    token = hub.token("carol-token", "carol")  # a hub user with no uid on the sandbox host
    hub.groups["carol"] = []
    response = await hub_gateway.fetch("/api/kernels", headers={"Authorization": f"token {token}"})
    assert response.code == 403
    assert "carol" in message(response)


async def test_a_hub_that_does_not_answer_lets_nobody_in(
    serve: Callable[..., Awaitable[Gateway]], hub: FakeHub, token_file: Path
) -> None:
    hub.url = f"http://127.0.0.1:{free_port()}/hub/api"  # nothing listens there
    served = await serve(*hub_args(hub, token_file))
    response = await served.fetch("/api/kernels", headers={"Authorization": "token whatever"})
    assert response.code >= 500
    assert served.km.list_kernel_ids() == []


@pytest.mark.parametrize(
    ("mode", "content"), [(0o640, SERVICE_TOKEN), (0o600, "")], ids=["readable", "empty"]
)
def test_the_gateway_does_not_start_without_a_private_service_token(
    gateway_args: list[str],
    hub: FakeHub,
    token_file: Path,
    mode: int,
    content: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token_file.write_text(content)
    token_file.chmod(mode)
    with pytest.raises(SystemExit):
        new_app([*gateway_args, f"--port={free_port()}", *hub_args(hub, token_file)])
    err = capsys.readouterr().err
    assert "HubIdentityProvider.api_token_file" in err
    if mode != 0o600:
        assert f"the gateway's hub service token file {token_file} must be a file of root's" in err
        assert "mode 0600" in err
        assert "tokens file" not in err, "it says which file it is"
    else:
        assert "is empty" in err
    assert "Traceback" not in err
    assert os.stat(token_file).st_mode & 0o777 == mode
