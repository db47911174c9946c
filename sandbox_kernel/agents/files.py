"""The host side's files API for a kernel's workspace: upload, download, list, delete.

The workspace is shared with sandboxed code that is hostile and may race the host:
between a check and a use it can swap a folder for a symbolic link to anywhere on the
host. So no path string is used after it is checked. Every operation walks from an open
descriptor of the workspace's root one name at a time, opening each folder with
``O_NOFOLLOW | O_DIRECTORY`` and acting on the last name with ``dir_fd=`` and
``O_NOFOLLOW``, then checking what it opened with ``fstat``. A name that is a link, a
fifo, a device or ``..`` is refused, never followed. The root itself is opened the same
way, and must still be the folder it was (device and inode): a local user who owns the
folder above it cannot swap the workspace for a link to, or a copy of, a folder of theirs
choosing and have a root server's files API read and write there.

What the host writes belongs to the kernel's uid and gid, with the modes a kernel-made
file gets (0644, folders 0755), so the kernel can read and overwrite it. An upload is
written to a temporary name in its folder and renamed into place.

Names are whatever bytes kernel code chose: one that is not UTF-8 is listed with surrogate
escapes, as ``os.listdir`` gives it, and flagged (``FileInfo.undecodable``); a recursive
delete removes a tree of any depth (see :mod:`~.trees`). A name over 255 bytes or a path
over 4095 is refused with a message, and messages quote long names shortened, on one line.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import secrets
import stat
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The files API's errors live in errors.py with the rest; importable from here too, as before.
from sandbox_kernel.errors import FileTooLargeError as FileTooLargeError
from sandbox_kernel.errors import FolderNotEmptyError as FolderNotEmptyError
from sandbox_kernel.errors import MissingFileError as MissingFileError
from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.host.trees import delete_tree

if TYPE_CHECKING:
    from sandbox_kernel.backends.base import SandboxBackend

#: What :meth:`WorkspaceFiles.download` reads at most unless told otherwise (100 MiB).
DEFAULT_MAX_BYTES = 100 * 1024 * 1024

#: The modes files and folders made by a kernel get (its umask is 022).
FILE_MODE = 0o644
FOLDER_MODE = 0o755

# O_NONBLOCK: a fifo swapped in for a folder must not make the open wait.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# O_NONBLOCK: opening a fifo must not wait for a writer; what was opened is checked after.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

_UPLOAD_PREFIX = ".sandbox-kernel-upload-"

#: The longest file or folder name Linux file systems take, in bytes (NAME_MAX).
MAX_NAME_BYTES = 255
#: The longest path the kernel could open inside the sandbox, in bytes (PATH_MAX less the NUL).
MAX_PATH_BYTES = 4095
#: How much of a long name a message quotes.
_QUOTED = 100

_NEVER_FOLLOWED = "the files API never follows links"


@dataclass(frozen=True)
class FileInfo:
    """One entry of a workspace folder."""

    name: str
    #: Relative to the kernel's working folder when it lies under it, else the absolute
    #: path inside the sandbox; either is accepted back by :class:`WorkspaceFiles`.
    path: str
    size: int
    is_dir: bool
    #: Last modification, seconds since the epoch.
    modified: float
    #: The name, or a folder's on its path, is not UTF-8 (kernel code may name a file with
    #: any bytes): ``name`` and ``path`` hold those bytes as surrogate escapes, as
    #: ``os.listdir`` does, and are accepted back as they are; such a string cannot be
    #: encoded as UTF-8 (JSON), so show it with :func:`printable`.
    undecodable: bool = False


def printable(name: str) -> str:
    """``name`` as valid UTF-8: each byte of it that is not UTF-8 (a surrogate escape in
    ``name``) as ``\\xNN``; :func:`from_printable` undoes it."""
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def from_printable(path: str) -> str:
    """The path :func:`printable` showed: each ``\\xNN`` escape of a byte from 80 to ff
    turned back into that byte (a surrogate escape where it is not UTF-8)."""
    escaped = re.sub(r"\\x([89a-fA-F][0-9a-fA-F])", lambda m: chr(0xDC00 + int(m.group(1), 16)), path)
    try:
        return escaped.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # it held a surrogate of its own
        return path


def _quoted(text: str) -> str:
    """``text`` as a message quotes it: ``repr`` (so a newline or control character in a
    name cannot break the message's line), its middle left out when it is long."""
    if len(text) <= _QUOTED:
        return repr(text)
    half = _QUOTED // 2
    return f"{text[:half]!r}...{text[-half:]!r} ({len(text)} characters)"


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _kind(mode: int) -> str:
    """What a non-regular, non-folder file is, in words."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "a regular file"


class WorkspaceFiles:
    """Files in one kernel's workspace, as the host sees them; synchronous, thread-safe.

    ``root``: the workspace's host folder (a named volume's host mountpoint);
    ``workspace_path``: where the sandbox sees it (``/workspace``); ``workdir``: the
    kernel's working folder inside the sandbox, under ``workspace_path``; ``uid``,
    ``gid``: whom the kernel runs as, who gets what the host writes; ``identity``: the
    ``(st_dev, st_ino)`` of the folder the kernel mounts, when the caller knows it (else
    the root's, as this object first opens it). The root itself is opened without
    following a link and must still be that folder: one swapped for a link, or for
    another folder, by whoever owns the folder above it is refused.

    A ``path`` argument is relative to the kernel's working folder, or absolute inside
    the sandbox under ``workspace_path``. Every method raises
    :class:`~.errors.WorkspaceError`, saying why, for a path that leaves the workspace,
    contains ``..``, goes through a symbolic link or names a special file, for a missing
    file (:class:`MissingFileError`, a ``FileNotFoundError`` too), a file over a
    download's limit (:class:`FileTooLargeError`), and for any failure of the host's
    file system.
    """

    def __init__(
        self,
        root: Path,
        workdir: str,
        workspace_path: str,
        uid: int,
        gid: int,
        identity: tuple[int, int] | None = None,
    ) -> None:
        if not posixpath.isabs(workspace_path):
            msg = f"workspace_path={_quoted(workspace_path)} must be an absolute path inside the sandbox."
            raise WorkspaceError(msg)
        self.root = Path(root)
        self.workspace_path = posixpath.normpath(workspace_path)
        self.workdir = posixpath.normpath(workdir)
        self.uid = uid
        self.gid = gid
        inner = self._inside(self.workdir)
        if inner is None:
            msg = (
                f"The kernel's working folder {_quoted(workdir)} is not under its workspace's path "
                f"{_quoted(workspace_path)} in the sandbox."
            )
            raise WorkspaceError(msg)
        self._workdir_parts = inner
        self.identity = identity
        if identity is None:
            try:
                os.close(self._open_root())
            except WorkspaceError:
                pass  # said again, with the same words, by the first operation

    # ---------------------------------------------------------------- the API

    def upload(self, path: str, data: bytes | str) -> str:
        """Write ``data`` (text as UTF-8) to ``path``, replacing a file there atomically and
        creating missing folders; the kernel's uid owns what is created. Returns the
        file's absolute path inside the sandbox.

        Raises:
            WorkspaceError: the path is refused, names a folder, or writing failed.
        """
        parts = self._parts(path)
        if not parts:
            msg = f"{_quoted(path)} is the workspace's folder, not a file name."
            raise WorkspaceError(msg)
        if path.endswith("/"):
            msg = f"{_quoted(path)} ends with '/', so it names a folder: give the file's name after it."
            raise WorkspaceError(msg)
        self._check_can_give()
        content = data.encode() if isinstance(data, str) else bytes(data)
        *folders, name = parts
        with self._folder(folders, path, create=True) as parent:
            self._check_replaceable(parent, name, parts)
            temp = f"{_UPLOAD_PREFIX}{secrets.token_hex(8)}"
            with self._guard(parts, "write"):
                fd = os.open(temp, _CREATE_FLAGS, 0o600, dir_fd=parent)
            try:
                with self._guard(parts, "write"):
                    self._give(fd, FILE_MODE)
                    view = memoryview(content)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                os.close(fd)
                fd = -1
                with self._guard(parts, "write"):
                    os.replace(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                try:
                    os.unlink(temp, dir_fd=parent)
                except OSError:
                    pass
                raise
        return self._sandbox_path(parts)

    def download(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        """The content of the regular file ``path``, at most ``max_bytes`` long.

        Raises:
            WorkspaceError: the path is refused or missing, names anything but a regular
                file with one link, or the file is longer than ``max_bytes``.
        """
        parts = self._parts(path)
        if not parts:
            msg = f"{_quoted(path)} is the workspace's folder, not a file."
            raise WorkspaceError(msg)
        *folders, name = parts
        with self._folder(folders, path) as parent:
            with self._guard(parts, "read"):
                # Devices are not even opened (opening one can act); what is opened is checked again.
                self._check_regular(parts, os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
                fd = os.open(name, _READ_FLAGS, dir_fd=parent)
            try:
                st = os.fstat(fd)
                self._check_regular(parts, st.st_mode)
                if st.st_nlink > 1:
                    # Made on the host (a kernel cannot link): it may be a file from outside.
                    msg = (
                        f"{self._named(parts)} has {st.st_nlink} hard links, so it may be a file from "
                        "outside the workspace: the files API does not read it. Copy it instead of "
                        "linking it."
                    )
                    raise WorkspaceError(msg)
                self._check_size(parts, st.st_size, max_bytes)
                chunks = []
                left = max_bytes + 1  # a file that grows while read is caught too
                with self._guard(parts, "read"):
                    while left > 0:
                        chunk = os.read(fd, min(left, 1 << 20))
                        if not chunk:
                            break
                        chunks.append(chunk)
                        left -= len(chunk)
            finally:
                os.close(fd)
        content = b"".join(chunks)
        self._check_size(parts, len(content), max_bytes, read=True)
        return content

    def list(self, path: str = ".") -> list[FileInfo]:
        """The files and folders in the folder ``path``, by name. Symbolic links, fifos,
        devices and sockets are left out, as are uploads being written.

        Raises:
            WorkspaceError: the path is refused, missing, or not a folder.
        """
        parts = self._parts(path)
        found = []
        with self._folder(parts, path) as folder, self._guard(parts, "list"):
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.startswith(_UPLOAD_PREFIX):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # removed meanwhile
                        continue
                    is_dir = stat.S_ISDIR(st.st_mode)
                    if not (is_dir or stat.S_ISREG(st.st_mode)):
                        continue
                    shown = self._display((*parts, entry.name))
                    found.append(
                        FileInfo(
                            name=entry.name,
                            path=shown,
                            size=0 if is_dir else st.st_size,
                            is_dir=is_dir,
                            modified=st.st_mtime,
                            undecodable=not _is_utf8(shown),
                        )
                    )
        return sorted(found, key=lambda info: info.name)

    def delete(self, path: str, recursive: bool = False) -> None:
        """Remove the file ``path``, or the folder ``path`` when it is empty, or with all it
        holds when ``recursive``. Links inside a folder removed recursively are removed,
        never followed.

        Raises:
            WorkspaceError: the path is refused or missing, is the kernel's working
                folder or holds it, or is a folder that is not empty (without ``recursive``).
        """
        parts = self._parts(path)
        if parts == self._workdir_parts[: len(parts)]:
            msg = (
                f"{_quoted(path)} is the kernel's working folder or holds it ({self.workdir}): "
                "the files API does not delete it."
            )
            raise WorkspaceError(msg)
        *folders, name = parts
        with self._folder(folders, path) as parent:
            with self._guard(parts, "delete"):
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise WorkspaceError(self._link_message(parts))
            if not stat.S_ISDIR(st.st_mode):
                with self._guard(parts, "delete"):
                    os.unlink(name, dir_fd=parent)
                return
            try:
                os.rmdir(name, dir_fd=parent)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    with self._guard(parts, "delete"):
                        raise
                if not recursive:
                    msg = (
                        f"{self._named(parts)} is a folder that is not empty: delete it with recursive=True."
                    )
                    raise FolderNotEmptyError(msg) from None
                with self._guard(parts, "delete"):
                    delete_tree(name, dir_fd=parent)

    # ---------------------------------------------------------------- paths

    def _inside(self, absolute: str) -> tuple[str, ...] | None:
        """The names of an absolute in-sandbox path below ``workspace_path``; None if outside."""
        if absolute == self.workspace_path:
            return ()
        if not absolute.startswith(self.workspace_path.rstrip("/") + "/"):
            return None
        return tuple(p for p in absolute[len(self.workspace_path) :].split("/") if p not in ("", "."))

    def _parts(self, path: str) -> tuple[str, ...]:
        """The names leading from the workspace's root to ``path``, checked but not opened.

        Raises:
            WorkspaceError: ``path`` has ``..`` or a NUL, or lies outside the workspace.
        """
        if not isinstance(path, str):
            msg = f"A workspace path is a string, not {type(path).__name__}: {_quoted(path)}."
            raise WorkspaceError(msg)
        if "\0" in path:
            msg = f"{_quoted(path)} contains a NUL character."
            raise WorkspaceError(msg)
        try:
            encoded = os.fsencode(path)
        except UnicodeEncodeError:  # a lone surrogate that stands for no byte
            msg = f"{_quoted(path)} holds a character that is no byte of a file name (a lone surrogate)."
            raise WorkspaceError(msg) from None
        too_long = next((name for name in encoded.split(b"/") if len(name) > MAX_NAME_BYTES), None)
        if too_long is not None:
            msg = (
                f"{_quoted(path)} has a name of {len(too_long)} bytes: a file or folder name may be "
                f"at most {MAX_NAME_BYTES} bytes."
            )
            raise WorkspaceError(msg)
        absolute = path.startswith("/")
        names = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in names:
            joined = posixpath.normpath(posixpath.join(self.workdir, path))
            if self._inside(joined) is None:
                msg = f"{_quoted(path)} leaves the workspace ({self.workspace_path} in the sandbox)."
            else:
                msg = (
                    f"{_quoted(path)} contains '..', which the files API does not follow: name the "
                    f"file without it, e.g. {joined!r}."
                )
            raise WorkspaceError(msg)
        if not absolute:
            parts = (*self._workdir_parts, *names)
        else:
            inner = self._inside(posixpath.normpath(path))
            if inner is None:
                msg = (
                    f"{_quoted(path)} is outside the workspace: only paths under {self.workspace_path} "
                    "(the workspace in the sandbox) can be used."
                )
                raise WorkspaceError(msg)
            parts = inner
        length = len(os.fsencode(self._sandbox_path(parts)))
        if length > MAX_PATH_BYTES:
            msg = (
                f"{_quoted(path)} is {length} bytes long in the sandbox: the kernel could not open a "
                f"path over {MAX_PATH_BYTES} bytes. Use a shorter path."
            )
            raise WorkspaceError(msg)
        return parts

    def _display(self, parts: Sequence[str]) -> str:
        """How to name ``parts`` to the caller: relative to the working folder if under it."""
        parts = tuple(parts)
        n = len(self._workdir_parts)
        if len(parts) > n and parts[:n] == self._workdir_parts:
            return "/".join(parts[n:])
        return self._sandbox_path(parts)

    def _named(self, parts: Sequence[str]) -> str:
        """``parts`` as a message names it (see :func:`_quoted`)."""
        return _quoted(self._display(parts))

    def _sandbox_path(self, parts: Sequence[str]) -> str:
        return posixpath.join(self.workspace_path, *parts) if parts else self.workspace_path

    def _link_message(self, parts: Sequence[str]) -> str:
        return f"{self._named(parts)} is a symbolic link: {_NEVER_FOLLOWED}."

    # ---------------------------------------------------------------- descriptors

    @contextmanager
    def _folder(self, parts: Sequence[str], path: str, create: bool = False) -> Iterator[int]:
        """An open descriptor of the folder ``parts``, walked to from the root one name at a
        time without following links; missing folders are made when ``create``."""
        fd = self._open_root()
        try:
            for depth, name in enumerate(parts, 1):
                here = tuple(parts[:depth])
                if create:
                    self._make_folder(fd, name, here)
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise self._walk_error(exc, fd, name, here, path) from None
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _open_root(self) -> int:
        """An open descriptor of the workspace's root: not through a link at its last name,
        and the folder :attr:`identity` names (recorded now if it is not known yet).

        Raises:
            WorkspaceError: the root is missing, a link, not a folder, or another folder
                than the kernel's, or cannot be opened.
        """
        where = _quoted(str(self.root))
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except FileNotFoundError:
            msg = f"The workspace's folder {where} no longer exists on the host."
            raise WorkspaceError(msg) from None
        except PermissionError as exc:
            msg = (
                f"This process may not open the workspace's folder {where} on the host "
                "(a named volume's files under Docker's data root need root): use the files API "
                "from a process running as root or as the folder's owner."
            )
            raise WorkspaceError(msg) from exc
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    what = _kind(os.lstat(self.root).st_mode)
                except OSError:
                    what = "not a folder"
                msg = (
                    f"The workspace's folder {where} on the host is now {what}: someone replaced "
                    f"it after the kernel started, and {_NEVER_FOLLOWED}. Restart the kernel in "
                    "the real folder."
                )
                raise WorkspaceError(msg) from None
            msg = f"Cannot open the workspace's folder {where} on the host: {exc.strerror}."
            raise WorkspaceError(msg) from exc
        st = os.fstat(fd)
        if self.identity is None:
            self.identity = (st.st_dev, st.st_ino)
        elif (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            msg = (
                f"The workspace's folder {where} on the host is no longer the folder the kernel "
                "was started with (it was moved or replaced, perhaps through a link above it): "
                "the files API does not use it. Restart the kernel in the real folder."
            )
            raise WorkspaceError(msg)
        return fd

    def _walk_error(
        self, exc: OSError, parent: int, name: str, here: tuple[str, ...], path: str
    ) -> WorkspaceError:
        """Why the folder ``here`` (on the way to ``path``) could not be opened."""
        try:
            mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        except OSError:
            mode = None
        shown = self._display(here)
        if exc.errno == errno.ELOOP or (mode is not None and stat.S_ISLNK(mode)):
            return WorkspaceError(self._link_message(here))
        if exc.errno == errno.ENOENT:
            return MissingFileError(
                f"No such folder {_quoted(shown)} in the workspace (for {_quoted(path)})."
            )
        if exc.errno == errno.ENOTDIR and mode is not None:
            return WorkspaceError(f"{_quoted(shown)} is {_kind(mode)}, not a folder (for {_quoted(path)}).")
        return WorkspaceError(f"Cannot open the folder {_quoted(shown)} in the workspace: {exc.strerror}.")

    def _make_folder(self, parent: int, name: str, here: tuple[str, ...]) -> None:
        """Make the folder ``name`` in ``parent`` unless there is one, given to the kernel."""
        try:
            os.mkdir(name, FOLDER_MODE, dir_fd=parent)
        except FileExistsError:
            return
        except OSError as exc:
            msg = f"Cannot create the folder {self._named(here)} in the workspace: {exc.strerror}."
            raise WorkspaceError(msg) from exc
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError:
            return  # swapped meanwhile: the walk's own open says what it found
        try:
            self._give(fd, FOLDER_MODE)
        finally:
            os.close(fd)

    def _check_regular(self, parts: tuple[str, ...], mode: int) -> None:
        if stat.S_ISLNK(mode):
            raise WorkspaceError(self._link_message(parts))
        if not stat.S_ISREG(mode):
            msg = f"{self._named(parts)} is {_kind(mode)}, not a regular file: it cannot be downloaded."
            raise WorkspaceError(msg)

    def _check_replaceable(self, parent: int, name: str, parts: tuple[str, ...]) -> None:
        """Refuse to upload over anything but a regular file (renaming would not follow a
        link there, but the caller asked for a file the API does not touch)."""
        try:
            mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        except OSError:
            return  # missing is fine; any other failure recurs, and is said, where it writes
        if stat.S_ISLNK(mode):
            raise WorkspaceError(self._link_message(parts))
        if not stat.S_ISREG(mode):
            msg = f"{self._named(parts)} is {_kind(mode)}: an upload only creates or replaces regular files."
            raise WorkspaceError(msg)

    def _check_size(self, parts: tuple[str, ...], size: int, max_bytes: int, read: bool = False) -> None:
        """Refuse a file over the limit (``read``: reading stopped just past it)."""
        if size > max_bytes:
            msg = (
                f"{self._named(parts)} ({'at least ' if read else ''}{size} bytes) is larger than "
                f"the download limit of {max_bytes} bytes: pass a larger max_bytes, or have the kernel "
                "split or compress it."
            )
            raise FileTooLargeError(msg, size, max_bytes)

    def _check_can_give(self) -> None:
        """Refuse to write files the kernel could not overwrite."""
        euid = os.geteuid()
        if euid not in (0, self.uid):
            msg = (
                f"This process runs as uid {euid}, not root, so what it writes cannot belong to "
                f"the kernel's uid {self.uid}: the kernel could not overwrite it. Upload from a "
                "process running as root or as the kernel's uid."
            )
            raise WorkspaceError(msg)

    def _give(self, fd: int, mode: int) -> None:
        """Hand a file the host made to the kernel's uid and gid, with a kernel's mode."""
        if os.geteuid() == 0:
            os.fchown(fd, self.uid, self.gid)
        os.fchmod(fd, mode)

    @contextmanager
    def _guard(self, parts: tuple[str, ...], doing: str) -> Iterator[None]:
        """The host's errors about ``parts`` as WorkspaceErrors that say what happened."""
        shown = self._display(parts)
        try:
            yield
        except WorkspaceError:
            raise
        except FileNotFoundError:
            msg = f"No such file {_quoted(shown)} in the workspace."
            raise MissingFileError(msg) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise WorkspaceError(self._link_message(parts)) from None
            if exc.errno == errno.EISDIR:
                msg = f"{_quoted(shown)} is a folder: cannot {doing} it as a file."
                raise WorkspaceError(msg) from None
            if exc.errno == errno.ENOTDIR:
                msg = f"{_quoted(shown)} is not a folder: cannot {doing} it as one."
                raise WorkspaceError(msg) from None
            msg = f"Cannot {doing} {_quoted(shown)} in the workspace: {exc.strerror}."
            raise WorkspaceError(msg) from exc


async def workspace_files(info: Mapping[str, Any], backend: SandboxBackend | None = None) -> WorkspaceFiles:
    """The files API for the kernel whose provisioner info is ``info``
    (``await km.provisioner.get_provisioner_info()``, or a saved kernel state's).

    ``info["workspace_identity"]``, when present, is the ``(st_dev, st_ino)`` of the
    folder the kernel mounts; the root must still be it (see :class:`WorkspaceFiles`).
    A named volume's files are found through ``backend`` (Docker by default), which
    only hands out sandbox-kernel workspace volumes of this server's user.

    Raises:
        WorkspaceError: the info lacks the kernel's workspace (not a started sandboxed
            kernel), or its volume is not such a volume or cannot be reached.
    """
    needed = ("workspace", "workdir", "workspace_path", "uid", "gid")
    missing = [key for key in needed if info.get(key) is None]
    if missing:
        msg = (
            f"The kernel's provisioner info lacks {', '.join(missing)}: it is not a started sandboxed "
            "kernel, or it was saved by an older sandbox-kernel. Start (or reattach) the kernel first."
        )
        raise WorkspaceError(msg)
    volume = info.get("volume")
    if volume:
        if backend is None:
            from sandbox_kernel.backends import configured_backend

            backend = configured_backend()
        root = await backend.volume_path(str(volume))
    else:
        root = Path(str(info["workspace"]))
    identity = info.get("workspace_identity")
    return WorkspaceFiles(
        root,
        workdir=str(info["workdir"]),
        workspace_path=str(info["workspace_path"]),
        uid=int(info["uid"]),
        gid=int(info["gid"]),
        identity=(int(identity[0]), int(identity[1])) if identity else None,
    )
