"""Under a root Jupyter server, what the server writes in a user's folder is that user's.

A root server runs each sandboxed kernel as the owner of its workspace (alice), but
JupyterLab's own writes (New Folder, uploads, new notebooks, saves, copies, the
``.ipynb_checkpoints`` folder) were root's: read-only to alice's kernel, and root
writing where alice's kernel code can plant links (``report.ipynb -> /etc/...``). So
the server extension (:mod:`~.lab`) makes the server's file manager do its work in a
folder that belongs to someone other than root *as that folder's owner*: the thread
doing it takes the owner's file-system uid and gid and no supplementary groups
(Linux's per-thread ``setfsuid``/``setfsgid``/``setgroups`` system calls, made
directly: glibc's wrappers would change every thread). The kernel drops a thread's
capabilities to override file permissions when its fsuid leaves 0, so what the server
creates there is the owner's from the start, and the server may write, read or copy
there only what the owner may: a link alice planted to a file of root's is opened with
alice's rights (``Permission denied``), nothing is chowned afterwards, so there is no
moment to race.

Which owner: that of the folder the file is made in (the nearest one that exists,
under the server's root). Where a folder above is shut to that owner (a workspace under
``/root``, or in a 0700 temporary folder), the owner could not reach it by its path, so
the server works there as root, as upstream does. A path that goes through a link whose owner is neither root
nor the owner of where it leads (alice's link to bob's folder) is refused, as a
sandboxed kernel's folder is (:func:`~.plan.refuse_foreign_links`). Folders of root
stay as upstream jupyter_server leaves them: root's work in them is root's.

Covered: saving a file, a notebook or a folder (uploads, chunked ones too, new
untitled files and folders), reading a file or notebook (so a copy, which reads as the
server, cannot turn a planted link into alice's copy of root's file), copying a folder,
checkpoints (made, restored), renaming within one owner's folders. Deleting stays
root's work (send2trash moves to root's trash), behind the same link check.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import platform
import secrets
import shutil
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from jupyter_server.services.contents.filecheckpoints import AsyncFileCheckpoints, FileCheckpoints
from jupyter_server.services.contents.fileio import FileManagerMixin, copy2_safe
from jupyter_server.services.contents.filemanager import AsyncFileContentsManager, FileContentsManager
from jupyter_server.services.contents.largefilemanager import LargeFileManager
from tornado.web import HTTPError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The system calls, by machine: (setgroups, setfsuid, setfsgid).
_SYSCALLS = {
    "x86_64": (116, 122, 123),
    "aarch64": (159, 151, 152),
}
Owner = tuple[int, int]


class OwnerSwitchError(OSError):
    """A thread could not take (or give back) an owner's file-system identity."""


class _Identity:
    """The calling thread's file-system identity, switched with raw system calls."""

    def __init__(self) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        self.available = numbers is not None and os.name == "posix"
        self._setgroups, self._setfsuid, self._setfsgid = numbers or (0, 0, 0)
        self._libc = ctypes.CDLL(None, use_errno=True) if self.available else None
        self._local = threading.local()

    def _call(self, number: int, *args: Any) -> int:
        if self._libc is None:
            raise OwnerSwitchError(0, f"no per-thread fsuid on {platform.machine()}")
        return int(self._libc.syscall(ctypes.c_long(number), *args))

    def _groups(self, groups: list[int]) -> None:
        array = (ctypes.c_uint * len(groups))(*groups) if groups else None
        if self._call(self._setgroups, ctypes.c_size_t(len(groups)), array) != 0:
            err = ctypes.get_errno()
            raise OwnerSwitchError(err, f"setgroups: {os.strerror(err)}")

    def _fs(self, uid: int, gid: int) -> None:
        # Each returns the previous id; asked twice, the second answer is the id now held.
        self._call(self._setfsgid, ctypes.c_uint(gid))
        self._call(self._setfsuid, ctypes.c_uint(uid))
        if (
            self._call(self._setfsgid, ctypes.c_uint(gid)) != gid
            or self._call(self._setfsuid, ctypes.c_uint(uid)) != uid
        ):
            raise OwnerSwitchError(0, f"could not take fsuid {uid}, fsgid {gid}")

    def run_as(self, owner: Owner, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)`` in this thread with ``owner``'s file-system identity.

        Raises:
            OwnerSwitchError: the identity could not be taken (nothing was called), or
                this thread already acts for another owner.
        """
        current = getattr(self._local, "owner", None)
        if current is not None:
            if current != owner:
                raise OwnerSwitchError(0, f"this thread acts for uid {current[0]}, not {owner[0]}")
            return call(*args, **kwargs)
        if not self.available:
            raise OwnerSwitchError(0, f"no per-thread fsuid on {platform.machine()}")
        groups = os.getgroups()
        uid, gid = os.geteuid(), os.getegid()
        try:
            self._groups([])
            self._fs(*owner)
        except BaseException:
            self._give_back(uid, gid, groups)
            raise
        self._local.owner = owner
        try:
            return call(*args, **kwargs)
        finally:
            self._local.owner = None
            self._give_back(uid, gid, groups)

    def _give_back(self, uid: int, gid: int, groups: list[int]) -> None:
        try:
            self._fs(uid, gid)
            self._groups(groups)
        except OwnerSwitchError:
            # Left with less than root's rights: only this module's threads, which set
            # their identity afresh at every call, ever get here.
            log.critical("sandbox-kernel: a file thread could not take back fsuid %d", uid, exc_info=True)
            raise


IDENTITY = _Identity()
#: Threads of their own: their identity is only ever the one a call sets.
_EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sandbox-kernel-owner")


async def run_as_owner(owner: Owner, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call`` in one of this module's threads, with ``owner``'s file-system identity."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        _EXECUTOR, functools.partial(IDENTITY.run_as, owner, call, *args, **kwargs)
    )


def _link_refusal(path: str) -> str | None:
    """Why a root server may not act through ``path``: a link in it owned by someone
    other than root or the owner of where it leads; None if there is none."""
    current = Path("/")
    for part in Path(path).parts[1:]:
        candidate = current / part
        try:
            info = os.lstat(candidate)
        except OSError:
            return None  # missing from here on: nothing to follow
        if not stat.S_ISLNK(info.st_mode):
            current = candidate
            continue
        try:
            target = candidate.resolve(strict=True)
            owner = target.stat().st_uid
        except (OSError, RuntimeError):
            return f"{candidate} is a link that leads nowhere"
        if info.st_uid not in (0, owner):
            return (
                f"{candidate} is a link of uid {info.st_uid} to {target}, of uid {owner}: a Jupyter "
                "server running as root follows only links of root or of the target's owner"
            )
        current = target
    return None


def folder_owner(os_path: str, root_dir: str) -> Owner | None:
    """Whom a root server acts for in ``os_path``'s folder: the owner of the nearest
    folder that exists (not above ``root_dir``), and its group (the owner's uid where the
    group is root's, as the kernel gets); None where that is root, or the server is not.

    Raises:
        HTTPError: 403, ``os_path`` goes through another user's link.
    """
    if os.geteuid() != 0:
        return None
    top = os.path.abspath(root_dir)
    folder = os.path.dirname(os.path.abspath(os_path))
    while not os.path.lexists(folder) and folder != top and folder.startswith(top + os.sep):
        folder = os.path.dirname(folder)
    refusal = _link_refusal(os.path.abspath(os_path))
    if refusal is not None:
        raise HTTPError(403, f"Refusing {os_path}: {refusal}")
    try:
        info = os.stat(folder)
    except OSError:
        return None  # the operation says what is missing
    if info.st_uid == 0:
        return None
    if not IDENTITY.available:
        log.warning(
            "sandbox-kernel: %s is uid %d's, but this machine has no per-thread fsuid", folder, info.st_uid
        )
        return None
    owner = info.st_uid, info.st_gid or info.st_uid
    try:
        IDENTITY.run_as(owner, os.stat, folder)
    except PermissionError:
        # A folder above is shut to the owner (under /root, a 0700 temporary folder):
        # the owner could not reach it by its path, so the server works there as root,
        # as upstream does, and what it makes stays root's.
        log.warning(
            "sandbox-kernel: uid %d cannot reach %s by its path; writing there as root", owner[0], folder
        )
        return None
    return owner


def _writing(os_path: str, write: Callable[[], T]) -> T:
    """``write()`` (as the owner) of ``os_path``; where that is a file the owner may not
    write (root's, made by the server before it wrote as the owner), it is moved aside
    first (the owner may: the folder is theirs) so that ``write`` makes it anew, the
    owner's, and put back if ``write`` fails."""
    try:
        info = os.lstat(os_path)
    except FileNotFoundError:
        return write()
    if not stat.S_ISREG(info.st_mode):
        return write()
    try:
        os.close(os.open(os_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC))
    except PermissionError:
        pass
    else:
        return write()
    folder, name = os.path.split(os_path)
    aside = os.path.join(folder, f".~{name}.{secrets.token_hex(4)}")
    os.rename(os_path, aside)  # a folder with the sticky bit refuses: so be it
    try:
        done = write()
    except BaseException:
        os.replace(aside, os_path)
        raise
    os.unlink(aside)
    return done


class OwnedCheckpoints:
    """For :class:`AsyncFileCheckpoints`: checkpoints (and their folder) made as the
    owner of the notebook's folder."""

    root_dir: str
    log: logging.Logger

    def checkpoint_path(self, checkpoint_id: str, path: str) -> str:  # it makes the folder
        os_path = self._get_os_path(path.strip("/"))  # type: ignore[attr-defined]
        owner = folder_owner(os_path, self.root_dir)
        upstream = super().checkpoint_path  # type: ignore[misc]
        if owner is None:
            return str(upstream(checkpoint_id, path))
        # Quick, and synchronous: this thread runs nothing else meanwhile.
        return str(IDENTITY.run_as(owner, upstream, checkpoint_id, path))

    async def _copy(self, src: str, dest: str) -> None:
        owner = folder_owner(dest, self.root_dir)
        if owner is None:
            await super()._copy(src, dest)  # type: ignore[misc]
            return
        await run_as_owner(owner, _writing, dest, functools.partial(copy2_safe, src, dest, log=self.log))


class OwnedContentsMixin:
    """For an :class:`AsyncFileContentsManager`: its writes and reads in a folder of
    someone other than root done as that owner (see the module)."""

    root_dir: str
    checkpoints: Any
    log: logging.Logger

    def _owner(self, os_path: str) -> Owner | None:
        return folder_owner(os_path, self.root_dir)

    async def save(self, model: dict[str, Any], path: str = "") -> Any:
        """A chunked upload's first chunk, written as the owner too: upstream writes it
        through a ``super()`` call that passes this class by."""
        if model.get("chunk") != 1 or model.get("type") != "file" or "content" not in model:
            return await super().save(model, path)  # type: ignore[misc]
        path = path.strip("/")
        os_path = self._get_os_path(path)  # type: ignore[attr-defined]
        if self._owner(os_path) is None:
            return await super().save(model, path)  # type: ignore[misc]
        self.run_pre_save_hooks(model=model, path=path)  # type: ignore[attr-defined]
        try:
            await self._save_file(os_path, model["content"], model.get("format"))
        except HTTPError:
            raise
        except Exception as e:
            self.log.exception("Error while saving file: %s %s", path, e)
            raise HTTPError(500, f"Unexpected error while saving file: {path} {e}") from e
        saved = await self.get(path, content=False)  # type: ignore[attr-defined]
        self.emit(data={"action": "save", "path": path})  # type: ignore[attr-defined]
        return saved

    async def _save_directory(self, os_path: str, model: dict[str, Any], path: str = "") -> None:
        owner = self._owner(os_path)
        if owner is None:
            await super()._save_directory(os_path, model, path)  # type: ignore[misc]
            return
        await run_as_owner(owner, FileContentsManager._save_directory, self, os_path, model, path)

    async def _save_file(self, os_path: str, content: Any, format: str | None) -> None:
        owner = self._owner(os_path)
        if owner is None:
            await super()._save_file(os_path, content, format)  # type: ignore[misc]
            return
        write = functools.partial(FileManagerMixin._save_file, self, os_path, content, format)  # type: ignore[arg-type]
        await run_as_owner(owner, _writing, os_path, write)

    async def _save_large_file(self, os_path: str, content: Any, format: str | None) -> None:
        owner = self._owner(os_path)
        if owner is None:
            await super()._save_large_file(os_path, content, format)  # type: ignore[misc]
            return
        await run_as_owner(owner, LargeFileManager._save_large_file, self, os_path, content, format)

    async def _save_notebook(self, os_path: str, nb: Any, capture_validation_error: Any = None) -> None:
        owner = self._owner(os_path)
        if owner is None:
            await super()._save_notebook(os_path, nb, capture_validation_error)  # type: ignore[misc]
            return
        write = functools.partial(
            FileManagerMixin._save_notebook,
            self,  # type: ignore[arg-type]
            os_path,
            nb,
            capture_validation_error,
        )
        await run_as_owner(owner, _writing, os_path, write)

    async def _read_file(self, os_path: str, format: str | None, raw: bool = False) -> Any:
        owner = self._owner(os_path)
        if owner is None:
            return await super()._read_file(os_path, format, raw=raw)  # type: ignore[misc]
        return await run_as_owner(owner, FileManagerMixin._read_file, self, os_path, format, raw=raw)

    async def _read_notebook(
        self, os_path: str, as_version: int = 4, capture_validation_error: Any = None, raw: bool = False
    ) -> Any:
        owner = self._owner(os_path)
        if owner is None:
            return await super()._read_notebook(  # type: ignore[misc]
                os_path, as_version, capture_validation_error=capture_validation_error, raw=raw
            )
        # The upstream body reads through self._read_file: the synchronous one, here.
        reader = functools.partial(_sync_read_notebook, self)
        return await run_as_owner(owner, reader, os_path, as_version, capture_validation_error, raw)

    async def _copy_dir(self, from_path: str, to_path_original: str, to_name: str, to_path: str) -> Any:
        os_to = f"{self._get_os_path(to_path_original.strip('/'))}/{to_name}"  # type: ignore[attr-defined]
        owner = self._owner(os_to)
        if owner is None:
            return await super()._copy_dir(from_path, to_path_original, to_name, to_path)  # type: ignore[misc]
        os_from = self._get_os_path(from_path.strip("/"))  # type: ignore[attr-defined]
        try:
            await run_as_owner(owner, shutil.copytree, os_from, os_to)
        except OSError as err:
            self.log.error("OSError in _copy_dir: %s", err)
            raise HTTPError(400, f"Can't copy '{from_path}' into read-only Folder '{to_path}'") from err
        return await self.get(to_path, content=False)  # type: ignore[attr-defined]

    async def rename_file(self, old_path: str, new_path: str) -> None:
        old_os = self._get_os_path(old_path.strip("/"))  # type: ignore[attr-defined]
        new_os = self._get_os_path(new_path.strip("/"))  # type: ignore[attr-defined]
        owner = self._owner(old_os)
        if owner is not None and owner == self._owner(new_os):
            await run_as_owner(owner, FileContentsManager.rename_file, self, old_path, new_path)
            return
        await super().rename_file(old_path, new_path)  # type: ignore[misc]

    async def delete_file(self, path: str) -> None:
        self._owner(self._get_os_path(path.strip("/")))  # type: ignore[attr-defined]  # the link check
        await super().delete_file(path)  # type: ignore[misc]

    async def restore_checkpoint(self, checkpoint_id: str, path: str) -> None:
        checkpoints = self.checkpoints
        owner = self._owner(self._get_os_path(path.strip("/")))  # type: ignore[attr-defined]
        if owner is None or not isinstance(checkpoints, FileCheckpoints):
            await super().restore_checkpoint(checkpoint_id, path)  # type: ignore[misc]
            return
        src = checkpoints.checkpoint_path(checkpoint_id, path)  # type: ignore[no-untyped-call]
        dest = self._get_os_path(path.strip("/"))  # type: ignore[attr-defined]
        await run_as_owner(owner, _writing, dest, functools.partial(copy2_safe, src, dest, log=self.log))


def _sync_read_notebook(
    manager: Any, os_path: str, as_version: int, capture_validation_error: Any, raw: bool
) -> Any:
    """FileManagerMixin's notebook reading, with its synchronous file reading."""
    proxy = _SyncReader(manager)
    return FileManagerMixin._read_notebook(proxy, os_path, as_version, capture_validation_error, raw)  # type: ignore[arg-type]


class _SyncReader:
    """``manager`` with FileManagerMixin's synchronous ``_read_file`` and
    ``_read_notebook``, for the upstream notebook reader to call."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def _read_file(self, os_path: str, format: str | None, raw: bool = False) -> Any:
        return FileManagerMixin._read_file(self._manager, os_path, format, raw=raw)

    def _read_notebook(
        self, os_path: str, as_version: int = 4, capture_validation_error: Any = None, raw: bool = False
    ) -> Any:
        return _sync_read_notebook(self._manager, os_path, as_version, capture_validation_error, raw)


def own_the_servers_files(contents_manager: Any, checkpoints: Any) -> bool:
    """Give a root server's contents manager (and its file checkpoints) the owner's
    identity in the owner's folders, in place; False where it is not a file manager this
    can extend (a sync or a database-backed one), which is left as it is."""
    if not isinstance(contents_manager, AsyncFileContentsManager) or not IDENTITY.available:
        return False
    cls = type(contents_manager)
    if not issubclass(cls, OwnedContentsMixin):
        contents_manager.__class__ = type(f"Owned{cls.__name__}", (OwnedContentsMixin, cls), {})
    if isinstance(checkpoints, AsyncFileCheckpoints) and not isinstance(checkpoints, OwnedCheckpoints):
        cp_cls = type(checkpoints)
        checkpoints.__class__ = type(f"Owned{cp_cls.__name__}", (OwnedCheckpoints, cp_cls), {})
    return True
