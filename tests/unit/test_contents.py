"""A root Jupyter server's file manager writes in a user's folder as that user (#23 item 3):
jupyter_server's real AsyncLargeFileManager, extended the way the server extension does,
on real folders; and the attacks a kernel running as that user can make on it."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
from tornado.web import HTTPError

from sandbox_kernel.jupyter.contents import IDENTITY, OwnedCheckpoints, own_the_servers_files, run_as_owner

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="what a root server does")

ALICE = (1000, 1000)
BOB = (1001, 1001)


def owner(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_uid, info.st_gid


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A folder every user may pass through (pytest's own are root's, 0700), as /srv or
    /home are; removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="sandbox-kernel-contents-", dir="/tmp"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture
def root_dir(reachable: Path) -> Path:
    """The server's root: root's, with alice's project in it (her kernel's workspace)."""
    top = reachable / "srv"
    (top / "alice").mkdir(parents=True)
    os.chown(top / "alice", *ALICE)
    return top


@pytest.fixture
def manager(root_dir: Path) -> AsyncLargeFileManager:
    contents = AsyncLargeFileManager(root_dir=str(root_dir))
    assert own_the_servers_files(contents, contents.checkpoints)
    assert isinstance(contents.checkpoints, OwnedCheckpoints)
    return contents


@pytest.fixture
def secret(reachable: Path) -> Path:
    """A file of root's no one else may read or write, where anyone may pass."""
    path = reachable / "shadow"
    path.write_text("root's secret\n")
    path.chmod(0o600)
    return path


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_new_folders_uploads_notebooks_and_their_checkpoints_are_the_folders_owners(
    manager: AsyncLargeFileManager, root_dir: Path
) -> None:
    alice = root_dir / "alice"
    folder = run(manager.new_untitled(path="alice", type="directory"))
    assert owner(root_dir / folder["path"]) == ALICE
    run(manager.save({"type": "file", "format": "text", "content": "a,b\n"}, "alice/data.csv"))
    notebook = run(manager.new_untitled(path="alice", type="notebook"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    run(manager.save({"type": "notebook", "content": nb}, notebook["path"]))
    run(manager.create_checkpoint(notebook["path"]))
    made = [alice / "data.csv", root_dir / notebook["path"], alice / ".ipynb_checkpoints"]
    made += list((alice / ".ipynb_checkpoints").iterdir())
    assert len(made) == 4
    assert {path: owner(path) for path in made} == dict.fromkeys(made, ALICE)
    # What the server reads back is what it wrote.
    assert run(manager.get("alice/data.csv"))["content"] == "a,b\n"
    assert run(manager.get(notebook["path"]))["content"]["cells"][0]["source"] == "1 + 1"


def test_a_chunked_upload_and_copies_are_the_owners_too(
    manager: AsyncLargeFileManager, root_dir: Path
) -> None:
    alice = root_dir / "alice"
    for chunk, text in ((1, "first "), (2, "second "), (-1, "last")):
        content = base64.b64encode(text.encode()).decode()
        run(
            manager.save(
                {"type": "file", "format": "base64", "content": content, "chunk": chunk}, "alice/big.bin"
            )
        )
    assert (alice / "big.bin").read_text() == "first second last"
    assert owner(alice / "big.bin") == ALICE
    (alice / "sub").mkdir()
    (alice / "sub" / "x.txt").write_text("x")
    copied = run(manager.copy("alice/big.bin", "alice"))
    folder = run(manager.copy("alice/sub", "alice"))
    run(manager.rename("alice/big.bin", "alice/renamed.bin"))
    for path in (root_dir / copied["path"], root_dir / folder["path"], root_dir / folder["path"] / "x.txt"):
        assert owner(path) == ALICE, path
    assert owner(alice / "renamed.bin") == ALICE


def test_a_notebook_root_made_before_is_saved_as_the_owners_anew(
    manager: AsyncLargeFileManager, root_dir: Path
) -> None:
    """Files a root server made in alice's folder before it wrote as her are root's,
    0644: saving one makes it hers, its old content kept until the save succeeded."""
    old = root_dir / "alice" / "old.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("old")])
    nbformat.write(nb, old)
    assert owner(old) == (0, 0)
    nb.cells[0].source = "new"
    run(manager.save({"type": "notebook", "content": nb}, "alice/old.ipynb"))
    assert owner(old) == ALICE
    assert nbformat.read(old, as_version=4).cells[0].source == "new"
    assert sorted(path.name for path in old.parent.iterdir()) == [".ipynb_checkpoints", "old.ipynb"]


def test_a_folder_of_someone_else_inside_gets_files_of_its_own_owner(
    manager: AsyncLargeFileManager, root_dir: Path
) -> None:
    shared = root_dir / "alice" / "bobs"
    shared.mkdir()
    os.chown(shared, *BOB)
    run(manager.save({"type": "file", "format": "text", "content": "hi"}, "alice/bobs/note.txt"))
    assert owner(shared / "note.txt") == BOB


def test_root_folders_stay_as_upstream_leaves_them(manager: AsyncLargeFileManager, root_dir: Path) -> None:
    run(manager.save({"type": "file", "format": "text", "content": "hi"}, "top.txt"))
    assert owner(root_dir / "top.txt") == (0, 0)


def test_a_link_planted_where_lab_saves_is_not_written_through(
    manager: AsyncLargeFileManager, root_dir: Path, secret: Path
) -> None:
    """Alice's kernel makes report.ipynb a link to root's file: the save is refused (the
    link's owner is not the target's), and even a link that got past that check is
    followed with alice's rights only."""
    planted = root_dir / "alice" / "report.txt"
    planted.symlink_to(secret)
    os.lchown(planted, *ALICE)
    with pytest.raises(HTTPError) as refused:
        run(manager.save({"type": "file", "format": "text", "content": "pwned"}, "alice/report.txt"))
    assert refused.value.status_code == 403
    assert "link of uid 1000" in str(refused.value.log_message)
    assert secret.read_text() == "root's secret\n"
    assert owner(secret) == (0, 0)
    # The race: the link swapped in after the check. The write itself is alice's.
    with pytest.raises(PermissionError):
        run(run_as_owner(ALICE, secret.write_text, "pwned"))
    assert secret.read_text() == "root's secret\n"


def test_a_link_to_someone_elses_folder_is_refused(
    manager: AsyncLargeFileManager, root_dir: Path, tmp_path: Path
) -> None:
    bobs = tmp_path / "bob-private"
    bobs.mkdir()
    os.chown(bobs, *BOB)
    link = root_dir / "alice" / "shared"
    link.symlink_to(bobs)
    os.lchown(link, *ALICE)
    for action in (
        manager.save({"type": "directory"}, "alice/shared/new"),
        manager.save({"type": "file", "format": "text", "content": "x"}, "alice/shared/x.txt"),
        manager.rename("alice/shared", "alice/elsewhere/x")
        if False
        else manager.delete_file("alice/shared/x"),
    ):
        with pytest.raises(HTTPError) as refused:
            run(action)
        assert refused.value.status_code == 403
    assert list(bobs.iterdir()) == []


def test_copying_a_planted_link_does_not_give_alice_roots_file(
    manager: AsyncLargeFileManager, root_dir: Path, secret: Path
) -> None:
    """A copy reads as the server: the read, too, is alice's in her folder."""
    alice = root_dir / "alice"
    (alice / "data").mkdir()
    os.chown(alice / "data", *ALICE)
    (alice / "data" / "secret.txt").symlink_to(secret)  # root's link: passes the link check
    with pytest.raises(HTTPError) as refused:
        run(manager.copy("alice/data/secret.txt", "alice"))
    assert refused.value.status_code == 403
    with pytest.raises(HTTPError):
        run(manager.copy("alice/data", "alice"))  # the folder is made, its link's target is not read
    assert sorted(path.name for path in alice.iterdir()) == ["data", "data-Copy1"]
    assert list((alice / "data-Copy1").iterdir()) == []


def test_a_chunked_upload_whose_file_is_swapped_for_a_link_between_chunks_stays_alices(
    manager: AsyncLargeFileManager, root_dir: Path, secret: Path
) -> None:
    first = base64.b64encode(b"first").decode()
    run(manager.save({"type": "file", "format": "base64", "content": first, "chunk": 1}, "alice/up.bin"))
    target = root_dir / "alice" / "up.bin"
    target.unlink()
    target.symlink_to(secret)
    os.lchown(target, *ALICE)
    with pytest.raises(HTTPError):
        run(manager.save({"type": "file", "format": "base64", "content": first, "chunk": -1}, "alice/up.bin"))
    assert secret.read_text() == "root's secret\n"


def test_the_identity_is_the_threads_alone_and_given_back(reachable: Path) -> None:
    seen: dict[str, Any] = {}
    reachable.chmod(0o777)  # alice may make her folder here
    started, done = threading.Event(), threading.Event()

    def elsewhere() -> None:  # a thread started before, working meanwhile
        started.wait()
        (reachable / "other.txt").write_text("root's")
        done.set()

    def as_alice() -> None:
        started.set()
        done.wait(10)
        (reachable / "alice-dir").mkdir()
        seen["groups"] = os.getgroups()

    other = threading.Thread(target=elsewhere)
    other.start()
    groups = os.getgroups()
    IDENTITY.run_as(ALICE, as_alice)
    other.join()
    assert owner(reachable / "alice-dir") == ALICE
    assert owner(reachable / "other.txt") == (0, 0)  # the other thread stayed root
    assert seen["groups"] == []
    (reachable / "after.txt").write_text("root again")
    assert owner(reachable / "after.txt") == (0, 0)
    assert os.getgroups() == groups
    with pytest.raises(OSError, match="acts for uid 1000"):
        IDENTITY.run_as(ALICE, IDENTITY.run_as, BOB, lambda: None)


def test_a_folder_its_owner_cannot_reach_is_written_as_root_as_upstream_does(tmp_path: Path) -> None:
    """pytest's temporary folders are root's, 0700: alice could not get to hers."""
    (tmp_path / "alice").mkdir()
    os.chown(tmp_path / "alice", *ALICE)
    contents = AsyncLargeFileManager(root_dir=str(tmp_path))
    own_the_servers_files(contents, contents.checkpoints)
    run(contents.save({"type": "file", "format": "text", "content": "x"}, "alice/x.txt"))
    assert owner(tmp_path / "alice" / "x.txt") == (0, 0)
