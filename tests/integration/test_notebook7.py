"""The analyst's path in ``jupyter notebook`` (Notebook 7), in a real browser.

Its server also serves JupyterLab, whose Launcher shows each kernelspec's logo. Playwright
drives Debian's ``chromium``, as in test_lab_browser.py; a failing test keeps screenshots
and the server's log in ``.ci/artifacts/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import Browser, Page, expect

from sandbox_kernel.cli.resources import data_path

from .conftest import REPORTS, SANDBOX_UID, make_workspace
from .test_jupyter_server import Server, start_server, stop_server
from .test_lab_browser import ARTIFACTS, LAB_CONFIG
from .test_lab_browser import browser as browser  # Debian's chromium

SHIPPED = {
    "sandboxed-python": "Sandboxed Python",
    "sandboxed-python-datascience": "Sandboxed Python (data science)",
}
LOCAL = "Python 3 (ipykernel)"


class Notebook7:
    """``jupyter notebook`` serving one folder, with both shipped kernelspecs, and its pages."""

    def __init__(self, browser: Browser, root: Path, log: Path) -> None:
        self.browser = browser
        self.root = root
        self.log = log
        self.pages: list[Page] = []
        config_dir = Path(os.environ["JUPYTER_CONFIG_DIR"])
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "jupyter_server_config.py").write_text(LAB_CONFIG)
        self.server, self.process = start_server(root, log, command="notebook")

    def page(self) -> Page:
        page = self.browser.new_page(viewport={"width": 1400, "height": 900})
        self.pages.append(page)
        return page

    @property
    def url(self) -> str:
        return self.server.url

    def write_notebook(self, name: str, kernel: str, display_name: str) -> str:
        """A notebook last saved with ``kernel``, as one an analyst opens again."""
        notebook = {
            "cells": [nbformat.v4.new_code_cell("1 + 1")],
            "metadata": {"kernelspec": {"name": kernel, "display_name": display_name, "language": "python"}},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        path = self.root / name
        path.write_text(json.dumps(notebook, default=dict))
        if os.getuid() == 0:
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
        return name


@pytest.fixture
def shipped_kernelspecs(jupyter_dirs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Both shipped kernelspecs as installed, with their logos; a local Python's comes with ipykernel."""
    data = tmp_path / "jupyter-data"
    for name in SHIPPED:
        shutil.copytree(data_path("kernelspecs") / name, data / "kernels" / name)
    monkeypatch.setenv("JUPYTER_PATH", str(data))
    return data


@pytest.fixture
def notebook7(
    request: pytest.FixtureRequest, browser: Browser, shipped_kernelspecs: Path, tmp_path: Path
) -> Iterator[Notebook7]:
    nb7 = Notebook7(browser, make_workspace(tmp_path / "notebooks"), tmp_path / "notebook.log")
    try:
        yield nb7
    finally:
        report = request.node.stash.get(REPORTS, {}).get("call")
        if report is not None and report.failed:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            for i, page in enumerate(nb7.pages):
                page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-{i}.png"), full_page=True)
            shutil.copy(nb7.log, ARTIFACTS / f"{request.node.name}-notebook.log")
        for page in nb7.pages:
            page.close()
        for session in nb7.server.api("GET", "/api/sessions").json():
            nb7.server.api("DELETE", f"/api/sessions/{session['id']}")
        stop_server(nb7.process)


def shown_logo(page: Page, server: Server, title: str) -> str:
    """A digest of the image the Launcher's notebook tile ``title`` shows."""
    card = page.locator(f'.jp-LauncherCard[title="{title}"][data-category="Notebook"]')
    image = card.locator("img")
    expect(image).to_be_visible(timeout=30_000)
    src = image.get_attribute("src") or ""
    url = src if src.startswith("http") else f"{server.url}{src}"
    response = page.request.get(url, headers=server.headers)
    assert response.ok, (title, src, response.status)
    return hashlib.sha256(response.body()).hexdigest()


def test_the_launcher_shows_each_kernel_its_own_logo(notebook7: Notebook7) -> None:
    """Every kernel's tile showed Python's logo: the sandboxed ones could not be told
    apart from each other, nor from a local Python."""
    page = notebook7.page()
    page.goto(f"{notebook7.url}/lab?reset&token={notebook7.server.token}")
    logos = {title: shown_logo(page, notebook7.server, title) for title in [*SHIPPED.values(), LOCAL]}
    assert len(set(logos.values())) == len(logos), logos
    for name in SHIPPED:
        resources = notebook7.server.api("GET", f"/api/kernelspecs/{name}").json()["resources"]
        assert {"logo-svg", "logo-32x32", "logo-64x64"} <= set(resources), resources


def new_notebook_from_the_tree(tree: Page, display_name: str) -> Page:
    """New > ``display_name`` on the file browser's page: the new notebook's tab."""
    tree.locator(".jp-DropdownMenu .lm-MenuBar-item", has_text="New").click()
    with tree.context.expect_page() as opened:
        tree.locator(
            ".lm-Menu-item .lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(display_name)}$")
        ).click()
    return opened.value


def test_a_new_sandboxed_notebook_opens_with_its_kernel(notebook7: Notebook7) -> None:
    """New > Sandboxed Python opened "No Kernel" and a Select Kernel dialog in 4 of 6 tries,
    the kernel idle on the server: the file browser's page starts the kernel and opens the
    notebook's tab at once, which looks for the notebook's session as it opens, while a
    sandboxed kernel still starts (a local one is up by then)."""
    tree = notebook7.page()
    tree.goto(f"{notebook7.url}/tree?token={notebook7.server.token}")
    for attempt in range(4):
        page = new_notebook_from_the_tree(tree, SHIPPED["sandboxed-python"])
        notebook7.pages.append(page)
        expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status=idle]")).to_be_visible(
            timeout=60_000
        )
        expect(page.locator(".jp-KernelName").first).to_have_text(SHIPPED["sandboxed-python"])
        assert page.locator(".jp-Dialog").count() == 0, (
            attempt,
            page.locator(".jp-Dialog").all_inner_texts(),
        )
        name = page.url.split("?")[0].rsplit("/", 1)[-1]
        sessions = [s for s in notebook7.server.api("GET", "/api/sessions").json() if s["path"] == name]
        assert [s["kernel"]["name"] for s in sessions] == ["sandboxed-python"], (attempt, sessions)
        page.close()
        notebook7.pages.remove(page)
