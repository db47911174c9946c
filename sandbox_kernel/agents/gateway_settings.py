"""Which sandbox gateway a session's kernel runs on, read from its arguments and the
environment, and what the session may ask of it: what the session API needs to know
before it reaches a gateway, without importing the client part (jupyter_server's gateway
client and all it loads, a second or more of every ``import sandbox_kernel``): see
:mod:`~sandbox_kernel.agents.gateway_session` for the rest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.plan.plan import NARROWABLE

#: The environment variables that name the gateway, as jupyter_server's GatewayClient reads them.
URL_VARIABLE = "JUPYTER_GATEWAY_URL"
TOKEN_VARIABLE = "JUPYTER_GATEWAY_AUTH_TOKEN"  # noqa: S105  # its name, not a token
CA_VARIABLE = "JUPYTER_GATEWAY_CA_CERTS"


@dataclass(frozen=True)
class GatewaySettings:
    """Where the gateway is and how this process proves who it is to it."""

    url: str
    token: str | None = None
    ca_certs: str | None = None

    @classmethod
    def given(
        cls, url: str | None = None, token: str | None = None, ca_certs: str | None = None
    ) -> GatewaySettings | None:
        """The settings of these arguments, each missing one from its environment variable;
        None when no gateway is named (a local session).

        Raises:
            ConfigurationError: a token or CA file without a gateway URL, or a URL that is
                not http(s).
        """
        url = url or os.environ.get(URL_VARIABLE) or None
        token = token or os.environ.get(TOKEN_VARIABLE) or None
        ca_certs = ca_certs or os.environ.get(CA_VARIABLE) or None
        if url is None:
            return None
        if not url.startswith(("https://", "http://")):
            msg = f"gateway_url={url!r} must be the gateway's https:// (or, on loopback, http://) URL"
            raise ConfigurationError(msg)
        return cls(url.rstrip("/"), token, ca_certs)

    @property
    def ws_url(self) -> str:
        return "ws" + self.url.removeprefix("http")


def narrowing_for_gateway(policy: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """The POST's ``"sandbox"`` object for a session's ``policy`` keywords.

    Raises:
        ConfigurationError: ``env`` (the gateway sets no variables a client sends), or a
            keyword the gateway cannot narrow: refused rather than dropped, since a dropped
            narrowing would run the kernel with more than was asked for.
    """
    if env:
        msg = (
            "env= is not sent to a sandbox gateway (it sets none of a client's variables in the kernel): "
            "pass env= to run() instead, or set them in code"
        )
        raise ConfigurationError(msg)
    unknown = sorted(set(policy) - set(NARROWABLE))
    if unknown:
        msg = (
            f"a kernel on a sandbox gateway may be narrowed only by {', '.join(NARROWABLE)}; "
            f"not {', '.join(unknown)}"
        )
        raise ConfigurationError(msg)
    return dict(policy)
