"""The plan: kernelspec keys, ceilings, the workspace and the uid a kernel runs as."""

from __future__ import annotations

import grp
import json
import os
import pwd
from pathlib import Path
from typing import Any

import pytest

from sandbox_kernel.backends.docker_args import SECCOMP_PROFILE, container_create_kwargs, volume_setup_kwargs
from sandbox_kernel.errors import ConfigurationError, WorkspaceError
from sandbox_kernel.plan.plan import (
    DEFAULT_KERNEL_UID,
    Launch,
    check_ceilings,
    check_default_uid_unused,
    check_sandbox_env,
    kernel_user,
    narrow_settings,
    plan_sandbox,
    resolve_workspace,
    start_policy,
    unpassed_env,
    validate_kernelspec_config,
    volume_name,
    volume_user,
)
from sandbox_kernel.plan.sandbox_spec import (
    CONTAINER_CONNECTION_FILE,
    CONTAINER_WORKSPACE,
    LABEL_WORKSPACE,
)
from sandbox_kernel.plan.settings import SandboxSettings, kernelspec_keys

from .conftest import make_spec


def no_accounts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose passwd and group know no uid or gid, whatever this one's hold."""

    def unknown(number: int) -> Any:
        raise KeyError(number)

    monkeypatch.setattr(pwd, "getpwuid", unknown)
    monkeypatch.setattr(grp, "getgrgid", unknown)


class TestResolveWorkspace:
    def test_without_a_root_the_start_folder_is_the_workspace(self, tmp_path: Path) -> None:
        project = tmp_path / "project"
        project.mkdir()
        assert resolve_workspace(project, None) == (project.resolve(), CONTAINER_WORKSPACE)

    def test_with_a_root_the_start_folder_maps_below_the_mount(self, tmp_path: Path) -> None:
        root = tmp_path / "root"
        (root / "a" / "b").mkdir(parents=True)
        assert resolve_workspace(root / "a" / "b", root) == (root.resolve(), f"{CONTAINER_WORKSPACE}/a/b")

    @pytest.mark.skipif(os.getuid() != 0, reason="a root server's concern; needs chown")
    def test_a_root_server_does_not_follow_alices_link_to_bobs_folder(self, tmp_path: Path) -> None:
        """The attack: a root SandboxSession with cwd = alice's link to bob's 0700 folder
        ran the kernel as bob with his folder mounted read-write."""
        alice, bob = 2101, 2102
        bobs = tmp_path / "bob-private"
        bobs.mkdir(mode=0o700)
        os.chown(bobs, bob, bob)
        link = tmp_path / "alice-project"
        link.symlink_to(bobs)
        os.lchown(link, alice, alice)
        with pytest.raises(WorkspaceError, match="owned by uid 2101") as info:
            resolve_workspace(link, None)
        assert str(bobs) in str(info.value)
        # A link into a folder below it, or bob's own link: followed.
        with pytest.raises(WorkspaceError, match="through the link"):
            resolve_workspace(link / "sub" / "..", None)
        os.lchown(link, bob, bob)
        assert resolve_workspace(link, None) == (bobs.resolve(), CONTAINER_WORKSPACE)
        os.lchown(link, 0, 0)
        assert resolve_workspace(link, None) == (bobs.resolve(), CONTAINER_WORKSPACE)

    def test_the_root_itself_maps_to_the_workspace(self, tmp_path: Path) -> None:
        assert resolve_workspace(tmp_path, tmp_path) == (tmp_path.resolve(), CONTAINER_WORKSPACE)

    def test_a_folder_outside_the_root_is_refused_with_a_fix(self, tmp_path: Path) -> None:
        root = tmp_path / "root"
        elsewhere = tmp_path / "elsewhere"
        root.mkdir()
        elsewhere.mkdir()
        with pytest.raises(WorkspaceError, match="outside the workspace root") as info:
            resolve_workspace(elsewhere, root)
        message = str(info.value)
        assert str(elsewhere) in message
        assert str(root) in message
        assert "Move the notebook under the workspace root" in message

    def test_a_symlink_escaping_the_root_is_resolved_and_refused(self, tmp_path: Path) -> None:
        root = tmp_path / "root"
        outside = tmp_path / "outside"
        root.mkdir()
        outside.mkdir()
        (root / "link").symlink_to(outside)
        with pytest.raises(WorkspaceError, match="outside the workspace root"):
            resolve_workspace(root / "link", root)

    def test_a_symlink_within_the_root_maps_to_its_target(self, tmp_path: Path) -> None:
        root = tmp_path / "root"
        (root / "real").mkdir(parents=True)
        (root / "link").symlink_to(root / "real")
        assert resolve_workspace(root / "link", root)[1] == f"{CONTAINER_WORKSPACE}/real"

    @pytest.mark.parametrize("root", [None, "/"])
    def test_the_filesystem_root_is_refused(self, tmp_path: Path, root: str | None) -> None:
        cwd = "/" if root is None else tmp_path
        with pytest.raises(WorkspaceError, match="system or home folder"):
            resolve_workspace(cwd, root)

    @pytest.mark.parametrize("folder", ["/etc", "/usr", "/var/lib/docker"])
    def test_system_folders_are_refused(self, folder: str) -> None:
        if not Path(folder).is_dir():
            pytest.skip(f"{folder} does not exist on this machine")
        with pytest.raises(WorkspaceError, match="Refusing to mount"):
            resolve_workspace(folder, None)

    def test_the_home_folder_is_refused(self, jupyter_dirs: dict[str, Path]) -> None:
        home = jupyter_dirs["HOME"]
        with pytest.raises(WorkspaceError, match="system or home folder"):
            resolve_workspace(home, None)
        with pytest.raises(WorkspaceError, match="system or home folder"):
            resolve_workspace(home / ".", home)

    def test_a_folder_below_home_is_fine(self, jupyter_dirs: dict[str, Path]) -> None:
        project = jupyter_dirs["HOME"] / "project"
        project.mkdir()
        assert resolve_workspace(project, None) == (project.resolve(), CONTAINER_WORKSPACE)

    def test_a_missing_start_folder_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(WorkspaceError, match="does not exist") as info:
            resolve_workspace(tmp_path / "gone", None)
        assert str(tmp_path / "gone") in str(info.value)

    def test_a_file_is_not_a_start_folder(self, tmp_path: Path) -> None:
        (tmp_path / "f").write_text("")
        with pytest.raises(WorkspaceError, match="not a folder"):
            resolve_workspace(tmp_path / "f", None)

    def test_a_missing_root_is_refused_with_the_setting_to_fix(self, tmp_path: Path) -> None:
        with pytest.raises(WorkspaceError, match=r"SandboxProvisioner\.workspace_root"):
            resolve_workspace(tmp_path, tmp_path / "no-root")

    def test_workspace_error_is_a_configuration_error(self) -> None:
        assert issubclass(WorkspaceError, ConfigurationError)
        assert issubclass(WorkspaceError, ValueError)


# ---------------------------------------------------------------- kernel_command


class TestValidateKernelspecConfig:
    def test_allowed_keys_pass(self) -> None:
        validate_kernelspec_config(dict.fromkeys(kernelspec_keys(), "x"), "ks")

    @pytest.mark.parametrize(
        "key",
        ["memroy", "kernel_uid", "docker_runtime", "runtime_parent", "max_memory", "max_cpus", "max_pids"],
    )
    def test_an_unknown_key_is_named_in_the_error(self, key: str) -> None:
        with pytest.raises(ConfigurationError) as info:
            validate_kernelspec_config({"image": "img:1", key: "x"}, "my-spec")
        message = str(info.value)
        assert repr(key) in message
        assert "'my-spec'" in message
        assert f"Allowed: {', '.join(sorted(kernelspec_keys()))}." in message


class TestKernelUser:
    def test_a_configured_uid_is_used_for_uid_and_gid(self, tmp_path: Path) -> None:
        assert kernel_user(tmp_path, 2000) == (2000, 2000)

    def test_a_non_root_server_runs_kernels_as_itself(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(os, "getuid", lambda: 1500)
        monkeypatch.setattr(os, "getgid", lambda: 1501)
        assert kernel_user(tmp_path) == (1500, 1501)

    def test_a_root_server_uses_the_workspace_owner(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        workspace = tmp_path / "ws"
        workspace.mkdir()
        if os.stat(workspace).st_uid == 0:
            os.chown(workspace, 4242, 4343)
        owner = os.stat(workspace)
        monkeypatch.setattr(os, "getuid", lambda: 0)
        assert kernel_user(workspace) == (owner.st_uid, owner.st_gid)
        assert owner.st_uid != 0

    def test_a_root_server_with_a_root_owned_workspace_uses_the_default(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        root_owned = Path("/")
        assert root_owned.stat().st_uid == 0
        monkeypatch.setattr(os, "getuid", lambda: 0)
        no_accounts(monkeypatch)
        assert kernel_user(root_owned) == (DEFAULT_KERNEL_UID, DEFAULT_KERNEL_UID)
        assert volume_user() == (DEFAULT_KERNEL_UID, DEFAULT_KERNEL_UID)
        assert DEFAULT_KERNEL_UID != 0

    def test_the_default_uid_is_reserved_for_no_one(self) -> None:
        """Not 1000 (the first human account on most hosts, ``cloudsdk`` on ours), not
        65534 (nobody): 65533, which Debian policy reserves and never allocates."""
        assert DEFAULT_KERNEL_UID == 65533

    @pytest.mark.parametrize("taken", ["account", "group"])
    def test_a_default_uid_that_is_a_host_account_is_refused(
        self, taken: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(os, "getuid", lambda: 0)
        no_accounts(monkeypatch)
        if taken == "account":
            entry = pwd.struct_passwd(("someone", "x", DEFAULT_KERNEL_UID, 100, "", "/home/x", "/bin/sh"))
            monkeypatch.setattr(pwd, "getpwuid", lambda uid: entry)
        else:
            monkeypatch.setattr(grp, "getgrgid", lambda gid: grp.struct_group(("staff2", "x", gid, [])))
        for choose in (lambda: kernel_user(Path("/")), volume_user, check_default_uid_unused):
            with pytest.raises(
                ConfigurationError, match=r"uid and gid 65533.*SandboxProvisioner\.kernel_uid"
            ):
                choose()
        # A configured uid, or a workspace owner, needs no default.
        assert kernel_user(Path("/"), 4321) == (4321, 4321)
        assert volume_user(4321) == (4321, 4321)

    def test_a_configured_uid_of_zero_is_never_used(self, tmp_path: Path) -> None:
        try:
            uid, _ = kernel_user(tmp_path, 0)
        except ConfigurationError:
            return
        assert uid != 0


# ---------------------------------------------------------------- container_connection_info


class TestWorkspaceVolumes:
    def test_the_template_is_filled_with_docker_safe_names(self) -> None:
        name = volume_name(
            "sk-{user}-{notebook}", user="Ann Lee", kernelspec="py", notebook="team/Sales Q3", project="team"
        )
        assert name == "sk-Ann-Lee-team-Sales-Q3"
        assert volume_name("team-{project}", project="analysis") == "team-analysis"
        assert volume_name("{kernelspec}-{notebook}", kernelspec="py") == "py-untitled"

    @pytest.mark.parametrize(
        ("template", "message"),
        [
            ("ws-{owner}", "placeholders"),
            ("{project", "not a valid template"),
            ("-{user}", "not a Docker volume"),
        ],
    )
    def test_a_bad_template_is_an_error_naming_it(self, template: str, message: str) -> None:
        with pytest.raises(ConfigurationError, match=message):
            volume_name(template, user="-", project="p")

    def test_the_kernel_gets_a_volume_mount_that_never_copies_the_image_over_it(self, tmp_path: Path) -> None:
        spec = make_spec(tmp_path, volume="team-analysis")
        (workspace, _) = container_create_kwargs(spec)["mounts"]
        assert workspace["Type"] == "volume"
        assert workspace["Source"] == "team-analysis"
        assert workspace["VolumeOptions"]["NoCopy"] is True
        assert spec.labels[LABEL_WORKSPACE] == "volume:team-analysis"
        setup = volume_setup_kwargs(spec)
        assert setup["command"] == ["chown", f"{spec.uid}:{spec.gid}", "/workspace"]
        assert setup["cap_add"] == ["CHOWN"]
        assert setup["security_opt"] == ["no-new-privileges:true", f"seccomp={SECCOMP_PROFILE}"]
        assert setup["network_mode"] == "none"
        assert setup["runtime"] == spec.runtime


def test_a_persistent_kernel_beyond_the_ttl_ceiling_is_refused() -> None:
    check_ceilings(SandboxSettings(lifecycle="persistent", persistent_ttl=3600, max_persistent_ttl=86400), {})
    check_ceilings(SandboxSettings(lifecycle="ephemeral", max_persistent_ttl=60), {})
    with pytest.raises(
        ConfigurationError, match=r"persistent_ttl=0.0 \(no limit\) exceeds.*max_persistent_ttl"
    ):
        check_ceilings(SandboxSettings(lifecycle="persistent", max_persistent_ttl=86400), {})


def test_a_kernelspec_may_name_only_images_the_server_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack: a user's kernelspec named any local image (its ENTRYPOINT ran)."""
    monkeypatch.delenv("SANDBOX_KERNEL_IMAGE", raising=False)
    check_ceilings(
        SandboxSettings(image="sandbox-kernel/python-datascience:latest"), {"image": "sandbox-kernel/x:1"}
    )
    check_ceilings(SandboxSettings(image="registry.example/own:1"), {})  # the server's own choice
    with pytest.raises(
        ConfigurationError, match=r"image='alpine:3' is not among.*allowed_images=\['sandbox-kernel/\*'\]"
    ):
        check_ceilings(SandboxSettings(image="alpine:3"), {"image": "alpine:3"})
    widened = SandboxSettings(image="registry.example/team/py:2", allowed_images=["registry.example/team/*"])
    check_ceilings(widened, {"image": "registry.example/team/py:2"})
    monkeypatch.setenv("SANDBOX_KERNEL_IMAGE", "mine:1")
    assert SandboxSettings().allowed_images == ["sandbox-kernel/*", "mine:1"]


def test_a_kernelspec_may_set_a_workspace_root_only_within_the_allowed_ones(tmp_path: Path) -> None:
    """The attack: a user's kernelspec widened workspace_root to the notebook's parent and
    saw a neighbouring project."""
    projects = tmp_path / "projects"
    (projects / "team").mkdir(parents=True)
    with pytest.raises(
        ConfigurationError, match=r"workspace_root=.* is not within .*allowed_workspace_roots=\[\]"
    ):
        check_ceilings(SandboxSettings(), {"workspace_root": str(projects)})
    check_ceilings(SandboxSettings(workspace_root=str(projects)), {})  # the server's own choice
    allowed = SandboxSettings(allowed_workspace_roots=[str(projects)])
    check_ceilings(allowed, {"workspace_root": str(projects / "team")})
    with pytest.raises(ConfigurationError, match="is not within"):
        check_ceilings(allowed, {"workspace_root": str(tmp_path)})


def test_a_plan_says_where_the_workspace_appears_and_what_the_kernel_gets(tmp_path: Path) -> None:
    from sandbox_kernel.plan.plan import Launch, plan_sandbox

    project = tmp_path / "Sales 2026"
    project.mkdir()
    launch = Launch(
        kernel_id="k1",
        kernel_name="ks",
        argv=["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        cwd=project,
        env={"LANG": "C.UTF-8", "SECRET": "x"},
        owner="me",
    )
    cold = plan_sandbox(SandboxSettings(kernel_uid=4321), launch, {"LANG": "C.UTF-8"}, []).spec
    assert (cold.workspace, cold.workdir, cold.workspace_path) == (project, "/workspace", "/workspace")
    assert cold.uid == 4321
    assert cold.command[-1] == CONTAINER_CONNECTION_FILE
    assert "SECRET" not in cold.env
    assert cold.env["LANG"] == "C.UTF-8"
    assert json.loads(cold.env["SANDBOX_KERNEL_POLICY"])["memory"] == "2g"
    pooled = plan_sandbox(SandboxSettings(kernel_uid=4321, pool_size=2), launch, {}, []).spec
    assert (pooled.workdir, pooled.workspace_path) == ("/workspace/Sales-2026", "/workspace/Sales-2026")


def test_a_kernelspec_without_subshells_runs_its_kernel_so_and_its_pool_alike(tmp_path: Path) -> None:
    """``subshells: false`` is the kernel's own option (its command): the kernelspec's pool
    is made of such kernels and serves its starts; a pool of kernels with subshells serves
    none of them (they start cold, and the log says why)."""
    from sandbox_kernel.plan.sandbox_spec import NO_SUBSHELLS_ARG, launcher_argv
    from sandbox_kernel.pool.fit import narrowing

    project = tmp_path / "project"
    project.mkdir()
    launch = Launch(kernel_id="k1", kernel_name="ks", argv=launcher_argv("ks"), cwd=project, env={})
    pooled = plan_sandbox(SandboxSettings(kernel_uid=4321, pool_size=2), launch, {}, []).spec
    quick = plan_sandbox(SandboxSettings(kernel_uid=4321, pool_size=2, subshells=False), launch, {}, []).spec
    assert NO_SUBSHELLS_ARG not in pooled.command
    assert quick.command == [*pooled.command, NO_SUBSHELLS_ARG]
    assert narrowing(pooled, quick) == "the kernel's command differs from the pool's"
    quick_pool = plan_sandbox(
        SandboxSettings(kernel_uid=4321, pool_size=2, subshells=False), launch, {}, []
    ).spec
    assert not isinstance(narrowing(quick_pool, quick), str)


# ---------------------------------------------------------------- one start's narrower policy


PYTHON_ORG = {"network": "allowlist", "allowed_domains": ["*.python.org"]}


def _settings(**config: Any) -> SandboxSettings:
    return SandboxSettings(max_allowed_domains=["*.python.org", "pypi.org"], **config)


@pytest.mark.parametrize(
    ("kernelspec", "asked"),
    [
        ({}, {"memory": "512m", "cpus": 0.5, "pids": 64, "tmp_size": "64m", "file_size": "1g"}),
        ({}, {"exec_timeout": "90s", "idle_timeout": 600}),  # no limit: any limit is narrower
        ({"exec_timeout": 60}, {"exec_timeout": 30}),
        (
            {"network": "allowlist", "allowed_domains": ["*.python.org"]},
            {"allowed_domains": ["docs.python.org"]},
        ),
        ({"network": "allowlist", "allowed_domains": ["*.python.org"]}, {"network": "none"}),
        ({"memory": "2g"}, {"memory": "1.5g"}),
    ],
)
def test_a_start_may_narrow_the_policy(kernelspec: dict[str, Any], asked: dict[str, Any]) -> None:
    settings = _settings(**kernelspec)
    narrow_settings(settings, asked, "py")
    for key, value in asked.items():
        if key.endswith("timeout") and isinstance(value, str):
            assert getattr(settings, key) == 90.0
        else:
            assert getattr(settings, key) == value
    if asked.get("network") == "none":
        assert settings.allowed_domains == []  # no network, no domains: consistent for the ceilings


@pytest.mark.parametrize(
    ("kernelspec", "asked", "words"),
    [
        (
            {},
            {"memory": "3g"},
            "start_kernel(memory='3g') would widen this kernel's policy: kernelspec 'py' gives",
        ),
        ({"memory": "1g"}, {"memory": "1025m"}, "memory='1g'"),
        ({}, {"cpus": 1.5}, "cpus"),
        ({}, {"pids": 512}, "pids"),
        ({"exec_timeout": 60}, {"exec_timeout": 0}, "exec_timeout=0"),
        ({"exec_timeout": 60}, {"exec_timeout": "2m"}, "exec_timeout"),
        ({}, {"network": "allowlist"}, "network"),
        (
            {"network": "allowlist", "allowed_domains": ["docs.python.org"]},
            {"allowed_domains": ["pypi.org"]},
            "allowed",
        ),
        ({}, {"allowed_domains": ["pypi.org"]}, "allowed_domains"),
        ({}, {"memory": "lots"}, "is not a valid memory"),
    ],
)
def test_a_wider_or_invalid_request_is_refused_and_changes_nothing(
    kernelspec: dict[str, Any], asked: dict[str, Any], words: str
) -> None:
    settings = _settings(**kernelspec)
    before = {key: getattr(settings, key) for key in asked}
    with pytest.raises(ConfigurationError) as info:
        narrow_settings(settings, {"cpus": 0.5, **asked} if "cpus" not in asked else asked, "py")
    assert words in str(info.value)
    assert {key: getattr(settings, key) for key in asked} == before
    assert settings.cpus == 1.0  # the valid part of the request was undone too


def test_start_arguments_are_taken_and_unknown_ones_refused() -> None:
    kwargs: dict[str, Any] = {"cwd": "/w", "env": {}, "memory": "1g", "network": "none"}
    assert start_policy(kwargs) == {"memory": "1g", "network": "none"}
    assert kwargs == {"cwd": "/w", "env": {}}
    with pytest.raises(ConfigurationError, match="got stdout, which a sandboxed kernel does not take"):
        start_policy({"cwd": "/w", "stdout": None})


def test_sandbox_env_must_map_names_to_strings() -> None:
    assert check_sandbox_env({"A": "1", "JPY_PARENT_PID": "7"}) == {"A": "1"}
    assert check_sandbox_env(None) == {}
    for bad in ({"A": 1}, {"": "x"}, {"A=B": "x"}, ["A"]):
        with pytest.raises(ConfigurationError, match="sandbox_env"):
            check_sandbox_env(bad)


def test_only_variables_a_start_set_itself_are_named_as_not_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME_SECRET", "s")
    launch = {"HOME_SECRET": "s", "MINE": "1", "LANG": "C.UTF-8", "JPY_SESSION_NAME": "n.ipynb"}
    assert unpassed_env(_settings(), launch) == ["MINE"]


def test_a_workspace_the_kernel_cannot_write_is_refused(real_workspace_modes: None, tmp_path: Path) -> None:
    folder = tmp_path / "ws"
    folder.mkdir(mode=0o755)
    launch = Launch(kernel_id="k1", kernel_name="ks", argv=["python"], cwd=folder, env={})
    with pytest.raises(WorkspaceError) as info:
        plan_sandbox(_settings(kernel_uid=4321), launch, {}, [])
    assert str(info.value) == (
        f"Run `chown -R 4321:4321 {folder}` first, or start the kernel in a folder of yours: the sandboxed "
        f"kernel (uid 4321) cannot write it (owner uid {os.getuid()}, mode drwxr-xr-x)."
    )


# ---------------------------------------------------------------- credentials


WAREHOUSE = {
    "warehouse": {"domains": ["api.python.org"], "headers": {"Authorization": "Bearer {env:WAREHOUSE_TOKEN}"}}
}


def _with_credentials(tmp_path: Path, **kernelspec: Any) -> Any:
    from traitlets.config import Config

    from sandbox_kernel.plan.plan import Launch, plan_sandbox

    config = Config({"SandboxSettings": {"credentials": WAREHOUSE, "max_credentials": ["warehouse"]}})
    settings = SandboxSettings(
        config=config, kernel_uid=4321, max_allowed_domains=["*.python.org"], **kernelspec
    )
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    launch = Launch("k1", "ks", ["python", "{connection_file}"], workspace, {}, "me")
    return settings, lambda: plan_sandbox(settings, launch, {}, [])


def test_a_kernelspec_names_the_server_s_credentials_and_the_plan_carries_no_value(tmp_path: Path) -> None:
    settings, plan = _with_credentials(tmp_path, credentials=["warehouse"], **PYTHON_ORG)
    check_ceilings(settings, {"credentials": ["warehouse"]})
    result = plan()
    (spec,) = result.credentials
    assert (spec.name, spec.rules.patterns, spec.header_names) == (
        "warehouse",
        ("api.python.org",),
        ("Authorization",),
    )
    policy = json.loads(result.spec.env["SANDBOX_KERNEL_POLICY"])
    assert policy["credentials"] == {"warehouse": ["api.python.org"]}
    _, plain = _with_credentials(tmp_path, **PYTHON_ORG)
    assert plain().credentials == (), "the server's definitions go to no kernel that does not name them"


@pytest.mark.parametrize(
    ("kernelspec", "says"),
    [
        ({"credentials": ["payroll"], **PYTHON_ORG}, r"\['payroll'\], which the server does not define"),
        ({"credentials": ["warehouse"]}, "needs network 'allowlist'"),
        (
            {"credentials": ["warehouse"], "network": "allowlist", "allowed_domains": ["docs.python.org"]},
            "never widens egress",
        ),
    ],
)
def test_a_credential_the_kernel_cannot_use_is_refused_before_it_starts(
    tmp_path: Path, kernelspec: dict[str, Any], says: str
) -> None:
    _, plan = _with_credentials(tmp_path, **kernelspec)
    with pytest.raises(ConfigurationError, match=says):
        plan()


def test_a_kernelspec_may_only_name_credentials_within_the_ceiling() -> None:
    settings = SandboxSettings(credentials=["warehouse", "payroll"], max_credentials=["warehouse"])
    with pytest.raises(
        ConfigurationError, match=r"credentials names \['payroll'\], beyond the server's ceiling"
    ):
        check_ceilings(settings, {"credentials": ["warehouse", "payroll"]})
    defining = SandboxSettings(credentials=WAREHOUSE, max_credentials=["warehouse"])
    with pytest.raises(ConfigurationError, match="it may only name the server's"):
        check_ceilings(defining, {"credentials": WAREHOUSE})


# ---------------------------------------------------------------- the Jupyter server's root as the workspace


def _tree(top: Path, *folders: str, owner: int | None = None) -> Path:
    """Make each folder below ``top`` (and ``top``), all owned by ``owner`` (root only)."""
    for folder in ("", *folders):
        (top / folder).mkdir(parents=True, exist_ok=True)
        for depth in range(len(Path(folder).parts) + 1):
            if owner is not None:
                os.chown(top.joinpath(*Path(folder).parts[:depth]), owner, owner)
    return top


def _start(cwd: Path, server_root: Path | None, **config: Any) -> Any:
    launch = Launch(
        kernel_id="k1", kernel_name="ks", argv=["python"], cwd=cwd, env={}, server_root=server_root
    )
    return plan_sandbox(SandboxSettings(**config), launch, {}, []).spec


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="a root server's concern; needs chown")


class TestServerRootWorkspace:
    """A notebooks/ + data/ layout: read_csv('../data/x.csv') must find the file."""

    def test_the_server_root_is_the_workspace_and_the_notebook_folder_the_working_one(
        self, tmp_path: Path
    ) -> None:
        lab = _tree(tmp_path / "lab", "project/notebooks", "project/data")
        spec = _start(lab / "project" / "notebooks", lab, kernel_uid=4321)
        assert (spec.workspace, spec.workdir) == (lab.resolve(), "/workspace/project/notebooks")

    def test_a_start_in_the_server_root_itself_mounts_it(self, tmp_path: Path) -> None:
        lab = _tree(tmp_path / "lab")
        spec = _start(lab, lab, kernel_uid=4321)
        assert (spec.workspace, spec.workdir) == (lab.resolve(), "/workspace")

    def test_a_server_root_that_is_a_home_folder_mounts_the_project_in_it(
        self, jupyter_dirs: dict[str, Path]
    ) -> None:
        """`jupyter lab` started in ~: the home folder (dotfiles, keys) is never mounted,
        the folder in it that holds the notebook is."""
        home = jupyter_dirs["HOME"]
        _tree(home, "analysis/notebooks", "analysis/data")
        spec = _start(home / "analysis" / "notebooks", home, kernel_uid=4321)
        assert (spec.workspace, spec.workdir) == ((home / "analysis").resolve(), "/workspace/notebooks")

    def test_without_a_server_the_start_folder_alone_is_the_workspace(self, tmp_path: Path) -> None:
        lab = _tree(tmp_path / "lab", "project/notebooks")
        spec = _start(lab / "project" / "notebooks", None, kernel_uid=4321)
        assert (spec.workspace, spec.workdir) == ((lab / "project" / "notebooks").resolve(), "/workspace")

    def test_the_administrator_may_keep_the_start_folder_alone(self, tmp_path: Path) -> None:
        lab = _tree(tmp_path / "lab", "project/notebooks")
        spec = _start(lab / "project" / "notebooks", lab, kernel_uid=4321, workspace_scope="start_folder")
        assert spec.workspace == (lab / "project" / "notebooks").resolve()

    def test_a_workspace_root_set_by_the_administrator_wins(self, tmp_path: Path) -> None:
        lab = _tree(tmp_path / "lab", "project/notebooks")
        spec = _start(
            lab / "project" / "notebooks", lab, kernel_uid=4321, workspace_root=str(lab / "project")
        )
        assert (spec.workspace, spec.workdir) == ((lab / "project").resolve(), "/workspace/notebooks")

    def test_workspace_scope_is_the_server_s_alone(self) -> None:
        assert "workspace_scope" not in kernelspec_keys()
        with pytest.raises(ConfigurationError, match="workspace_scope"):
            validate_kernelspec_config({"workspace_scope": "server_root"}, "mine")

    def test_a_server_root_holding_the_runtime_folders_is_not_mounted(self, tmp_path: Path) -> None:
        lab = _tree(tmp_path / "lab", "runtime", "project")
        spec = _start(lab / "project", lab, kernel_uid=4321, runtime_parent=str(lab / "runtime"))
        assert spec.workspace == (lab / "project").resolve()

    def test_a_server_root_holding_jupyter_s_own_folders_or_the_audit_log_is_not_mounted(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The runtime folder holds local kernels' keys and the server's token."""
        lab = _tree(tmp_path / "lab", "jupyter-runtime", "project")
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(lab / "jupyter-runtime"))
        assert _start(lab / "project", lab, kernel_uid=4321).workspace == (lab / "project").resolve()
        monkeypatch.delenv("JUPYTER_RUNTIME_DIR")
        audit = str(lab / "audit" / "audit.jsonl")
        assert (
            _start(lab / "project", lab, kernel_uid=4321, audit_log=audit).workspace
            == (lab / "project").resolve()
        )

    @needs_root
    def test_a_root_server_runs_the_kernel_as_the_owner_of_the_tree(self, tmp_path: Path) -> None:
        lab = _tree(tmp_path / "lab", "project/notebooks", owner=2201)
        spec = _start(lab / "project" / "notebooks", lab)
        assert (spec.workspace, spec.uid, spec.gid) == (lab.resolve(), 2201, 2201)

    @needs_root
    def test_attack_another_user_s_server_root_is_not_mounted_with_alice_s_folder(
        self, tmp_path: Path
    ) -> None:
        """A root server whose root is bob's: alice's folder in it is mounted alone, and her
        kernel (run as alice) sees nothing of bob's."""
        alice, bob = 2201, 2202
        lab = _tree(tmp_path / "lab", "bob-private", owner=bob)
        _tree(lab / "alice", owner=alice)
        spec = _start(lab / "alice", lab)
        assert (spec.workspace, spec.uid) == ((lab / "alice").resolve(), alice)

    @needs_root
    def test_attack_a_folder_of_another_user_on_the_way_stops_the_climb(self, tmp_path: Path) -> None:
        """alice's lab holds bob's folder, which holds alice's: mounting her lab would show
        bob's folder (as its modes allow) to her kernel; only what lies below bob's is hers."""
        alice, bob = 2201, 2202
        lab = _tree(tmp_path / "lab", owner=alice)
        _tree(lab / "shared", owner=bob)
        _tree(lab / "shared" / "alice-nb", owner=alice)
        spec = _start(lab / "shared" / "alice-nb", lab)
        assert spec.workspace == (lab / "shared" / "alice-nb").resolve()

    @needs_root
    def test_attack_a_server_root_through_another_user_s_link_is_not_followed(self, tmp_path: Path) -> None:
        alice, bob = 2201, 2202
        lab = _tree(tmp_path / "alice-lab", "project", owner=alice)
        link = tmp_path / "bobs-link"
        link.symlink_to(lab)
        os.lchown(link, bob, bob)
        spec = _start(lab / "project", link)
        assert spec.workspace == (lab / "project").resolve()

    def test_a_non_root_server_mounts_only_a_root_of_its_own(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        lab = _tree(tmp_path / "lab", "project")
        monkeypatch.setattr(os, "getuid", lambda: os.stat(lab).st_uid + 1)
        spec = _start(lab / "project", lab, kernel_uid=os.stat(lab).st_uid + 1)
        assert spec.workspace == (lab / "project").resolve()


# ---------------------------------------------------------------- a root-owned folder with a root server


@needs_root
def test_a_root_owned_folder_is_refused_in_one_short_line_that_says_what_to_run(
    real_workspace_modes: None, tmp_path: Path
) -> None:
    """JupyterLab shows the message in a <pre> about 110 characters wide: it was cut at
    'mode drwxr', before the fix; what to run now comes first."""
    home = _tree(tmp_path / "alice-home", owner=2201)
    project = home / "project"
    project.mkdir(mode=0o755)  # root made it (a `git clone` as root, say)
    with pytest.raises(WorkspaceError) as info:
        _start(project, None)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        f"Run `chown -R 2201: {project}` first (2201 owns {home}): the folder is root's, and a "
        "sandboxed kernel never runs as root."
    )
    assert "65533" not in message


@needs_root
def test_a_root_owned_folder_with_no_other_owner_above_names_the_account_to_give_it_to(
    real_workspace_modes: None, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir(mode=0o755)
    with pytest.raises(WorkspaceError) as info:
        _start(project, None)
    assert str(info.value) == (
        f"Run `chown -R USER: {project}` first (USER: who works there): the folder is root's, and a "
        "sandboxed kernel never runs as root."
    )
