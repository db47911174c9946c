"""Hostile files: what kernel code leaves in its workspace or runtime folder for the host.

Each test does what the red-team report (issue #8) did, in real sandboxed kernels, and
checks the outcome on the host: no setuid, setgid or sticky file appears in a workspace
(bind-mounted folder or named volume), the kernel never runs as a real host account by
default, and code planted in the workspace never runs at a kernel's start, when the
runtime folder is not sealed yet. And what another local user does to the workspace
folder itself under a root server's files API: a swap for a link, or another folder.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import pytest
from jupyter_client.manager import KernelManager

from sandbox_kernel.agents.session import SandboxSession
from sandbox_kernel.errors import WorkspaceError
from sandbox_kernel.plan.plan import DEFAULT_KERNEL_UID
from sandbox_kernel.plan.sandbox_spec import kernel_sockets

from .conftest import SANDBOX_UID, KernelStarter, make_workspace, run, run_ok

pytestmark = pytest.mark.integration

SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX

#: Cell code: every way of making a file with a setuid, setgid or sticky bit that the
#: report found or that a library offers; prints what each attempt gave, as JSON.
PLANT_SPECIAL_FILES = r"""
import ctypes, errno, io, json, os, shutil, stat, tarfile, zipfile
libc = ctypes.CDLL(None, use_errno=True)
results = {}

def attempt(name, fn):
    try:
        fn()
        results[name] = 'ok'
    except OSError as e:
        results[name] = errno.errorcode.get(e.errno, str(e.errno))
    except tarfile.ExtractError as e:
        cause = e.__cause__
        results[name] = errno.errorcode.get(getattr(cause, 'errno', None), repr(cause))

def syscall(nr, *args):
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    if libc.syscall(ctypes.c_long(nr), *args) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

def tar_with_special_members():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode='w') as tar:
        data = b'#!/bin/sh\nid\n'
        info = tarfile.TarInfo('tarred'); info.size = len(data); info.mode = 0o4755
        tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo('tardir'); info.type = tarfile.DIRTYPE; info.mode = 0o3777
        tar.addfile(info)
    buf.seek(0)
    return buf

def untar(dest, **kwargs):
    with tarfile.open(fileobj=tar_with_special_members(), **kwargs) as tar:
        tar.extractall(dest)

def untar_filtered(dest, how):
    with tarfile.open(fileobj=tar_with_special_members()) as tar:
        tar.extractall(dest, filter=how)

def unzip():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w') as z:
        info = zipfile.ZipInfo('zipped')
        info.external_attr = (stat.S_IFREG | 0o6755) << 16
        z.writestr(info, b'#!/bin/sh\nid\n')
    zipfile.ZipFile(buf).extractall('unzipped')

shutil.copyfile('/usr/bin/python3.11', 'h')    # the report's attack, step 1
open('plain', 'wb').write(b'x')
os.mkdir('shared')
here = os.open('.', os.O_RDONLY | os.O_DIRECTORY)
attempt('chmod 4755 (the report)', lambda: os.chmod('h', 0o4755))
attempt('chmod 2755', lambda: os.chmod('h', 0o2755))
attempt('chmod 1755', lambda: os.chmod('h', 0o1755))
attempt('fchmod', lambda: os.fchmod(os.open('h', os.O_RDONLY), 0o4755))
attempt('fchmodat (dir_fd)', lambda: os.chmod('h', 0o6755, dir_fd=here))
attempt('chmod follow_symlinks=False', lambda: os.chmod('h', 0o4755, follow_symlinks=False))
attempt('fchmodat2 (syscall 452)', lambda: syscall(452, -100, b'h', 0o4755, 0))
attempt('shutil.copy of su', lambda: shutil.copy('/usr/bin/su', 'su-copy'))
attempt('shutil.copy2 of su', lambda: shutil.copy2('/usr/bin/su', 'su-copy2'))
attempt('shutil.copymode of su', lambda: shutil.copymode('/usr/bin/su', 'plain'))
attempt('os.open O_CREAT 4755', lambda: os.close(os.open('created', os.O_CREAT | os.O_WRONLY, 0o4755)))
create = os.O_CREAT | os.O_WRONLY
attempt('openat O_CREAT 2755', lambda: os.close(os.open('created2', create, 0o2755, dir_fd=here)))
attempt('open syscall O_CREAT 1755', lambda: syscall(2, b'created3', os.O_CREAT | os.O_WRONLY, 0o1755))
attempt('creat 4755', lambda: syscall(85, b'created4', 0o4755))
attempt('mkdir 3777', lambda: os.mkdir('d3777', 0o3777))
attempt('mkdir 1777', lambda: os.mkdir('d1777', 0o1777))
attempt('mkdirat 2777', lambda: os.mkdir('d2777', 0o2777, dir_fd=here))
attempt('chmod folder 1777', lambda: os.chmod('shared', 0o1777))
attempt('chmod the workspace 2775', lambda: os.chmod('.', 0o2775))
attempt('tarfile', lambda: untar('untarred'))
attempt('tarfile errorlevel=2', lambda: untar('untarred2', errorlevel=2))
for how in ('fully_trusted', 'tar', 'data'):
    if hasattr(tarfile, 'data_filter'):
        attempt('tarfile filter=' + how, lambda: untar_filtered('untarred-' + how, how))
    else:
        results['tarfile filter=' + how] = 'no filter support'
attempt('zipfile', unzip)
caps = bytes.fromhex('01000002' + '00200000' + '00000000' + '00000000' + '00000000')  # cap_setuid
attempt('setxattr security.capability', lambda: os.setxattr('h', 'security.capability', caps))
print(json.dumps(results))
"""


def special_files(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) with a special mode bit or file capability."""
    found = []
    for folder, dirs, files in os.walk(root):
        paths = [Path(folder)] if Path(folder) == root else []
        paths += [Path(folder) / name for name in dirs + files]
        for path in paths:
            mode = path.lstat().st_mode
            if mode & SPECIAL_BITS:
                found.append(f"{path.relative_to(root)} {stat.filemode(mode)}")
            if not path.is_symlink() and "security.capability" in os.listxattr(path):
                found.append(f"{path.relative_to(root)} security.capability")
    return found


@pytest.mark.parametrize("kind", ["folder", "volume"])
def test_no_setuid_setgid_or_sticky_file_reaches_the_host(
    kind: str,
    volume_prefix: str,
    make_kernelspec: Callable[..., str],
    start_sandboxed: KernelStarter,
    workspace: Path,
    docker_client: docker.DockerClient,
) -> None:
    """The report: a copy of python made setuid in the workspace gives any host user who
    runs it the kernel's host uid. Every way to make such a file is refused with EPERM
    (or, for tarfile and zipfile, which swallow or skip modes, ends without the bit),
    and the host sees no such file, in a bind-mounted folder and in a named volume."""
    config = {"workspace_volume": volume_prefix + "-{project}"} if kind == "volume" else {}
    _, kc = start_sandboxed(make_kernelspec(f"py-files-{kind}", config=config))
    results = json.loads(run_ok(kc, PLANT_SPECIAL_FILES))
    if kind == "volume":
        host_root = Path(docker_client.volumes.get(f"{volume_prefix}-{workspace.name}").attrs["Mountpoint"])
    else:
        host_root = workspace
    planted = special_files(host_root)
    assert planted == [], f"the sandbox planted special files on the host: {planted}; attempts: {results}"

    swallowed = {"tarfile", "zipfile"} | {name for name in results if name.startswith("tarfile filter=")}
    refused = {name: got for name, got in results.items() if name not in swallowed}
    assert refused.pop("fchmodat2 (syscall 452)") in ("EPERM", "ENOSYS")
    assert refused.pop("setxattr security.capability") in ("EPERM", "ENOTSUP", "EOPNOTSUPP")
    assert refused == dict.fromkeys(refused, "EPERM"), results
    assert len(refused) == 19, results
    for name in swallowed:
        assert results[name] in ("ok", "EPERM", "no filter support"), (name, results)
    assert (host_root / "h").stat().st_size > 1_000_000, "the copy itself is allowed"


def _root_owned_folder(tmp_path: Path) -> Path:
    """A folder of root's that anyone may write (a root-owned folder the kernel cannot
    write is refused at start: see test_session_api.py)."""
    folder = tmp_path / "root-owned"
    folder.mkdir()
    folder.chmod(0o777)
    assert folder.stat().st_uid == 0
    return folder


@pytest.mark.skipif(os.getuid() != 0, reason="only a root server picks the kernel's uid")
def test_a_root_owned_workspace_gets_a_uid_that_is_no_host_account(
    start_sandboxed: KernelStarter, tmp_path: Path
) -> None:
    """Files a kernel writes belong to its uid on the host; the default uid (for a root
    server and a root-owned workspace) must not be a real host account such as uid 1000."""
    _, kc = start_sandboxed(cwd=_root_owned_folder(tmp_path))
    uid, gid = map(int, run_ok(kc, "import os; print(os.getuid(), os.getgid())").split())
    assert (uid, gid) == (DEFAULT_KERNEL_UID, DEFAULT_KERNEL_UID)
    assert uid not in (0, SANDBOX_UID)
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    with pytest.raises(KeyError):
        grp.getgrgid(gid)


#: Cell code: a tiny wheel built in /tmp, for pip to install without a network.
BUILD_WHEEL = r"""
import base64, hashlib, zipfile
files = {
    'sk_probe.py': b'VALUE = 42\n',
    'sk_probe-1.0.dist-info/METADATA': b'Metadata-Version: 2.1\nName: sk-probe\nVersion: 1.0\n',
    'sk_probe-1.0.dist-info/WHEEL':
        b'Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n',
}
def digest(data):
    return 'sha256=' + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
record = ''.join(f'{name},{digest(data)},{len(data)}\n' for name, data in files.items())
record += 'sk_probe-1.0.dist-info/RECORD,,\n'
with zipfile.ZipFile('/tmp/sk_probe-1.0-py3-none-any.whl', 'w') as z:
    for name, data in files.items():
        z.writestr(name, data)
    z.writestr('sk_probe-1.0.dist-info/RECORD', record)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="only a root server picks the kernel's uid")
def test_a_kernel_whose_uid_has_no_account_in_the_image_works(
    start_sandboxed: KernelStarter, tmp_path: Path
) -> None:
    """The default uid has no passwd entry in the image: what analysts use still works."""
    _, kc = start_sandboxed(cwd=_root_owned_folder(tmp_path))
    run_ok(kc, BUILD_WHEEL)
    out = run_ok(
        kc,
        "import getpass, os, subprocess, sys\n"
        "print(os.getuid(), getpass.getuser(), os.path.expanduser('~'))\n"
        "pip = [sys.executable, '-m', 'pip', 'install', '--no-index', '--no-warn-script-location']\n"
        "wheel = '/tmp/sk_probe-1.0-py3-none-any.whl'\n"
        # pip takes one install location: the kernel's own (PIP_PREFIX) is set aside.
        "env = {**os.environ, 'PIP_PREFIX': ''}\n"
        "for how in (['--target', '/tmp/pkgs'], ['--user']):\n"
        "    done = subprocess.run(pip + how + [wheel], capture_output=True, text=True, env=env)\n"
        "    print('pip', how[0], done.returncode, (done.stderr.strip().splitlines() or [''])[-1])\n"
        "sys.path.insert(0, '/tmp/pkgs')\n"
        "import sk_probe\n"
        "print('imported', sk_probe.VALUE)",
    )
    first, pip_target, pip_user, imported = out.strip().splitlines()
    uid, user, home = first.split()
    assert int(uid) == DEFAULT_KERNEL_UID
    assert user, "getpass.getuser() names someone"
    assert home == "/tmp"
    assert pip_target.startswith("pip --target 0"), pip_target
    # The image's kernel lives in a venv, where pip refuses --user for every uid alike.
    assert pip_user.startswith("pip --user 0") or "virtualenv" in pip_user, pip_user
    assert imported == "imported 42"
    result = run(
        kc,
        "%matplotlib inline\n"
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3]); plt.show()\n"
        "print(get_ipython().history_manager.hist_file)",
    )
    assert result.status == "ok", result.outputs
    assert result.stdout.strip() == ":memory:", "IPython's history is kept in memory, not written"
    assert [o for o in result.outputs if "image/png" in o.get("data", {})], "a figure arrives as PNG"


# ---------------------------------------------------------------- item 9: the start is clean


def _expected_launch_entries(km: KernelManager) -> set[str]:
    launch_dir = km.provisioner.launch_dir  # type: ignore[union-attr]
    sockets = {path.name for path in kernel_sockets(launch_dir).values()}
    return sockets | {
        "connection.json",
        "startup.py",
        "in_kernel_startup.py",
        "fast_io.py",
        "kernel_app.py",
        "kernel_relay.py",
    }


def _launch_dir_problems(km: KernelManager) -> list[str]:
    """Whatever in the kernel's host launch folder is unexpected: a name, a folder in it
    (where the kernel could add entries), or the folder itself writable by the kernel."""
    launch_dir: Path = km.provisioner.launch_dir  # type: ignore[union-attr]
    expected = _expected_launch_entries(km)
    problems = [f"unexpected {name}" for name in sorted(set(os.listdir(launch_dir)) - expected)]
    sockets = {path.name for path in kernel_sockets(launch_dir).values()}
    if os.getuid() == 0:
        st = launch_dir.stat()
        if st.st_uid != 0 or st.st_mode & 0o022:
            problems.append(f"launch folder {stat.filemode(st.st_mode)} uid {st.st_uid}")
        for entry in launch_dir.iterdir():
            mode = entry.lstat().st_mode
            kind_ok = stat.S_ISSOCK(mode) if entry.name in sockets else stat.S_ISREG(mode)
            if not kind_ok:
                problems.append(f"{entry.name} is a {stat.filemode(mode)}")
    return problems


#: Cell code: plant modules and config files in the workspace that would run at the
#: kernel's next start and leave a writable folder in its runtime folder.
PLANT_STARTUP_CODE = r"""
import os
mark = "open(" + repr(os.path.abspath('planted-ran')) + ", 'a').write({!r} + chr(10))\n"
leave_folder = (
    "import os\n"
    "try:\n"
    "    os.mkdir('/run/sandbox-kernel/planted'); os.chmod('/run/sandbox-kernel/planted', 0o777)\n"
    "except OSError:\n"
    "    pass\n"
)
run_the_real_launcher = (
    "import runpy, sys\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', " + repr(os.getcwd()) + ")]\n"
    "runpy.run_module('ipykernel_launcher', run_name='__main__', alter_sys=True)\n"
)
launcher = mark.format('ipykernel_launcher') + leave_folder + run_the_real_launcher
open('ipykernel_launcher.py', 'w').write(launcher)
for name in ('ipython_kernel_config', 'ipython_config', 'sitecustomize', 'usercustomize'):
    open(name + '.py', 'w').write(mark.format(name) + leave_folder)
# The kernel itself runs as a script of the runtime folder (kernel_app.py): the packages it imports
os.mkdir('ipykernel')
open('ipykernel/__init__.py', 'w').write(mark.format('ipykernel') + leave_folder)
open('zmq.py', 'w').write(mark.format('zmq') + leave_folder)
open('mymodule.py', 'w').write('VALUE = 42\n')
os.mkdir('tools')
open('tools/helper.py', 'w').write('WHO = "helper"\n')
open('tools/script.py', 'w').write('import helper, sys\nprint(helper.WHO, sys.flags.safe_path)\n')
"""


def test_code_planted_in_the_workspace_does_not_run_at_the_next_start(
    start_sandboxed: KernelStarter, workspace: Path, inside: str
) -> None:
    """The report: the kernel starts as ``python -m ipykernel_launcher`` in /workspace, so
    a planted ``ipykernel_launcher.py`` (or a config file) would run at the next restart,
    before the runtime folder is sealed. It must not; once the kernel is up, modules in
    the notebook's folder import as in a local kernel, and child processes behave normally."""
    km, kc = start_sandboxed()
    run_ok(kc, PLANT_STARTUP_CODE)
    km.restart_kernel(now=True)
    kc.wait_for_ready(timeout=60)
    out = run_ok(
        kc,
        "import os, subprocess, sys\n"
        "import mymodule\n"
        "print(mymodule.VALUE, mymodule.__file__)\n"
        "print('PYTHONSAFEPATH' in os.environ, '' in sys.path)\n"
        "site = next(i for i, p in enumerate(sys.path) if p.endswith('site-packages'))\n"
        "print(sys.path.index('') < site, sys.path.index('') > sys.path.index('/usr/lib/python3.11'))\n"
        "print(subprocess.run([sys.executable, 'tools/script.py'], capture_output=True, text=True).stdout)",
    )
    ran = (workspace / "planted-ran").read_text() if (workspace / "planted-ran").exists() else ""
    assert ran == "", f"planted code ran at the kernel's start: {ran.split()}"
    imported, environ, order, script = out.strip().splitlines()
    assert imported == f"42 {inside}/mymodule.py"
    assert environ == "False True", "the working folder is on sys.path, PYTHONSAFEPATH is not inherited"
    assert order == "True True", "as IPython does: after the standard library, before site-packages"
    assert script == "helper False", "a script run from the kernel finds its own folder's modules"
    assert _launch_dir_problems(km) == []


@pytest.mark.skipif(os.getuid() != 0, reason="only a root server can seal the runtime folder")
def test_what_a_kernel_leaves_in_its_runtime_folder_before_the_seal_does_not_survive_it(
    make_kernelspec: Callable[..., str], start_sandboxed: KernelStarter
) -> None:
    """Code that runs before the seal (a kernelspec's own argv here, as any user may write)
    leaves a world-writable folder, a file, and a folder under a host-written file's name
    in the runtime folder: after the seal (at the start and again after a restart) the
    folder holds only what is expected, and nothing in it is writable by the kernel."""
    early = (
        "import os, runpy, sys\n"
        "rt = '/run/sandbox-kernel'\n"
        "os.mkdir(rt + '/early'); os.chmod(rt + '/early', 0o777)\n"
        "os.mkdir(rt + '/early/deeper'); open(rt + '/early/deeper/file', 'w').write('x')\n"
        "open(rt + '/junk', 'w').write('x')\n"
        "os.replace(rt + '/startup.py', rt + '/early/startup.py')\n"
        "os.mkdir(rt + '/startup.py'); os.chmod(rt + '/startup.py', 0o777)\n"
        "os.replace(rt + '/early/startup.py', rt + '/startup.py/x')\n"
        "os.environ.pop('PYTHONSTARTUP', None)\n"
        "sys.argv[0] = 'ipykernel_launcher'\n"
        "runpy.run_module('ipykernel_launcher', run_name='__main__', alter_sys=True)\n"
    )
    name = make_kernelspec("py-early", argv=["python", "-c", early, "-f", "{connection_file}"])
    km, kc = start_sandboxed(name)
    for when in ("start", "restart"):
        assert _launch_dir_problems(km) == [], when
        out = run_ok(
            kc,
            "import json, os\n"
            "print(json.dumps(os.listdir('/run/sandbox-kernel')))\n"
            "for path in ('/run/sandbox-kernel/early/x', '/run/sandbox-kernel/startup.py/x'):\n"
            "    try:\n"
            "        os.mkdir(path); print('ALLOWED', path)\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)",
        )
        listing = set(json.loads(out.splitlines()[0]))
        sockets = {path.name for path in kernel_sockets(km.provisioner.launch_dir).values()}  # type: ignore[union-attr]
        assert sockets <= listing <= _expected_launch_entries(km), (when, listing)
        assert "ALLOWED" not in out, out
        if when == "start":
            km.restart_kernel(now=True)
            kc.wait_for_ready(timeout=60)


ALICE = 2101


@pytest.fixture
def alices_home() -> Iterator[Path]:
    """A folder of another local user's (alice's), where a root server starts a kernel for
    a project of hers; in a folder every user can pass through, as /home is."""
    base = Path(tempfile.mkdtemp(prefix="sk-alice-", dir="/tmp"))
    base.chmod(0o755)
    home = base / "alice"
    home.mkdir()
    os.chown(home, ALICE, ALICE)
    try:
        yield home
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_alice(script: str, *paths: Path) -> None:
    """Run the shell ``script`` as alice, with ``paths`` as ``$1``, ``$2``..."""
    command = ["/bin/sh", "-ec", script, "sh", *map(str, paths)]
    subprocess.run(command, user=ALICE, group=ALICE, cwd="/", check=True, timeout=30)


@pytest.mark.skipif(os.getuid() != 0, reason="the attack is on a root server's files API")
@pytest.mark.timeout(300)
def test_a_workspace_swapped_for_a_link_is_refused_by_roots_files_api(
    jupyter_dirs: Path, alices_home: Path, tmp_path: Path
) -> None:
    """The attack (#21): while a root session ran a kernel in alice's project, alice, who
    owns the folder holding it, swapped the project folder for a link to a root-only
    folder, and root's files API read and wrote there: it opened the workspace's root
    following links. Then a real folder of her choosing in its place."""
    project = make_workspace(alices_home / "project")
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    (private / "secret.txt").write_text("root's secret")
    with SandboxSession(cwd=project) as sandbox:
        sandbox.files.upload("mine.txt", "alice's notes")
        as_alice('mv "$1" "$2"; ln -s "$3" "$1"', project, alices_home / "moved", private)
        attempts: list[Callable[[], object]] = [
            sandbox.files.list,
            lambda: sandbox.files.download("secret.txt"),
            lambda: sandbox.files.upload("planted.txt", "alice's"),
            lambda: sandbox.files.delete("secret.txt"),
        ]
        for attempt in attempts:
            with pytest.raises(WorkspaceError, match="is now a symbolic link: someone replaced it"):
                attempt()
        assert sorted(os.listdir(private)) == ["secret.txt"]
        assert (private / "secret.txt").read_text() == "root's secret"

        as_alice('rm "$1"; mkdir "$1"', project)
        with pytest.raises(WorkspaceError, match="is no longer the folder the kernel was started with"):
            sandbox.files.upload("planted.txt", "x")
        assert os.listdir(project) == []

        as_alice('rmdir "$1"; mv "$2" "$1"', project, alices_home / "moved")
        assert [info.name for info in sandbox.files.list()] == ["mine.txt"], "the real folder works again"
        assert run_ok_session(sandbox, "print(open('mine.txt').read())") == "alice's notes\n"


def run_ok_session(sandbox: SandboxSession, code: str) -> str:
    execution = sandbox.run(code)
    assert execution.status == "ok", execution.error
    return execution.stdout
