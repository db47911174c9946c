"""``jupyter sandbox-kernel``: install the kernelspecs, build the images, check the host, run notebooks."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_core.application import JupyterApp, base_aliases, base_flags
from jupyter_core.paths import SYSTEM_JUPYTER_PATH
from traitlets import Bool, CaselessStrEnum, Float, Int, List, TraitError, TraitType, Unicode, default

from ._version import __version__
from .docker_backend import DockerBackend, ImageBuildError, ImageStore
from .errors import ConfigurationError, DockerUnavailableError, SandboxKernelError
from .ownership import SandboxedKernel, list_kernels, prune_orphans, remove_kernel
from .plan import ceiling_violations, validate_kernelspec_config, volume_name
from .provisioner import SandboxProvisioner
from .resources import data_path
from .settings import DATASCIENCE_IMAGE, DEFAULT_IMAGE, DEFAULT_RUNTIME, SandboxSettings, kernelspec_keys

T = TypeVar("T")
A = TypeVar("A", bound=JupyterApp)

KERNEL_NAME = "sandboxed-python"
RECIPE_LABEL = "io.sandbox-kernel.recipe"
DEBIAN_BASE = "sandbox-kernel-base:bookworm"


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


class _SubApp(JupyterApp):
    version = __version__

    def fail(self, message: str) -> None:
        """Print a user error to stderr and exit non-zero."""
        print(f"error: {message}", file=sys.stderr)
        self.exit(1)


def _kernelspec_flag(trait: TraitType[Any, Any]) -> TraitType[Any, Any]:
    """``install``'s flag for a kernelspec setting: unset (the server's) unless given."""
    help_text = f"{trait.help} Unset: the server's."
    if isinstance(trait, List):
        return List(Unicode(), config=True, help=help_text + " Repeat for several.")
    if isinstance(trait, Float):
        return Float(0, config=True, help=help_text)
    if isinstance(trait, Int):
        return Int(0, config=True, help=help_text)
    return Unicode("", config=True, help=help_text)


def with_kernelspec_flags(cls: type[A], name: str) -> type[A]:
    """``cls``, as the app ``name``, with a flag for each setting a kernelspec may choose,
    from the settings' own declarations (see :mod:`~.settings`): adding a kernelspec key
    adds its flag."""
    traits = SandboxSettings.class_traits(kernelspec=True)
    aliases = {
        trait.metadata.get("flag", key.replace("_", "-")): f"{name}.{key}" for key, trait in traits.items()
    }
    namespace: dict[str, Any] = {key: _kernelspec_flag(trait) for key, trait in traits.items()}
    namespace.update(__doc__=cls.__doc__, __module__=cls.__module__, aliases={**cls.aliases, **aliases})
    return type(name, (cls,), namespace)


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
    the server allows them."""
    examples = """
    jupyter sandbox-kernel install --sys-prefix
    jupyter sandbox-kernel install --sys-prefix --recipe datascience
    jupyter sandbox-kernel install --user --name py-sandbox --display-name "Python (sandbox)"
    jupyter sandbox-kernel install --image registry.example/sandbox-python:2 --replace
    jupyter sandbox-kernel install --name py-small --display-name "Python (small)" --memory 512m --cpus 0.5
    jupyter sandbox-kernel install --name py-offline --display-name "Sandboxed Python (offline)"
    jupyter sandbox-kernel install --name py-docs --display-name "Sandboxed Python (web: docs sites)" \
        --allow-domain docs.python.org --allow-domain '*.readthedocs.io'
    jupyter sandbox-kernel install --name py-team --display-name "Sandboxed Python (team, lasting)" \
        --lifecycle persistent --persistent-ttl 604800 --workspace-volume 'team-{project}'
    """

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
        source = data_path("kernelspecs") / RECIPES[self.recipe].kernelspec
        spec = json.loads((source / "kernel.json").read_text())
        spec["display_name"] = self.display_name or spec["display_name"]
        config = spec["metadata"]["kernel_provisioner"].setdefault("config", {})
        chosen = {key: getattr(self, key) for key in sorted(kernelspec_keys())}
        if chosen["allowed_domains"] and not chosen["network"]:
            chosen["network"] = "allowlist"
        config.update({key: value for key, value in chosen.items() if value})
        self._validate(config)
        ksm = KernelSpecManager(parent=self)
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

    def _validate(self, config: dict[str, Any]) -> None:
        """Check the spec's settings as a kernel start will, so a bad spec never lands.

        Ceilings are the server's business; here only the defaults are known, so a
        value above them is a warning, not an error.
        """
        try:
            validate_kernelspec_config(config, self.kernel_name)
            provisioner = SandboxProvisioner(**config)
            provisioner.egress_rules()
            if provisioner.workspace_volume:
                volume_name(provisioner.workspace_volume)
        except (ConfigurationError, TraitError) as exc:
            self.fail(str(exc))
        ceilings = SandboxProvisioner(parent=self, **config)
        for problem in ceiling_violations(ceilings, config):
            print(
                f"warning: {problem} Kernels of this spec start only where the server allows it.",
                file=sys.stderr,
            )

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
    examples = """
    jupyter sandbox-kernel build-image
    jupyter sandbox-kernel build-image --debian-base --if-missing
    jupyter sandbox-kernel build-image --recipe datascience --debian-base --if-missing
    jupyter sandbox-kernel build-image --base my-registry/python:3.12 --tag sandbox-kernel/python:3.12
    jupyter sandbox-kernel build-image --recipe datascience --base sandbox-kernel/python:3.12 \\
        --tag sandbox-kernel/python-datascience:3.12
    """

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
    Exits non-zero, with the fix, if anything is missing."""

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
        return 0


def _human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


class _KernelsApp(_SubApp):
    runtime_parent = Unicode(
        "", config=True, help="Where the servers keep runtime folders (default: the system temp folder)."
    )

    def docker(self, operation: Callable[[DockerBackend], Coroutine[Any, Any, T]]) -> T:
        """Run one async Docker operation; a Docker error is a user error, not a traceback."""
        try:
            return asyncio.run(operation(DockerBackend()))
        except SandboxKernelError as exc:
            self.fail(str(exc))
            raise  # unreachable: fail() exits

    def kernels(self) -> list[SandboxedKernel]:
        return self.docker(list_kernels)


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
                k.status,
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

    def start(self) -> None:
        if not self.extra_args:
            self.fail("give one or more kernel ids (see `jupyter sandbox-kernel list`)")
        kernels = self.kernels()
        for prefix in self.extra_args:
            matches = [k for k in kernels if k.kernel_id.startswith(prefix)]
            if len(matches) != 1:
                found = "no kernel" if not matches else f"{len(matches)} kernels"
                self.fail(f"{found} with an id starting with {prefix!r}; see `jupyter sandbox-kernel list`")
            (kernel,) = matches
            self.docker(partial(remove_kernel, kernel=kernel, runtime_parent=self.runtime_parent or None))
            print(f"Stopped {kernel.kernel_id}")


class PruneApp(_KernelsApp):
    """Remove sandboxed kernels whose Jupyter server is gone."""

    name = "jupyter-sandbox-kernel-prune"
    description = """Remove the ephemeral sandboxed kernels whose server process has died on
    this host (orphans), and the persistent ones no server has held for their time-to-live,
    with their runtime folders. A kernel is judged only when its owner ran on this host in
    this PID namespace; when in doubt it is left alone. Every process running sandboxed
    kernels also does this when it starts its first one, and every minute while it has
    any; where none may run for long, run this from a timer (cron or systemd)."""

    def start(self) -> None:
        removed = self.docker(partial(prune_orphans, runtime_parent=self.runtime_parent or None))
        for kernel in removed:
            why = "its time-to-live ran out" if kernel.expired else f"server {kernel.owner} is gone"
            print(f"Removed kernel {kernel.kernel_id} ({why})")
        print(f"{len(removed)} kernel(s) removed.")


class RunApp(_SubApp):
    """Execute a notebook in a sandboxed kernel."""

    name = "jupyter-sandbox-kernel-run"
    description = """Execute a notebook with nbclient in a sandboxed kernel. The notebook's folder
    is the kernel's workspace; the executed copy is written next to it (or to --output)
    and each cell's printed output is echoed here."""
    examples = """
    jupyter sandbox-kernel run notebooks/demo.ipynb
    jupyter sandbox-kernel run analysis.ipynb --output analysis.done.ipynb --timeout 600
    """

    kernel_name = Unicode(KERNEL_NAME, config=True, help="Kernelspec to run the notebook with.")
    output = Unicode(
        "", config=True, help="Where to write the executed notebook (default NAME.executed.ipynb)."
    )
    timeout = Float(600, config=True, help="Seconds each cell may run.")
    aliases = {
        **base_aliases,
        "kernel": "RunApp.kernel_name",
        "output": "RunApp.output",
        "timeout": "RunApp.timeout",
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
        nb = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
        client = NotebookClient(
            nb,
            kernel_name=self.kernel_name,
            timeout=int(self.timeout),
            resources={"metadata": {"path": str(path.parent)}},
        )
        print(f"==> executing {path} with the {self.kernel_name!r} kernel")
        failed: BaseException | None = None
        try:
            client.execute()
        except (CellExecutionError, SandboxKernelError, RuntimeError) as exc:
            failed = exc
        finally:
            nbformat.write(nb, output)  # type: ignore[no-untyped-call]
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    sys.stdout.write(out["text"])
                elif "image/png" in out.get("data", {}):
                    print("[image/png output]")
        print(f"==> executed notebook: {output}")
        if failed is not None:
            self.fail(f"the notebook failed: {failed}")


class SandboxKernelApp(JupyterApp):
    """The ``jupyter sandbox-kernel`` command."""

    name = "jupyter-sandbox-kernel"
    version = __version__
    description = """Run Jupyter's IPython kernels inside hardened gVisor containers.

    Typical setup: build the image, install the kernelspec, check the host; then choose
    "Sandboxed Python" in JupyterLab, or KernelManager(kernel_name="sandboxed-python").
    For data work, also build and install the data-science recipe (--recipe datascience):
    "Sandboxed Python (data science)", kernel name sandboxed-python-datascience."""
    examples = """
    jupyter sandbox-kernel build-image --debian-base
    jupyter sandbox-kernel install --sys-prefix
    jupyter sandbox-kernel check
    jupyter sandbox-kernel build-image --recipe datascience --debian-base
    jupyter sandbox-kernel install --sys-prefix --recipe datascience
    jupyter sandbox-kernel run notebooks/demo.ipynb
    """
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
        "prune": (PruneApp, "Remove sandboxed kernels whose Jupyter server is gone."),
    }

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
