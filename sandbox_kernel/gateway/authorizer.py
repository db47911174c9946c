"""Who may do what on the gateway: a user, to their own kernels only.

jupyter_server asks the Authorizer before every kernel and kernelspec request, the
websocket's included. Every route that names a kernel names it in the group
``kernel_id`` (jupyter_server's routes and ours), so the Authorizer sees it in
``handler.path_kwargs``: a request on a kernel is allowed only if the gateway recorded
the caller as its owner. An unknown id is refused the same way as another user's (403),
so a refusal says nothing of which kernels exist. The handlers check again
(:mod:`~.handlers`): the Authorizer is configurable, and a misconfiguration must not open
kernels.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.auth.authorizer import Authorizer
from jupyter_server.auth.identity import User
from tornado import web

#: What the gateway serves (jupyter_server's resource names).
RESOURCES = ("kernels", "kernelspecs")


def owns(handler: web.RequestHandler, user: User | None, kernel_id: str) -> bool:
    """Whether the gateway recorded ``user`` as the owner of kernel ``kernel_id``."""
    if user is None:
        return False
    owner = getattr(handler.settings.get("kernel_manager"), "owner", None)
    return callable(owner) and owner(kernel_id) == user.username


class KernelOwnerAuthorizer(Authorizer):
    """Allows kernel and kernelspec requests; those on one kernel only to its owner."""

    def is_authorized(self, handler: web.RequestHandler, user: User, action: str, resource: str) -> bool:
        """Whether ``user`` may do ``action`` on ``resource`` in this request."""
        if resource not in RESOURCES:
            return False
        kernel_id: Any = handler.path_kwargs.get("kernel_id")
        if kernel_id is None:
            return True
        return owns(handler, user, str(kernel_id))
