"""Attacks on the sandbox gateway (served in this process, the fake backend for its kernels),
each written the way a hostile user tried it: another user's kernel by another form of its id
or route, someone else's credentials or folders, more than their ceilings. A test that passes
is an attack that failed."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httputil import HTTPHeaders
from tornado.simple_httpclient import HTTPStreamClosedError

from sandbox_kernel.gateway.identity import add_token, token_hash
from sandbox_kernel.gateway.users import UserPolicy, UserRefused, check_cwd
from sandbox_kernel.plan.users import KernelUser

from .test_gateway import UIDS, Gateway, connect, gateway, gateway_args, message, serve, short_tmp

__all__ = ["gateway", "gateway_args", "serve", "short_tmp"]  # the fixtures, as test_gateway.py makes them


def id_forms(kernel_id: str) -> list[str]:
    """Other spellings of one kernel id, as a path segment."""
    hexed = "".join(f"%{ord(c):02x}" for c in kernel_id)
    return [
        kernel_id.upper(),
        f"{kernel_id}/",
        f"{kernel_id}%2F",
        f"{kernel_id[:8]}%2D{kernel_id[9:]}",
        hexed,
        f"x/../{kernel_id}",
        f"{kernel_id}/.",
        f"{kernel_id}%00",
        f" {kernel_id}",
        f"{kernel_id}?x=/../",
    ]


async def test_bob_reaches_alices_kernel_by_no_other_spelling_of_its_id_or_route(gateway: Gateway) -> None:
    mine = await gateway.start("alice")
    tried = []
    for form in id_forms(mine):
        for path, method, body in [
            (f"/api/kernels/{form}", "GET", None),
            (f"/api/kernels/{form}", "DELETE", None),
            (f"//api/kernels/{form}", "DELETE", None),
            (f"/api//kernels/{form}", "DELETE", None),
            (f"/API/kernels/{form}", "DELETE", None),
            (f"/api/kernels/{form}/restart", "POST", ""),
            (f"/api/kernels/{form}/interrupt", "POST", ""),
            (f"/api/sandbox-kernel/kernels/{form}", "GET", None),
            (f"/api/sandbox-kernel/kernels/{form}/pause", "POST", ""),
            (f"/api/sandbox-kernel/kernels/{form}/files?path=a.txt", "PUT", "bob's"),
            (f"/api/sandbox-kernel/kernels/{form}/files/list", "GET", None),
        ]:
            response = await gateway.fetch(path, "bob", method=method, body=body)
            tried.append(f"{method} {path}")
            assert response.code in (400, 403, 404), f"bob: {method} {path}: {response.code}"
        assert await connect(gateway, form, "bob") in (400, 403, 404), form
    # A form of the id in the body, and one with alice's id after bob's own.
    for form in [mine.upper(), f" {mine}", f"{mine}\n", f"{mine}/"]:
        taken = await gateway.fetch("/api/kernels", "bob", method="POST", body={"kernel_id": form})
        assert taken.code == 403, form
    assert gateway.km.list_kernel_ids() == [mine], "bob started nothing, stopped nothing"
    assert gateway.km.owner(mine) == "alice"
    assert gateway.km.get_kernel(mine).provisioner.paused is None
    assert not (gateway.roots["alice"] / "proj" / "a.txt").exists()
    assert len(tried) > 100


async def test_the_websocket_of_alices_kernel_takes_no_session_or_query_trick(gateway: Gateway) -> None:
    mine = await gateway.start("alice")
    token = gateway.tokens["alice"]
    for query in [
        "?session_id=alice",
        f"?session_id={mine}",
        f"?token={token}",
        f"?kernel_id={mine}",
        "?session_id=x&username=alice",
    ]:
        assert await connect(gateway, mine, "bob", query) == 403, query
        assert await connect(gateway, mine, None, query) == 403, query


async def test_the_kernelspec_resource_route_serves_no_file_outside_a_sandboxed_kernelspec(
    gateway: Gateway, short_tmp: Path
) -> None:
    (short_tmp / "secret.txt").write_text("root's")
    for path in [
        "/kernelspecs/python3/kernel.json",  # not sandboxed: not the gateway's
        "/kernelspecs/python3/logo-64x64.png",
        "/kernelspecs/PYTHON3/kernel.json",
        "/kernelspecs/sandboxed-python/../python3/kernel.json",
        "/kernelspecs/sandboxed-python/..%2Fpython3%2Fkernel.json",
        "/kernelspecs/sandboxed-python/%2E%2E/%2E%2E/%2E%2E/%2E%2E/%2E%2E/etc/passwd",
        "/kernelspecs/sandboxed-python/..%2F..%2F..%2F..%2F..%2F..%2Fetc%2Fpasswd",
        "/kernelspecs/sandboxed-python//etc/passwd",
        "/kernelspecs/sandboxed-python/%2Fetc%2Fpasswd",
        f"/kernelspecs/sandboxed-python/{'..%2F' * 12}{str(short_tmp / 'secret.txt').lstrip('/')}",
        "/kernelspecs/..%2F..%2F..%2Fetc/passwd",
    ]:
        response = await gateway.fetch(path, "alice")
        assert response.code in (400, 403, 404), f"{path}: {response.code} {response.body[:80]!r}"
        assert b"root:" not in response.body
        assert b"root's" not in response.body
        assert b'"argv"' not in response.body, "no kernel.json"


async def test_only_one_token_in_one_authorization_header_lets_a_user_in(gateway: Gateway) -> None:
    alice, bob = gateway.tokens["alice"], gateway.tokens["bob"]
    for value in [f"TOKEN {alice}", f"token  {alice}  ", f"bearer\t{alice}", f"Bearer {alice}\t"]:
        response = await gateway.fetch("/api/kernels", headers={"Authorization": value})
        assert response.code == 200, value
    for value in [
        f"token {alice} {bob}",
        f"token {alice},token {bob}",
        f"token {alice}x",
        f"token{alice}",
        f"{alice}",
        f"token {alice[:-1]}",
        f"token {alice.upper()}" if alice.upper() != alice else "token -",
        f"token {token_hash(alice)}",
        f"Basic {alice}",
        f"token {alice}\x00",
    ]:
        response = await gateway.fetch("/api/kernels", headers={"Authorization": value})
        assert response.code in (400, 403), value
    two = HTTPHeaders()
    two.add("Authorization", f"token {bob}")
    two.add("Authorization", f"token {alice}")
    response = await AsyncHTTPClient().fetch(
        HTTPRequest(gateway.url + "/api/kernels", headers=two), raise_error=False
    )
    assert response.code in (400, 403), "two Authorization headers: neither user"
    try:
        huge = await gateway.fetch(
            "/api/kernels", headers={"Authorization": f"token {alice}", "X-Pad": "x" * 70000}
        )
        assert huge.code in (400, 403, 431)
    except HTTPStreamClosedError:
        pass  # the gateway hung up on it
    assert (await gateway.fetch("/api/kernels", "alice")).code == 200, "and the gateway still serves"


async def test_a_tokens_file_entry_of_a_name_or_uid_no_user_may_have_lets_no_kernel_start(
    gateway: Gateway,
) -> None:
    path = Path(gateway.app.identity_provider.path)  # type: ignore[attr-defined]
    tried = {}
    for name, uid in [
        ("../bob", UIDS["alice"]),
        ("alice/../bob", UIDS["alice"]),
        (".hidden", UIDS["alice"]),
        ("", UIDS["alice"]),
        ("x\ny", UIDS["alice"]),
        ("carol", 0),
        ("carol2", 999),
        ("carol3", 65534),
        ("carol4", -1),
    ]:
        tried[name] = add_token(path, name, uid=uid)
    for name, token in tried.items():
        headers = {"Authorization": f"token {token}"}
        listed = await gateway.fetch("/api/kernels", headers=headers)
        started = await gateway.fetch("/api/kernels", headers=headers, method="POST", body={})
        assert (listed.code, started.code) == (403, 403), repr(name)
        assert "\n" not in message(started)
    assert gateway.km.list_kernel_ids() == []


async def test_a_user_revoked_while_the_gateway_runs_is_refused_on_their_next_request(
    gateway: Gateway,
) -> None:
    kernel_id = await gateway.start("bob")
    path = Path(gateway.app.identity_provider.path)  # type: ignore[attr-defined]
    data = json.loads(path.read_text())
    del data["users"]["bob"]
    new = path.with_name("tokens.json.new")
    new.write_text(json.dumps(data))
    new.chmod(0o600)
    st = path.stat()
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same mtime: a new inode only
    new.replace(path)
    assert (await gateway.fetch("/api/kernels", "bob")).code == 403
    assert (await gateway.fetch(f"/api/kernels/{kernel_id}", "bob", method="DELETE")).code == 403
    assert await connect(gateway, kernel_id, "bob") == 403
    assert (await gateway.fetch("/api/kernels", "alice")).code == 200


@pytest.mark.parametrize(
    ("asked", "reason"),
    [
        ("{root}/proj/../../bob/proj", "outside your sandbox workspace"),
        ("{root}/../bob/proj", "outside your sandbox workspace"),
        ("/proc/self/cwd", "outside your sandbox workspace"),
        ("/proc/1/root/etc", "outside your sandbox workspace|leads nowhere"),
        ("//{root}/proj/../../../etc", "outside your sandbox workspace"),
    ],
    ids=[
        "dotdot",
        "dotdot-root",
        "proc-cwd",
        "proc-1",
        "slashes",
    ],
)
async def test_a_folder_asked_for_in_any_odd_form_outside_her_own_is_refused_in_one_line(
    gateway: Gateway, asked: str, reason: str
) -> None:
    import re

    folder = asked.format(root=gateway.roots["alice"])
    response = await gateway.fetch(
        "/api/kernels", "alice", method="POST", body={"env": {"KERNEL_WORKING_DIR": folder}}
    )
    assert response.code == 403, (response.code, response.body[:300])
    assert re.search(reason, message(response)), message(response)
    assert "\n" not in message(response)
    assert "Traceback" not in message(response)
    assert gateway.km.list_kernel_ids() == []


@pytest.mark.parametrize(
    "asked",
    ["{root}/proj\x00", "{root}/proj/" + "x" * 300, "{root}/proj/" + "a/" * 3000],
    ids=["nul", "name", "path"],
)
async def test_a_folder_no_system_call_takes_is_refused_in_one_line_not_a_500(
    gateway: Gateway, asked: str
) -> None:
    folder = asked.format(root=gateway.roots["alice"])
    response = await gateway.fetch(
        "/api/kernels", "alice", method="POST", body={"env": {"KERNEL_WORKING_DIR": folder}}
    )
    assert response.code == 403, (response.code, response.body[:300])
    assert "\n" not in message(response)


async def test_a_folder_through_proc_self_root_is_her_own_folder_resolved(gateway: Gateway) -> None:
    """/proc/self/root is the gateway's own "/", a link of root's: followed, to her folder."""
    root = gateway.roots["alice"]
    asked = f"{root}/proj/" + "../" * 40 + f"proc/self/root{root}/proj"
    kernel_id = await gateway.start("alice", env={"KERNEL_WORKING_DIR": asked})
    assert gateway.km.get_kernel(kernel_id)._launch_args["cwd"] == str((root / "proj").resolve())


async def test_her_own_odd_folders_deep_unicode_or_named_like_a_path_start_her_kernel_there(
    gateway: Gateway,
) -> None:
    root = gateway.roots["alice"]
    deep = root / "proj"
    for _ in range(60):
        deep = deep / "d"
    odd = root / "proj" / "\u202eevil\u200b..\u00e9 ;$(id)"
    for folder in (deep, odd):
        folder.mkdir(parents=True)
        here = folder
        while here != root:
            os.chown(here, UIDS["alice"], UIDS["alice"])
            here = here.parent
    for folder in (deep, odd):
        kernel_id = await gateway.start("alice", env={"KERNEL_WORKING_DIR": str(folder)})
        assert gateway.km.get_kernel(kernel_id)._launch_args["cwd"] == str(folder.resolve())
        assert (await gateway.fetch(f"/api/kernels/{kernel_id}", "alice", method="DELETE")).code == 204


async def test_a_folder_of_hers_under_one_of_someone_elses_is_refused(gateway: Gateway) -> None:
    """A folder root made in her home (and one bob owns), with a folder of hers inside: every
    folder on the way must be hers."""
    root = gateway.roots["alice"]
    for owner in (0, UIDS["bob"]):
        above = root / f"above-{owner}"
        (above / "mine").mkdir(parents=True)
        os.chown(above, owner, owner)
        os.chown(above / "mine", UIDS["alice"], UIDS["alice"])
        response = await gateway.fetch(
            "/api/kernels", "alice", method="POST", body={"env": {"KERNEL_WORKING_DIR": str(above / "mine")}}
        )
        assert response.code == 403, owner
        assert f"owned by uid {owner}" in message(response)


async def test_her_link_to_bobs_folder_or_to_proc_is_not_followed(gateway: Gateway, short_tmp: Path) -> None:
    root = gateway.roots["alice"]
    for name, target in [
        ("to-bob", gateway.roots["bob"] / "proj"),
        ("to-proc", Path("/proc/self/root")),
        ("to-etc", Path("/etc")),
        ("to-rt", short_tmp / "rt"),
    ]:
        link = root / "proj" / name
        link.symlink_to(target)
        os.chown(link, UIDS["alice"], UIDS["alice"], follow_symlinks=False)
        for asked in (link, link / "."):
            response = await gateway.fetch(
                "/api/kernels", "alice", method="POST", body={"env": {"KERNEL_WORKING_DIR": str(asked)}}
            )
            assert response.code == 403, asked
    assert gateway.km.list_kernel_ids() == []


def test_a_check_then_swap_of_the_folder_for_a_link_is_caught_by_the_provisioners_check(
    tmp_path: Path,
) -> None:
    """The gateway's check passes; the folder is then swapped for alice's link to bob's: the
    provisioner checks the folder again before the mount, and refuses it."""
    from sandbox_kernel.errors import WorkspaceError
    from sandbox_kernel.plan.plan import check_user_folder

    alice_root, bob_root = tmp_path / "alice", tmp_path / "bob"
    for root, uid in ((alice_root, UIDS["alice"]), (bob_root, UIDS["bob"])):
        (root / "proj").mkdir(parents=True)
        os.chown(root, uid, uid)
        os.chown(root / "proj", uid, uid)
    alice = KernelUser("alice", UIDS["alice"], UIDS["alice"], alice_root)
    checked = check_cwd(alice, str(alice_root / "proj"))
    (alice_root / "proj").rename(alice_root / "aside")
    (alice_root / "proj").symlink_to(bob_root / "proj")
    os.chown(alice_root / "proj", UIDS["alice"], UIDS["alice"], follow_symlinks=False)
    with pytest.raises(WorkspaceError):
        check_user_folder(checked, alice)


async def test_a_start_or_a_restart_gets_no_more_than_her_ceilings_whatever_the_body_asks(
    serve: object,
) -> None:
    gateway = await serve(  # type: ignore[operator]
        '--UserPolicy.ceilings={"*": {"max_memory": "2g", "max_cpus": 2}, "alice": {"max_memory": "1g"}}',
        "--SandboxProvisioner.memory=1g",
        "--SandboxProvisioner.cpus=1",
        "--SandboxProvisioner.exec_timeout=60",
    )
    for sandbox in [
        {"memory": "64g"},
        {"memory": "1025m"},
        {"cpus": 4},
        {"cpus": 1e300},
        {"network": "open"},
        {"network": "host"},
        {"allowed_domains": ["*"]},
        {"exec_timeout": 0},
        {"pids": 1000000},
        {"memory": "1g", "image": "alpine"},
        {"kernel_user": 0},
    ]:
        response = await gateway.fetch("/api/kernels", "alice", method="POST", body={"sandbox": sandbox})
        assert response.code == 400, sandbox
    forget_failed_starts(gateway)
    for body in [
        {"sandbox_user": {"name": "bob", "uid": 0}},
        {"env": {"KERNEL_UID": "0", "KERNEL_USERNAME": "bob", "KERNEL_EXTRA_SPEC": "x"}},
        {"path": "/", "kernel_name": "python3", "kernel_uid": 0},
    ]:
        kernel_id = await gateway.start("alice", **body)
        kernel = gateway.km.get_kernel(kernel_id)
        user = kernel._launch_args["sandbox_user"]
        assert (user.name, user.uid) == ("alice", UIDS["alice"]), body
        assert Path(kernel._launch_args["cwd"]).is_relative_to(gateway.roots["alice"].resolve()), body
        assert not (kernel._launch_args.get("env") or {}).keys() & {"KERNEL_UID", "KERNEL_USERNAME"}
        assert kernel.provisioner.policy.memory == "1g"
        # A restart whose body asks for more gets what she had.
        restart = await gateway.fetch(
            f"/api/kernels/{kernel_id}/restart",
            "alice",
            method="POST",
            body=json.dumps({"sandbox": {"memory": "64g"}, "env": {"KERNEL_WORKING_DIR": "/"}}),
        )
        assert restart.code == 200
        kernel = gateway.km.get_kernel(kernel_id)
        assert kernel.provisioner.policy.memory == "1g"
        assert Path(kernel._launch_args["cwd"]).is_relative_to(gateway.roots["alice"].resolve())
        assert (await gateway.fetch(f"/api/kernels/{kernel_id}", "alice", method="DELETE")).code == 204


async def test_max_kernels_per_user_holds_against_starts_from_many_connections_at_once(
    gateway: Gateway,
) -> None:
    here = {"env": {"KERNEL_WORKING_DIR": str(gateway.roots["alice"])}}
    at_once = [gateway.fetch("/api/kernels", "alice", method="POST", body=here) for _ in range(12)]
    codes = [response.code for response in await asyncio.gather(*at_once)]
    assert codes.count(201) == 2, codes
    assert len(gateway.km.kernels_of("alice")) == 2


async def test_her_files_api_follows_no_link_or_hard_link_out_of_her_workspace(
    gateway: Gateway, short_tmp: Path
) -> None:
    kernel_id = await gateway.start("alice")
    proj = gateway.roots["alice"] / "proj"
    secret = short_tmp / "secret.txt"
    secret.write_text("root's")
    secret.chmod(0o600)
    for name, target in [("to-etc", "/etc"), ("to-bob", str(gateway.roots["bob"] / "proj"))]:
        (proj / name).symlink_to(target)
        os.chown(proj / name, UIDS["alice"], UIDS["alice"], follow_symlinks=False)
    os.link(secret, proj / "hard.txt")  # where protected_hardlinks is off, she could make this
    files = f"/api/sandbox-kernel/kernels/{kernel_id}/files"
    for path, method, body in [
        ("to-etc/passwd", "GET", None),
        ("to-bob/planted", "PUT", "alice's"),
        ("hard.txt", "GET", None),
        ("../../bob/proj/planted", "PUT", "alice's"),
        ("/etc/passwd", "GET", None),
        (str(gateway.roots["bob"] / "proj" / "planted"), "PUT", "alice's"),
        ("to-etc", "DELETE", None),
    ]:
        response = await gateway.fetch(f"{files}?path={path}", "alice", method=method, body=body)
        assert response.code in (400, 403, 404), (path, response.code)
        assert b"root" not in response.body or response.code >= 400
    listed = await gateway.fetch(f"{files}/list?path=to-bob", "alice")
    assert listed.code == 400
    assert not (gateway.roots["bob"] / "proj" / "planted").exists()
    assert (proj / "to-etc").is_symlink()
    assert secret.read_text() == "root's"


def test_names_that_could_climb_out_of_the_workspace_template_are_refused() -> None:
    policy = UserPolicy(workspace_root="/home/{username}", uid_source="map", uids={"x": 15001})
    for name in ["../x", "..", ".", "x/../../root", "x/", "/x", "x\x00", "-x", "x" * 65, "x y", "\nx"]:
        with pytest.raises(UserRefused):
            policy.resolve(name, uid=15001)


def test_a_name_ending_in_a_newline_is_refused() -> None:
    policy = UserPolicy(workspace_root="/home/{username}", uid_source="map", uids={})
    with pytest.raises(UserRefused):
        policy.resolve("alice\n", uid=15001)


def forget_failed_starts(gateway: Gateway) -> None:
    """Drop the starts that failed from jupyter_client's pending kernels, where it leaves them
    (see the test below), so that the gateway's shutdown at the end of a test works."""
    km = gateway.km
    for kernel_id, task in list(km._pending_kernels.items()):
        if task.done() and kernel_id not in km._kernels:
            km._pending_kernels.pop(kernel_id)


async def test_a_users_refused_starts_leave_nothing_behind_and_the_gateway_still_shuts_down(
    serve: object,
) -> None:
    gateway = await serve("--SandboxProvisioner.memory=1g")  # type: ignore[operator]
    bobs = await gateway.start("bob")
    try:
        for _ in range(5):
            refused = await gateway.fetch(
                "/api/kernels", "alice", method="POST", body={"sandbox": {"memory": "64g"}}
            )
            assert refused.code == 400
        assert list(gateway.km._pending_kernels) == [], "nothing kept of a refused start"
        await gateway.km.shutdown_all(now=True)
        assert bobs not in gateway.km.list_kernel_ids()
    finally:
        forget_failed_starts(gateway)


async def test_her_delete_racing_her_restart_stops_the_kernel(gateway: Gateway) -> None:
    kernel_ids = []
    try:
        for _ in range(3):
            kernel_id = await gateway.start("alice")
            kernel_ids.append(kernel_id)
            path = f"/api/kernels/{kernel_id}"
            restart = gateway.fetch(f"{path}/restart", "alice", method="POST", body="", request_timeout=8)
            delete = gateway.fetch(path, "alice", method="DELETE", request_timeout=8)
            codes = [response.code for response in await asyncio.gather(restart, delete)]
            assert codes[1] == 204, codes
            assert kernel_id not in gateway.km.list_kernel_ids(), codes
            assert gateway.km.owner(kernel_id) is None
    finally:
        for kernel_id in kernel_ids:
            if kernel_id in gateway.km:
                await asyncio.wait_for(gateway.km.shutdown_kernel(kernel_id, now=True), 30)
        forget_failed_starts(gateway)
