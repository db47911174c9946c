"""``jupyter sandbox-kernel gateway``: serve sandboxed kernels to other users' Jupyter servers.

A jupyter_server (``ServerApp``) that serves only the kernel API, as Jupyter's own gateway
protocol has it (``jupyter lab --gateway-url=https://sandbox-host:8870``), and nothing else:

- ``GET/POST /api/kernels``, ``GET/DELETE /api/kernels/<id>``,
  ``POST /api/kernels/<id>/{interrupt,restart}``, ``GET /api/kernels/<id>/channels``
  (the websocket), ``GET /api/kernelspecs[/<name>]``, ``GET /kernelspecs/<name>/<file>``,
  ``GET /api/sandbox-kernel/kernels/<id>`` (the status bar's) and the owner's routes below it
  (``pause``, ``resume``, ``usage``, ``audit``, ``files``: see :mod:`~.handlers`), and
  ``GET /api`` (the version).
  Everything else is 404: no contents, files, terminals, sessions, login pages, metrics
  (unless ``c.SandboxGatewayApp.metrics = True``), no server extensions.
- Users authenticate with their own token in the ``Authorization`` header (the tokens file,
  :mod:`~.identity`); each user's kernels are theirs alone (:mod:`~.authorizer`,
  :mod:`~.manager`), run as their uid, under their folder (:mod:`~.users`).
- Only sandboxed kernelspecs exist for it (:mod:`~.kernelspecs`).
- Persistent kernels outlive it, killed or stopped; started again, it adopts those it
  started for its users, each for its owner (:mod:`~.manager`).
- It runs as root (to run kernels as its users' uids), and refuses to start otherwise; it
  serves TLS only, unless on a loopback address with ``allow_plain_http``.

Its config file is its own, ``jupyter_sandbox_gateway_config.py`` (a notebook server's
``jupyter_server_config`` never applies to it, nor its to them).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any

from jupyter_core.application import JupyterApp, base_aliases
from jupyter_server import serverapp
from jupyter_server.base.handlers import APIVersionHandler, PrometheusMetricsHandler, Template404
from jupyter_server.serverapp import ServerApp
from jupyter_server.services.kernelspecs.handlers import KernelSpecHandler, MainKernelSpecHandler
from jupyter_server.services.sessions.sessionmanager import SessionManager
from traitlets import Bool, Int, List, Unicode, default

from sandbox_kernel._version import __version__
from sandbox_kernel.agents.files import DEFAULT_MAX_BYTES
from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.gateway import handlers
from sandbox_kernel.gateway.authorizer import KernelOwnerAuthorizer
from sandbox_kernel.gateway.identity import (
    DEFAULT_TOKENS_FILE,
    HeaderTokenIdentityProvider,
    TokensFileIdentityProvider,
    add_token,
    revoke_tokens,
)
from sandbox_kernel.gateway.kernelspecs import SandboxedOnlyKernelSpecManager
from sandbox_kernel.gateway.manager import GatewayKernelManagerForUsers
from sandbox_kernel.gateway.tls import write_tls_files
from sandbox_kernel.gateway.users import UserPolicy, UserRefused
from sandbox_kernel.jupyter.connection_state import StateOnConnectWebsocketConnection

CONFIG_FILE_NAME = "jupyter_sandbox_gateway_config"
DEFAULT_PORT = 8870
DEFAULT_ROOT_DIR = "/var/lib/sandbox-kernel/gateway"
DEFAULT_TLS_DIR = "/etc/sandbox-kernel/gateway"

#: What the gateway serves: its own routes, jupyter_server's kernelspec routes, the version,
#: and the 404 page for everything else.
SERVED = (
    *(route[1] for route in handlers.default_handlers),
    MainKernelSpecHandler,
    KernelSpecHandler,
    APIVersionHandler,
    Template404,
)


def is_loopback(ip: str) -> bool:
    """Whether a server listening on ``ip`` can be reached from this host only."""
    if ip == "localhost":
        return True
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def serving_refusal(euid: int, ip: str, certfile: str, keyfile: str, allow_plain_http: bool) -> str | None:
    """Why a gateway with these settings must not serve (one line), or None."""
    if euid != 0:
        return (
            f"the sandbox gateway must run as root (it runs as uid {euid}): it runs each user's "
            "kernels as that user's uid, and only root may"
        )
    if certfile and keyfile:
        return None
    if allow_plain_http and is_loopback(ip):
        return None
    where = f"on {ip or 'every address'}"
    return (
        f"the sandbox gateway serves TLS only {where}: give --certfile and --keyfile "
        "(`jupyter sandbox-kernel gateway init-tls` makes them), or, on a loopback address "
        "only, set --SandboxGatewayApp.allow_plain_http=True"
    )


class _GatewayCommand(JupyterApp):
    """A subcommand of the gateway's, reading the gateway's config file."""

    version = __version__

    @default("config_file_name")
    def _config_file_name_default(self) -> str:
        return CONFIG_FILE_NAME

    def fail(self, message: str) -> None:
        """Print a user error to stderr and exit non-zero."""
        print(f"error: {message}", file=sys.stderr)
        self.exit(1)

    def parse_command_line(self, argv: Any = None) -> None:
        """Parse the command line; an unknown option is a one-line error (traitlets would
        only warn, and ``--tokens-fle=...`` would write the default file).

        Raises:
            SystemExit: for an unknown option.
        """
        known = {
            name
            for key in (*self.aliases, *self.flags)
            for name in (key if isinstance(key, tuple) else (key,))
        }
        for arg in sys.argv[1:] if argv is None else argv:
            if arg == "--":
                break
            name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
            if name and "." not in name and name not in known:
                self.fail(f"unknown option --{name}; see --help")
        super().parse_command_line(argv)

    def tokens_file(self) -> Path:
        """The gateway's tokens file, as its config (or ``--tokens-file``) names it."""
        return Path(self.config.get("TokensFileIdentityProvider", {}).get("path", DEFAULT_TOKENS_FILE))

    def user_name(self) -> str:
        """The one user name the command line gives."""
        if len(self.extra_args) != 1:
            command = self.name.rpartition("gateway-")[2]
            self.fail(f"give one user name: jupyter sandbox-kernel gateway {command} USER")
        return str(self.extra_args[0])


class AddTokenApp(_GatewayCommand):
    """Make a token for a user of the gateway."""

    name = "jupyter-sandbox-kernel-gateway-add-token"
    description = """Make a new token for USER, keep its sha256 in the gateway's tokens file
    (TokensFileIdentityProvider.path; made root's and 0600 if there is none) and print the
    token, once: it is kept nowhere else. The user's Jupyter server sends it
    (JUPYTER_GATEWAY_AUTH_TOKEN). A user the gateway would refuse (root, a system account,
    a member of sudo or docker: see UserPolicy) gets none."""
    examples = "jupyter sandbox-kernel gateway add-token alice --group analysts"
    groups = List(Unicode(), config=True, help="Groups of the user (for UserPolicy.ceilings); repeat.")
    uid = Int(-1, config=True, help="The user's uid, for UserPolicy.uid_source='map' (default: none).")
    classes = [TokensFileIdentityProvider, UserPolicy]
    aliases = {
        **base_aliases,
        "group": "AddTokenApp.groups",
        "uid": "AddTokenApp.uid",
        "tokens-file": "TokensFileIdentityProvider.path",
    }

    def start(self) -> None:
        name = self.user_name()
        uid = None if self.uid < 0 else self.uid
        try:
            UserPolicy(config=self.config).resolve(name, self.groups, uid)
        except UserRefused as exc:
            self.fail(f"{exc}; no token made")
        path = self.tokens_file()
        try:
            token = add_token(path, name, tuple(self.groups), uid)
        except (ConfigurationError, OSError) as exc:
            self.fail(str(exc))
        print(f"A new token for {name} (shown once; {path} keeps its sha256 only):", file=sys.stderr)
        print(token)


class RevokeTokenApp(_GatewayCommand):
    """Remove every token of a user of the gateway."""

    name = "jupyter-sandbox-kernel-gateway-revoke-token"
    description = """Remove every token of USER from the gateway's tokens file
    (TokensFileIdentityProvider.path). The gateway refuses them from its next request on;
    the user's kernels keep running until they or an administrator shut them down."""
    examples = "jupyter sandbox-kernel gateway revoke-token alice"
    classes = [TokensFileIdentityProvider]
    aliases = {**base_aliases, "tokens-file": "TokensFileIdentityProvider.path"}

    def start(self) -> None:
        name = self.user_name()
        path = self.tokens_file()
        try:
            removed = revoke_tokens(path, name)
        except (ConfigurationError, OSError) as exc:
            self.fail(str(exc))
        print(f"Revoked {removed} token(s) of {name} in {path}")


class InitTlsApp(_GatewayCommand):
    """Make the gateway's CA and server certificate."""

    name = "jupyter-sandbox-kernel-gateway-init-tls"
    description = """Make a certificate authority for the gateway (ca.pem, and its key
    ca-key.pem) unless --dir has one, and a server certificate it signs for the given host
    names and addresses (server.pem, server-key.pem). A folder it makes is 0755, the
    certificates 0644 (every user's server may read ca.pem), the keys 0600. Give the
    gateway --certfile and --keyfile, and the users' servers the CA
    (JUPYTER_GATEWAY_CA_CERTS=DIR/ca.pem, with sandbox-kernel installed on their side)."""
    examples = "jupyter sandbox-kernel gateway init-tls --hostname gw.example --ip 10.77.0.2"
    directory = Unicode(DEFAULT_TLS_DIR, config=True, help="Where to write the CA and the certificate.")
    hostnames = List(Unicode(), config=True, help="Host names of the gateway (default: this host's); repeat.")
    ips = List(Unicode(), config=True, help="IP addresses of the gateway (default: 127.0.0.1); repeat.")
    aliases = {
        **base_aliases,
        "dir": "InitTlsApp.directory",
        "hostname": "InitTlsApp.hostnames",
        "ip": "InitTlsApp.ips",
    }

    def start(self) -> None:
        folder = Path(self.directory)
        hostnames = self.hostnames or [socket.getfqdn(), "localhost"]
        ips = self.ips or ["127.0.0.1"]
        try:
            made = write_tls_files(folder, hostnames, ips)
        except ValueError as exc:
            self.fail(str(exc))
        ca = folder / "ca.pem"
        print(f"Made a CA: {ca} (its key: {folder / 'ca-key.pem'})" if made else f"Using the CA in {ca}")
        print(f"Made a server certificate for {', '.join([*hostnames, *ips])}: {folder / 'server.pem'}")
        print(f"Serve with: --certfile {folder / 'server.pem'} --keyfile {folder / 'server-key.pem'}")


class SandboxGatewayApp(ServerApp):
    """Serve sandboxed kernels to other users' Jupyter servers (a kernel gateway)."""

    name = "jupyter-sandbox-kernel-gateway"
    version = __version__
    description = """Serve sandboxed kernels to the Jupyter servers of other users or machines,
    through Jupyter's gateway protocol (their `jupyter lab --gateway-url=https://HOST:8870`).
    It serves the kernel API only, to users with a token (see `add-token`), runs each user's
    kernels as their uid under their folder, and only sandboxed kernelspecs. It must run as
    root, and serves TLS (see `init-tls`). Config: jupyter_sandbox_gateway_config.py."""
    examples = """
    jupyter sandbox-kernel gateway init-tls --hostname gw.example --ip 10.77.0.2
    jupyter sandbox-kernel gateway add-token alice
    jupyter sandbox-kernel gateway revoke-token alice
    jupyter sandbox-kernel gateway --ip 10.77.0.2 --certfile /etc/sandbox-kernel/gateway/server.pem \\
        --keyfile /etc/sandbox-kernel/gateway/server-key.pem
    """
    default_services = ("kernels", "kernelspecs")  # type: ignore[assignment]  # a subset, as the base invites
    subcommands = {
        "add-token": (AddTokenApp, AddTokenApp.description.splitlines()[0]),
        "revoke-token": (RevokeTokenApp, RevokeTokenApp.description.splitlines()[0]),
        "init-tls": (InitTlsApp, InitTlsApp.description.splitlines()[0]),
    }
    classes = [*ServerApp.classes, TokensFileIdentityProvider, UserPolicy, GatewayKernelManagerForUsers]
    # ServerApp's, as plain dicts (as every other command's are), not its traits.
    aliases = dict(serverapp.aliases)
    flags = dict(serverapp.flags)

    allow_plain_http = Bool(
        False,
        config=True,
        help="""Serve plain HTTP (no --certfile/--keyfile). Only on a loopback address, where
        no network sees the users' tokens.""",
    )
    metrics = Bool(False, config=True, help="Serve /metrics (Prometheus; it needs a user's token).")

    @default("config_file_name")
    def _gateway_config_file_name_default(self) -> str:
        return CONFIG_FILE_NAME

    @default("kernel_manager_class")
    def _gateway_kernel_manager_class_default(self) -> type:
        return GatewayKernelManagerForUsers

    @default("session_manager_class")
    def _gateway_session_manager_class_default(self) -> type:
        # Never jupyter_server's gateway client's, whatever this process's GatewayClient says.
        return SessionManager

    @default("kernel_spec_manager_class")
    def _gateway_kernel_spec_manager_class_default(self) -> type:
        return SandboxedOnlyKernelSpecManager

    @default("identity_provider_class")
    def _gateway_identity_provider_class_default(self) -> type:
        return TokensFileIdentityProvider

    @default("authorizer_class")
    def _gateway_authorizer_class_default(self) -> type:
        return KernelOwnerAuthorizer

    @default("kernel_websocket_connection_class")
    def _gateway_connection_class_default(self) -> type:
        return StateOnConnectWebsocketConnection

    @default("extra_services")
    def _gateway_extra_services_default(self) -> list[str]:
        return [handlers.__name__]

    @default("allow_root")
    def _gateway_allow_root_default(self) -> bool:
        return True

    @default("open_browser")
    def _gateway_open_browser_default(self) -> bool:
        return False

    @default("port")
    def _gateway_port_default(self) -> int:
        return DEFAULT_PORT

    @default("root_dir")
    def _gateway_root_dir_default(self) -> str:
        # Only the adoption scope of persistent kernels hashes it; kernels run under their users' folders.
        os.makedirs(DEFAULT_ROOT_DIR, mode=0o700, exist_ok=True)
        return DEFAULT_ROOT_DIR

    @default("max_body_size")
    def _gateway_max_body_size_default(self) -> int:
        # The largest body a route takes is a file upload, which the files API caps; tornado
        # buffers a body before anyone is authenticated (jupyter_server's default: 512 MiB).
        return DEFAULT_MAX_BYTES

    @default("max_buffer_size")
    def _gateway_max_buffer_size_default(self) -> int:
        return DEFAULT_MAX_BYTES

    @default("terminals_enabled")
    def _gateway_terminals_default(self) -> bool:
        return False

    def find_server_extensions(self) -> None:
        """None: the gateway loads no server extension (no Lab, no terminals)."""

    def init_server_extensions(self) -> None:
        self.jpserver_extensions = {}
        super().init_server_extensions()

    def init_configurables(self) -> None:
        try:
            super().init_configurables()
        except ConfigurationError as exc:
            self.log.critical("%s", exc)
            self.exit(1)
        self.introduce_users()

    def introduce_users(self) -> None:
        """Tell the kernel manager how users are known (the identity provider's word, made
        after the manager), so that it plans each pool with its user's groups' ceilings; then
        it adopts its users' kernels and plans their pools, before the gateway serves."""
        manager, identity = self.kernel_manager, self.identity_provider
        if not isinstance(manager, GatewayKernelManagerForUsers):
            return
        if isinstance(identity, HeaderTokenIdentityProvider):
            identity.on_user = manager.user_seen
            manager.serve_users(identity.known_user)
        else:  # an identity provider of the site's own: no groups before a start
            manager.serve_users(UserPolicy(config=self.config).resolve)

    def init_webapp(self) -> None:
        """Refuse to serve unsafely; then serve exactly the gateway's routes."""
        refusal = serving_refusal(os.geteuid(), self.ip, self.certfile, self.keyfile, self.allow_plain_http)
        if refusal is not None:
            self.log.critical("%s", refusal)
            self.exit(1)
        super().init_webapp()
        served = (*SERVED, PrometheusMetricsHandler) if self.metrics else SERVED
        router = self.web_app.wildcard_router
        dropped = [rule for rule in router.rules if rule.target not in served]
        router.rules = [rule for rule in router.rules if rule.target in served]
        for rule in dropped:
            self.log.debug("Sandbox gateway: not serving %s", getattr(rule.matcher, "regex", rule.matcher))

    def running_server_info(self, kernel_count: bool = True) -> str:
        """What the gateway serves, where (its start-up lines)."""
        kernels = f"{len(self.kernel_manager.list_kernel_ids())} kernels; " if kernel_count else ""
        users = getattr(self.identity_provider, "path", type(self.identity_provider).__name__)
        return (
            f"Sandbox gateway {__version__} (Jupyter Server {ServerApp.version}): {kernels}serving "
            f"sandboxed kernels to the users of {users} at:\n{self.display_url}"
        )


main = SandboxGatewayApp.launch_instance
