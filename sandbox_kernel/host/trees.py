"""Folder trees on the host that sandboxed code or a user may have made: removed, measured
and opened safely.

A kernel's launch folder, a workspace folder deleted through the files API, a runtime
folder a dead process left: the host walks trees whose every entry kernel code may have
chosen. It may have made them thousands of levels deep (Python 3.11's ``shutil.rmtree``
and ``os.fwalk`` recurse, and fail with ``RecursionError``; holding a descriptor per
level runs out of descriptors), full of links, read-only, and owned by the kernel's uid.

So the walk here keeps an explicit stack, not Python's, and holds one descriptor at a
time: it opens each folder relative to its parent with ``O_NOFOLLOW | O_DIRECTORY`` (a
link is unlinked, never followed), climbs back through ``..`` only after checking that
it leads to the folder it came from (a folder moved meanwhile stops the walk, never
sends it out of the tree), and never enters another file system mounted inside.

Opening one folder of such a tree by its path (:func:`open_folder`, a gateway user's
workspace) is the same walk downward only: one name at a time from ``/``, each relative to
the descriptor of the last, no link followed, and whose folder it is read with ``fstat`` on
the very descriptor that is returned. What is checked is then what is open, however the
names change meanwhile.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

# O_NONBLOCK: a fifo swapped in for a folder must not make the open wait.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# A handle that can only be a folder and needs no permission on it: to make it readable.
_HANDLE_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def delete_tree(
    path: str | os.PathLike[str], dir_fd: int | None = None, owner: tuple[int, int] | None = None
) -> None:
    """Remove ``path`` (a name in the open folder ``dir_fd`` when given) and, when it is
    a folder, everything in it, however deep; a missing ``path`` is fine.

    Links are removed, never followed. A folder this process may not read or write is
    made so (0700) where it may (as its owner, or root). With ``owner`` (uid, gid), each
    folder is handed to ``owner`` (0700) as it is entered, before its entries are read:
    kernel code still running can add nothing to a folder being emptied.

    Raises:
        OSError: something could not be removed (the first such failure; all else that
            could be removed is gone), or a folder was moved out from under the walk.
    """
    deleting = _Deleting(owner)
    if dir_fd is not None:
        deleting.run(dir_fd, os.fspath(path))
        return
    folder, name = os.path.split(os.path.abspath(path))
    try:
        parent = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return  # so there is no ``path`` either
    try:
        deleting.run(parent, name)
    finally:
        os.close(parent)


class ForeignFolderError(PermissionError):
    """A folder on the way to the one :func:`open_folder` opens belongs to another uid
    (``owner``); ``filename`` is its path."""

    def __init__(self, path: str, owner: int) -> None:
        super().__init__(errno.EPERM, f"belongs to uid {owner}", path)
        self.owner = owner


def open_folder(
    path: str | os.PathLike[str],
    owner: int | None = None,
    owned_from: str | os.PathLike[str] | None = None,
) -> int:
    """An ``O_PATH`` descriptor of the folder ``path``, opened one name at a time from ``/``,
    each name relative to the descriptor of the folder before it, following no link. With
    ``owner``, every folder from ``owned_from`` (an ancestor of ``path``, or ``path`` itself,
    the default) down to ``path`` must belong to that uid: read with ``fstat`` on each
    descriptor of the walk, so the folders checked are the ones opened, and the folder
    returned is the one checked, whatever is renamed or swapped for a link meanwhile. At
    most two descriptors are open at a time, so any depth works (however long ``path``).

    Raises:
        ValueError: ``path`` (or ``owned_from``) is not absolute and normalised (no ``.``,
            ``..`` or empty name), or ``owned_from`` is not ``path`` or above it.
        NotADirectoryError: a name on the way is a link, or not a folder (``filename``: the
            path up to it).
        ForeignFolderError: a folder from ``owned_from`` down belongs to another uid.
        OSError: a folder on the way could not be opened (FileNotFoundError: it is gone).
    """
    names = _names(path)
    checked_from = len(names) if owned_from is None else len(_names(owned_from))
    if owned_from is not None and names[:checked_from] != _names(owned_from):
        msg = f"{os.fspath(owned_from)!r} is not {os.fspath(path)!r} or a folder above it"
        raise ValueError(msg)
    fd = os.open("/", _HANDLE_FLAGS)
    try:
        for depth in range(len(names) + 1):
            if depth > 0:
                try:
                    child = _open(fd, names[depth - 1], _HANDLE_FLAGS)
                except _NotAFolder:
                    where = os.fsdecode(b"/" + b"/".join(names[:depth]))
                    raise NotADirectoryError(errno.ENOTDIR, "is a link or not a folder", where) from None
                os.close(fd)
                fd = child
            if owner is not None and depth >= checked_from:
                uid = os.fstat(fd).st_uid
                if uid != owner:
                    raise ForeignFolderError(os.fsdecode(b"/" + b"/".join(names[:depth])), uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _names(path: str | os.PathLike[str]) -> list[bytes]:
    """The names of the absolute, normalised ``path`` (bytes: any a file system takes).

    Raises:
        ValueError: it is not absolute, or has an empty, ``.`` or ``..`` name.
    """
    raw = os.fsencode(path)
    names = raw.split(b"/")[1:] if raw != b"/" else []
    if not raw.startswith(b"/") or any(name in (b"", b".", b"..") for name in names):
        msg = f"{os.fsdecode(raw)!r} is not an absolute path without '.', '..' or empty names"
        raise ValueError(msg)
    return names


def tree_size(path: str | os.PathLike[str]) -> int:
    """The bytes of the regular files in the folder ``path`` and in its folders, however
    deep (0 if there is no such folder); links are not followed, other mounted file
    systems not entered.

    Raises:
        OSError: ``path`` or a folder in it could not be read.
    """
    measuring = _Measuring()
    folder, name = os.path.split(os.path.abspath(path))
    try:
        parent = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    try:
        measuring.run(parent, name)
    finally:
        os.close(parent)
    return measuring.total


class _NotAFolder(Exception):
    """The name is not (or no longer) a folder: a file, a link, a socket..."""


@dataclass
class _Level:
    """A folder on the walk's path: its name in its parent, its (device, inode), and
    the subfolders still to visit."""

    name: str
    identity: tuple[int, int]
    subfolders: list[str] = field(default_factory=list)


class _Walk:
    """Depth first through a folder tree, one open descriptor at a time; what to do in
    each folder is the subclass's. Failures inside are kept in ``errors`` and the walk
    goes on; :meth:`run` raises the first."""

    def __init__(self, owner: tuple[int, int] | None = None) -> None:
        self.owner = owner
        self.errors: list[OSError] = []

    def enter(self, fd: int) -> list[str]:
        """Act on the entries of the open folder ``fd``; its subfolders to visit."""
        raise NotImplementedError

    def leave(self, parent: int, name: str) -> None:
        """The folder ``name`` in ``parent``, all its subfolders visited."""

    def not_a_folder(self, parent: int, name: str) -> None:
        """``name`` in ``parent`` was to be visited, but it is not a folder (any more)."""

    def run(self, parent: int, name: str) -> None:
        """Walk the folder ``name`` in the open folder ``parent`` (which stays open).

        Raises:
            OSError: the first failure; or ``name`` could not be opened; or a folder was
                moved out from under the walk (climbing back through ``..`` would have
                led elsewhere).
        """
        try:
            fd = self._open_folder(parent, name)
        except FileNotFoundError:
            return
        except _NotAFolder:
            self.not_a_folder(parent, name)
            self._raise_first()
            return
        try:
            top = _Level(name, _identity(fd))
            top.subfolders = self.enter(fd)
            stack = [top]
            while stack:
                level = stack[-1]
                if level.subfolders:
                    opened = self._descend(fd, level.subfolders.pop(), top.identity[0])
                    if opened is not None:
                        fd, child = opened
                        stack.append(child)
                        child.subfolders = self.enter(fd)
                    continue
                stack.pop()
                if not stack:
                    os.close(fd)
                    fd = -1
                    self.leave(parent, level.name)
                    break
                fd = self._climb(fd, stack[-1], level.name)
                self.leave(fd, level.name)
        finally:
            if fd != -1:
                os.close(fd)
        self._raise_first()

    def _raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]

    def _descend(self, fd: int, name: str, device: int) -> tuple[int, _Level] | None:
        """Open the subfolder ``name`` of ``fd`` instead of ``fd``; None if it is not entered."""
        try:
            child = self._open_folder(fd, name)
        except FileNotFoundError:
            return None
        except _NotAFolder:  # swapped for a link or a file since it was listed
            self.not_a_folder(fd, name)
            return None
        except OSError as exc:
            self.errors.append(exc)
            return None
        identity = _identity(child)
        if identity[0] != device:
            os.close(child)
            self.errors.append(OSError(errno.EXDEV, "another file system is mounted there", name))
            return None
        os.close(fd)
        return child, _Level(name, identity)

    @staticmethod
    def _climb(fd: int, parent: _Level, name: str) -> int:
        """The parent of the open folder ``fd``, which must be ``parent``; ``fd`` is closed."""
        up = os.open("..", _DIR_FLAGS, dir_fd=fd)
        if _identity(up) != parent.identity:
            os.close(up)
            raise OSError(errno.ESTALE, "a folder was moved while the host walked it", name)
        os.close(fd)
        return up

    def _open_folder(self, parent: int, name: str) -> int:
        """The folder ``name`` in ``parent``, open for reading (made readable if need
        be) and handed to ``owner`` if one is given.

        Raises:
            _NotAFolder: it is not a folder (a link to one is not).
            OSError: it could not be opened (FileNotFoundError: it is gone).
        """
        try:
            fd = _open(parent, name, _DIR_FLAGS)
        except PermissionError as denied:
            handle = _open(parent, name, _HANDLE_FLAGS)
            try:
                # Through the handle: the folder it holds, whatever the name is now.
                os.chmod(f"/proc/self/fd/{handle}", 0o700)
            except FileNotFoundError:  # no /proc
                raise denied from None
            finally:
                os.close(handle)
            fd = _open(parent, name, _DIR_FLAGS)
        if self.owner is not None:
            try:
                os.fchown(fd, *self.owner)
                os.fchmod(fd, 0o700)
            except OSError:
                os.close(fd)
                raise
        return fd


class _Deleting(_Walk):
    def enter(self, fd: int) -> list[str]:
        subfolders, others = _listing(fd, self.errors)
        for name in others:
            try:
                _writable(fd, functools.partial(os.unlink, name, dir_fd=fd))
            except FileNotFoundError:
                continue
            except IsADirectoryError:  # swapped for a folder since it was listed
                subfolders.append(name)
            except OSError as exc:
                self.errors.append(exc)
        return subfolders

    def leave(self, parent: int, name: str) -> None:
        try:
            _writable(parent, functools.partial(os.rmdir, name, dir_fd=parent))
        except FileNotFoundError:
            return
        except OSError as exc:
            if not self.errors:  # else it is not empty for what failed before
                self.errors.append(exc)

    def not_a_folder(self, parent: int, name: str) -> None:
        try:
            _writable(parent, functools.partial(os.unlink, name, dir_fd=parent))
        except FileNotFoundError:
            return
        except OSError as exc:
            self.errors.append(exc)


class _Measuring(_Walk):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def enter(self, fd: int) -> list[str]:
        subfolders: list[str] = []
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    subfolders.append(entry.name)
                elif stat.S_ISREG(st.st_mode):
                    self.total += st.st_size
        return subfolders


def _listing(fd: int, errors: list[OSError]) -> tuple[list[str], list[str]]:
    """(subfolders, other entries) of the open folder ``fd``."""
    subfolders: list[str] = []
    others: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                errors.append(exc)
                continue
            (subfolders if is_dir else others).append(entry.name)
    return subfolders, others


def _writable(fd: int, change: Callable[[], None]) -> None:
    """``change()`` in the open folder ``fd``, made writable (0700) first if it was not."""
    try:
        change()
    except PermissionError:
        os.fchmod(fd, 0o700)
        change()


def _open(parent: int, name: str | bytes, flags: int) -> int:
    try:
        return os.open(name, flags, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _NotAFolder(name) from exc
        raise


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
