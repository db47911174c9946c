"""Saving a gVisor sandbox to disk with runsc itself, beside Docker, and fast.

Docker 20.10's own checkpoint is slow for a kernel that holds memory: runsc compresses
the image (flate, on the host's cores), containerd copies it into its content store and
Docker copies it out again into its checkpoint folder; a start from the checkpoint copies
it twice more before runsc reads it. For a kernel holding 1 GiB of Python objects
(1.3 GB of pages) that is 49 s to pause and 25-50 s to resume. Measured on the same
2-core host, runsc 20240729 (``runsc checkpoint`` alone, then the whole resume to the
kernel's first reply; 2026-12-02, interleaved, load 2-3):

===============================================  ===========  ================
1 GiB of objects (1.35 GB of pages)               checkpoint   resume -> reply
===============================================  ===========  ================
``docker checkpoint create`` / ``start``          27 s         25 s
runsc, uncompressed, O_DIRECT writes              1.1-1.3 s    2.3-3.4 s
runsc, uncompressed, through the page cache       0.7-1.9 s    1.5-1.6 s
runsc, flate-best-speed (image 0.37 GB)           4.3 s        2.5 s (alone)
===============================================  ===========  ================

Docker's start from a checkpoint has runsc read the pages file without O_DIRECT
(Docker's runc shim passes no restore flags), so an image written with O_DIRECT is read
back from the disk (here ~0.5 GB/s); one written through the page cache is read back
from memory while the host has it there (the kernel writes it out meanwhile, and may
drop it when memory is short: then the resume reads the disk, as with O_DIRECT). The
resume is what a user waits for; the pause happens while nobody does. So the image is
written through the page cache where it fits in the dirty memory the host's kernel
allows (``vm.dirty_ratio`` of the memory available; past that the writer is held to the
disk's pace: an earlier run here measured 8 s for 1 GiB written buffered), else with
O_DIRECT where the file system takes it: :func:`writes_through_cache`.

So, where this process may (it runs as root, like Docker's own runtime calls), the
backend runs ``runsc checkpoint`` itself, with the flags Docker gives the container's
runtime and the state root its sandbox runs under, writing the image uncompressed
through the page cache into a folder of the container's own, which Docker removes with
the container. Docker's checkpoint folder then gets only symbolic links to the image's
files: ``docker start --checkpoint`` carries the links through containerd, and ``runsc
restore`` reads the image where it lies.

containerd unpacks a checkpoint into a ``ctrd-checkpoint*`` folder of its temp folder to
start a container from it, and never removes it (containerd 1.6, ``services/tasks/local.go``):
each resume would leave one behind, holding links to the image (or, for Docker's own
checkpoint, a copy of it). :func:`restore_copies` finds that folder of one checkpoint,
and nothing else, for the backend to remove.

What is decided here is pure, but for :func:`supports_direct_io`, :func:`link_image` and
:func:`restore_copies`, which touch only the folders they are given, and
:func:`containerd_temp_dirs` and :func:`dirty_room`, which read /proc.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

#: Where the images are kept, inside Docker's folder of the container (removed with it).
IMAGES_FOLDER = "sandbox-kernel-checkpoints"
#: How containerd names the folder (in its temp folder) it unpacks a checkpoint into.
RESTORE_FOLDER_PREFIX = "ctrd-checkpoint"
#: Files up to this size are compared whole to tell containerd's copy of a checkpoint;
#: bigger ones (the memory pages) by their size, first and last ``_SAMPLE`` bytes.
_WHOLE = 16 * 2**20
_SAMPLE = 2**20


def may_run_runsc() -> bool:
    """Whether this process may run runsc itself (as Docker's runtime calls do: as root);
    else Docker's own checkpoint saves the sandbox."""
    return os.geteuid() == 0


def image_folder(container_folder: Path, name: str) -> Path:
    """The folder holding checkpoint ``name``'s image files."""
    return container_folder / IMAGES_FOLDER / name


def runsc_root(cmdline: bytes) -> str | None:
    """The state root (``--root``) a gVisor sandbox runs under, from its host process's
    command line (NUL-separated, as in ``/proc/PID/cmdline``; Docker's runtime call wrote
    it, but it is the sandbox process's own memory: check it with :func:`is_state_root`).
    None if it has none."""
    args = [arg.decode("utf-8", "surrogateescape") for arg in cmdline.split(b"\0")]
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            return None  # the subcommand (boot): its flags are not runsc's global ones
        flag, _, value = arg.lstrip("-").partition("=")
        if flag == "root":
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            return value if value.startswith("/") else None
    return None


def is_state_root(root: str, container_id: str) -> bool:
    """Whether ``root`` is a state root runsc may be pointed at as root for this
    container: an absolute path that resolves (``/var/run`` is a link to ``/run``) to
    folders owned by root that no one else may write to, holding the container's state
    file (runsc names it ``ID_sandbox:ID.state``), also root's."""
    if not root.startswith("/"):
        return False
    root = os.path.realpath(root)
    try:
        path = Path("/")
        for part in Path(root).parts[1:]:
            path = path / part
            info = path.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
                return False
        state = (Path(root) / f"{container_id}_sandbox:{container_id}.state").lstat()
    except OSError:
        return False
    return stat.S_ISREG(state.st_mode) and state.st_uid == 0


def checkpoint_command(
    runsc: str,
    runtime_args: Sequence[str],
    root: str,
    image: Path,
    container_id: str,
    *,
    direct: bool = False,
) -> list[str]:
    """``runsc checkpoint`` of the container's sandbox into ``image``: the runtime's
    own flags (as Docker passes them), its state root, an uncompressed image (compressing
    costs more time than writing the pages), zero pages left out, written through the page
    cache unless ``direct`` (O_DIRECT: see :func:`writes_through_cache`); the sandbox stops
    once saved."""
    flags: list[str] = []
    args = iter(runtime_args)
    for arg in args:
        if arg.lstrip("-").partition("=")[0] != "root":
            flags.append(arg)
        elif "=" not in arg:
            next(args, None)  # ``--root X``: X goes too
    options = ["-compression=none", "-exclude-committed-zero-pages"] + (["-direct"] if direct else [])
    return [runsc, *flags, f"--root={root}", "checkpoint", *options, f"--image-path={image}", container_id]


def supports_direct_io(folder: Path) -> bool:
    """Whether files in ``folder`` can be written with O_DIRECT (not on every file
    system: runsc's checkpoint fails there, and ends the sandbox)."""
    probe = folder / ".direct-io-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        probe.unlink()
    return hasattr(os, "O_DIRECT")


def writes_through_cache(image_bytes: int | None, room: tuple[int | None, int]) -> bool:
    """Whether an image of up to ``image_bytes`` (the kernel's memory in use) is written
    through the page cache: where it fits in ``room`` (the bytes available, the percent of
    them the host lets be dirty: :func:`dirty_room`), so that the write is not held to the
    disk's pace and a resume soon after reads the pages from memory. Not where either is
    unknown (then O_DIRECT, as a host short of memory needs)."""
    available, percent = room
    if image_bytes is None or available is None:
        return False
    return image_bytes * 100 <= available * percent


def dirty_room(proc: Path = Path("/proc")) -> tuple[int | None, int]:
    """(MemAvailable in bytes, ``vm.dirty_ratio``): how much written data the kernel lets
    wait for the disk before it holds writers back. A set ``vm.dirty_bytes`` (which
    replaces the ratio) is (that many bytes, 100); None where unreadable."""
    try:
        dirty_bytes = int((proc / "sys/vm/dirty_bytes").read_text())
        if dirty_bytes > 0:
            return dirty_bytes, 100
        percent = int((proc / "sys/vm/dirty_ratio").read_text())
        for line in (proc / "meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024, percent
    except (OSError, ValueError, IndexError):
        pass
    return None, 0


def link_image(image: Path, checkpoint: Path) -> None:
    """Make ``checkpoint`` (Docker's folder of the checkpoint) hold a symbolic link to
    each of ``image``'s files, so Docker's start from it copies links, not pages."""
    checkpoint.mkdir(mode=0o700, parents=True, exist_ok=True)
    for entry in sorted(image.iterdir()):
        if entry.is_file() and not entry.is_symlink():
            (checkpoint / entry.name).symlink_to(entry)


def containerd_temp_dirs(proc: Path = Path("/proc")) -> list[Path]:
    """The temp folder of each containerd on this host, as this process reaches it
    (through ``/proc/PID/root``, so in containerd's own mount namespace): its
    ``XDG_RUNTIME_DIR``, else ``TMPDIR``, else /tmp, as its ``os.MkdirTemp`` picks.
    Empty where this process may not read containerd's environment (not root)."""
    found: list[Path] = []
    try:
        entries = [entry for entry in proc.iterdir() if entry.name.isdigit()]
    except OSError:
        return found
    for entry in entries:
        try:
            if (entry / "comm").read_bytes().strip() != b"containerd":
                continue
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.partition(b"=")[::2] for item in environ.split(b"\0") if b"=" in item)
        base = env.get(b"XDG_RUNTIME_DIR") or env.get(b"TMPDIR") or b"/tmp"
        found.append(entry / "root" / os.fsdecode(base).lstrip("/"))
    return found


def restore_copies(temp_dirs: Iterable[Path], checkpoint: Path, owner: int = 0) -> list[Path]:
    """The folders containerd (running as ``owner``: root) unpacked Docker's
    ``checkpoint`` folder into, in ``temp_dirs``: its ``ctrd-checkpoint*`` folders
    holding exactly the checkpoint's entries, each the same link (how runsc's images are
    handed over) or a file of the same bytes. Another program's folder never matches."""
    try:
        wanted = {entry.name: _entry(entry) for entry in checkpoint.iterdir()}
    except OSError:
        return []
    if not wanted or None in wanted.values():
        return []
    found = []
    for temp in temp_dirs:
        try:
            candidates = [entry for entry in temp.iterdir() if entry.name.startswith(RESTORE_FOLDER_PREFIX)]
        except OSError:
            continue
        for folder in candidates:
            with contextlib.suppress(OSError):
                if _is_copy(folder, checkpoint, wanted, owner):
                    found.append(folder)
    return found


def _entry(path: Path) -> tuple[str, str | int] | None:
    """A link and its target, or a regular file and its size; None for anything else."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return "link", os.readlink(path)
    return ("file", info.st_size) if stat.S_ISREG(info.st_mode) else None


def _is_copy(
    folder: Path, checkpoint: Path, wanted: dict[str, tuple[str, str | int] | None], owner: int
) -> bool:
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != owner:
        return False
    if {entry.name for entry in folder.iterdir()} != set(wanted):
        return False
    for name, kind in wanted.items():
        if _entry(folder / name) != kind:
            return False
        if kind is not None and kind[0] == "file" and not _same_bytes(folder / name, checkpoint / name):
            return False
    return True


def _same_bytes(copy: Path, original: Path) -> bool:
    """Whether two files of the same size hold the same bytes (a big one: at both ends)."""
    size = original.lstat().st_size
    spans = [(0, size)] if size <= _WHOLE else [(0, _SAMPLE), (size - _SAMPLE, _SAMPLE)]
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(os.open(copy, flags), "rb") as a, open(os.open(original, flags), "rb") as b:
        for offset, length in spans:
            a.seek(offset)
            b.seek(offset)
            while length > 0:
                chunk = min(length, _SAMPLE)
                if a.read(chunk) != b.read(chunk):
                    return False
                length -= chunk
    return True


#: The first gVisor release that no longer brings a deleted epoll entry back at a restore
#: (commit 5d857245b, "vfs: clear temporary notReady lists"; see inside/kernel_app.py).
EPOLL_RESTORE_FIXED = 20260330


def runsc_release(version_output: str) -> int | None:
    """The release date (``YYYYMMDD``) in ``runsc --version``'s output: ``runsc version
    release-20260406.0`` from gVisor's packages, ``0.0~20240729.0`` from Debian's."""
    match = re.search(r"\b(?:release-|~)(20\d{6})\b", version_output)
    return int(match.group(1)) if match else None


def resurrects_epoll_entries(version_output: str) -> bool:
    """Whether this runsc can restore an epoll set with an entry deleted before the pause
    (ready for ever, with a stale pointer for libzmq to call through); True when unknown."""
    release = runsc_release(version_output)
    return release is None or release < EPOLL_RESTORE_FIXED
