# The sandboxed kernel's start-up code (its PYTHONSTARTUP): a stub that runs the module
# in_kernel_startup.py (what the kernel sets up: clear messages for its limits, its
# network and its packages, the memory watch, the wall clock, a pooled kernel's claim).
#
# The image does not have this package: the host copies this file and that module into
# the kernel's launch folder, side by side. IPython runs this file in the user's
# namespace, which keeps whatever it leaves there: so it runs the module as one of its
# own (compiled on its own, so that the module's __future__ import does not change how
# the user's cells compile), and deletes its one name as it ends.
#
# IPython carries on without a start-up file it could not run (a warning at most), and
# such a kernel must not be handed to a user: the mark this file leaves beside itself
# (see startup_mark.py) tells the host whether the module ran to its end, or how it failed.
#
# (Comments, not a docstring: the file runs in the user's namespace, whose __doc__ is
# IPython's. No module-level imports, for the same reason.)


def _sandbox_kernel_run() -> None:
    import os
    import traceback
    import types

    startup = os.environ.get("PYTHONSTARTUP")
    try:
        if not startup:
            msg = "PYTHONSTARTUP is not set: the start-up module beside it cannot be found"
            raise RuntimeError(msg)
        path = os.path.join(os.path.dirname(startup), "in_kernel_startup.py")
        with open(path, encoding="utf-8") as source:
            code = compile(source.read(), path, "exec", dont_inherit=True)
        module = types.ModuleType("sandbox_kernel_startup")
        module.__file__ = path
        exec(code, module.__dict__)  # noqa: S102 (the host's own file, beside this one)
        module.start()
        outcome = "ok\n"
    except BaseException:
        outcome = "failed\n" + traceback.format_exc()[-6000:] + "\n"
        raise
    finally:
        if startup:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            try:
                fd = os.open(os.path.join(os.path.dirname(startup), "started"), flags, 0o644)
                with os.fdopen(fd, "w") as mark:
                    mark.write(outcome)
            except OSError:
                pass  # the host waits in vain, and says so


if __name__ == "__main__":  # as the kernel's PYTHONSTARTUP
    try:
        _sandbox_kernel_run()
    finally:
        del _sandbox_kernel_run
