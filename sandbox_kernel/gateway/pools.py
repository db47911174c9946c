"""Whose warm pools a sandbox gateway keeps, and as whom it plans each one (pure: no I/O).

A pooled sandbox serves a start whole only if it was planned as that start is: the user's
uid and gid, their ``io.sandbox-kernel.user`` label, and the ceilings that hold for them,
their groups' included (``UserPolicy.ceilings``). A ceiling the pool was planned without
narrows the sandbox at the claim (memory, cpus, a time limit), or sends the start cold
(another ``tmp_size`` or image; see :mod:`~sandbox_kernel.pool.fit`). So each user's pools
are planned with the ceilings the gateway knows for them as it starts (the tokens file gives
their groups), and planned again when a request of theirs shows others: under JupyterHub
their groups come with their first request, and an administrator may change them at any time.
Groups count only through the ceilings they bring: a user whose groups have no entry of
their own is planned once.

Only the users of ``pool_users`` get pools. Each waiting sandbox reserves its memory limit
(``max_pool_memory`` counts them) and holds its pages while frozen; pools for everyone who
sends a request would let any user make the gateway hold sandboxes, and share the bounds
(``max_pool_size`` of a kernelspec, ``max_pool_memory``) among users who may never start a
kernel, in the order they happened to ask. Everyone else starts cold.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from sandbox_kernel.plan.users import KernelUser

#: What of a user their pooled sandboxes are fixed to: name (the label), uid, gid, ceilings.
Planned = tuple[str, int, int, str]


def planned_as(user: KernelUser) -> Planned:
    """What ``user``'s pooled sandboxes are planned with, comparable: their name, uid, gid and
    ceilings (their groups count only through these)."""
    ceilings = json.dumps(dict(user.ceilings), sort_keys=True, default=str)
    return (user.name, user.uid, user.gid, ceilings)


class PoolUsers:
    """The users of ``pool_users``, and as whom each one's pools were last planned."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(dict.fromkeys(names))
        self._planned: dict[str, Planned] = {}

    def update(self, user: KernelUser) -> bool:
        """Whether ``user``'s pools are to be planned now, as ``user``: they are listed, and
        their pools were planned for no one yet, or for other ceilings (or another uid). If so,
        they count as planned so from now on (a plan that fails is not tried again until
        ``user`` changes)."""
        if user.name not in self.names:
            return False
        planned = planned_as(user)
        if self._planned.get(user.name) == planned:
            return False
        self._planned[user.name] = planned
        return True

    def current(self, user: KernelUser) -> bool:
        """Whether ``user`` is still as their pools were last to be planned (a later
        :meth:`update` may have found them changed again)."""
        return self._planned.get(user.name) == planned_as(user)
