"""The settings of a sandboxed kernel: traits, their validation, the administrator's ceilings.

Every setting is a trait of :class:`SandboxSettings`, which the provisioner inherits,
declared once, in the part for its topic (:class:`LimitSettings`, :class:`EgressSettings`,
:class:`WorkspaceSettings`, :class:`LifecycleSettings`; the image, the runtime, the
transport and the audit log in :class:`SandboxSettings` itself). The parts are plain
``HasTraits``, no configurable classes of their own, so they add no config section: the
server's config sets a setting as ``c.SandboxProvisioner.NAME``, and its tags say the
rest. ``kernelspec=True``: a kernelspec may set it too
(``metadata.kernel_provisioner.config``), and ``jupyter sandbox-kernel install`` has a
flag for it (``--name-with-dashes``, or ``flag=``). ``ceiling="max_..."`` with
``bound=``: the server's ``max_*`` trait bounds it, and how (see
:func:`~.plan.check_ceilings`). The ``max_*`` traits are ceilings only the server's
config can raise. Adding a kernelspec setting is one trait here.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from typing import Any

from jupyter_core.paths import jupyter_data_dir
from traitlets import (
    Bool,
    CaselessStrEnum,
    Dict,
    Float,
    HasTraits,
    Int,
    List,
    TraitError,
    TraitType,
    Type,
    Unicode,
    default,
    validate,
)
from traitlets.config import LoggingConfigurable

from sandbox_kernel.egress import EgressPolicy, EgressRules
from sandbox_kernel.egress.credentials import CredentialSpec, parse_definitions
from sandbox_kernel.errors import ConfigurationError
from sandbox_kernel.plan.limits import (
    DURATION_FORMS,
    SIZE_FORMS,
    Limits,
    duration_seconds,
    size_bytes,
    validate_size,
)
from sandbox_kernel.plan.sandbox_spec import CONTAINER_WORKSPACE

DEFAULT_IMAGE = "sandbox-kernel/python:latest"
#: The data-science image (`build-image --recipe datascience`), built FROM DEFAULT_IMAGE.
DATASCIENCE_IMAGE = "sandbox-kernel/python-datascience:latest"
DEFAULT_RUNTIME = "runsc-sandbox-kernel"

#: The least memory a kernel may have: the kernel stops cells a margin (64 MiB and more)
#: below its limit (see in_kernel_startup.py), so less would stop every cell at once.
SMALLEST_MEMORY = "128m"
#: The longest duration a time limit may have (a week); longer is a typo, or no limit (0).
LONGEST = 7 * 24 * 3600


class Duration(TraitType[float, float | int | str]):
    """A duration, read as float seconds: a number of seconds, or a string such as
    ``"300"``, ``"90s"``, ``"5m"``, ``"1.5h"`` or ``"1d"`` (see :func:`~.limits.duration_seconds`)."""

    default_value = 0.0
    info_text = f"a duration: {DURATION_FORMS}"

    def validate(self, obj: Any, value: Any) -> float:
        try:
            return duration_seconds(self.name or "duration", value)
        except ConfigurationError as exc:
            raise TraitError(str(exc)) from None


class Size(TraitType[str, str | int]):
    """A size, kept as written (lowercased) so messages and the kernel's policy show it:
    bytes, or a number with k, m or g such as ``"512m"`` or ``"1.5g"`` (see
    :func:`~.limits.size_bytes`, which reads it in bytes)."""

    default_value = ""
    info_text = f"a size: {SIZE_FORMS}"

    def validate(self, obj: Any, value: Any) -> str:
        try:
            return validate_size(self.name or "size", value)
        except ConfigurationError as exc:
            raise TraitError(str(exc)) from None


class Credentials(TraitType[Any, Any]):
    """``credentials``: in the server's config the definitions (name -> domains, headers,
    ttl), in a kernelspec or a start the names of those its kernels get."""

    default_value: Any = {}
    info_text = "credential definitions (server config) or a list of credential names (kernelspec)"

    def validate(self, obj: Any, value: Any) -> Any:
        if isinstance(value, dict):
            try:
                parse_definitions(value)
            except ConfigurationError as exc:
                raise TraitError(str(exc)) from None
            return dict(value)
        if isinstance(value, list | tuple) and all(isinstance(name, str) for name in value):
            return list(value)
        self.error(obj, value)
        return None


def _at_most_a_week(proposal: dict[str, Any]) -> float:
    """A time limit (a :class:`Duration`; 0: none) of at most a week."""
    value: float = proposal["value"]  # seconds already: a Duration
    if value > LONGEST:
        msg = (
            f"{proposal['trait'].name}={value!r} is out of range; use at most a week "
            f"({LONGEST} seconds, '7d'), or 0 for no limit."
        )
        raise TraitError(msg)
    return value


def _a_wait(proposal: dict[str, Any]) -> float:
    """A wait (a :class:`Duration`) above 0 and at most a week."""
    value: float = proposal["value"]
    if not 0 < value <= LONGEST:
        name = proposal["trait"].name
        waits = (
            "a kernel needs time to start" if name == "startup_timeout" else "a person needs time to answer"
        )
        msg = (
            f"{name}={value!r} is out of range; {waits}: use more than 0 seconds and at most "
            "a week, e.g. 120 or '2m' (the default is 60)."
        )
        raise TraitError(msg)
    return value


class LimitSettings(HasTraits):
    """What one kernel may use (memory, CPUs, processes, /tmp, file size) and its clocks (a
    wall-clock limit per execution, an idle limit), each with the administrator's ceiling
    (``max_*``), and the output one execution may send."""

    memory = Size(
        "2g", config=True, help="Memory limit of the kernel's container, e.g. '512m', '1.5g' or '2g'."
    ).tag(kernelspec=True, ceiling="max_memory", bound="size")
    cpus = Float(1.0, config=True, help="CPU limit of the kernel's container, in cores (e.g. 0.5).").tag(
        kernelspec=True, ceiling="max_cpus", bound="amount"
    )
    pids = Int(
        256,
        config=True,
        help="""Most processes and threads the kernel's user may run (RLIMIT_NPROC); more
        forks or threads fail with EAGAIN. ipykernel and numpy need a few dozen.""",
    ).tag(kernelspec=True, ceiling="max_pids", bound="amount")
    tmp_size = Size(
        "256m",
        config=True,
        help="Size of the /tmp tmpfs, the only writable place besides the workspace, e.g. '256m'.",
    ).tag(kernelspec=True, ceiling="max_tmp_size", bound="size")
    file_size = Size(
        "4g",
        config=True,
        help="""Largest file the kernel may write, in the workspace or /tmp (RLIMIT_FSIZE):
        a write past it fails with "File too large" (EFBIG). A bind-mounted workspace has no
        quota of its own; see docs/administrators/workspace.md on bounding its total size.""",
    ).tag(kernelspec=True, ceiling="max_file_size", bound="size")
    idle_timeout = Duration(
        0.0,
        config=True,
        help="""Time without any execution after which the kernel is stopped to free its
        memory, in seconds or e.g. '30m' or '2h' (0: never). Clients are told; later
        requests get an error reply `IdleLimitExceeded` until the kernel is restarted.""",
    ).tag(kernelspec=True, ceiling="max_idle_timeout", bound="timeout")
    max_idle_timeout = Duration(
        0.0,
        config=True,
        help="""Ceiling for `idle_timeout`, in seconds or e.g. '8h' (0: none). When set,
        every kernel must have an idle limit at or below it. Server config only.""",
    )
    exec_timeout = Duration(
        0.0,
        config=True,
        help="""Wall-clock limit of one execution, in seconds or e.g. '90s' or '5m' (0: none).
        The cell gets a TimeoutError naming the limit; code that ignores it is interrupted,
        then the kernel is killed (and restarted by Jupyter) `exec_kill_grace` later.""",
    ).tag(kernelspec=True, ceiling="max_exec_timeout", bound="timeout")
    exec_kill_grace = Duration(
        10.0,
        config=True,
        help="""Time past `exec_timeout` (seconds, or e.g. '30s') before a runaway kernel is
        interrupted and then killed.""",
    )
    max_exec_timeout = Duration(
        0.0,
        config=True,
        help="""Ceiling for `exec_timeout`, in seconds or e.g. '1h' (0: none). When set,
        every kernel must have a limit at or below it. Server config only.""",
    )
    output_limit = Size(
        "10m",
        config=True,
        help="""Most output (printed text, displays, errors) one execution may send to
        clients, e.g. '10m'; past it the rest is dropped and clients get one notice.
        Server config only.""",
    )
    max_cpus = Float(
        2.0, config=True, help="Ceiling for `cpus`: no kernelspec may ask for more. Server config only."
    )
    max_memory = Size(
        "4g", config=True, help="Ceiling for `memory`: no kernelspec may ask for more. Server config only."
    )
    max_pids = Int(
        1024, config=True, help="Ceiling for `pids`: no kernelspec may ask for more. Server config only."
    )
    max_tmp_size = Size(
        "1g", config=True, help="Ceiling for `tmp_size`: no kernelspec may ask for more. Server config only."
    )
    max_file_size = Size(
        "16g",
        config=True,
        help="Ceiling for `file_size`: no kernelspec may ask for more. Server config only.",
    )

    @property
    def limits(self) -> Limits:
        """What this kernel asks for (kernelspec values over the server's defaults)."""
        return Limits(
            self.cpus,
            self.memory,
            self.pids,
            self.tmp_size,
            self.exec_timeout,
            self.idle_timeout,
            self.file_size,
        )

    @validate("memory", "max_memory")
    def _validate_memory(self, proposal: dict[str, Any]) -> str:
        value: str = proposal["value"]  # a size already: a Size
        if size_bytes(proposal["trait"].name, value) < size_bytes("", SMALLEST_MEMORY):
            msg = (
                f"{proposal['trait'].name}={value!r} is too little memory for ipykernel under gVisor; "
                f"use at least {SMALLEST_MEMORY!r} (the default is '2g')."
            )
            raise TraitError(msg)
        return value

    @validate("cpus", "max_cpus")
    def _validate_cpus(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if not 0 < value <= 64:
            msg = (
                f"{proposal['trait'].name}={value!r} is out of range; use a number of cores above 0 "
                "and at most 64, e.g. 1 or 0.5."
            )
            raise TraitError(msg)
        return value

    @validate("pids", "max_pids")
    def _validate_pids(self, proposal: dict[str, Any]) -> int:
        value = int(proposal["value"])
        if value < 16:
            msg = (
                f"{proposal['trait'].name}={value!r} is too low for ipykernel to start; "
                "use at least 16 (the default is 256)."
            )
            raise TraitError(msg)
        return value

    @validate("exec_timeout", "max_exec_timeout", "exec_kill_grace", "idle_timeout", "max_idle_timeout")
    def _validate_limit_seconds(self, proposal: dict[str, Any]) -> float:
        return _at_most_a_week(proposal)


class EgressSettings(HasTraits):
    """The kernel's network: none, or HTTP(S) to allowed domains through the host's egress
    proxy, with the credentials it adds to requests and the approval of other domains."""

    network = CaselessStrEnum(
        ["none", "allowlist"],
        default_value="none",
        config=True,
        help="""The kernel's network: `none` (loopback only), or `allowlist`: HTTP and HTTPS to
        `allowed_domains` only, through a proxy on the host (HTTP_PROXY/HTTPS_PROXY inside).
        Either way the sandbox has no network interface.""",
    ).tag(kernelspec=True)
    allowed_domains = List(
        Unicode(),
        default_value=[],
        config=True,
        help="""With network `allowlist`: the domains the kernel may reach, as exact names
        (`docs.python.org`) or wildcards (`*.python.org`, any subdomain), each with an optional
        port (`api.example.com:8443`; without one, 80 and 443). Each must lie within
        `max_allowed_domains`.""",
    ).tag(kernelspec=True, ceiling="max_allowed_domains", bound="domains", flag="allow-domain")
    max_allowed_domains = List(
        Unicode(),
        default_value=[],
        config=True,
        help="""Ceiling for `allowed_domains`: every domain a kernel may be allowed must be covered
        by one of these patterns. Empty (the default): no kernel gets any network. Server config only.""",
    )
    egress_host_map = Dict(
        value_trait=Unicode(),
        key_trait=Unicode(),
        default_value={},
        config=True,
        help="""Host names the egress proxy resolves to a fixed IP address instead of asking DNS
        (like curl --resolve), e.g. {"pypi.internal": "10.0.0.5"}. Server config only.""",
    )
    egress_private_networks = List(
        Unicode(),
        default_value=[],
        config=True,
        help="""Non-public networks (CIDRs) the egress proxy may connect to, e.g. an internal
        package mirror's ["10.0.0.5/32"]. Otherwise an allowed name that resolves to a private,
        loopback, link-local (cloud metadata) or reserved address is denied. Server config only.""",
    )
    credentials = Credentials(
        config=True,
        help="""Credentials the egress proxy adds to a kernel's requests to their domains, so
        that the kernel never holds them. In the server's config, their definitions:
        {"warehouse": {"domains": ["api.example.com"], "headers": {"Authorization":
        "Bearer {env:WAREHOUSE_TOKEN}"}, "ttl": 3600}}, values read on the host from the
        server's environment ({env:NAME}) or a file ({file:/path}), ttl in seconds (0: none).
        In a kernelspec, the names of those its kernels get (["warehouse"]), within
        `max_credentials`. Needs network `allowlist` with the credential's domains allowed.""",
    ).tag(kernelspec=True, ceiling="max_credentials", bound="credentials", flag="credential")
    approval = CaselessStrEnum(
        ["off", "egress"],
        default_value="off",
        config=True,
        help="""With network `allowlist`: `egress` has a request to a domain outside
        `allowed_domains` (but within the server's `max_allowed_domains`) wait while the
        kernel's holder is asked: a program's `km.provisioner.approval_handler`, else the
        client running the cell, through a stdin prompt (JupyterLab shows it). The answer is
        once, kernel (this domain from now on) or deny; no answer within `approval_timeout`,
        or a client that cannot answer prompts, is deny. `off`: such requests are denied.""",
    ).tag(kernelspec=True)
    approval_timeout = Duration(
        60.0,
        config=True,
        help="Seconds (or e.g. '2m') a request waits for approval before it is denied.",
    ).tag(kernelspec=True)
    withheld_domains = List(
        Unicode(),
        default_value=[],
        help="""The kernelspec's allowed domains that this kernel's start took out (set by
        plan.narrow_settings, not configurable): denied, never asked about with approval
        `egress`.""",
    )
    max_credentials = List(
        Unicode(),
        default_value=[],
        config=True,
        help="""Ceiling for a kernelspec's `credentials`: the names of the server's credentials
        a kernelspec may ask for. Empty (the default): none. Server config only.""",
    )
    egress_ca_bundle = Unicode(
        None,
        allow_none=True,
        config=True,
        help="""CA certificates (a PEM file) the egress proxy verifies a host with when it adds
        a credential to a request for it; unset: the system's. Server config only.""",
    )

    @validate("egress_private_networks")
    def _validate_networks(self, proposal: dict[str, Any]) -> list[str]:
        networks: list[str] = list(proposal["value"])
        for network in networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                msg = f"egress_private_networks: {network!r} is not a network; use CIDR, e.g. '10.0.0.5/32'."
                raise TraitError(msg) from None
        return networks

    @validate("egress_host_map")
    def _validate_host_map(self, proposal: dict[str, Any]) -> dict[str, str]:
        host_map: dict[str, str] = dict(proposal["value"])
        for name, address in host_map.items():
            try:
                ipaddress.ip_address(address)
            except ValueError:
                msg = f"egress_host_map: {name!r} maps to {address!r}, which is not an IP address."
                raise TraitError(msg) from None
        return host_map

    @validate("approval_timeout")
    def _validate_approval_wait(self, proposal: dict[str, Any]) -> float:
        return _a_wait(proposal)

    def egress_policy(self) -> EgressPolicy | None:
        """The kernel's egress policy (None: no network), checked against the ceiling.

        Raises:
            ConfigurationError: as :meth:`egress_rules` and :meth:`check_domains`.
        """
        rules = self.egress_rules()
        if rules is None:
            return None
        self.check_domains(rules)
        return EgressPolicy(
            rules=rules,
            host_map=dict(self.egress_host_map),
            private_networks=tuple(self.egress_private_networks),
            upstream_cafile=self.egress_ca_bundle or None,
            approval=self.approval,
            approval_timeout=self.approval_timeout,
            approvable=EgressRules.parse(self.max_allowed_domains, "max_allowed_domains")
            if self.approval == "egress"
            else EgressRules(),
            withheld=EgressRules.parse(self.withheld_domains, "allowed_domains"),
        )

    def egress_rules(self) -> EgressRules | None:
        """The domains this kernel asks for (None: no network), consistent in themselves.

        Raises:
            ConfigurationError: a malformed domain, an allow-list without domains, or
                domains with network "none".
        """
        if self.network == "none":
            if self.allowed_domains:
                msg = (
                    f"allowed_domains={list(self.allowed_domains)!r} is set but network is 'none', so it "
                    "would be ignored. Set network to 'allowlist' to use it, or remove allowed_domains."
                )
                raise ConfigurationError(msg)
            return None
        rules = EgressRules.parse(self.allowed_domains, "allowed_domains")
        if not rules.patterns:
            msg = (
                "network='allowlist' needs allowed_domains, the domains the kernel may reach, e.g. "
                '["docs.python.org", "*.pythonhosted.org"]. Add them, or use network \'none\'.'
            )
            raise ConfigurationError(msg)
        return rules

    def check_domains(
        self,
        rules: EgressRules,
        setting: str = "SandboxProvisioner.max_allowed_domains",
        whose: str = "the server's",
    ) -> None:
        """Refuse domains beyond this server's ``max_allowed_domains`` (``setting``, the
        ceiling of ``whose``: a gateway's user's, when it is theirs).

        Raises:
            ConfigurationError: naming the domains and the ceiling.
        """
        ceiling = EgressRules.parse(self.max_allowed_domains, "max_allowed_domains")
        beyond = rules.uncovered_by(ceiling)
        if beyond:
            msg = (
                f"allowed_domains {beyond!r} exceed {whose} ceiling "
                f"({setting}={list(ceiling.patterns)!r}). Ask only for "
                "domains within it, or have the server's administrator widen it."
            )
            raise ConfigurationError(msg)


class WorkspaceSettings(HasTraits):
    """What the kernel sees of the host: its workspace (a folder, or a volume), the uid it
    runs as, and the server's environment variables it gets."""

    WORKSPACE_ROOT_ENV = "SANDBOX_KERNEL_WORKSPACE_ROOT"

    workspace_root = Unicode(
        None,
        allow_none=True,
        config=True,
        help=f"""Host folder mounted read-write at {CONTAINER_WORKSPACE}. The kernel's working
        directory is the notebook's folder mapped into it; a notebook outside it is refused.
        When unset, `workspace_scope` chooses. Default: ${WORKSPACE_ROOT_ENV}, else unset.
        A kernelspec may set one only within `allowed_workspace_roots`.""",
    ).tag(kernelspec=True, ceiling="allowed_workspace_roots", bound="roots")
    workspace_scope = CaselessStrEnum(
        ["server_root", "start_folder"],
        default_value="server_root",
        config=True,
        help=f"""What the workspace is when `workspace_root` is unset. "server_root" (default):
        under a Jupyter server, its root folder (what the file browser shows), mounted at
        {CONTAINER_WORKSPACE} with the notebook's folder as the working folder, so that
        `../data/x.csv` beside `notebooks/` is there; when the root is a home or system
        folder, the folder in it that holds the notebook. Only folders of the notebook
        folder's owner (and of the server's user, unless it is root) are mounted, none
        reached through another user's link: elsewhere the notebook's folder alone is.
        Without a server (a KernelManager, the session API) the folder the kernel is
        started in is the workspace. "start_folder": always that folder alone.
        Server config only.""",
    )
    allowed_workspace_roots = List(
        Unicode(),
        default_value=[],
        config=True,
        help="""Ceiling for a kernelspec's `workspace_root`: folders it may name, or name a
        folder within. Default: none, so only the server's config (or
        $SANDBOX_KERNEL_WORKSPACE_ROOT) chooses a root: users can write kernelspecs, and a
        root above the notebook's folder would show the kernel the projects beside it.
        Server config only.""",
    )
    pass_env = List(
        Unicode(),
        default_value=["LANG", "LC_ALL", "TZ"],
        config=True,
        help="""Names of environment variables passed from the server into the sandbox.
        Nothing else of the server's environment enters it (variables the kernelspec's
        own `env` sets are passed too). JPY_PARENT_PID is never passed.""",
    ).tag(kernelspec=True, ceiling="max_pass_env", bound="names")
    max_pass_env = List(
        Unicode(),
        default_value=["LANG", "LC_ALL", "TZ"],
        config=True,
        help="""Ceiling for a kernelspec's `pass_env`: the only server environment variables a
        kernelspec may pass into the sandbox. Server config only (the server's own `pass_env`
        is not bounded by it).""",
    )
    workspace_volume = Unicode(
        None,
        allow_none=True,
        config=True,
        help="""A named Docker volume to mount as the workspace instead of a host folder,
        created on first use: a template with {user}, {kernelspec}, {notebook} (the
        notebook's path) and {project} (its folder's name), e.g. 'team-{project}' (one per
        project, shared by the team) or '{user}-{notebook}' (one per person and notebook).""",
    ).tag(kernelspec=True)
    kernel_uid = Int(
        None,
        allow_none=True,
        config=True,
        help="""Numeric uid (and gid) the kernel runs as. Unset: the server's uid when that
        is not root, else the workspace owner's uid when that is not root, else 65533 (a uid
        Debian reserves and never gives to an account, so no host user owns what the kernel writes).
        Never 0. Only a server running as root may choose a uid other than its own.""",
    )

    @default("workspace_root")
    def _workspace_root_default(self) -> str | None:
        return os.environ.get(self.WORKSPACE_ROOT_ENV) or None

    @validate("kernel_uid")
    def _validate_kernel_uid(self, proposal: dict[str, Any]) -> int | None:
        value: int | None = proposal["value"]
        if value is not None and value <= 0:
            msg = (
                f"kernel_uid={value!r} is not allowed: the kernel never runs as root; "
                "use a non-root uid, e.g. the uid that should own its files."
            )
            raise TraitError(msg)
        return value


class LifecycleSettings(HasTraits):
    """How long a kernel's sandbox lives: ephemeral or persistent, paused to disk when idle,
    started ahead of its kernel in a warm pool."""

    pause_after = Duration(
        0.0,
        config=True,
        help="""Time without any execution after which the kernel is paused: its whole
        sandbox, memory included, is saved to disk and stopped (in seconds or e.g. '30m';
        0: never). The next message from any client resumes it and is then delivered; the
        variables are all there. Needs Docker's experimental mode (see docs/administrators/pausing.md).""",
    ).tag(kernelspec=True, ceiling="max_pause_after", bound="timeout")
    lifecycle = CaselessStrEnum(
        ["ephemeral", "persistent"],
        default_value="ephemeral",
        config=True,
        help="""`ephemeral`: the container goes away with the kernel, and with its server.
        `persistent`: it keeps running when the server stops (even when killed) until
        someone shuts the kernel down or `persistent_ttl` runs out; a server using
        sandbox_kernel.jupyter.server.SandboxMappingKernelManager adopts it again.""",
    ).tag(kernelspec=True)
    persistent_ttl = Duration(
        0.0,
        config=True,
        help="""A persistent kernel that no server has held for this long (seconds, or e.g.
        '12h' or '7d') is removed (by the next server start or `jupyter sandbox-kernel
        prune`); 0: never.""",
    ).tag(kernelspec=True, ceiling="max_persistent_ttl", bound="lifetime")
    max_persistent_ttl = Duration(
        0.0,
        config=True,
        help="""Ceiling for `persistent_ttl`, in seconds or e.g. '7d' (0: none). When set,
        every persistent kernel must have a time-to-live at or below it. Server config only.""",
    )
    max_pause_after = Duration(
        0.0,
        config=True,
        help="""Ceiling for `pause_after`, in seconds or e.g. '1h' (0: none). When set,
        every kernel must pause at or below it when idle. Server config only.""",
    )
    freeze_idle_after = Duration(
        30.0,
        config=True,
        help="""Time without any execution, client message or computing (threads of the
        kernel's code at work) after which the kernel's sandbox is frozen, in seconds or
        e.g. '2m' (0: never; at least 1 s). A frozen sandbox uses no CPU and keeps its
        memory; the host answers heartbeats meanwhile, and any client's request thaws it
        within milliseconds and is then delivered. What mostly waits (a thread printing
        now and then, timers, a process started in the background) stops meanwhile (see
        docs/administrators/idle-cost.md).""",
    ).tag(kernelspec=True, ceiling="max_freeze_idle_after", bound="timeout")
    max_freeze_idle_after = Duration(
        0.0,
        config=True,
        help="""Ceiling for `freeze_idle_after`, in seconds or e.g. '5m' (0: none). When set,
        every kernel must freeze at or below it when idle. Server config only.""",
    )
    checkpoint_budget = Size(
        "32g",
        config=True,
        help="""Disk that the images of paused kernels may take on this Docker host, all
        together, e.g. '32g'. A pause that could exceed it (the kernel's memory in use is
        the bound) is refused with an error, and the kernel keeps running. Server config only.""",
    )
    pool_size = Int(
        0,
        config=True,
        help="""Sandboxes of this kernelspec kept started and waiting (kernel imported,
        channels open, no workspace yet), so that a new kernel is ready in about 0.1 s
        instead of seconds: the workspace is attached when one is claimed (the kernel
        sees it at /workspace/<folder name>), and each sandbox serves one kernel only.
        0: every kernel starts cold. Needs a server running as root (attaching the
        workspace is a mount); at most `max_pool_size`.""",
    ).tag(kernelspec=True, ceiling="max_pool_size", bound="amount")
    max_pool_size = Int(
        4, config=True, help="Ceiling for `pool_size`: no kernelspec may ask for more. Server config only."
    )
    max_pool_memory = Size(
        "8g",
        config=True,
        help="""Most memory (the sum of their memory limits) that waiting pooled sandboxes of
        all kernelspecs may reserve in this process; a pool stops filling at it.
        Server config only.""",
    )

    @validate("pool_size", "max_pool_size")
    def _validate_pool_size(self, proposal: dict[str, Any]) -> int:
        value = int(proposal["value"])
        if not 0 <= value <= 64:
            msg = f"{proposal['trait'].name}={value!r} is out of range; use 0 (no pool) to 64."
            raise TraitError(msg)
        return value

    @validate("pause_after", "max_pause_after", "persistent_ttl", "max_persistent_ttl")
    def _validate_lifetime_seconds(self, proposal: dict[str, Any]) -> float:
        return _at_most_a_week(proposal)

    @validate("freeze_idle_after", "max_freeze_idle_after")
    def _validate_freeze_seconds(self, proposal: dict[str, Any]) -> float:
        value = _at_most_a_week(proposal)
        if 0 < value < 1:
            msg = (
                f"{proposal['trait'].name}={value!r} is too short: a kernel would freeze between "
                "the messages of one conversation. Use at least 1 second, or 0 for never."
            )
            raise TraitError(msg)
        return value


class SandboxSettings(
    LimitSettings, EgressSettings, WorkspaceSettings, LifecycleSettings, LoggingConfigurable
):
    """What a sandboxed kernel may use, and how it runs; see docs/administrators/configuration.md.

    Every duration (a :class:`Duration`) takes seconds or a string such as ``"5m"``, and
    reads back as float seconds; every size (a :class:`Size`) takes bytes or a string
    such as ``"1.5g"``, and reads back as written (lowercased).
    """

    IMAGE_ENV = "SANDBOX_KERNEL_IMAGE"
    RUNTIME_ENV = "SANDBOX_KERNEL_RUNTIME"
    AUDIT_LOG_ENV = "SANDBOX_KERNEL_AUDIT_LOG"

    image = Unicode(
        config=True,
        help=f"""Docker image the kernel runs in. It must already exist on the Docker host:
        images are never pulled. Build the default with `jupyter sandbox-kernel build-image`.
        Default: ${IMAGE_ENV}, else {DEFAULT_IMAGE}. A kernelspec may name only images
        `allowed_images` matches.""",
    ).tag(kernelspec=True, ceiling="allowed_images", bound="images")
    allowed_images = List(
        Unicode(),
        config=True,
        help=f"""Ceiling for a kernelspec's `image`: the images a kernelspec may name, as names
        or wildcards (`sandbox-kernel/*`, `registry.example/team/*:2`). Users can write
        kernelspecs, and every local image would otherwise be theirs to run (its entrypoint is
        never run either way). Server config only; the server's own `image` is not bounded by
        it. Default: `sandbox-kernel/*`, and ${IMAGE_ENV} when set.""",
    )
    docker_runtime = Unicode(
        config=True,
        help=f"""Name of the Docker runtime that runs gVisor's runsc with --network=none and
        --host-uds=create --oci-seccomp. Starting a kernel fails if it is missing or is not runsc.
        Default: ${RUNTIME_ENV}, else {DEFAULT_RUNTIME}.""",
    )
    subshells = Bool(
        True,
        config=True,
        help="""Whether the kernel offers subshells (ipykernel 7, JEP 91): JupyterLab 4.4 and
        later send widgets' messages on them, so a slider's callback runs while a cell is
        still running. The kernel's main thread reads the shell channel itself until a
        client asks for a subshell; from then on ipykernel reads every shell request in a
        thread of its own and hands it to the main thread, which under gVisor lengthens
        each round trip by 1.4 to 2 ms (15 % of a sandboxed `1+1`,
        bench/kernel_choices.py). False: no subshells, the main thread reads the shell
        channel for good (as in ipykernel 6), and widgets' messages wait for the running
        cell. Only for kernelspecs that run sandbox-kernel's launcher.""",
    ).tag(kernelspec=True)
    safe_output = Bool(
        True,
        config=True,
        help="""Clean what the kernel shows before any client sees it, so that a browser
        rendering it runs none of the kernel's code: HTML without scripts or event
        handlers, no JavaScript or other code-running output types, no HTML in widgets
        (see sandbox_kernel/sanitize.py). JupyterLab runs script in output it trusts, and
        it trusts the output of its own session: turn this off only where everyone who
        sees a kernel's output could run code as the server's user anyway. Server config
        only.""",
    )
    client_transport = CaselessStrEnum(
        ["ipc", "tcp"],
        default_value="ipc",
        config=True,
        help="""How clients reach a sandboxed kernel's channels. "ipc" (default): unix sockets
        in the server's private runtime folder (mode 0700), so no other local user can
        connect to the kernel or read its output; jupyter_server, JupyterLab, nbclient and
        papermill use them as they are. "tcp": ports on 127.0.0.1, for clients that need
        TCP; any local user can then connect (messages without the session key's signature
        are dropped, but output can be read): use it with CurveZMQ transport encryption
        (the client asks with KernelManager(transport_encryption="required")). Server
        config only.""",
    )
    backend_class = Type(
        default_value="sandbox_kernel.backends.docker.DockerBackend",
        klass="sandbox_kernel.backends.base.SandboxBackend",
        config=True,
        help="""What runs the sandboxes: a sandbox_kernel.backend.SandboxBackend. The default
        runs Docker containers under gVisor (docker_runtime). Server config only.""",
    )
    startup_timeout = Duration(
        60.0,
        config=True,
        help="Time to wait for the kernel in a new container to open its channels (seconds, or e.g. '2m').",
    )
    audit_log = Unicode(
        config=True,
        help=f"""JSON-lines file on the host recording every request that makes a sandboxed
        kernel run code, and the requests the bridge refuses (time, kernel id, kernelspec,
        the client's claimed user name beside the host-known client and server uids,
        session, code bounded with its sha256, user_expressions, status, duration), and
        its egress decisions. It must lie outside every workspace. Empty string: no audit
        log. Kernels read it from the server's config files whatever starts them.
        Default: ${AUDIT_LOG_ENV}, else JUPYTER_DATA_DIR/sandbox-kernel/audit.jsonl.""",
    )
    audit_log_max_bytes = Int(
        50 * 1024 * 1024,
        config=True,
        help="Rotate the audit log when it reaches this size (bytes, at least 1).",
    )
    audit_log_backups = Int(
        10, config=True, help="Rotated audit log files to keep (audit.jsonl.1, ...; at least 1)."
    )
    runtime_parent = Unicode(
        config=True,
        help="""Host folder under which each kernel gets a private runtime folder (its
        connection file and ipc sockets). Keep the path short: unix socket paths are
        limited to about 100 characters. Default: the system temp folder.""",
    )

    @default("image")
    def _image_default(self) -> str:
        return os.environ.get(self.IMAGE_ENV) or DEFAULT_IMAGE

    @default("allowed_images")
    def _allowed_images_default(self) -> list[str]:
        image = os.environ.get(self.IMAGE_ENV)
        return ["sandbox-kernel/*", *([image] if image else [])]

    @default("docker_runtime")
    def _docker_runtime_default(self) -> str:
        return os.environ.get(self.RUNTIME_ENV) or DEFAULT_RUNTIME

    @default("audit_log")
    def _audit_log_default(self) -> str:
        env = os.environ.get(self.AUDIT_LOG_ENV)
        if env is not None:
            return env
        return os.path.join(jupyter_data_dir(), "sandbox-kernel", "audit.jsonl")

    @default("runtime_parent")
    def _runtime_parent_default(self) -> str:
        return tempfile.gettempdir()

    @validate("startup_timeout")
    def _validate_startup_wait(self, proposal: dict[str, Any]) -> float:
        return _a_wait(proposal)

    @validate("audit_log_max_bytes", "audit_log_backups")
    def _validate_audit_rotation(self, proposal: dict[str, Any]) -> int:
        # Python's RotatingFileHandler never rotates when either is 0: the log would grow
        # without bound, the opposite of what the setting is for.
        value = int(proposal["value"])
        if value < 1:
            msg = (
                f"{proposal['trait'].name}={value!r} would stop the audit log from rotating, so it "
                "would grow without bound; use 1 or more (to keep no audit log, set audit_log to '')."
            )
            raise TraitError(msg)
        return value

    def credential_catalog(self) -> dict[str, CredentialSpec]:
        """The credentials the server's config defines (a kernelspec only names them).

        Raises:
            ConfigurationError: a definition is malformed.
        """
        defined = self.credentials if isinstance(self.credentials, dict) else None
        if defined is None:  # the kernelspec's names took the trait: the server's own config
            defined = self._find_my_config(self.config).get("credentials") or {}
        return parse_definitions(defined) if isinstance(defined, dict) else {}

    def credential_specs(self, egress: EgressPolicy | None) -> tuple[CredentialSpec, ...]:
        """The credentials this kernel gets: those its kernelspec (or start) names, each
        for domains the kernel may reach.

        Raises:
            ConfigurationError: a name the server does not define, a kernel without
                network, or a credential for domains outside its allowed_domains.
        """
        names = list(self.credentials) if isinstance(self.credentials, list) else []
        if not names:
            return ()
        catalog = self.credential_catalog()
        unknown = [name for name in names if name not in catalog]
        if unknown:
            msg = (
                f"credentials={names!r} names {unknown}, which the server does not define "
                f"(SandboxProvisioner.credentials defines {sorted(catalog)}). Ask the administrator."
            )
            raise ConfigurationError(msg)
        if egress is None:
            msg = (
                f"credentials={names!r} needs network 'allowlist': the egress proxy adds them to "
                "requests, and a kernel without network makes none."
            )
            raise ConfigurationError(msg)
        specs = tuple(catalog[name] for name in names)
        for spec in specs:
            outside = spec.rules.uncovered_by(egress.rules)
            if outside:
                msg = (
                    f"Credential {spec.name!r} is for {outside}, which this kernel may not reach "
                    f"(allowed_domains={list(egress.rules.patterns)!r}): a credential never widens "
                    "egress. Allow those domains in the kernelspec, or drop the credential."
                )
                raise ConfigurationError(msg)
        return specs


def kernelspec_keys() -> frozenset[str]:
    """The settings a kernelspec may choose (tagged ``kernelspec=True``)."""
    return frozenset(SandboxSettings.class_trait_names(kernelspec=True))


def ceiling_names() -> frozenset[str]:
    """The administrator's ceilings (``max_memory``, ``allowed_images``...): the traits a
    setting names as its ``ceiling``."""
    traits = SandboxSettings.class_traits(ceiling=lambda name: name is not None).values()
    return frozenset(trait.metadata["ceiling"] for trait in traits)
