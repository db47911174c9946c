"""``jupyter sandbox-kernel``: install the kernelspecs, build the images, check the host, run
notebooks, serve kernels to an AI assistant over MCP."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.application import JupyterApp, base_aliases, base_flags
from jupyter_core.paths import SYSTEM_JUPYTER_PATH
from jupyter_core.utils import ensure_async, run_sync
from traitlets import Bool, CaselessStrEnum, Float, Int, List, TraitError, TraitType, Unicode, default
from traitlets.config import Application
from traitlets.config.loader import ArgumentError, KVArgParseConfigLoader
from traitlets.utils.importstring import import_item

from sandbox_kernel._version import __version__
from sandbox_kernel.agents.workspaces import sweep_abandoned_workspaces
from sandbox_kernel.backends import configured_backend, gvisor_checkpoint
from sandbox_kernel.backends.base import SandboxBackend
from sandbox_kernel.backends.docker import DockerBackend, ImageStore
from sandbox_kernel.cli.resources import data_path
from sandbox_kernel.errors import (
    ConfigurationError,
    DockerUnavailableError,
    ImageBuildError,
    SandboxKernelError,
)
from sandbox_kernel.lifecycle.ownership import SandboxedKernel, list_kernels, prune_orphans, remove_kernel
from sandbox_kernel.plan.admission import CONFIG_FILE_NAME, require_sandboxed, sandboxed_manager
from sandbox_kernel.plan.plan import ceiling_violations, validate_kernelspec_config, volume_name
from sandbox_kernel.plan.sandbox_spec import launcher_argv
from sandbox_kernel.plan.settings import (
    DATASCIENCE_IMAGE,
    DEFAULT_IMAGE,
    DEFAULT_RUNTIME,
    Credentials,
    Duration,
    SandboxSettings,
    kernelspec_keys,
)
from sandbox_kernel.provisioner import SandboxProvisioner
from sandbox_kernel.reattach import pause_kernel

if TYPE_CHECKING:
    from sandbox_kernel.agents.gateway_settings import GatewaySettings

T = TypeVar("T")
A = TypeVar("A", bound=JupyterApp)

KERNEL_NAME = "sandboxed-python"
RECIPE_LABEL = "io.sandbox-kernel.recipe"
DEBIAN_BASE = "sandbox-kernel-base:bookworm"
#: What jupyter_client accepts as a kernel name (the kernelspec's folder).
KERNEL_NAME_RE = re.compile(r"^[a-z0-9_-][a-z0-9._-]*$", re.IGNORECASE)


@dataclass(frozen=True)
class Recipe:
    """One image recipe shipped under images/, and the kernelspec that runs its image."""

    folder: str
    """The build context, relative to images/ ("" is images/ itself); it holds the Dockerfile."""
    tag: str
    kernelspec: str
    builds_on: str | None = None
    """The recipe whose image is this one's base (build argument BASE), if any."""


RECIPES = {
    "python": Recipe("", DEFAULT_IMAGE, KERNEL_NAME),
    "datascience": Recipe("datascience", DATASCIENCE_IMAGE, "sandboxed-python-datascience", "python"),
}


class _StrictLoader(KVArgParseConfigLoader):
    """A subcommand's command line, where an unknown option is an error: traitlets only
    warns that it "will have no effect", and the command would run without it."""

    def _create_parser(self) -> None:
        super()._create_parser()
        # argparse would print its whole usage and exit 2; the app prints one line instead.
        self.parser.error = _raise_argument_error  # type: ignore[method-assign]

    def _parse_args(self, args: Any) -> Any:
        known = {
            name
            for key in (*self.aliases, *self.flags)
            for name in (key if isinstance(key, tuple) else (key,))
        }
        for arg in args:
            if arg == "--":
                break
            name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
            # --Class.trait=value is traitlets' own way to set any setting.
            if name and "." not in name and name not in known:
                msg = f"unknown option --{name}"
                raise ArgumentError(msg)
        return super()._parse_args(args)


def _raise_argument_error(message: str) -> NoReturn:
    raise ArgumentError(message)


#: traitlets' own command-line parsing, without the decorator that turns a bad value into
#: a CRITICAL log line: a subcommand reports it as a user error instead (see ``_SubApp``).
_parse_command_line = inspect.unwrap(Application.parse_command_line)


class _SubApp(JupyterApp):
    version = __version__
    #: Whether the subcommand takes positional arguments (``run NOTEBOOK``, ``stop ID``);
    #: if not, one given is an error rather than ignored.
    takes_arguments: ClassVar[bool] = False

    def fail(self, message: str) -> None:
        """Print a user error to stderr and exit non-zero."""
        print(f"error: {message}", file=sys.stderr)
        self.exit(1)

    def _create_loader(
        self,
        argv: list[str] | None,
        aliases: dict[str, Any],
        flags: dict[str, Any],
        classes: Any,
    ) -> KVArgParseConfigLoader:
        return _StrictLoader(argv, aliases, flags, classes=classes, log=self.log, exit_on_error=False)

    def parse_command_line(self, argv: Any = None) -> None:
        """Parse the command line; an unknown option, a bad value or an unexpected argument
        is a one-line error on stderr and exit status 1.

        Raises:
            SystemExit: for any of those.
        """
        try:
            _parse_command_line(self, argv)
        except (ArgumentError, argparse.ArgumentError, TraitError) as exc:  # argparse's: exit_on_error
            message = str(exc).rstrip(".")
            for option, target in self.aliases.items():  # in the words the user typed
                message = message.replace(f"argument --{target}:", f"argument --{option}:")
            if message.endswith("expected one argument"):
                message += " (for a value that starts with '-', write --option=value)"
            self.fail(f"{message}; see `{self._command()} --help`")
        section = type(self).__name__
        if self.cli_config._has_section(section):
            known = set(self.class_trait_names(config=True))
            unknown = sorted(set(self.cli_config[section]) - known)
            if unknown:
                self.fail(f"{section} has no option {', '.join(unknown)}; see `{self._command()} --help-all`")
        if self.extra_args and not self.takes_arguments:
            self.fail(
                f"unexpected argument {' '.join(self.extra_args)!r}: `{self._command()}` takes options "
                f"only; see `{self._command()} --help`"
            )

    def _command(self) -> str:
        """How the user typed this subcommand: ``jupyter sandbox-kernel install``."""
        return self.name.replace("jupyter-", "jupyter ", 1).replace("-kernel-", "-kernel ", 1)


def _kernelspec_flag(trait: TraitType[Any, Any]) -> TraitType[Any, Any]:
    """``install``'s flag for a kernelspec setting: unset (the server's) unless given.

    Its default only stands in for "not given" (``install`` writes what was given, see
    ``_InstallBase.given``), so ``--pids 0`` is checked like any value, never dropped.
    """
    help_text = f"{trait.help} Unset: the server's."
    if isinstance(trait, List | Credentials):  # a kernelspec names credentials
        return List(Unicode(), config=True, help=help_text + " Repeat for several.")
    if isinstance(trait, Duration):
        return Duration(0, config=True, help=help_text)
    if isinstance(trait, Float):
        return Float(0, config=True, help=help_text)
    if isinstance(trait, Int):
        return Int(0, config=True, help=help_text)
    if isinstance(trait, Bool):
        return Bool(trait.default_value, config=True, help=help_text)
    return Unicode("", config=True, help=help_text)


def _flag_name(key: str) -> str:
    """The ``install`` option of kernelspec setting ``key``: ``--memory``, ``--allow-domain``."""
    return str(SandboxSettings.class_traits()[key].metadata.get("flag", key.replace("_", "-")))


def with_kernelspec_flags(cls: type[A], name: str) -> type[A]:
    """``cls``, as the app ``name``, with a flag for each setting a kernelspec may choose,
    from the settings' own declarations (see :mod:`~.settings`): adding a kernelspec key
    adds its flag."""
    traits = SandboxSettings.class_traits(kernelspec=True)
    aliases = {_flag_name(key): f"{name}.{key}" for key in traits}
    namespace: dict[str, Any] = {key: _kernelspec_flag(trait) for key, trait in traits.items()}
    namespace.update(__doc__=cls.__doc__, __module__=cls.__module__, aliases={**cls.aliases, **aliases})
    return type(name, (cls,), namespace)


class _WarningsOnly(logging.LoggerAdapter):  # type: ignore[type-arg]  # generic at run time from 3.11
    """``logger``'s warnings and errors, without its info and debug lines."""

    def isEnabledFor(self, level: int) -> bool:
        return level >= logging.WARNING and super().isEnabledFor(level)


class _InstallBase(_SubApp):
    """Install the Sandboxed Python kernelspec, or the data-science one."""

    name = "jupyter-sandbox-kernel-install"
    description = """Install the "Sandboxed Python" kernelspec, so that Jupyter offers it and
    `KernelManager(kernel_name="sandboxed-python")` starts kernels inside gVisor. With
    --recipe datascience it installs "Sandboxed Python (data science)", kernel name
    sandboxed-python-datascience, whose kernels run the image that
    `jupyter sandbox-kernel build-image --recipe datascience` builds.
    By default it installs system-wide (for all users, e.g. /usr/local/share/jupyter);
    use --user, --sys-prefix or --prefix to choose another place. Limits and the network
    given here are validated and written into the spec; one beyond the server's ceilings
    (as jupyter_server_config sets them) gets a warning: such kernels start only where
    the server allows them. Durations take seconds or a unit (90s, 5m, 1.5h, 7d) and are
    written in seconds; sizes take bytes or k, m, g (512m, 1.5g). An unknown option or a
    bad value is an error, and nothing is written."""
    examples = inspect.cleandoc(
        """
    jupyter sandbox-kernel install --sys-prefix
    jupyter sandbox-kernel install --sys-prefix --recipe datascience
    jupyter sandbox-kernel install --user --name py-sandbox --display-name "Python (sandbox)"
    jupyter sandbox-kernel install --image registry.example/sandbox-python:2 --replace
    jupyter sandbox-kernel install --name py-small --display-name "Python (small)" --memory 512m --cpus 0.5
    jupyter sandbox-kernel install --name py-batch --display-name "Python (batch)" --memory 1.5g \\
        --exec-timeout 5m --idle-timeout 2h
    jupyter sandbox-kernel install --name py-offline --display-name "Sandboxed Python (offline)"
    jupyter sandbox-kernel install --name py-docs --display-name "Sandboxed Python (web: docs sites)" \\
        --allow-domain docs.python.org --allow-domain '*.readthedocs.io'
    jupyter sandbox-kernel install --name py-team --display-name "Sandboxed Python (team, lasting)" \\
        --lifecycle persistent --persistent-ttl 7d --workspace-volume 'team-{project}'
    """
    )

    @default("config_file_name")
    def _config_file_name_default(self) -> str:
        # The server's config holds the ceilings a new spec is checked against.
        return "jupyter_server_config"

    recipe = CaselessStrEnum(
        list(RECIPES),
        default_value="python",
        config=True,
        help=f"""Which shipped kernelspec to install: python ("Sandboxed Python", image
        {DEFAULT_IMAGE}) or datascience ("Sandboxed Python (data science)",
        image {DATASCIENCE_IMAGE}: build it with --recipe datascience).""",
    )
    kernel_name = Unicode(
        config=True,
        help="Name (folder) of the installed kernelspec (default: sandboxed-python, or "
        "sandboxed-python-datascience with --recipe datascience).",
    )
    display_name = Unicode(
        "", config=True, help="Name shown in Jupyter's launcher (default: the shipped spec's)."
    )
    user = Bool(False, config=True, help="Install for the current user only.")
    prefix = Unicode("", config=True, help="Install into PREFIX/share/jupyter/kernels.")
    replace = Bool(False, config=True, help="Replace an existing kernelspec of the same name.")
    aliases = {
        **base_aliases,
        "recipe": "InstallApp.recipe",
        "name": "InstallApp.kernel_name",
        "display-name": "InstallApp.display_name",
        "prefix": "InstallApp.prefix",
    }
    flags = {
        **base_flags,
        "user": ({"InstallApp": {"user": True}}, "Install for the current user only."),
        "sys-prefix": ({"InstallApp": {"prefix": sys.prefix}}, "Install into this Python environment."),
        "replace": ({"InstallApp": {"replace": True}}, "Replace an existing kernelspec of the same name."),
    }

    @default("kernel_name")
    def _kernel_name_default(self) -> str:
        return RECIPES[self.recipe].kernelspec

    def start(self) -> None:
        if self.user and self.prefix:
            self.fail("choose one of --user and --prefix/--sys-prefix")
        if not KERNEL_NAME_RE.match(self.kernel_name):
            self.fail(
                f"--name {self.kernel_name!r} is not a kernel name: use only ASCII letters, digits, "
                "'-', '.' and '_', not starting with '.' (it names the kernelspec's folder), "
                "e.g. --name py-small"
            )
        source = data_path("kernelspecs") / RECIPES[self.recipe].kernelspec
        spec = json.loads((source / "kernel.json").read_text())
        spec["display_name"] = self.display_name or spec["display_name"]
        # Front ends that ignore provisioners run this themselves: the sandboxed kernel,
        # started by this environment's interpreter (see sandbox_kernel.launch).
        spec["argv"] = launcher_argv(self.kernel_name)
        config = spec["metadata"]["kernel_provisioner"].setdefault("config", {})
        chosen = self.given()
        if chosen.get("allowed_domains") and "network" not in chosen:
            chosen["network"] = "allowlist"
        config.update(chosen)
        config.update(self._validate(config, chosen))
        # Its own "Installed kernelspec" line would repeat ours; its warnings stay.
        ksm = KernelSpecManager(parent=self, log=_WarningsOnly(self.log))
        dest_dir = self._destination(ksm)
        if dest_dir.exists() and not self.replace:
            self.fail(f"a kernelspec exists at {dest_dir}; add --replace to overwrite it")
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / self.kernel_name
            shutil.copytree(source, staged)
            (staged / "kernel.json").write_text(json.dumps(spec, indent=2) + "\n")
            try:
                dest = ksm.install_kernel_spec(
                    str(staged), self.kernel_name, user=self.user, prefix=self.prefix or None
                )
            except PermissionError as exc:
                self.fail(f"{exc}; install with --user, --sys-prefix, or as root")
        print(f"Installed kernelspec {self.kernel_name!r} ({spec['display_name']}) in {dest}")

    def given(self) -> dict[str, Any]:
        """The kernelspec settings given on the command line (or in config), even 0 or empty.

        Raises:
            SystemExit: an option given an empty string.
        """
        section = type(self).__name__
        if not self.config._has_section(section):
            return {}
        given = {key: getattr(self, key) for key in sorted(kernelspec_keys() & set(self.config[section]))}
        for key, value in given.items():
            if value == "":
                self.fail(f"--{_flag_name(key)} is empty; give a value, or leave it out to use the server's")
        return given

    def _validate(self, config: dict[str, Any], chosen: Mapping[str, Any]) -> dict[str, Any]:
        """Check the spec's settings as a kernel start will, so a bad spec never lands;
        the ``chosen`` ones as the spec should hold them (durations in seconds, sizes and
        names lowercased).

        Ceilings are the server's business; here only the defaults are known, so a
        value above them is a warning, not an error.

        Raises:
            SystemExit: a setting a kernel start would refuse, with the reason.
        """
        try:
            validate_kernelspec_config(config, self.kernel_name)
            provisioner = SandboxProvisioner(**config)
            provisioner.egress_rules()
            if provisioner.workspace_volume:
                volume_name(provisioner.workspace_volume)
        except (ConfigurationError, TraitError) as exc:
            self.fail(str(exc))
        normalized = {key: getattr(provisioner, key) for key in chosen}
        ceilings = SandboxProvisioner(parent=self, **config)
        for problem in ceiling_violations(ceilings, config):
            print(
                f"warning: {problem} Kernels of this spec start only where the server allows it.",
                file=sys.stderr,
            )
        return normalized

    def _destination(self, ksm: KernelSpecManager) -> Path:
        """Where install_kernel_spec will put the spec (it replaces silently)."""
        if self.user:
            base = Path(ksm.user_kernel_dir)
        elif self.prefix:
            base = Path(self.prefix) / "share" / "jupyter" / "kernels"
        else:
            base = Path(SYSTEM_JUPYTER_PATH[0]) / "kernels"
        return base / self.kernel_name.lower()


InstallApp = with_kernelspec_flags(_InstallBase, "InstallApp")


class BuildImageApp(_SubApp):
    """Build a kernel image from one of the recipes under images/."""

    name = "jupyter-sandbox-kernel-build-image"
    description = f"""Build a kernel image from a bundled recipe, showing the build's progress.

    --recipe python (the default) builds {DEFAULT_IMAGE} from images/Dockerfile:
    ipykernel, ipywidgets, numpy, pandas, matplotlib and requests, non-root user.

    --recipe datascience builds {DATASCIENCE_IMAGE} from
    images/datascience/Dockerfile, FROM the default image, sharing its layers; it adds
    scipy, scikit-learn, statsmodels, seaborn, plotly, polars, duckdb, pyarrow and
    openpyxl. The default image is built first if it is missing or was built from another
    recipe.

    The default recipe's base is a build argument. Sites with a registry use the default
    (python:3.11-slim-bookworm). Sites without one pass --debian-base: the base is then
    built from a Debian rootfs with debootstrap (as root, about a minute) unless it exists.
    Each image is labelled with a digest of its recipe (its files under images/, and for
    datascience the id of the image it builds on): --if-missing rebuilds only what changed."""
    examples = inspect.cleandoc(
        """
    jupyter sandbox-kernel build-image
    jupyter sandbox-kernel build-image --debian-base --if-missing
    jupyter sandbox-kernel build-image --recipe datascience --debian-base --if-missing
    jupyter sandbox-kernel build-image --base my-registry/python:3.12 --tag sandbox-kernel/python:3.12
    jupyter sandbox-kernel build-image --recipe datascience --base sandbox-kernel/python:3.12 \\
        --tag sandbox-kernel/python-datascience:3.12
    """
    )

    recipe = CaselessStrEnum(
        list(RECIPES),
        default_value="python",
        config=True,
        help="""What to build: python (images/Dockerfile, the default kernel image) or
        datascience (images/datascience/Dockerfile, built FROM the python image).""",
    )
    tag = Unicode(
        "",
        config=True,
        help=f"Tag of the image to build (default {DEFAULT_IMAGE}; with --recipe datascience, "
        f"{DATASCIENCE_IMAGE}).",
    )
    base = Unicode(
        "",
        config=True,
        help=f"""Base image (build argument BASE): for python, an image with python3 and
        venv; for datascience, one the python recipe built. Default for datascience:
        {DEFAULT_IMAGE}, built or brought up to date first.""",
    )
    debian_base = Bool(
        False,
        config=True,
        help=f"Build the python recipe on {DEBIAN_BASE}, building it from a Debian rootfs if it is missing.",
    )
    if_missing = Bool(
        False,
        config=True,
        help="Do nothing if the tag exists and was built from the current recipe.",
    )
    no_cache = Bool(False, config=True, help="Build without Docker's layer cache.")

    aliases = {
        **base_aliases,
        "recipe": "BuildImageApp.recipe",
        "tag": "BuildImageApp.tag",
        "base": "BuildImageApp.base",
    }
    flags = {
        **base_flags,
        "debian-base": (
            {"BuildImageApp": {"debian_base": True}},
            "Build on a local Debian rootfs base (no registry).",
        ),
        "if-missing": (
            {"BuildImageApp": {"if_missing": True}},
            "Skip if the image exists and was built from the current recipe.",
        ),
        "no-cache": ({"BuildImageApp": {"no_cache": True}}, "Do not use the layer cache."),
    }

    def start(self) -> None:
        try:
            store = ImageStore()
        except DockerUnavailableError as exc:
            self.fail(str(exc))
            return
        self._build_recipe(
            store, self.recipe, self.tag or RECIPES[self.recipe].tag, self.base, self.if_missing
        )

    def _build_recipe(self, store: ImageStore, name: str, tag: str, base: str, if_missing: bool) -> None:
        """Build recipe ``name`` as ``tag``; the image it builds on comes first."""
        images = data_path("images")
        recipe = RECIPES[name]
        base_id = ""
        if recipe.builds_on is not None:
            below = RECIPES[recipe.builds_on]
            base = base or below.tag
            if base == below.tag:
                # Built on a stale or missing base, the image would lack what that recipe adds.
                print(f"==> the {name} image builds on {base}")
                self._build_recipe(store, recipe.builds_on, base, "", if_missing=True)
            base_id = store.image_id(base) or ""
            if not base_id:
                self.fail(
                    f"the base image {base} is not on this Docker host; build it first "
                    f"(jupyter sandbox-kernel build-image --tag {base}), or choose another --base"
                )
                return
        digest = _recipe_digest(images, name, base_id)
        if if_missing:
            built_from = store.label(tag, RECIPE_LABEL)
            if built_from == digest:
                print(f"==> image {tag} already present, built from the current recipe")
                return
            if built_from is not None:
                print(f"==> image {tag} was built from another recipe; rebuilding")
        if recipe.builds_on is None and self.debian_base:
            base = base or DEBIAN_BASE
            self._ensure_debian_base(store, images, base)
        self._docker_build(store, images / recipe.folder, tag, base, digest)

    def _ensure_debian_base(self, store: ImageStore, images: Path, base: str) -> None:
        if store.image_id(base) is None:
            print(f"==> building the base image {base} from a Debian rootfs")
            script = images / "base" / "build-debian-base.sh"
            if subprocess.call(["bash", str(script), base]) != 0:  # noqa: S603, S607
                self.fail(f"building the base image {base} failed (see the output above)")

    def _docker_build(self, store: ImageStore, context: Path, tag: str, base: str, digest: str) -> None:
        """Run the build of ``context``'s Dockerfile, echoing its progress."""
        print(f"==> building {tag} from {context / 'Dockerfile'}" + (f" on {base}" if base else ""))
        try:
            for line in store.build(
                context, tag, {"BASE": base} if base else {}, {RECIPE_LABEL: digest}, nocache=self.no_cache
            ):
                sys.stdout.write(line)
                sys.stdout.flush()
        except ImageBuildError as exc:
            self.fail(f"image build failed: {exc}")
        print(f"==> built {tag}")


def _recipe_digest(images: Path, recipe: str = "python", base_id: str = "") -> str:
    """A digest of ``recipe``, stored as a label on its image.

    It covers the files of the recipe's folder under ``images`` but not those of another
    recipe's folder inside it (a change to images/datascience/ leaves the python recipe's
    digest alone), and ``base_id``: the id of the image it builds on, if it builds on one.
    """
    folder = images / RECIPES[recipe].folder
    others = [images / other.folder for name, other in RECIPES.items() if name != recipe]
    nested = [other for other in others if other != folder and other.is_relative_to(folder)]
    files = [p for p in folder.rglob("*") if p.is_file() and not any(p.is_relative_to(o) for o in nested)]
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    if base_id:
        digest.update(b"FROM\0" + base_id.encode())
    return digest.hexdigest()[:16]


class CheckApp(_SubApp):
    """Check that this host can run sandboxed kernels."""

    name = "jupyter-sandbox-kernel-check"
    description = """Check that Docker is reachable, the gVisor runtime is registered with the
    flags the bridge needs, the kernel image exists and the kernelspec is installed.
    Exits non-zero, with the fix, if anything is missing. Where kernels can pause, it
    also says whether paused kernels of the image resume safely on this host's runsc
    (it runs the image's Python once, in a throwaway sandbox)."""

    image = Unicode(DEFAULT_IMAGE, config=True, help="Image to look for.")
    runtime = Unicode(DEFAULT_RUNTIME, config=True, help="Docker runtime to look for.")
    aliases = {**base_aliases, "image": "CheckApp.image", "runtime": "CheckApp.runtime"}

    def start(self) -> None:
        failures = asyncio.run(self._check())
        ksm = KernelSpecManager(parent=self)
        try:
            ksm.get_kernel_spec(KERNEL_NAME)
            print(f"ok    kernelspec {KERNEL_NAME!r} installed")
        except NoSuchKernel:
            failures += 1
            print(f"FAIL  kernelspec {KERNEL_NAME!r} is not installed: run `jupyter sandbox-kernel install`")
        if failures:
            self.exit(1)
        if warning := docker_access_warning():
            print(f"note  {warning}")
        print("This host is ready to run sandboxed kernels.")

    async def _check(self) -> int:
        docker_backend = DockerBackend()
        checks = [
            ("Docker daemon reachable", docker_backend.client()),
            (f"gVisor runtime {self.runtime!r} registered", docker_backend.check_runtime(self.runtime)),
            (f"kernel image {self.image!r} present", docker_backend.check_image(self.image)),
        ]
        for label, check in checks:
            try:
                await check
            except SandboxKernelError as exc:
                print(f"FAIL  {label}: {exc}")
                for _, rest in checks[checks.index((label, check)) + 1 :]:
                    rest.close()
                return 1
            print(f"ok    {label}")
        try:  # optional: only kernels that pause need it
            await docker_backend.check_checkpoints()
            how = (
                "gVisor checkpoints saved by runsc directly"
                if gvisor_checkpoint.may_run_runsc()
                else "Docker's own checkpoints, slow for big kernels; as root, runsc saves them directly"
            )
            print(f"ok    pausing kernels to disk ({how})")
        except SandboxKernelError as exc:
            print(f"note  kernels cannot pause to disk here: {exc}")
            return 0
        try:
            safe, why = await docker_backend.resume_hazard(self.image, self.runtime)
        except SandboxKernelError as exc:
            print(f"note  could not tell whether paused kernels of {self.image!r} resume safely: {exc}")
            return 0
        if safe:
            print(f"ok    paused kernels of {self.image!r} resume safely: {why}")
        else:
            print(f"note  paused kernels of {self.image!r} may die as they resume: {why}")
        return 0


def docker_access_warning(uid: int | None = None) -> str | None:
    """What a server that is not root, reaching Docker through the docker group (or an
    open socket), should know: that access is root's, for every user of that account."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return None
    return (
        f"this account (uid {uid}) reaches the Docker daemon, which is root-equivalent: whoever "
        "runs code as it (not the sandboxed kernels) can read any file on the host, enter any "
        "kernel's container and stop or replace it, with no audit line. Give it to no one you "
        "would not give root; on a shared host run the server as root, or keep Docker on a "
        "machine of its own (see docs/security/threat-model.md)."
    )


def _human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


class _KernelsApp(_SubApp):
    runtime_parent = Unicode(
        "", config=True, help="Where the servers keep runtime folders (default: the system temp folder)."
    )

    def docker(self, operation: Callable[[SandboxBackend], Coroutine[Any, Any, T]]) -> T:
        """Run one async operation on the configured backend (Docker + gVisor unless
        ``c.SandboxProvisioner.backend_class`` says otherwise); its error is a user error,
        not a traceback."""
        try:
            return asyncio.run(operation(configured_backend(self.config)))
        except SandboxKernelError as exc:
            self.fail(str(exc))
            raise  # unreachable: fail() exits

    def kernels(self) -> list[SandboxedKernel]:
        return self.docker(list_kernels)

    def chosen(self) -> list[SandboxedKernel]:
        """The kernel each given id prefix names (exactly one each), or a usage error."""
        if not self.extra_args:
            self.fail("give one or more kernel ids (see `jupyter sandbox-kernel list`)")
        kernels = self.kernels()
        chosen = []
        for prefix in self.extra_args:
            matches = [k for k in kernels if k.kernel_id.startswith(prefix)]
            if len(matches) != 1:
                found = "no kernel" if not matches else f"{len(matches)} kernels"
                self.fail(f"{found} with an id starting with {prefix!r}; see `jupyter sandbox-kernel list`")
            chosen.extend(matches)
        return chosen


class ListApp(_KernelsApp):
    """List the sandboxed kernels on this Docker host."""

    name = "jupyter-sandbox-kernel-list"
    description = """List the sandboxed kernels on this Docker host: kernel id, kernelspec,
    state, lifecycle, age, memory in use and its limit, the server that owns it
    (host/pid-namespace/pid/start) and its workspace. An ephemeral kernel whose server is
    gone is "orphaned" (`prune` removes it); a persistent one is "detached" until a server
    adopts it, or "expired" once its time-to-live has run out. A sandbox a kernelspec's
    pool started ahead, which no kernel has claimed yet, is "pooled" (no kernel id)."""
    json_output = Bool(False, config=True, help="Print JSON instead of a table.")
    flags = {**base_flags, "json": ({"ListApp": {"json_output": True}}, "Print JSON instead of a table.")}

    def start(self) -> None:
        kernels = self.kernels()
        if self.json_output:
            rows = [
                {
                    **asdict(k),
                    "status": k.status,
                    "orphaned": k.orphaned,
                    "detached": k.detached,
                    "expired": k.expired,
                    "age_seconds": round(k.age_seconds),
                }
                for k in kernels
            ]
            print(json.dumps(rows, indent=2))
            return
        if not kernels:
            print("No sandboxed kernels on this Docker host.")
            return
        header = ("KERNEL ID", "KERNELSPEC", "STATE", "LIFECYCLE", "AGE", "MEMORY", "OWNER", "WORKSPACE")
        rows_text = [header] + [
            (
                k.kernel_id or "-",
                k.kernelspec,
                k.status + (f" ({_mib(k.checkpoint_size)} on disk)" if k.paused else ""),
                k.lifecycle + (f" (ttl {_human_age(k.ttl)})" if k.persistent and k.ttl else ""),
                _human_age(k.age_seconds),
                f"{_mib(k.memory_usage)} / {_mib(k.memory_limit)}",
                k.owner,
                k.workspace,
            )
            for k in kernels
        ]
        widths = [max(len(row[i]) for row in rows_text) for i in range(len(header))]
        for row in rows_text:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _mib(size: int | None) -> str:
    return f"{size / 2**20:.0f}M" if size else "-"


class StopApp(_KernelsApp):
    """Stop and remove sandboxed kernels by kernel id."""

    name = "jupyter-sandbox-kernel-stop"
    description = """Stop and remove the sandboxed kernels whose kernel id starts with each
    given ID (see `list`), with their runtime folders. The workspace is untouched."""
    examples = "jupyter sandbox-kernel stop 3f2a9c1e"
    takes_arguments = True

    def start(self) -> None:
        for kernel in self.chosen():
            self.docker(partial(remove_kernel, kernel=kernel, runtime_parent=self.runtime_parent or None))
            print(f"Stopped {kernel.kernel_id}")


class PauseApp(_KernelsApp):
    """Pause sandboxed kernels to disk."""

    name = "jupyter-sandbox-kernel-pause"
    description = """Pause the sandboxed kernels whose kernel id starts with each given ID (see
    `list`): each one's whole sandbox, memory included, is saved to disk and its container
    stopped. The server that drives it does it, and its clients notice nothing; their next
    message resumes it (or `resume`). A kernel running an execution is not paused.
    Needs Docker's experimental mode (see `check`)."""
    examples = "jupyter sandbox-kernel pause 3f2a9c1e"
    takes_arguments = True
    resume = False
    timeout = Float(900.0, config=True, help="Seconds to wait for each kernel.")
    aliases = {**base_aliases, "timeout": "PauseApp.timeout"}

    def start(self) -> None:
        for kernel in self.chosen():
            started = time.monotonic()
            said = self.docker(partial(self._pause, kernel_id=kernel.kernel_id))
            print(f"Kernel {kernel.kernel_id}: {said} in {time.monotonic() - started:.1f} s")

    async def _pause(self, _: SandboxBackend, kernel_id: str) -> str:
        return await pause_kernel(kernel_id, resume=self.resume, timeout=self.timeout)


class ResumeApp(PauseApp):
    """Resume paused sandboxed kernels."""

    name = "jupyter-sandbox-kernel-resume"
    description = """Resume the paused sandboxed kernels whose kernel id starts with each given
    ID (see `list`), with all their variables, without waiting for a client's message."""
    examples = "jupyter sandbox-kernel resume 3f2a9c1e"
    resume = True
    aliases = {**base_aliases, "timeout": "ResumeApp.timeout"}


class PruneApp(_KernelsApp):
    """Remove sandboxed kernels whose Jupyter server is gone."""

    name = "jupyter-sandbox-kernel-prune"
    description = """Remove the ephemeral sandboxed kernels whose server process has died on
    this host (orphans), and the persistent ones no server has held for their time-to-live,
    with their runtime folders, and the fresh workspaces of sessions killed outright. A
    kernel is judged only when its owner ran on this host in this PID namespace; when in
    doubt it is left alone. Every process running sandboxed
    kernels also does this when it starts its first one, and every minute while it has
    any; where none may run for long, run this from a timer (cron or systemd)."""

    def start(self) -> None:
        removed = self.docker(partial(prune_orphans, runtime_parent=self.runtime_parent or None))
        for kernel in removed:
            why = "its time-to-live ran out" if kernel.expired else f"server {kernel.owner} is gone"
            print(f"Removed {kernel.description}: {why}")
        print(f"{len(removed)} kernel(s) removed.")
        for folder in sweep_abandoned_workspaces():
            print(f"Removed the fresh workspace {folder}: the session that made it is gone")


class _KernelStarter(_SubApp):
    """A subcommand that starts kernels: under the server's config (its files, then
    ``--config`` and ``--SandboxProvisioner.NAME=`` options), from a sandboxed kernelspec."""

    @default("config_file_name")
    def _config_file_name_default(self) -> str:
        return CONFIG_FILE_NAME

    def require_sandboxed(self, kernel_name: str) -> None:
        """Exit with a one-line error unless ``kernel_name`` is a sandboxed kernelspec."""
        try:
            require_sandboxed(kernel_name, config=self.config)
        except ConfigurationError as exc:
            self.fail(f"{exc} (--kernel)")


class _GatewayOptions(_KernelStarter):
    """A subcommand whose kernels may run on a sandbox gateway (``--gateway-url``), as the
    session API's (see :mod:`sandbox_kernel.agents.gateway_session`). The token comes from a
    file or ``JUPYTER_GATEWAY_AUTH_TOKEN``, never the command line (``ps`` shows that)."""

    gateway_url = Unicode(
        "",
        config=True,
        help="""The sandbox gateway to run the kernels on (https://HOST:PORT); default
        JUPYTER_GATEWAY_URL. Without either, kernels run here under this host's Docker.""",
    )
    gateway_token_file = Unicode(
        "",
        config=True,
        help="""A file holding your token for the gateway (from `gateway add-token`); default
        the JUPYTER_GATEWAY_AUTH_TOKEN variable.""",
    )
    ca_certs = Unicode(
        "",
        config=True,
        help="The CA file that signed the gateway's certificate; default JUPYTER_GATEWAY_CA_CERTS.",
    )

    def gateway(self) -> GatewaySettings | None:
        """The gateway asked for, or None; exits with a one-line error for one that cannot be used."""
        from sandbox_kernel.agents.gateway_settings import GatewaySettings  # only here

        token = None
        if self.gateway_token_file:
            path = Path(self.gateway_token_file).expanduser()
            try:
                token = path.read_text().strip()
            except OSError as exc:
                self.fail(f"--gateway-token-file {self.gateway_token_file!r}: {exc.strerror or exc}")
            if not token:
                self.fail(f"--gateway-token-file {self.gateway_token_file!r} is empty")
        try:
            settings = GatewaySettings.given(self.gateway_url or None, token, self.ca_certs or None)
        except ConfigurationError as exc:
            self.fail(f"{exc} (--gateway-url)")
            return None
        if settings is not None and not settings.token:
            self.fail(
                "a sandbox gateway needs your token: --gateway-token-file FILE, or JUPYTER_GATEWAY_AUTH_TOKEN"
            )
        if settings is not None and settings.ca_certs and not Path(settings.ca_certs).is_file():
            self.fail(f"--ca-certs {settings.ca_certs!r} is not a file")
        return settings


def gateway_aliases(app: str) -> dict[str, str]:
    """The command-line options of :class:`_GatewayOptions`, for the subcommand ``app``."""
    return {
        "gateway-url": f"{app}.gateway_url",
        "gateway-token-file": f"{app}.gateway_token_file",
        "ca-certs": f"{app}.ca_certs",
    }


class RunApp(_GatewayOptions):
    """Execute a notebook in a sandboxed kernel."""

    name = "jupyter-sandbox-kernel-run"
    description = """Execute a notebook with nbclient in a sandboxed kernel. The notebook's folder
    is the kernel's workspace; the executed copy is written next to it (or to --output)
    and each cell's printed output is echoed here."""
    examples = inspect.cleandoc(
        """
    jupyter sandbox-kernel run notebooks/demo.ipynb
    jupyter sandbox-kernel run analysis.ipynb --output analysis.done.ipynb --timeout 10m
    jupyter sandbox-kernel run demo.ipynb --gateway-url https://sandbox.example:8870 \\
        --gateway-token-file ~/.sandbox-token --ca-certs ~/ca.pem --cwd /home/alice/proj
    """
    )
    takes_arguments = True

    kernel_name = Unicode(KERNEL_NAME, config=True, help="Kernelspec to run the notebook with.")
    output = Unicode(
        "", config=True, help="Where to write the executed notebook (default NAME.executed.ipynb)."
    )
    timeout = Duration(600, config=True, help="Time each cell may run: seconds, or e.g. '90s' or '10m'.")
    cwd = Unicode(
        "",
        config=True,
        help="""With --gateway-url: the kernel's folder on the gateway's host (default: your
        root there). Here the notebook's folder is the kernel's.""",
    )
    aliases = {
        **base_aliases,
        **gateway_aliases("RunApp"),
        "kernel": "RunApp.kernel_name",
        "output": "RunApp.output",
        "timeout": "RunApp.timeout",
        "cwd": "RunApp.cwd",
    }

    def start(self) -> None:
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError

        if len(self.extra_args) != 1:
            self.fail("give exactly one notebook: jupyter sandbox-kernel run NOTEBOOK.ipynb")
        path = Path(self.extra_args[0]).resolve()
        if not path.is_file():
            self.fail(f"no such notebook: {path}")
        output = Path(self.output).resolve() if self.output else path.with_suffix(".executed.ipynb")
        gateway = self.gateway()
        km: AsyncKernelManager
        if gateway is not None:
            from sandbox_kernel.agents.gateway_session import (  # only here
                SessionGatewayKernelManager,
                use_gateway,
            )

            if self.cwd and not os.path.isabs(self.cwd):
                self.fail(
                    f"--cwd {self.cwd!r}: give the absolute path of the kernel's folder on the gateway's host"
                )
            use_gateway(gateway)
            km = SessionGatewayKernelManager(kernel_name=self.kernel_name)
            where = {"metadata": {"path": self.cwd}} if self.cwd else {}
            on = f" on the sandbox gateway {gateway.url}"
        else:
            if self.cwd:
                self.fail("--cwd is for --gateway-url: here the notebook's folder is the kernel's")
            self.require_sandboxed(self.kernel_name)
            km = sandboxed_manager(self.kernel_name, config=self.config)
            where, on = {"metadata": {"path": str(path.parent)}}, ""
        nb = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
        client = NotebookClient(
            nb, km=km, kernel_name=self.kernel_name, timeout=int(self.timeout), resources=where
        )
        print(f"==> executing {path} with the {self.kernel_name!r} kernel{on}")
        failed: BaseException | None = None
        try:
            client.execute()
        except (CellExecutionError, SandboxKernelError, RuntimeError) as exc:
            failed = exc
        finally:
            nbformat.write(nb, output)  # type: ignore[no-untyped-call]
            # nbclient shuts down only a kernel manager it made itself.
            run_sync(_shut_down)(km, client.kc)
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    sys.stdout.write(out["text"])
                elif "image/png" in out.get("data", {}):
                    print("[image/png output]")
        print(f"==> executed notebook: {output}")
        if failed is not None:
            self.fail(f"the notebook failed: {failed}")


async def _shut_down(km: AsyncKernelManager, kc: Any) -> None:
    """End ``km``'s kernel (its container removed), and ``kc``'s channels, if any."""
    if kc is not None:
        kc.stop_channels()
    try:
        if km.has_kernel:
            await km.shutdown_kernel(now=True)
    finally:
        await ensure_async(km.cleanup_resources())  # a gateway's manager's is not a coroutine


class McpApp(_GatewayOptions):
    """Serve sandboxed kernels to an AI assistant over MCP (stdio)."""

    name = "jupyter-sandbox-kernel-mcp"
    description = """Serve sandboxed kernels to an AI assistant over MCP (stdio): run this as
    the command of an MCP server in the assistant's settings (Claude Desktop, an IDE, an
    agent framework); it speaks the Model Context Protocol on stdin and stdout, and logs
    to stderr. The assistant gets the tools start_kernel, run_code, upload_file,
    download_file, list_files, restart_kernel and shutdown_kernel. Every kernel starts
    from the kernelspec --kernel, with its policy, limits and audit log, in gVisor, and
    its workspace is --cwd, the only host folder the assistant's code can read or write (without
    it, a fresh folder of its own, removed at the end unless --keep-workspace).

    Needs the mcp package: pip install 'sandbox-kernel[mcp]'"""
    examples = inspect.cleandoc(
        """
    jupyter sandbox-kernel mcp
    jupyter sandbox-kernel mcp --kernel sandboxed-python-datascience --cwd ~/projects/analysis
    jupyter sandbox-kernel mcp --gateway-url https://sandbox.example:8870 \\
        --gateway-token-file ~/.sandbox-token --ca-certs ~/ca.pem --cwd /home/alice/proj
    """
    )

    kernel_name = Unicode(KERNEL_NAME, config=True, help="Kernelspec the assistant's kernels start from.")
    cwd = Unicode(
        "",
        config=True,
        help="""The kernels' workspace: a host folder. Default: a fresh, empty folder of this
        server's own under JUPYTER_DATA_DIR/sandbox-kernel/workspaces, removed when it
        ends (unless --keep-workspace). With --gateway-url: a folder on the gateway's host,
        under your root there (default: that root).""",
    )
    keep_workspace = Bool(
        False,
        config=True,
        help="Without --cwd, keep the fresh workspace when the server ends (its path is logged).",
    )
    aliases = {
        **base_aliases,
        **gateway_aliases("McpApp"),
        "kernel": "McpApp.kernel_name",
        "cwd": "McpApp.cwd",
    }
    flags = {
        **base_flags,
        "keep-workspace": (
            {"McpApp": {"keep_workspace": True}},
            "Without --cwd, keep the fresh workspace when the server ends.",
        ),
    }

    def start(self) -> None:
        try:
            from sandbox_kernel.agents.mcp_server import serve_stdio
        except ImportError as exc:
            # mcp, or a package it brings (anyio, pydantic); a module of ours is a bug.
            if exc.name is None or exc.name.partition(".")[0] == __package__:
                raise
            detail = "" if exc.name.partition(".")[0] == "mcp" else f" (no module {exc.name!r})"
            self.fail(
                f"the MCP server needs the mcp package, which is not installed{detail}: "
                "pip install 'sandbox-kernel[mcp]'"
            )
            return
        gateway = self.gateway()
        if gateway is not None:
            if self.cwd and not os.path.isabs(self.cwd):
                self.fail(
                    f"--cwd {self.cwd!r}: give the absolute path of the kernels' folder on the gateway's host"
                )
            try:
                serve_stdio(kernel_name=self.kernel_name, cwd=self.cwd or None, gateway=gateway)
            except SandboxKernelError as exc:
                self.fail(str(exc))
            return
        cwd = None
        if self.cwd:
            folder = Path(self.cwd).expanduser().resolve()
            if not folder.is_dir():
                self.fail(f"--cwd {self.cwd!r} is not a folder; give the folder the kernels should work in")
            cwd = str(folder)
        self.require_sandboxed(self.kernel_name)
        try:
            serve_stdio(
                kernel_name=self.kernel_name, cwd=cwd, config=self.config, keep_workspace=self.keep_workspace
            )
        except SandboxKernelError as exc:
            self.fail(str(exc))


class SandboxKernelApp(JupyterApp):
    """The ``jupyter sandbox-kernel`` command."""

    name = "jupyter-sandbox-kernel"
    version = __version__
    description = """Run Jupyter's IPython kernels inside hardened gVisor containers.

    Typical setup: build the image, install the kernelspec, check the host; then choose
    "Sandboxed Python" in JupyterLab, or KernelManager(kernel_name="sandboxed-python").
    For data work, also build and install the data-science recipe (--recipe datascience):
    "Sandboxed Python (data science)", kernel name sandboxed-python-datascience."""
    examples = inspect.cleandoc(
        """
    jupyter sandbox-kernel build-image --debian-base
    jupyter sandbox-kernel install --sys-prefix
    jupyter sandbox-kernel check
    jupyter sandbox-kernel build-image --recipe datascience --debian-base
    jupyter sandbox-kernel install --sys-prefix --recipe datascience
    jupyter sandbox-kernel run notebooks/demo.ipynb
    jupyter sandbox-kernel mcp --cwd ~/projects/analysis
    """
    )
    subcommands = {
        "install": (
            InstallApp,
            "Install the Sandboxed Python kernelspec (--recipe datascience: its data-science one).",
        ),
        "build-image": (
            BuildImageApp,
            "Build a kernel image (--recipe python or datascience), showing progress.",
        ),
        "check": (CheckApp, "Check Docker, the gVisor runtime, the image and the kernelspec."),
        "run": (RunApp, "Execute a notebook in a sandboxed kernel."),
        "list": (ListApp, "List the sandboxed kernels on this Docker host (--json for JSON)."),
        "stop": (StopApp, "Stop and remove sandboxed kernels by kernel id."),
        "pause": (PauseApp, "Pause sandboxed kernels to disk, memory included, by kernel id."),
        "resume": (ResumeApp, "Resume paused sandboxed kernels by kernel id."),
        "prune": (PruneApp, "Remove sandboxed kernels whose Jupyter server is gone."),
        "mcp": (McpApp, "Serve sandboxed kernels to an AI assistant over MCP (stdio)."),
        "gateway": (
            # Imported when chosen: it loads jupyter_server, a second of every other command's start.
            "sandbox_kernel.gateway.app.SandboxGatewayApp",
            "Serve sandboxed kernels to other users' Jupyter servers (a kernel gateway).",
        ),
    }

    @classmethod
    def clear_instances(cls) -> None:
        """Forget the singletons of this application and of every subcommand, so that a
        process can run another command (traitlets keeps one instance of each)."""
        cls.clear_instance()
        for sub, _ in cls.subcommands.values():
            (import_item(sub) if isinstance(sub, str) else sub).clear_instance()

    def start(self) -> None:
        if self.subapp is not None:
            self.subapp.start()
            return
        print("No subcommand given; choose one of: " + ", ".join(self.subcommands), file=sys.stderr)
        print(file=sys.stderr)
        self.print_description()
        self.print_subcommands()
        self.exit(1)


main = SandboxKernelApp.launch_instance
