"""The gateway's pure parts and commands: who its users are (UserPolicy, the tokens file),
where their kernels may start (check_cwd), when it serves, and its TLS files."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets import TraitError
from traitlets.config import Config

from sandbox_kernel.errors import ConfigurationError, WorkspaceError
from sandbox_kernel.gateway.app import AddTokenApp, InitTlsApp, RevokeTokenApp, serving_refusal
from sandbox_kernel.gateway.authorizer import KernelOwnerAuthorizer
from sandbox_kernel.gateway.identity import add_token, read_tokens, token_hash
from sandbox_kernel.gateway.tls import make_ca, make_server_cert, write_tls_files
from sandbox_kernel.gateway.users import UserPolicy, UserRefused, check_cwd, narrowest
from sandbox_kernel.plan.users import KernelUser

ALICE = 15001


def policy(**traits: Any) -> UserPolicy:
    return UserPolicy(
        config=Config({"UserPolicy": {"uid_source": "map", "uids": {"alice": ALICE}, **traits}})
    )


def test_a_user_gets_their_uid_their_folder_and_the_narrowest_ceilings() -> None:
    ceilings = {
        "*": {"max_memory": "4g", "max_exec_timeout": 600},
        "group:interns": {"max_memory": "1g", "max_allowed_domains": ["pypi.org"]},
        "alice": {"max_memory": "8g", "max_cpus": 2, "max_exec_timeout": "5m"},
    }
    user = policy(ceilings=ceilings, workspace_root="/srv/sandbox/{username}").resolve("alice", ["interns"])
    kernel_user = user.sandbox_user
    assert (user.username, kernel_user.uid, kernel_user.gid) == ("alice", ALICE, ALICE)
    assert kernel_user.root == Path("/srv/sandbox/alice")
    assert kernel_user.groups == ("interns",)
    assert dict(kernel_user.ceilings) == {
        "max_memory": "1g",  # the group's: alice's own entry cannot widen it
        "max_exec_timeout": "5m",
        "max_allowed_domains": ["pypi.org"],
        "max_cpus": 2,
    }
    assert str(kernel_user) == "alice", "what the kernel's argv templates see"


def test_ceilings_only_narrow_one_another() -> None:
    assert narrowest([{"max_exec_timeout": 0}, {"max_exec_timeout": 60}]) == {"max_exec_timeout": 60}
    assert narrowest([{"max_exec_timeout": 60}, {"max_exec_timeout": 0}]) == {"max_exec_timeout": 60}
    assert narrowest([{"max_pids": 64}, {"max_pids": 256}]) == {"max_pids": 64}
    domains = narrowest(
        [{"max_allowed_domains": ["a.org", "b.org"]}, {"max_allowed_domains": ["b.org", "c.org"]}]
    )
    assert domains == {"max_allowed_domains": ["b.org"]}
    assert narrowest([{}, {"max_memory": "2g"}]) == {"max_memory": "2g"}


def test_a_ceiling_must_be_one_a_user_may_get() -> None:
    with pytest.raises(TraitError, match="'memory', which no user may get"):
        policy(ceilings={"*": {"memory": "1g"}})
    with pytest.raises(TraitError, match="must be a dict"):
        policy(ceilings={"alice": "1g"})
    with pytest.raises(TraitError, match="absolute path with \\{username\\}"):
        policy(workspace_root="home/{username}")


@pytest.mark.parametrize(
    ("name", "uid", "reason"),
    [
        ("alice", 0, "uid 0"),
        ("alice", 999, "system accounts"),
        ("alice", 65534, "system accounts"),
        ("../etc", ALICE, "cannot name a workspace"),
        ("carol", None, "has no uid in UserPolicy.uids"),
    ],
)
def test_privileged_or_unknown_users_are_refused(name: str, uid: int | None, reason: str) -> None:
    with pytest.raises(UserRefused, match=reason):
        policy().resolve(name, uid=uid)


def test_root_and_unknown_accounts_are_refused_by_passwd() -> None:
    passwd = UserPolicy()
    with pytest.raises(UserRefused, match="uid 0"):
        passwd.resolve("root")
    with pytest.raises(UserRefused, match="no account on the sandbox host"):
        passwd.resolve("sk-no-such-user")


@pytest.fixture
def privileged_account() -> Iterator[str]:
    """A real account in a group named like a privileged one (made for the test, removed)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (useradd)")
    subprocess.run(["userdel", "sk-ut-user"], check=False, capture_output=True)  # a crashed run's
    subprocess.run(["groupdel", "sk-ut-priv"], check=False, capture_output=True)
    subprocess.run(["groupadd", "sk-ut-priv"], check=True)
    subprocess.run(["useradd", "-M", "-N", "-g", "users", "-G", "sk-ut-priv", "sk-ut-user"], check=True)
    try:
        yield "sk-ut-user"
    finally:
        subprocess.run(["userdel", "sk-ut-user"], check=True)
        subprocess.run(["groupdel", "sk-ut-priv"], check=True)


def test_members_of_root_equivalent_groups_are_refused(privileged_account: str) -> None:
    assert UserPolicy().resolve(privileged_account).sandbox_user.name == privileged_account
    refusing = UserPolicy(config=Config({"UserPolicy": {"refused_groups": ["sk-ut-priv"]}}))
    with pytest.raises(UserRefused, match="in the host group\\(s\\) sk-ut-priv"):
        refusing.resolve(privileged_account)
    by_primary = UserPolicy(config=Config({"UserPolicy": {"refused_groups": ["users"]}}))
    with pytest.raises(UserRefused, match="users"):
        by_primary.resolve(privileged_account)
    assert {"docker", "sudo", "wheel"} <= set(UserPolicy().refused_groups)


@pytest.fixture
def alice(tmp_path: Path) -> KernelUser:
    root = tmp_path / "home" / "alice"
    (root / "proj" / "sub").mkdir(parents=True)
    for folder in (root, root / "proj", root / "proj" / "sub"):
        os.chown(folder, ALICE, ALICE)
    return KernelUser("alice", ALICE, ALICE, root)


def test_a_kernel_starts_in_the_users_own_folder(alice: KernelUser) -> None:
    assert check_cwd(alice, str(alice.root / "proj" / "sub")) == (alice.root / "proj" / "sub").resolve()
    assert check_cwd(alice, None) == alice.root.resolve(), "asking nothing: the root"
    assert check_cwd(alice, str(alice.root / "proj" / ".." / "proj")) == (alice.root / "proj").resolve()


def test_a_folder_not_the_users_is_refused(alice: KernelUser, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, ALICE, ALICE)
    own_link = alice.root / "link"
    own_link.symlink_to(other)
    os.chown(own_link, ALICE, ALICE, follow_symlinks=False)
    foreign = alice.root / "proj" / "foreign"
    foreign.symlink_to(alice.root / "proj" / "sub")  # root's link, in alice's folder: followed
    (alice.root / "proj" / "roots").mkdir()
    readonly = alice.root / "proj" / "readonly"
    readonly.mkdir(mode=0o555)
    os.chown(readonly, ALICE, ALICE)
    readonly.chmod(0o555)
    assert check_cwd(alice, str(foreign)) == (alice.root / "proj" / "sub").resolve()
    for folder, reason in [
        (str(other), "is outside your sandbox workspace"),
        (str(own_link), "is outside your sandbox workspace"),
        (str(alice.root / "proj" / "roots"), "owned by uid 0, not by you"),
        (str(readonly), "is not writable by you"),
        (str(alice.root / "nothing"), "does not exist"),
        ("proj", "not an absolute path"),
    ]:
        with pytest.raises(WorkspaceError, match=reason):
            check_cwd(alice, folder)
    bob_link = alice.root / "bobs"
    bob_link.symlink_to(alice.root / "proj")
    os.chown(bob_link, ALICE + 1, ALICE + 1, follow_symlinks=False)
    with pytest.raises(WorkspaceError, match="owned by uid 15002"):
        check_cwd(alice, str(bob_link))


def test_a_root_the_user_does_not_own_is_refused(alice: KernelUser) -> None:
    os.chown(alice.root, 0, 0)
    with pytest.raises(WorkspaceError, match="owned by uid 0"):
        check_cwd(alice, str(alice.root / "proj"))


def test_the_tokens_file_keeps_hashes_and_must_be_private(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gw" / "tokens.json"
    app = AddTokenApp()
    app.initialize(
        [
            "alice",
            "--group",
            "analysts",
            "--uid",
            str(ALICE),
            f"--tokens-file={path}",
            "--UserPolicy.uid_source=map",
        ]
    )
    app.start()
    token = capsys.readouterr().out.strip()
    assert len(token) >= 40
    assert path.stat().st_mode & 0o777 == 0o600
    assert token not in path.read_text()
    entry = json.loads(path.read_text())["users"]["alice"]
    assert entry == {"sha256": [token_hash(token)], "groups": ["analysts"], "uid": ALICE}
    found = read_tokens(path)[token_hash(token)]
    assert (found.name, found.groups, found.uid) == ("alice", ("analysts",), ALICE)
    path.chmod(0o604)
    with pytest.raises(ConfigurationError, match=r"^the gateway's tokens file .* mode 0604"):
        read_tokens(path)
    path.chmod(0o600)
    path.parent.chmod(0o777)
    with pytest.raises(ConfigurationError, match="in a folder only root may write"):
        read_tokens(path)
    path.parent.chmod(0o700)
    path.write_text("[]")
    with pytest.raises(ConfigurationError, match="is not a gateway tokens file"):
        read_tokens(path)


def test_no_token_is_made_for_a_user_the_gateway_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tokens.json"
    app = AddTokenApp()
    app.initialize(["root", f"--tokens-file={path}"])
    with pytest.raises(SystemExit):
        app.start()
    assert "uid 0" in capsys.readouterr().err
    assert not path.exists()


def test_the_gateway_serves_as_root_and_over_tls_unless_on_loopback() -> None:
    assert serving_refusal(0, "0.0.0.0", "c.pem", "k.pem", False) is None
    assert serving_refusal(0, "127.0.0.1", "", "", True) is None
    assert serving_refusal(0, "::1", "", "", True) is None
    assert serving_refusal(0, "localhost", "", "", True) is None
    for ip in ("0.0.0.0", "", "10.77.0.2", "gw.example"):
        refusal = serving_refusal(0, ip, "", "", True)
        assert "serves TLS only" in str(refusal)
    refusal = serving_refusal(0, "127.0.0.1", "", "", False)
    assert "allow_plain_http" in str(refusal)
    refusal = serving_refusal(1000, "127.0.0.1", "c.pem", "k.pem", False)
    assert "must run as root (it runs as uid 1000)" in str(refusal)
    assert "\n" not in str(refusal)


def test_init_tls_makes_a_ca_and_a_certificate_it_verifies(tmp_path: Path) -> None:
    app = InitTlsApp()
    app.initialize([f"--dir={tmp_path}", "--hostname=gw.example", "--ip=10.77.0.2", "--ip=127.0.0.1"])
    app.start()
    for key in ("ca-key.pem", "server-key.pem"):
        assert (tmp_path / key).stat().st_mode & 0o777 == 0o600
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "server.pem", tmp_path / "server-key.pem")
    client = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    for name in ("gw.example", "10.77.0.2", "127.0.0.1"):
        assert handshake(server, client, name), name
    assert not handshake(server, client, "other.example")
    ca = (tmp_path / "ca.pem").read_bytes()
    again = InitTlsApp()
    again.initialize([f"--dir={tmp_path}", "--ip=127.0.0.1"])
    again.start()
    assert (tmp_path / "ca.pem").read_bytes() == ca, "the CA is kept: clients trust it already"
    with pytest.raises(ValueError, match="at least one"):
        make_server_cert(*make_ca(), [], [])


def test_the_tls_files_are_for_everyone_to_read_but_the_keys(tmp_path: Path) -> None:
    folder = tmp_path / "etc" / "gateway"
    old = os.umask(0o077)
    try:
        assert write_tls_files(folder, ["gw.example"], ["10.77.0.2"]), "a new CA"
    finally:
        os.umask(old)
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()}
    assert modes == {"ca.pem": 0o644, "server.pem": 0o644, "ca-key.pem": 0o600, "server-key.pem": 0o600}
    assert folder.stat().st_mode & 0o777 == 0o755, "users' servers read ca.pem where it is"
    ca = (folder / "ca.pem").read_bytes()
    server = (folder / "server.pem").read_bytes()
    folder.chmod(0o700)
    assert not write_tls_files(folder, [], ["127.0.0.1"]), "the CA is kept"
    assert (folder / "ca.pem").read_bytes() == ca
    assert (folder / "server.pem").read_bytes() != server
    assert folder.stat().st_mode & 0o777 == 0o700, "a folder that was there is left as it is"
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(folder / "server.pem", folder / "server-key.pem")
    client = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    assert handshake(server_side, client, "127.0.0.1")
    assert not handshake(server_side, client, "gw.example"), "the new certificate's names only"


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> bool:
    """Whether ``client`` accepts ``server``'s certificate for ``name`` (a handshake in memory)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    ends = [
        (client.wrap_bio(c_in, c_out, server_hostname=name), c_out, s_in),
        (server.wrap_bio(s_in, s_out, server_side=True), s_out, c_in),
    ]
    done: set[int] = set()
    for _ in range(10):
        for index, (end, outbox, peer) in enumerate(ends):
            if index not in done:
                try:
                    end.do_handshake()
                    done.add(index)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError:
                    return False
            peer.write(outbox.read())
        if len(done) == 2:
            return True
    return False


def test_the_authorizer_lets_a_user_at_their_own_kernels_only() -> None:
    owners = {"k-alice": "alice"}
    km = SimpleNamespace(owner=owners.get)

    def request(kernel_id: str | None) -> Any:
        kwargs = {} if kernel_id is None else {"kernel_id": kernel_id}
        return SimpleNamespace(path_kwargs=kwargs, settings={"kernel_manager": km})

    authorizer = KernelOwnerAuthorizer()
    alice, bob = SimpleNamespace(username="alice"), SimpleNamespace(username="bob")
    assert authorizer.is_authorized(request("k-alice"), alice, "execute", "kernels")  # type: ignore[arg-type]
    assert not authorizer.is_authorized(request("k-alice"), bob, "execute", "kernels")  # type: ignore[arg-type]
    assert not authorizer.is_authorized(request("k-unknown"), alice, "read", "kernels")  # type: ignore[arg-type]
    assert authorizer.is_authorized(request(None), bob, "write", "kernels")  # type: ignore[arg-type]
    assert authorizer.is_authorized(request(None), bob, "read", "kernelspecs")  # type: ignore[arg-type]
    for resource in ("contents", "terminals", "sessions", "server"):
        assert not authorizer.is_authorized(request(None), alice, "read", resource)  # type: ignore[arg-type]
    unowned = SimpleNamespace(path_kwargs={"kernel_id": "k-alice"}, settings={"kernel_manager": object()})
    assert not authorizer.is_authorized(unowned, alice, "read", "kernels"), "a manager that records no owners"  # type: ignore[arg-type]


def test_the_documented_config_is_the_gateways() -> None:
    """docs/administrators/gateway.md's config: every setting is one of the classes the
    gateway configures, and its values are accepted."""
    from sandbox_kernel.gateway.app import SandboxGatewayApp
    from sandbox_kernel.gateway.identity import TokensFileIdentityProvider
    from sandbox_kernel.provisioner import SandboxProvisioner

    page = (Path(__file__).parents[2] / "docs" / "administrators" / "gateway.md").read_text()
    marker = "test_gateway_users.py::test_the_documented_config_is_the_gateways -->\n```python\n"
    code = page.split(marker, 1)[1].split("```", 1)[0]
    config = Config()
    exec(compile(code, "gateway.md", "exec"), {"c": config})  # noqa: S102  # our own docs
    classes = {
        "ServerApp": SandboxGatewayApp,
        "SandboxGatewayApp": SandboxGatewayApp,
        "TokensFileIdentityProvider": TokensFileIdentityProvider,
        "UserPolicy": UserPolicy,
        "SandboxProvisioner": SandboxProvisioner,
    }
    assert set(config) <= set(classes)
    for section, values in config.items():
        traits = classes[section].class_traits(config=True)
        assert set(values) <= set(traits), f"{section}: {set(values) - set(traits)}"
    user_policy = UserPolicy(config=config)  # a refused value raises here
    assert user_policy.ceilings["group:interns"]["max_memory"] == "1g"
    assert SandboxProvisioner(config=config).max_memory == "8g"


def test_revoke_token_removes_a_users_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tokens.json"
    for _ in range(2):
        add_token(path, "alice", uid=ALICE)
    bobs = add_token(path, "bob", uid=ALICE + 1)
    app = RevokeTokenApp()
    app.initialize(["alice", f"--tokens-file={path}"])
    app.start()
    assert "Revoked 2 token(s) of alice" in capsys.readouterr().out
    assert {entry.name for entry in read_tokens(path).values()} == {"bob"}
    assert token_hash(bobs) in read_tokens(path)
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("app_class", [AddTokenApp, RevokeTokenApp, InitTlsApp])
def test_a_gateway_command_refuses_an_unknown_option(
    app_class: type[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app = app_class()
    with pytest.raises(SystemExit):
        app.initialize(["alice", f"--tokens-fle={tmp_path / 'x.json'}"])
    assert "unknown option --tokens-fle" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
