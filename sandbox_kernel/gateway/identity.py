"""Who is asking: the gateway's users, from a tokens file (the standalone shape).

Each request is authenticated by its ``Authorization: token <T>`` (or ``Bearer <T>``)
header, and by nothing else: no ``?token=`` in the URL, no cookies, no login page, and
never a field the client sends about itself (``KERNEL_USERNAME``, the body's env). The
file holds the sha256 of each token, never a token::

    {"users": {"alice": {"sha256": ["9f86d0..."], "groups": ["analysts"]},
               "bob": {"sha256": ["..."], "uid": 1002}}}

``uid`` is optional (for ``UserPolicy.uid_source = "map"``; with "passwd" it must agree
with the account). The file must be root's and private (0600): whoever can write it can
be anyone. It is read again whenever it changes, so ``jupyter sandbox-kernel gateway
add-token USER`` (and ``revoke-token USER``) takes effect at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_server.auth.identity import IdentityProvider, User
from tornado import web
from traitlets import Instance, Unicode, default

from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.gateway.users import GatewayUser, UserPolicy, UserRefused
from sandbox_kernel.host.files import replace_file
from sandbox_kernel.plan.users import KernelUser

DEFAULT_TOKENS_FILE = "/etc/sandbox-kernel/gateway/tokens.json"
#: As JupyterHub's ``HubAuth.auth_header_pat``.
AUTH_HEADER_RE = re.compile(r"^(?:token|bearer)\s+(\S+)\s*$", re.IGNORECASE)


def token_hash(token: str) -> str:
    """What the tokens file keeps of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenEntry:
    """One user of the tokens file."""

    name: str
    groups: tuple[str, ...] = ()
    uid: int | None = None


def check_private(path: Path, what: str = "the gateway's tokens file") -> os.stat_result:
    """``path``'s stat, if it is a regular file of root's that only root may read, in a
    folder of root's that no one else may write (who could swap the file). ``what`` names
    the file in the error.

    Raises:
        ConfigurationError: it is missing, or someone else could read, write or replace it.
    """
    try:
        st = os.stat(path)
        folder = os.stat(path.parent)
    except OSError as exc:
        msg = f"{what} {path} cannot be read: {exc.strerror or exc}"
        raise ConfigurationError(msg) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        msg = (
            f"{what} {path} must be a file of root's with mode 0600 "
            f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): whoever can change it "
            "can be anyone"
        )
        raise ConfigurationError(msg)
    if folder.st_uid != 0 or folder.st_mode & 0o022:
        msg = (
            f"{what} {path} must be in a folder only root may write (its folder "
            f"is uid {folder.st_uid}, mode {stat.S_IMODE(folder.st_mode):04o}): whoever can replace "
            "the file can be anyone"
        )
        raise ConfigurationError(msg)
    return st


def read_tokens(path: Path) -> dict[str, TokenEntry]:
    """sha256 of each token -> its user, from the tokens file.

    Raises:
        ConfigurationError: the file is not private, or not a tokens file.
    """
    check_private(path)
    try:
        data = json.loads(path.read_text())
        users = data["users"]
        if not isinstance(users, dict):
            raise TypeError(users)  # one message for every malformed shape
        found: dict[str, TokenEntry] = {}
        for name, entry in users.items():
            uid = entry.get("uid")
            user = TokenEntry(
                str(name), tuple(str(g) for g in entry.get("groups", ())), None if uid is None else int(uid)
            )
            for digest in entry.get("sha256", ()):
                found[str(digest).lower()] = user
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        msg = f"{path} is not a gateway tokens file ({{'users': {{NAME: {{'sha256': [...]}}}}}}): {exc!r}"
        raise ConfigurationError(msg) from None
    return found


def add_token(path: Path, name: str, groups: tuple[str, ...] = (), uid: int | None = None) -> str:
    """Make a new token for ``name``, keep its sha256 in the tokens file (made, root's
    and 0600, if there is none), and return the token: it is shown once and kept nowhere.

    Raises:
        ConfigurationError: the file exists and is not private, or not a tokens file.
    """
    if path.exists():
        read_tokens(path)
        data: dict[str, Any] = json.loads(path.read_text())
    else:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = {"users": {}}
    token = secrets.token_urlsafe(32)
    entry = data["users"].setdefault(name, {})
    entry.setdefault("sha256", []).append(token_hash(token))
    if groups:
        entry["groups"] = sorted({*entry.get("groups", ()), *groups})
    if uid is not None:
        entry["uid"] = uid
    replace_file(path, (json.dumps(data, indent=2) + "\n").encode())
    return token


def revoke_tokens(path: Path, name: str) -> int:
    """Remove every token of ``name`` from the tokens file; how many there were.

    Raises:
        ConfigurationError: the file is missing, not private, or not a tokens file.
    """
    read_tokens(path)
    data: dict[str, Any] = json.loads(path.read_text())
    entry = data["users"].pop(name, None)
    if entry is None:
        return 0
    replace_file(path, (json.dumps(data, indent=2) + "\n").encode())
    return len(entry.get("sha256", ()))


class HeaderTokenIdentityProvider(IdentityProvider):
    """What the gateway's identity providers share: each user has their own token, sent in
    the ``Authorization`` header; no server-wide token, no login or logout pages, no
    cookies. Subclasses say whose a token is (``get_user``, with :data:`AUTH_HEADER_RE`),
    and resolve its user with :meth:`request_user`."""

    policy = Instance(UserPolicy, help="Which users get kernels, as which uid, under which folder.")

    #: Told of each user a request is authenticated as (the gateway hands it its kernel
    #: manager's ``user_seen``, which plans their warm pools again if their ceilings changed).
    on_user: Callable[[KernelUser], None] | None = None

    def known_user(self, name: str) -> GatewayUser:
        """User ``name`` as this source knows them before any request of theirs (here with no
        groups; a source that keeps its users, as the tokens file does, knows theirs).

        Raises:
            UserRefused: the policy refuses them, saying why.
        """
        return self.policy.resolve(name)

    def request_user(self, name: str, groups: Iterable[str] = (), uid: int | None = None) -> GatewayUser:
        """The user a request is authenticated as (``name``, in ``groups``, ``uid`` if the
        source gives one), as the policy resolves them; :attr:`on_user` is told.

        Raises:
            HTTPError: 403 for a user the policy refuses, saying why.
        """
        try:
            user = self.policy.resolve(name, groups, uid)
        except UserRefused as exc:
            self.log.warning("Sandbox gateway: %s", exc)
            raise web.HTTPError(403, str(exc)) from None
        if self.on_user is not None:
            self.on_user(user.sandbox_user)
        return user

    @default("policy")
    def _policy_default(self) -> UserPolicy:
        return UserPolicy(parent=self)

    @default("token")
    def _token_default(self) -> str:
        return ""  # no server-wide token: each user has their own

    def identity_model(self, user: User) -> dict[str, Any]:
        return {"username": user.username, "name": user.name}

    def get_handlers(self) -> list[tuple[str, object]]:
        return []  # no login or logout pages

    @property
    def login_available(self) -> bool:
        return False

    @property
    def logout_available(self) -> bool:
        return False

    def validate_security(self, app: Any, ssl_options: dict[str, Any] | None = None) -> None:
        """The gateway checks TLS itself (see :mod:`~.app`); every request needs a token."""


class TokensFileIdentityProvider(HeaderTokenIdentityProvider):
    """Users from a tokens file; the ``Authorization`` header is the only credential."""

    path = Unicode(
        DEFAULT_TOKENS_FILE,
        config=True,
        help="""The tokens file (root's, mode 0600): {"users": {NAME: {"sha256": [...],
        "groups": [...], "uid": N}}}. Read again when it changes. Add a user's token with
        `jupyter sandbox-kernel gateway add-token NAME`.""",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tokens: dict[str, TokenEntry] = {}
        self._read_at: tuple[int, int] | None = None
        self.reload()  # a gateway whose tokens file is wrong does not start

    def reload(self) -> None:
        """Read the tokens file again if it changed (mtime or inode).

        Raises:
            ConfigurationError: the file is not private, or not a tokens file.
        """
        path = Path(self.path)
        st = check_private(path)
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp != self._read_at:
            self._tokens = read_tokens(path)
            self._read_at = stamp
            self.log.info("Read %d token(s) of the sandbox gateway from %s", len(self._tokens), path)

    def known_user(self, name: str) -> GatewayUser:
        """User ``name`` with the groups (and uid) the tokens file gives them, as their
        requests will be; with none if the file has no token of theirs.

        Raises:
            UserRefused: the policy refuses them, saying why.
        """
        entry = next((entry for entry in self._tokens.values() if entry.name == name), None)
        if entry is None:
            return super().known_user(name)
        return self.policy.resolve(name, entry.groups, entry.uid)

    def user_for_token(self, token: str) -> TokenEntry | None:
        """The user of ``token``, or None. The file is looked at again first; a file that
        went wrong lets nobody in."""
        try:
            self.reload()
        except ConfigurationError as exc:
            self.log.error("Refusing every request: %s", exc)
            self._tokens, self._read_at = {}, None
            return None
        return self._tokens.get(token_hash(token))

    def get_user(self, handler: web.RequestHandler) -> User | None:
        """The user whose token the request's ``Authorization`` header carries, or None.

        Raises:
            HTTPError: 403 for a known token of a user the policy refuses, saying why.
        """
        match = AUTH_HEADER_RE.match(handler.request.headers.get("Authorization", ""))
        if match is None:
            return None
        entry = self.user_for_token(match.group(1))
        if entry is None:
            return None
        user = self.request_user(entry.name, entry.groups, entry.uid)
        handler._token_authenticated = True  # type: ignore[attr-defined]  # as jupyter_server's own
        return user
