"""Errors raised by sandbox-kernel, each saying what happened and how to fix it.

Exception tree::

    SandboxKernelError
    ├── ConfigurationError (ValueError)       a kernelspec or server setting is invalid
    │   └── WorkspaceError                    the workspace cannot be mounted, or a
    │       │                                 files-API path is refused
    │       ├── MissingFileError              no such file in the workspace
    │       │   (FileNotFoundError)
    │       ├── FolderNotEmptyError           a folder to delete holds files
    │       └── FileTooLargeError             a file is over a download's limit
    ├── DockerUnavailableError                the Docker daemon cannot be reached
    ├── RuntimeMissingError                   Docker has no usable gVisor runtime
    ├── ImageNotFoundError (LookupError)      the kernel image is not on the Docker host
    ├── ImageBuildError                       a kernel image could not be built
    ├── DockerOperationError                  a Docker call failed unexpectedly
    ├── KernelStartupError                    the container started but the kernel died
    ├── KernelNotFoundError (LookupError)     no such sandboxed kernel to reattach to
    ├── KernelHeldError                       another live process drives the kernel
    ├── KernelTakenOverError                  another process took the kernel over
    └── PauseError                            a kernel could not be paused or resumed
"""

from __future__ import annotations

import errno


class SandboxKernelError(Exception):
    """Base class of every error raised by sandbox-kernel."""


class ConfigurationError(SandboxKernelError, ValueError):
    """A kernelspec or server setting is invalid."""


class WorkspaceError(ConfigurationError):
    """The workspace folder cannot be mounted into the sandbox."""


class MissingFileError(WorkspaceError, FileNotFoundError):
    """No such file or folder in the workspace: a :class:`WorkspaceError` that
    ``except FileNotFoundError`` catches too, as for a local file."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOENT


class FolderNotEmptyError(WorkspaceError):
    """A folder to delete holds files, and the delete was not recursive."""


class FileTooLargeError(WorkspaceError):
    """A file is longer than a download may be: ``size`` bytes (at least), over ``limit``."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class DockerUnavailableError(SandboxKernelError):
    """The Docker daemon cannot be reached."""


class RuntimeMissingError(SandboxKernelError):
    """The Docker daemon has no usable gVisor runtime registered."""


class ImageNotFoundError(SandboxKernelError, LookupError):
    """The kernel image does not exist on the Docker host (it is never pulled)."""


class ImageBuildError(SandboxKernelError):
    """A kernel image could not be built; the message is Docker's."""


class DockerOperationError(SandboxKernelError):
    """A Docker API call failed for a reason not covered by a narrower error."""


class KernelStartupError(SandboxKernelError):
    """The sandbox container started, but the kernel in it exited or never came up.

    ``logs`` holds the last lines the container printed.
    """

    def __init__(self, message: str, logs: str = "") -> None:
        super().__init__(message)
        self.logs = logs


class KernelNotFoundError(SandboxKernelError, LookupError):
    """No running sandboxed kernel matches, or its reattach state cannot be read."""


class KernelHeldError(SandboxKernelError):
    """The kernel is driven by another live process (or manager): reattaching would break it."""


class KernelTakenOverError(SandboxKernelError):
    """Another process took the kernel over: this one no longer drives it."""


class PauseError(SandboxKernelError):
    """A kernel could not be paused (it keeps running, nothing lost) or resumed (its
    workspace is intact; it can be started fresh). The message says why."""
