"""Hostile code, run as cells in a real sandboxed kernel: it fails cleanly, the host is unharmed."""

from __future__ import annotations

import os
import resource
import secrets
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from .conftest import SANDBOX_UID, KernelStarter, fill_file, make_workspace, run, run_ok


@pytest.fixture
def host_secret(tmp_path: Path) -> tuple[Path, str]:
    """A secret on the host, next to (not inside) the workspace."""
    token = secrets.token_hex(16)
    beside = tmp_path / "host-secret.txt"
    beside.write_text(token)
    return beside, token


def test_host_files_are_out_of_reach(start_sandboxed: KernelStarter, host_secret: tuple[Path, str]) -> None:
    secret_file, token = host_secret
    _, kc = start_sandboxed()
    out = run_ok(
        kc,
        "import os\n"
        f"candidates = [{str(secret_file)!r}, '../host-secret.txt', '/workspace/../host-secret.txt',\n"
        f"              '/proc/1/root' + {str(secret_file)!r}, '/proc/self/root' + {str(secret_file)!r}]\n"
        "found = []\n"
        "for path in candidates:\n"
        "    try:\n"
        "        found.append(open(path).read())\n"
        "    except OSError:\n"
        "        pass\n"
        "def readable(path):\n"
        "    try:\n"
        "        open(path).read(); return True\n"
        "    except OSError:\n"
        "        return False\n"
        "print(found)\n"
        "print(readable('/etc/shadow'), os.listdir('/root') if os.access('/root', os.R_OK) else 'no /root')\n"
        "cmdlines = []\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            cmdlines.append(open(f'/proc/{pid}/cmdline', 'rb').read())\n"
        "        except OSError:\n"
        "            pass\n"
        "print(len(cmdlines), any(b'dockerd' in c or b'jupyter' in c or b'pytest' in c for c in cmdlines))",
    )
    found, shadow_root, procs = out.splitlines()
    assert found == "[]"
    assert token not in out
    assert shadow_root.startswith("False")
    count, host_visible = procs.split()
    assert host_visible == "False", "host processes are visible from the sandbox"
    assert int(count) < 20


def test_privileged_operations_are_refused(start_sandboxed: KernelStarter) -> None:
    _, kc = start_sandboxed()
    out = run_ok(
        kc,
        "import ctypes, os, socket, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def attempt(name, fn):\n"
        "    try:\n"
        "        result = fn()\n"
        "    except (OSError, subprocess.SubprocessError) as e:\n"
        "        print('refused', name, type(e).__name__); return\n"
        "    print('refused' if result else 'ALLOWED', name, result)\n"
        "attempt('raw socket', lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))\n"
        "attempt('packet socket', lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))\n"
        "attempt('mount', lambda: libc.mount(b'none', b'/mnt', b'tmpfs', 0, None) != 0)\n"
        "attempt('unshare', lambda: libc.unshare(0x10000000) != 0)  # CLONE_NEWUSER\n"
        "attempt('ptrace init', lambda: libc.ptrace(16, 1, None, None) != 0)  # PTRACE_ATTACH\n"
        "attempt('setuid 0', lambda: os.setuid(0))\n"
        "su = subprocess.run(['su', '-c', 'id -u', 'root'], input=b'\\n', capture_output=True, timeout=20)\n"
        "print('su', su.returncode, su.stdout.strip())\n"
        "print('euid', os.geteuid())",
    )
    assert "ALLOWED" not in out, out
    assert out.count("refused") == 6, out
    su_line = next(line for line in out.splitlines() if line.startswith("su "))
    assert su_line.split()[1] != "0", out
    assert "b'0'" not in su_line
    assert out.strip().splitlines()[-1].split() == ["euid", str(os.getuid() or SANDBOX_UID)]


def test_filling_tmp_fails_with_no_space_and_the_kernel_lives(start_sandboxed: KernelStarter) -> None:
    _, kc = start_sandboxed()
    result = run(kc, fill_file("/tmp/filler", chunk_mib=8), timeout=120)
    assert result.status == "error"
    assert result.reply["content"]["ename"] == "OSError"
    assert "No space left on device" in result.reply["content"]["evalue"]
    assert run_ok(kc, "import os; os.remove('/tmp/filler'); print('ok')").strip() == "ok"


def test_archives_cannot_write_outside_the_sandbox(start_sandboxed: KernelStarter, workspace: Path) -> None:
    outside = workspace.parent
    _, kc = start_sandboxed()
    out = run_ok(
        kc,
        "import io, tarfile, zipfile, os\n"
        "buf = io.BytesIO()\n"
        "with tarfile.open(fileobj=buf, mode='w') as tar:\n"
        "    for name in ['../escaped.txt', '../../escaped.txt', '/etc/escaped.txt', 'ok/inside.txt']:\n"
        "        data = b'payload'\n"
        "        info = tarfile.TarInfo(name); info.size = len(data)\n"
        "        tar.addfile(info, io.BytesIO(data))\n"
        "buf.seek(0)\n"
        "os.makedirs('unpack', exist_ok=True)\n"
        "with tarfile.open(fileobj=buf) as tar:\n"
        "    for member in tar.getmembers():\n"
        "        try:\n"
        "            tar.extract(member, 'unpack')\n"
        "        except OSError as e:\n"
        "            print('refused', member.name, e.errno)\n"
        "bomb = io.BytesIO()\n"
        "with zipfile.ZipFile(bomb, 'w', zipfile.ZIP_DEFLATED) as z:\n"
        "    z.writestr('zeros.bin', b'\\0' * (400 * 1024 * 1024))\n"
        "print('bomb size', len(bomb.getvalue()))\n"
        "try:\n"
        "    zipfile.ZipFile(bomb).extractall('/tmp/bomb')\n"
        "    print('EXTRACTED')\n"
        "except OSError as e:\n"
        "    print('bomb stopped', e.errno)\n"
        "print(os.path.exists('unpack/ok/inside.txt'))",
        timeout=300,
    )
    assert "bomb stopped 28" in out, out  # ENOSPC: /tmp is 256 MiB
    assert out.strip().endswith("True")
    escaped = [p for p in outside.rglob("escaped.txt") if workspace not in p.parents]
    assert escaped == [], "an archive wrote outside the workspace on the host"
    assert not Path("/etc/escaped.txt").exists()


def test_flooding_the_container_stdout_keeps_host_disk_bounded(
    start_sandboxed: KernelStarter, docker_client: docker.DockerClient
) -> None:
    km, kc = start_sandboxed()
    run_ok(
        kc,
        "import os\n"
        "chunk = b'x' * (1024 * 1024) + b'\\n'\n"
        "for _ in range(100):\n"
        "    os.write(1, chunk)\n"
        "print('done')",
    )
    container = docker_client.containers.get(km.provisioner.container_id)
    log_path = Path(container.attrs["LogPath"])
    assert log_path.stat().st_size < 15 * 1024 * 1024, "the container log is not capped"


def test_bombs_in_one_kernel_leave_another_kernel_the_server_and_the_workspace_unharmed(
    make_kernelspec: Any, start_sandboxed: KernelStarter, tmp_path: Path
) -> None:
    """Each attack runs in one kernel while a bystander kernel, started by the same
    process (the "server"), keeps its state and answers promptly; the attacker's
    workspace files survive, and the server's memory stays bounded through an output
    flood of 1 GB."""
    bystander_ws = make_workspace(tmp_path / "bystander")
    attacker_ws = make_workspace(tmp_path / "attacker")
    (attacker_ws / "results.csv").write_text("a,b\n1,2\n")
    _, bystander = start_sandboxed(cwd=bystander_ws)
    run_ok(bystander, "y = 7")
    name = make_kernelspec("attacker", config={"memory": "512m", "pids": 64, "file_size": "64m"})
    km, attacker = start_sandboxed(name, cwd=attacker_ws)
    attacks = {
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "thread bomb": "import threading, time\n"
        "while True:\n    threading.Thread(target=time.sleep, args=[60]).start()",
        "fill /tmp": fill_file("/tmp/f"),
        "fill the workspace": fill_file("big.bin"),
        "1 GB print": "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)",
        "memory bomb": "hoard = []\nwhile True:\n    hoard.append(bytearray(2**24))",
    }
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for attack, code in attacks.items():
        result = run(attacker, code, timeout=300)
        assert result.status == "error" or "Output truncated" in result.stderr, attack
        started = time.monotonic()
        assert run_ok(bystander, "print(y)").strip() == "7", attack
        assert time.monotonic() - started < 15, f"the bystander was slow after the {attack}"
        if not km.is_alive():
            km.restart_kernel(now=True)
            attacker.wait_for_ready(timeout=60)
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert growth_mib < 256, f"the server's memory grew by {growth_mib:.0f} MiB"
    assert (attacker_ws / "results.csv").read_text() == "a,b\n1,2\n"
