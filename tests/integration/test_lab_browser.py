"""The analyst's path as analysts take it: ``jupyter lab`` in a real browser.

Playwright drives Debian's ``chromium`` (Playwright cannot download its own browsers
here): Launcher tile, cells, an inline plot, the file browser, interrupt, restart, the
memory and network messages as a notebook shows them, and a persistent kernel that
survives a SIGKILL of ``jupyter lab``. When a test fails, a screenshot of the page and
the server's log are kept in ``.ci/artifacts/`` (or ``$SANDBOX_KERNEL_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright

from sandbox_kernel.backends.docker import DockerBackend
from sandbox_kernel.lifecycle.ownership import list_kernels, remove_kernel

from .conftest import REPORTS, SANDBOX_UID, make_workspace
from .test_egress import Upstreams, _fetch
from .test_egress import upstreams as upstreams  # the egress tests' local HTTPS upstream
from .test_jupyter_server import Server, start_server, stop_server
from .test_jupyter_server import reachable as reachable  # a folder every user may pass through

SK = Path(sys.executable).with_name("jupyter-sandbox-kernel")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(
    os.environ.get("SANDBOX_KERNEL_TEST_ARTIFACTS") or Path(__file__).parents[2] / ".ci" / "artifacts"
)
#: Quiet JupyterLab: no news or update checks (they reach for the internet).
LAB_CONFIG = """\
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
"""
PERSISTENT_CONFIG = 'c.ServerApp.kernel_manager_class = "sandbox_kernel.server.SandboxMappingKernelManager"\n'


class Lab:
    """One JupyterLab page, driven as an analyst drives it."""

    def __init__(self, page: Page, server: Server) -> None:
        self.page = page
        self.server = server

    def open(self, reset: bool = True) -> None:
        self.page.goto(f"{self.server.url}/lab?{'reset&' if reset else ''}token={self.server.token}")

    def new_notebook(self, kernel: str) -> None:
        """From the Launcher's tile, as a new user starts."""
        self.page.locator(f'.jp-LauncherCard[title="{kernel}"][data-category="Notebook"]').click()
        self.wait_for_kernel(kernel)

    def wait_for_kernel(self, kernel: str, state: str = "Idle", timeout: float = 60) -> None:
        item = self.page.locator(".jp-StatusBar-TextItem", has_text=f"{kernel} | {state}")
        expect(item).to_be_visible(timeout=timeout * 1000)

    @property
    def cells(self) -> Locator:
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell")

    def type_cell(self, code: str) -> Locator:
        """Type ``code`` into the last (empty) cell and run it; the cell."""
        cell = self.cells.nth(self.cells.count() - 1)  # pinned: running it appends a cell
        cell.locator(".cm-content").click()
        self.page.keyboard.insert_text(code)  # as pasted: no auto-indent
        self.page.keyboard.press("Shift+Enter")
        return cell

    def run(self, code: str, timeout: float = 60) -> str:
        """Run ``code`` in a new cell; the text of its output once it has finished."""
        cell = self.type_cell(code)
        expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=timeout * 1000)
        return cell.locator(".jp-OutputArea").inner_text().strip()

    def command(self, name: str) -> None:
        """Click the notebook toolbar's button for a JupyterLab command."""
        self.page.locator(f'.jp-NotebookPanel-toolbar [data-command="{name}"]').click()

    def dialogs(self) -> list[str]:
        return self.page.locator(".jp-Dialog").all_inner_texts()


@pytest.fixture
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


class Labs:
    """Real ``jupyter lab`` processes serving one notebook folder, and pages on them."""

    def __init__(self, browser: Browser, root: Path, log: Path) -> None:
        self.browser = browser
        self.root = root
        self.log = log
        self.pages: list[Page] = []
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, persistent: bool = False, config_lines: str = "") -> Lab:
        """A server (``persistent``: with the documented kernel_manager_class line; and
        ``config_lines``) and a fresh page on it."""
        config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
        config_dir.mkdir(parents=True, exist_ok=True)
        config = LAB_CONFIG + (PERSISTENT_CONFIG if persistent else "") + config_lines
        (config_dir / "jupyter_server_config.py").write_text(config)
        server = self.serve()
        page = self.browser.new_page(viewport={"width": 1400, "height": 900})
        self.pages.append(page)
        lab = Lab(page, server)
        lab.open()
        return lab

    def serve(self, port: int | None = None, token: str | None = None) -> Server:
        server, proc = start_server(self.root, self.log, port, command="lab", token=token)
        self.processes.append(proc)
        return server


@pytest.fixture
def labs(
    request: pytest.FixtureRequest, browser: Browser, jupyter_dirs: Path, tmp_path: Path
) -> Iterator[Labs]:
    """Keeps a screenshot of each page and the server's log if the test fails."""
    labs = Labs(browser, make_workspace(tmp_path / "notebooks"), tmp_path / "lab.log")
    yield labs
    report = request.node.stash.get(REPORTS, {}).get("call")
    if report is not None and report.failed:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for i, page in enumerate(labs.pages):
            page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-{i}.png"), full_page=True)
        if labs.log.exists():
            shutil.copy(labs.log, ARTIFACTS / f"{request.node.name}-lab.log")
    for page in labs.pages:
        page.close()
    for proc in labs.processes:
        stop_server(proc)


def test_an_analyst_works_in_a_sandboxed_notebook(labs: Labs) -> None:
    analyst = labs.start()
    analyst.new_notebook("Sandboxed Python")

    assert analyst.run("import os\nx = 'kept'\nprint(os.uname().release, os.getcwd())") == "4.4.0 /workspace"

    # which sandbox, how close to its limits: the status bar, and its policy on click
    status = analyst.page.locator("#sandbox-kernel-status")
    expect(status).to_have_text(re.compile(r"^gVisor · no network · \d+\.\d/2\.0 GiB$"), timeout=15_000)
    status.click()
    policy = analyst.page.locator(".jp-Dialog .sandbox-kernel-policy")
    expect(policy).to_contain_text("Network")
    expect(policy).to_contain_text("none")
    analyst.page.locator(".jp-Dialog button", has_text="Close").click()
    expect(analyst.page.locator(".jp-Dialog")).to_have_count(0)

    # an inline plot
    analyst.run("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('revenue')\nplt.show()")
    image = analyst.cells.nth(-2).locator(".jp-OutputArea img")
    expect(image).to_have_attribute("src", re.compile(r"^data:image/png;base64,"))

    # a widget: the slider renders and moving it reaches the kernel
    analyst.run("import ipywidgets\nslider = ipywidgets.IntSlider(value=3, max=10)\nslider")
    handle = analyst.cells.nth(-2).locator(".widget-slider .noUi-handle")
    expect(handle).to_be_visible()
    handle.focus()
    analyst.page.keyboard.press("ArrowRight")
    assert analyst.run("print(slider.value)") == "4"

    # a result file shows up in the file browser
    analyst.run("import pandas as pd\npd.DataFrame({'a': [1, 2]}).to_csv('from-notebook.csv')")
    analyst.page.locator('[data-command="filebrowser:refresh"]').first.click()
    expect(analyst.page.locator(".jp-DirListing-itemText", has_text="from-notebook.csv")).to_be_visible()

    # the network: one line saying there is none
    shown = analyst.run("import urllib.request\nurllib.request.urlopen('https://example.com', timeout=10)")
    assert shown == (
        "URLError: cannot resolve 'example.com': this sandboxed kernel has no network (network policy: none)"
    )

    # a cell that keeps allocating: a MemoryError in that cell; the kernel and x live on
    shown = analyst.run("hoard = []\nwhile True:\n    hoard.append(bytearray(2**24))", timeout=120)
    assert "MemoryError: memory limit 2g of this sandboxed kernel reached" in shown, shown
    assert "the cell was stopped and the kernel keeps its other variables" in shown
    assert analyst.dialogs() == []
    assert analyst.run("del hoard\nprint(x)") == "kept"

    # interrupt a long cell from the toolbar
    cell = analyst.type_cell("import time\nprint('started', flush=True)\ntime.sleep(120)")
    expect(cell.locator(".jp-InputPrompt")).to_have_text("[*]:")
    # An interrupt before the cell runs is lost (an idle kernel ignores it).
    expect(cell.locator(".jp-OutputArea")).to_contain_text("started", timeout=30_000)
    analyst.command("notebook:interrupt-kernel")
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=30_000)
    assert "KeyboardInterrupt" in cell.locator(".jp-OutputArea").inner_text()

    # restart: the variables go, the files stay
    analyst.command("notebook:restart-kernel")
    analyst.page.locator(".jp-Dialog .jp-mod-accept").click()
    analyst.wait_for_kernel("Sandboxed Python")
    shown = analyst.run("import os\nprint(os.path.exists('from-notebook.csv'))\nx")
    assert shown.startswith("True"), shown
    assert "NameError: name 'x' is not defined" in shown


@pytest.mark.skipif(os.geteuid() != 0, reason="what a server running as root makes")
def test_under_a_root_server_what_the_analyst_makes_in_lab_is_the_folders_owners(
    labs: Labs, reachable: Path
) -> None:
    """#23 item 3: under a root ``jupyter lab``, New Folder, an upload and a new notebook
    were root's, read-only to the kernel (which runs as the folder's owner): now they
    are the owner's, and the kernel writes in them."""
    labs.root = make_workspace(reachable / "alice")
    analyst = labs.start()
    page = analyst.page
    page.get_by_role("button", name="New Folder").click()
    editor = page.locator(".jp-DirListing-editor")
    editor.click()
    editor.fill("results")  # JupyterLab makes "Untitled Folder", then renames it
    editor.press("Enter")
    expect(page.locator(".jp-DirListing-itemText", has_text="results")).to_be_visible()
    with page.expect_file_chooser() as chosen:
        page.get_by_role("button", name="Upload Files").click()
    chosen.value.set_files({"name": "sales.csv", "mimeType": "text/csv", "buffer": b"a,b\n1,2\n"})
    expect(page.locator(".jp-DirListing-itemText", has_text="sales.csv")).to_be_visible()
    page.locator(".jp-FileBrowser").get_by_role("button", name=re.compile("^New Launcher")).click()
    page.locator('.jp-LauncherCard[title="Sandboxed Python"][data-category="Notebook"]:visible').click()
    analyst.wait_for_kernel("Sandboxed Python")
    shown = analyst.run(
        "open('results/result.txt', 'w').write('from the kernel')\n"
        "open('sales.csv', 'a').write('3,4\\n')\nprint('written')"
    )
    assert shown == "written"
    page.keyboard.press("Control+s")  # JupyterLab asks for a name on first save
    page.locator(".jp-Dialog input[type=text]").fill("analysis.ipynb")
    page.locator(".jp-Dialog .jp-mod-accept").click()
    expect(page.locator(".jp-mod-dirty")).to_have_count(0)
    alice = labs.root
    deadline = time.monotonic() + 10  # JupyterLab renames Untitled.ipynb after the dialog
    while not (alice / "analysis.ipynb").exists():
        assert time.monotonic() < deadline, sorted(path.name for path in alice.iterdir())
        time.sleep(0.2)
    made = [
        "results",
        "results/result.txt",
        "sales.csv",
        "analysis.ipynb",
        ".ipynb_checkpoints",
    ]
    owners = {name: ((alice / name).lstat().st_uid, (alice / name).lstat().st_gid) for name in made}
    assert owners == dict.fromkeys(made, (SANDBOX_UID, SANDBOX_UID))
    assert (alice / "sales.csv").read_text() == "a,b\n1,2\n3,4\n"
    assert (alice / "results" / "result.txt").read_text() == "from the kernel"
    for session in analyst.server.api("GET", "/api/sessions").json():
        analyst.server.api("DELETE", f"/api/sessions/{session['id']}")


ATTACK = """\
from IPython.display import HTML, Javascript, Markdown, display
import ipywidgets, pandas

def attack(name):
    return ("(window.__pwned = window.__pwned || []).push('" + name + "');"
            "fetch('/api/terminals', {method: 'POST', headers: {'X-XSRFToken': "
            "(document.cookie.match(/_xsrf=([^;]+)/) || [])[1] || ''}})")

display(Javascript(attack('javascript')))
display(HTML('<script>' + attack('script') + '</script>'))
display(HTML('<img src=x onerror="' + attack('img') + '">'))
display(Markdown('<img src=x onerror="' + attack('markdown') + '">'))
display(ipywidgets.HTML('<img src=x onerror="' + attack('widget') + '">'))
pandas.DataFrame({'revenue': [1, 2]})
"""


def test_the_kernels_output_runs_no_code_in_the_analysts_browser(labs: Labs) -> None:
    """Written as an attacker would: JupyterLab trusts what its own session outputs, so
    script in it would act with the analyst's session: here, open a terminal on the host.
    Nothing of it may run; a DataFrame still shows as a table."""
    analyst = labs.start()
    analyst.new_notebook("Sandboxed Python")
    analyst.run(ATTACK)
    expect(analyst.cells.nth(-2).locator("table.dataframe")).to_be_visible()
    time.sleep(3)  # images fail to load, scripts would have run
    assert analyst.page.evaluate("window.__pwned || []") == []
    assert analyst.server.api("GET", "/api/terminals").json() == []


def test_a_limit_that_stops_the_kernel_is_announced(labs: Labs, make_kernelspec: Callable[..., str]) -> None:
    """Memory filled out of the kernel's reach (files in /tmp) gets it killed at the
    limit: the analyst is told so, in words, and the kernel comes back."""
    make_kernelspec("py-small", config={"memory": "512m", "tmp_size": "1g"}, display_name="Small Python")
    analyst = labs.start()
    analyst.new_notebook("Small Python")
    analyst.run("x = 1")
    expect(analyst.page.locator("#sandbox-kernel-status")).to_have_text(
        re.compile(r"^gVisor · no network · \d+/512 MiB$"), timeout=15_000
    )
    analyst.type_cell("f = open('/tmp/fill', 'wb')\nwhile True:\n    f.write(b'x' * 2**24)")
    notice = analyst.page.locator(".Toastify__toast.jp-Notification-Toast-error")
    expect(notice).to_contain_text("reached its memory limit (512m)", timeout=60_000)
    # JupyterLab's own word on a dead kernel, which the analyst acknowledges
    dialog = analyst.page.locator(".jp-Dialog")
    expect(dialog).to_contain_text("appears to have died. It will restart automatically.")
    dialog.locator(".jp-mod-accept").click()
    analyst.wait_for_kernel("Small Python")
    assert "NameError" in analyst.run("x")


def _asking_lab(
    labs: Labs, make_kernelspec: Callable[..., str], upstreams: Upstreams, **config: Any
) -> tuple[Lab, str]:
    """A notebook on a kernel that asks before it leaves its allow-list (allowed.test;
    other.test is within the server's ceiling); the URL of a request it asks about."""
    port = upstreams.https_port
    (labs.root / "ca.pem").write_bytes(upstreams.ca_pem)
    make_kernelspec(
        "py-asking",
        config={
            "network": "allowlist",
            "allowed_domains": [f"allowed.test:{port}"],
            "approval": "egress",
            **config,
        },
        env={"SSL_CERT_FILE": "/workspace/ca.pem"},
        display_name="Asking Python",
    )
    analyst = labs.start(
        config_lines=(
            f"c.SandboxProvisioner.max_allowed_domains = ['allowed.test:{port}', 'other.test:{port}']\n"
            "c.SandboxProvisioner.egress_host_map = "
            "{'allowed.test': '127.0.0.1', 'other.test': '127.0.0.1'}\n"
            "c.SandboxProvisioner.egress_private_networks = ['127.0.0.1/32']\n"
        )
    )
    analyst.new_notebook("Asking Python")
    return analyst, f"https://other.test:{port}/asked"


def _answer(analyst: Lab, url: str, answer: str) -> str:
    """Run a cell fetching ``url``, type ``answer`` at the question; the cell's output."""
    cell = analyst.type_cell(_fetch(url))
    box = cell.locator(".jp-Stdin-input")
    box.fill(answer)
    box.press("Enter")
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=30_000)
    return cell.locator(".jp-OutputArea").inner_text()


def test_the_analyst_is_asked_before_the_kernel_leaves_its_allow_list(
    labs: Labs, make_kernelspec: Callable[..., str], upstreams: Upstreams
) -> None:
    """Approval through JupyterLab's own input box, as for input(), in plain words."""
    analyst, url = _asking_lab(labs, make_kernelspec, upstreams)
    cell = analyst.type_cell(_fetch(url))
    prompt = cell.locator(".jp-Stdin-prompt")
    expect(prompt).to_contain_text(
        f"Sandbox: allow a connection to other.test:{upstreams.https_port}? It is not among this kernel's "
        "allowed domains. Type once (this time), kernel (from now on, in this kernel) or deny; "
        "no answer within 60 s denies:",
        timeout=30_000,
    )
    assert "egress" not in prompt.inner_text()
    box = cell.locator(".jp-Stdin-input")
    box.fill("once")
    box.press("Enter")
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=30_000)
    assert "OK" in cell.locator(".jp-OutputArea").inner_text()


def test_an_unanswered_question_goes_away_and_the_notebook_runs_on(
    labs: Labs, make_kernelspec: Callable[..., str], upstreams: Upstreams
) -> None:
    """Unanswered within approval_timeout, the question's box closes and the next cell
    runs (the box used to stay, and every later cell got "Cell not executed due to pending
    input" until the analyst typed into it); only the documented answers allow; a domain
    allowed for the kernel shows in the status bar and its policy."""
    analyst, url = _asking_lab(labs, make_kernelspec, upstreams, approval_timeout="3s")
    cell = analyst.type_cell(_fetch(url))
    expect(cell.locator(".jp-Stdin-input")).to_be_visible(timeout=30_000)
    expect(cell.locator(".jp-Stdin")).to_have_count(0, timeout=15_000)
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=30_000)
    shown = cell.locator(".jp-OutputArea").inner_text()
    assert "FAILED" in shown
    assert "no answer within 3 s" in shown, shown
    assert analyst.run("print('next')") == "next"
    assert analyst.dialogs() == []

    shown = _answer(analyst, url, "yes")
    assert "FAILED" in shown, "the README: once, kernel or deny; anything else denies"
    assert "denied at the prompt" in shown, shown
    assert "OK" in _answer(analyst, url, "kernel")

    status = analyst.page.locator("#sandbox-kernel-status")
    expect(status).to_have_text(re.compile(r"^gVisor · 2 domains · "), timeout=15_000)
    status.click()
    policy = analyst.page.locator(".jp-Dialog .sandbox-kernel-policy")
    expect(policy).to_contain_text(f"other.test:{upstreams.https_port} (allowed at the prompt)")
    analyst.page.locator(".jp-Dialog button", has_text="Close").click()


def test_a_paused_kernel_says_so_and_so_does_its_waking(labs: Labs) -> None:
    """Paused, the status bar used to read "-/2.0 GiB" (no memory) beside JupyterLab's
    "Idle", and a cell waking the kernel showed [*] and "Idle" for 1-3 s, nothing saying why."""
    analyst = labs.start()
    analyst.new_notebook("Sandboxed Python")
    assert analyst.run("x = 42\nprint('set')") == "set"
    status = analyst.page.locator("#sandbox-kernel-status")
    expect(status).to_have_text(re.compile(r"GiB$"), timeout=15_000)
    (session,) = analyst.server.api("GET", "/api/sessions").json()
    subprocess.run([str(SK), "pause", session["kernel"]["id"]], check=True, timeout=120, capture_output=True)
    expect(status).to_have_text("gVisor · no network · paused", timeout=15_000)
    assert "memory is saved to disk" in (status.get_attribute("title") or "")
    cell = analyst.type_cell("print(x)")
    expect(status).to_have_text("gVisor · no network · resuming…", timeout=15_000)
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=60_000)
    assert cell.locator(".jp-OutputArea").inner_text().strip() == "42"
    expect(status).to_have_text(re.compile(r"^gVisor · no network · \d+\.\d/2\.0 GiB$"), timeout=15_000)


def test_a_persistent_kernel_survives_a_sigkill_of_jupyter_lab(
    labs: Labs, make_kernelspec: Callable[..., str]
) -> None:
    """x = 42; ``jupyter lab`` is killed outright and started again; the analyst reloads
    the page: the notebook reconnects to the same kernel, 42, and no dialog asks anything."""
    make_kernelspec("py-persistent", config={"lifecycle": "persistent"}, display_name="Persistent Python")
    analyst = labs.start(persistent=True)
    try:
        analyst.new_notebook("Persistent Python")
        assert analyst.run("x = 42\nprint('set')") == "set"
        analyst.page.keyboard.press("Control+s")  # JupyterLab asks for a name on first save
        analyst.page.locator(".jp-Dialog input[type=text]").fill("analysis.ipynb")
        analyst.page.locator(".jp-Dialog .jp-mod-accept").click()
        expect(analyst.page.locator(".jp-mod-dirty")).to_have_count(0)
        # JupyterLab tells the server the session's new name just after saving
        deadline = time.monotonic() + 10
        while (session := analyst.server.api("GET", "/api/sessions").json()[0])["path"] != "analysis.ipynb":
            assert time.monotonic() < deadline, session
            time.sleep(0.2)
        kernel_id = session["kernel"]["id"]

        (killed,) = labs.processes
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        port = int(analyst.server.url.rsplit(":", 1)[1])
        analyst.server = labs.serve(port, token=analyst.server.token)
        analyst.open(reset=False)
        if not analyst.cells.count():  # the layout was not saved before the kill
            analyst.page.locator(".jp-DirListing-itemText", has_text="analysis.ipynb").dblclick()
        analyst.wait_for_kernel("Persistent Python")
        assert analyst.run("print(x)") == "42"
        assert analyst.dialogs() == []
        assert f"Adopted persistent sandboxed kernel {kernel_id}" in labs.log.read_text()
        for session in analyst.server.api("GET", "/api/sessions").json():
            analyst.server.api("DELETE", f"/api/sessions/{session['id']}")
    finally:  # a persistent kernel outlives its server, never the test (in a thread:
        # Playwright's loop runs in this one)
        with ThreadPoolExecutor(1) as thread:
            thread.submit(asyncio.run, _remove_kernels("py-persistent")).result()


async def _remove_kernels(kernelspec: str) -> None:
    docker = DockerBackend()
    for kernel in await list_kernels(docker):
        if kernel.kernelspec == kernelspec:
            await remove_kernel(docker, kernel, None)
