"""Output a browser can show without running the kernel's code, fetching for it, or
restyling the page around it.

JupyterLab trusts the output a notebook produces in its own session, and the notebook it
saves stays trusted when it is opened again: HTML from the kernel goes into the page as
it is and its ``<script>`` tags run, ``application/javascript`` runs, HTML in Markdown
runs, and so does HTML in an ``ipywidgets.HTML`` value. Script in the page acts with the
user's Jupyter session: it can open a terminal on the host and type into it. Without any
script, what the page fetches is a way out for a kernel that has no network: an image URL
carrying a workspace file's contents, sent by the analyst's browser (with the Jupyter
server's cookies, to any port of its host). And a kernel style sheet can hide the host's
own questions and word its own in their place. So the bridge cleans, on the host,
everything from the kernel that a front end renders as rich output, before any client
sees it:

- ``display_data``, ``execute_result`` and ``update_display_data`` on IOPub, the bundles
  of ``inspect_reply`` (the help panel) and of ``execute_reply``'s pager payloads on shell;
- widget state in ``comm_open`` and ``comm_msg`` (``update_states``, the answer a page
  gets when it loads a running kernel's widgets, too): the value of HTML widgets, the
  outputs an Output widget holds, ``description_allow_html`` (always off), media widgets'
  ``format="url"``, CSS values in widget styles and layouts, and ``_dom_classes``.

What stays:

- HTML, cleaned by ammonia (the Rust sanitizer, as ``nh3``) to tags and attributes that
  cannot run code or make the browser fetch anything: an image only from a ``data:`` URL,
  links (fetched only when clicked), no ``<style>`` element, no ``id`` (the page's own
  ids: ``#jupyterlab-splash`` covers the page), classes only from :data:`_SAFE_CLASS`
  (JupyterLab's own, such as ``jp-Dialog``, would place the kernel's text over the page),
  inline styles only with the properties in :data:`_STYLE_PROPERTIES`, whose values hold
  no ``url()`` or other function that fetches (:func:`clean_style`). A pandas Styler's
  rules (``#T_..._row0_col0 {background-color: ...}``) are applied to their cells as
  inline styles first, so its colours stay.
- Markdown, as it is unless it holds HTML (``<`` before a letter, ``/``, ``!`` or
  ``?``), an image (``![``) or a Mermaid diagram (whose ``%%{init}%%`` CSS fetches):
  then those are made text (``&lt;``, ``!\\[``, a ``text`` fence). ``p < 0.05`` is
  kept as it is. Markdown or LaTeX with a script URL is dropped.
- Images (SVG shows in an ``<img>`` in JupyterLab, which loads nothing; an SVG with
  external references, script or entities is dropped all the same, as other front ends
  and HTML exports put it inline), JSON, PDF, plotly and GeoJSON unless they name a
  network URL, and ``text/plain``.

Everything else (JavaScript, Bokeh, HoloViews, Vega...) is dropped. What was removed is
said in a short note, ``[sandbox-kernel removed: external image]``, added to the bundle's
text (its ``text/plain``, HTML and Markdown), so nothing goes missing silently.

A cleaned message is signed again with the session key. Messages needing nothing pass
untouched.
"""

from __future__ import annotations

import html as html_escapes
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import nh3
import zmq
from jupyter_client.session import Session

from sandbox_kernel.channels.wire import find_delimiter, frame_bytes, load_dict

Frames = Sequence[zmq.Frame | bytes]
log = logging.getLogger(__name__)

#: MIME types shown as they are (those in :data:`_MAY_FETCH` unless they name a URL).
PASSED = frozenset(
    {
        "text/plain",
        "image/png",
        "image/jpeg",
        "image/gif",
        "image/webp",
        "image/bmp",
        "image/svg+xml",
        "application/json",
        "application/pdf",
        "application/geo+json",
        "application/vnd.dataresource+json",
        "application/vnd.jupyter.widget-view+json",
        "application/vnd.plotly.v1+json",
    }
)
#: MIME types shown once cleaned (see :func:`clean_bundle`); everything else is dropped.
SHOWN = PASSED | {"text/html", "text/markdown", "text/latex"}
#: What a cleaned bundle says was removed, in its text, HTML and Markdown.
REMOVED_NOTE = "[sandbox-kernel removed: {what}]"

_DISPLAYS = frozenset({"display_data", "execute_result", "update_display_data"})
_COMMS = frozenset({"comm_open", "comm_msg"})
_HTML_WIDGETS = frozenset({"HTMLModel", "HTMLMathModel"})
#: ipywidgets' media widgets, and the format each gets instead of "url" (the front end
#: then shows the value's bytes as that type, never as an address to load).
_MEDIA_WIDGETS = {"ImageModel": "png", "VideoModel": "mp4", "AudioModel": "mp3"}
#: Widgets remembered at once (by comm id), to know a widget's later updates. One
#: forgotten is cleaned as any widget could need.
_MAX_COMMS = 10_000

_TAGS = (nh3.ALLOWED_TAGS - {"map", "area"}) | {"font", "center", "section", "main", "article"}
_ATTRIBUTES: dict[str, set[str]] = {
    "*": {"class", "id", "style", "title", "align", "valign", "lang", "dir", "width", "height"},
    "a": {"href", "target"},
    "img": {"src", "alt"},
    "td": {"colspan", "rowspan", "headers"},
    "th": {"colspan", "rowspan", "scope", "headers"},
    "col": {"span"},
    "colgroup": {"span"},
    "ol": {"start", "type"},
    "font": {"color", "size", "face"},
}
#: After decoding character references and removing what a browser ignores in a URL's
#: scheme (tabs, newlines, spaces).
_SCRIPT_URL = re.compile(r"(?:java|vb)script:|data:text/html", re.IGNORECASE)
_IGNORED_IN_URLS = re.compile(r"[\x00-\x20]+")

#: Inline style properties kept: colours, fonts, alignment, borders, spacing inside the
#: element and sizes; none positions, overlays, hides, adds content or takes an image
#: (``background`` keeps colours and gradients only: see :data:`_CSS_FUNCTIONS`).
_STYLE_PROPERTIES = frozenset(
    {
        "color",
        "background",
        "background-color",
        "background-size",
        "background-repeat",
        "background-position",
        "font-family",
        "font-size",
        "font-style",
        "font-variant",
        "font-weight",
        "line-height",
        "text-align",
        "text-decoration",
        "text-transform",
        "vertical-align",
        "white-space",
        "word-break",
        "overflow-wrap",
        "border",
        *(f"border-{side}" for side in ("top", "right", "bottom", "left")),
        *(f"border-{part}" for part in ("color", "style", "width", "collapse", "spacing", "radius")),
        *(
            f"border-{side}-{part}"
            for side in ("top", "right", "bottom", "left")
            for part in ("color", "style", "width")
        ),
        "padding",
        *(f"padding-{side}" for side in ("top", "right", "bottom", "left")),
        "width",
        "height",
        "min-width",
        "max-width",
        "min-height",
        "max-height",
    }
)
#: CSS functions a kept value may call: colours, gradients, arithmetic and the page's
#: variables (a kernel cannot set one). ``url()``, ``image-set()``, ``image()``,
#: ``cross-fade()``, ``element()``, ``src()`` and ``paint()`` are not among them.
_CSS_FUNCTIONS = frozenset(
    {
        "rgb",
        "rgba",
        "hsl",
        "hsla",
        "hwb",
        "lab",
        "lch",
        "oklab",
        "oklch",
        "color",
        "color-mix",
        "linear-gradient",
        "radial-gradient",
        "conic-gradient",
        "repeating-linear-gradient",
        "repeating-radial-gradient",
        "repeating-conic-gradient",
        "calc",
        "min",
        "max",
        "clamp",
        "var",
    }
)
#: A kept inline style value: no quotes, escapes, comments, braces or semicolons.
_CSS_VALUE = re.compile(r"[\w\s#%.,()+\-/]*")
_CSS_FUNCTION = re.compile(r"([\w-]*)\s*\(")
_CSS_IMPORTANT = re.compile(r"!\s*important\s*$", re.IGNORECASE)
_CSS_COMMENT = re.compile(r"/\*.*?(?:\*/|$)", re.DOTALL)
_CSS_BRACE = re.compile(r"[{}]")
#: Classes kept: pandas' table, Bootstrap-style alerts and ANSI colours (JupyterLab
#: styles them as colours); the page's own (``jp-``, ``lm-``...) never.
_SAFE_CLASS = re.compile(r"dataframe|alert(?:-(?:info|warning|danger|success))?|ansi-[a-z-]+")
#: The ids a style sheet's rules may name to be applied as inline styles: one id alone.
_ID_SELECTOR = re.compile(r"#([A-Za-z_][\w-]*)")
_STYLE_ELEMENT = re.compile(r"<style\b[^>]*>(.*?)</style\s*>", re.IGNORECASE | re.DOTALL)
#: A start tag as nh3 writes it (attribute values double-quoted, ``<>"&`` escaped).
_START_TAG = re.compile(r'<([a-z][a-z0-9]*)((?: [^\s="]+="[^"]*")*)>')
_TAG_ATTRIBUTE = re.compile(r' ([^\s="]+)="([^"]*)"')
#: Elements dropped whose loss the note names (found in the HTML before it is cleaned).
_NOTED_ELEMENTS = {
    "script": "script",
    "iframe": "embedded page",
    "frame": "embedded page",
    "object": "embedded object",
    "embed": "embedded object",
    "video": "video",
    "audio": "audio",
    "svg": "inline SVG",
    "form": "form",
}
_NOTED_ELEMENT = re.compile(r"<(" + "|".join(_NOTED_ELEMENTS) + r")\b", re.IGNORECASE)

#: Markdown that a renderer could turn into HTML, an image or a Mermaid diagram.
_MARKDOWN_HTML = re.compile(r"<(?=[A-Za-z/!?])")
_MARKDOWN_IMAGE = re.compile(r"!\[")
_MARKDOWN_FENCE = re.compile(r"^(?P<before>.*?(?:`{3,}|~{3,}))(?P<info>[^\n]*)$", re.MULTILINE)
#: What in an SVG could fetch, run or hide either: references other than ``#id`` and
#: ``data:``, ``@import``, character references and entities (which could spell them),
#: backslashes (CSS escapes), script, event handlers and foreign HTML.
_SVG_UNSAFE = re.compile(
    r"""(?:\b(?:href|src)\s*=\s*["']\s*(?!#|data:)|url\(\s*["']?\s*(?!#)|@import|&\#|<!ENTITY|\\"""
    r"""|<script|<foreignObject|\bon[a-z]+\s*=|javascript:)""",
    re.IGNORECASE,
)
#: JSON whose renderer loads what it names (plotly's images, map styles and topojson;
#: GeoJSON's tiles): dropped if it names an address on the network.
_MAY_FETCH = frozenset({"application/vnd.plotly.v1+json", "application/geo+json"})
_NETWORK_URL = re.compile(r"""(?:https?|ftp|wss?):|url\(|@import|"\s*(?:/|\\\\){2}""", re.IGNORECASE)
#: Widget layout values that could move a widget over the rest of the page.
_LAYOUT_OFFSETS = frozenset({"margin", "top", "right", "bottom", "left"})
_MOVES = re.compile(r"-\s*[\d.]|\b(?:calc|min|max|clamp|var)\s*\(", re.IGNORECASE)


def _note(what: Sequence[str]) -> str:
    return REMOVED_NOTE.format(what=", ".join(dict.fromkeys(what)))


def _fetchable(url: str) -> bool:
    """Whether the browser would fetch ``url`` from somewhere (anything but ``data:``)."""
    return not _IGNORED_IN_URLS.sub("", url).lower().startswith("data:")


def _css_functions_safe(value: str) -> bool:
    return all(name.lower() in _CSS_FUNCTIONS for name in _CSS_FUNCTION.findall(value))


def clean_style(style: str) -> str:
    """The declarations of an inline ``style`` that can neither fetch nor position,
    overlay or hide anything (see :data:`_STYLE_PROPERTIES`), as ``name: value; ...``."""
    kept = []
    for declaration in _CSS_COMMENT.sub(" ", style).split(";"):
        name, colon, value = declaration.partition(":")
        name = name.strip().lower()
        value = _CSS_IMPORTANT.sub("", value).strip()
        if (
            colon
            and value
            and name in _STYLE_PROPERTIES
            and _CSS_VALUE.fullmatch(value)
            and _css_functions_safe(value)
        ):
            kept.append(f"{name}: {value}")
    return "; ".join(kept)


def _clean_classes(classes: str) -> str:
    return " ".join(name for name in classes.split() if _SAFE_CLASS.fullmatch(name))


def _id_styles(html: str) -> dict[str, str]:
    """Inline styles, by element id, from the top-level rules of the HTML's style sheets
    that name ids alone (a pandas Styler's ``#T_..._row0_col0 {...}``), cleaned."""
    styles: dict[str, str] = {}
    for sheet in _STYLE_ELEMENT.findall(html):
        sheet = _CSS_COMMENT.sub(" ", sheet)
        depth, start, selectors = 0, 0, ""
        for brace in _CSS_BRACE.finditer(sheet):
            if brace[0] == "{":
                if depth == 0:
                    selectors, start = sheet[start : brace.start()], brace.end()
                depth += 1
            elif depth:
                depth -= 1
                if depth == 0:
                    declarations = clean_style(sheet[start : brace.start()])
                    start = brace.end()
                    if not declarations or "@" in selectors:
                        continue
                    for selector in selectors.split(","):
                        match = _ID_SELECTOR.fullmatch(selector.strip())
                        if match:
                            before = styles.get(match[1])
                            styles[match[1]] = f"{before}; {declarations}" if before else declarations
    return styles


def _apply_id_styles(html: str, styles: dict[str, str]) -> str:
    """``html`` (as nh3 writes it) with each element whose id has rules styled by them,
    before its own inline style (which wins, as in CSS)."""

    def restyle(tag: re.Match[str]) -> str:
        attributes = {name: html_escapes.unescape(value) for name, value in _TAG_ATTRIBUTE.findall(tag[2])}
        rules = styles.get(attributes.get("id", ""))
        if not rules:
            return tag[0]
        attributes["style"] = f"{rules}; {attributes['style']}" if attributes.get("style") else rules
        written = "".join(f' {name}="{html_escapes.escape(value)}"' for name, value in attributes.items())
        return f"<{tag[1]}{written}>"

    return _START_TAG.sub(restyle, html)


def _attribute_filter(removed: list[str], keep_ids: bool) -> Callable[[str, str, str], str | None]:
    def keep(tag: str, attribute: str, value: str) -> str | None:
        if attribute == "style":
            return clean_style(value) or None
        if attribute == "class":
            return _clean_classes(value) or None
        if attribute == "id":
            return value if keep_ids else None
        if tag == "img" and attribute == "src" and _fetchable(value):
            removed.append("external image")
            return None
        if tag == "a" and attribute == "href" and not _fetchable(value):
            return None  # a data: link: nothing to follow
        return value

    return keep


def _nh3(html: str, removed: list[str], keep_ids: bool = False) -> str:
    return nh3.clean(
        html,
        tags=_TAGS,
        clean_content_tags={"script", "style"},
        attributes=_ATTRIBUTES,
        attribute_filter=_attribute_filter(removed, keep_ids),
        url_schemes={"http", "https", "mailto", "data"},
        link_rel="noopener noreferrer",
    )


def clean_html(html: str) -> tuple[str, list[str]]:
    """``html`` without anything that runs code, fetches or restyles the page (see the
    module's docstring), and what the note should say was removed."""
    removed = [_NOTED_ELEMENTS[name.lower()] for name in _NOTED_ELEMENT.findall(html)]
    styles = _id_styles(html) if "<style" in html.lower() else {}
    if styles:  # the Styler's colours onto its cells, then cleaned again without ids
        html = _apply_id_styles(_nh3(html, removed, keep_ids=True), styles)
    return _nh3(html, removed), list(dict.fromkeys(removed))


def clean_markdown(markdown: str) -> tuple[str, list[str]]:
    """``markdown`` with what a renderer would make HTML, an image or a Mermaid diagram
    of made text, and what the note should say of it; as it is if it holds none."""
    removed = []
    if _MARKDOWN_HTML.search(markdown):
        markdown = _MARKDOWN_HTML.sub("&lt;", markdown)
        removed.append("HTML in Markdown (shown as text)")
    if _MARKDOWN_IMAGE.search(markdown):
        markdown = _MARKDOWN_IMAGE.sub(r"!\\[", markdown)
        removed.append("image in Markdown (shown as text)")

    def unfence(fence: re.Match[str]) -> str:
        info = html_escapes.unescape(fence["info"]).replace("\\", "").lower()
        if "mermaid" not in info:
            return fence[0]
        removed.append("Mermaid diagram (shown as its source)")
        return f"{fence['before']}text"

    return _MARKDOWN_FENCE.sub(unfence, markdown), list(dict.fromkeys(removed))


def _could_run(text: str, markers: Sequence[str]) -> bool:
    """Whether Markdown or LaTeX holds a script URL (its character references decoded,
    twice over: a renderer decodes once) or one of ``markers``."""
    decoded = text
    for _ in range(2):
        if "&" in decoded:
            decoded = html_escapes.unescape(decoded)
    squeezed = _IGNORED_IN_URLS.sub("", decoded)
    return bool(_SCRIPT_URL.search(squeezed)) or any(marker in text for marker in markers)


def _text(value: Any) -> str | None:
    """A bundle's text value (a string, or the list of lines nbformat allows)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "".join(value)
    return None


def _with_note(cleaned: dict[str, Any], note: str) -> None:
    """Say ``note`` in every text the front end could show of ``cleaned``."""
    plain = _text(cleaned.get("text/plain"))
    cleaned["text/plain"] = f"{plain}\n{note}" if plain else note
    if isinstance(cleaned.get("text/html"), str):
        cleaned["text/html"] += f"<p><small>{html_escapes.escape(note)}</small></p>"
    if isinstance(cleaned.get("text/markdown"), str):
        cleaned["text/markdown"] += "\n\n" + note.replace("[", "\\[").replace("]", "\\]")


def clean_bundle(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A MIME bundle with only what a browser may render safely, and what was removed
    (as the note says it; the note is in the bundle's text already)."""
    cleaned: dict[str, Any] = {}
    removed: list[str] = []
    for mime, value in data.items():
        text = _text(value)
        if mime == "image/svg+xml" and (text is None or _SVG_UNSAFE.search(text)):
            removed.append("SVG image with external references or script")
        elif mime in _MAY_FETCH and _NETWORK_URL.search(json.dumps(value)):
            removed.append(f"{mime} that loads from the network")
        elif mime in PASSED:
            cleaned[mime] = value
        elif mime == "text/html" and text is not None:
            cleaned[mime], notes = clean_html(text)
            removed += notes
        elif mime == "text/markdown" and text is not None and not _could_run(text, ()):
            cleaned[mime], notes = clean_markdown(text)
            removed += notes
        elif mime == "text/latex" and text is not None and not _could_run(text, ("\\href", "\\url")):
            cleaned[mime] = value
        else:
            removed.append(mime)
    if removed:
        _with_note(cleaned, _note(removed))
    return cleaned, removed


def _clean_bundle_in(holder: dict[str, Any], key: str = "data") -> bool:
    """Clean ``holder[key]`` in place if it is a bundle; whether anything changed."""
    data = holder.get(key)
    if not isinstance(data, dict):
        return False
    cleaned, _ = clean_bundle(data)
    if cleaned == data:
        return False
    holder[key] = cleaned
    return True


def _css_value_safe(value: str) -> bool:
    """A widget's CSS value (set as one property) that fetches nothing."""
    return "\\" not in value and "@" not in value and _css_functions_safe(value)


def clean_widget_state(model: str, state: dict[str, Any]) -> bool:
    """Clean one widget's state in place (``model``: its ``_model_name``, "" if not
    known: then as any widget could need); whether anything changed."""
    changed = False

    def put(key: str, value: Any) -> None:
        nonlocal changed
        if state[key] != value:
            state[key] = value
            changed = True

    if state.get("description_allow_html"):
        put("description_allow_html", False)
    value = state.get("value")
    if model in _HTML_WIDGETS | {""} and isinstance(value, str):
        html, removed = clean_html(value)
        put(
            "value",
            html + (f"<p><small>{html_escapes.escape(_note(removed))}</small></p>" if removed else ""),
        )
    if (model in _MEDIA_WIDGETS or not model) and state.get("format") == "url":
        put("format", _MEDIA_WIDGETS.get(model, "png"))
    if model.endswith("StyleModel") or model == "LayoutModel" or not model:
        for key, item in list(state.items()):
            if key.startswith("_") or not isinstance(item, str) or key == "value":
                continue
            if not _css_value_safe(item) or (key in _LAYOUT_OFFSETS and _MOVES.search(item)):
                put(key, None)
    classes = state.get("_dom_classes")
    if isinstance(classes, list):
        put("_dom_classes", [c for c in classes if isinstance(c, str) and _SAFE_CLASS.fullmatch(c)])
    outputs = state.get("outputs")
    if model in ("OutputModel", "") and isinstance(outputs, list):
        for output in outputs:
            if isinstance(output, dict):
                changed |= _clean_bundle_in(output)
    return changed


class OutputSanitizer:
    """Cleans what the kernel sends to clients (see the module's docstring). Used by
    the bridge's one thread."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._widgets: OrderedDict[str, str] = OrderedDict()  # comm id -> model name
        #: Messages cleaned, by type (for logs and tests).
        self.cleaned: dict[str, int] = {}

    def clean(self, channel: str, frames: Frames) -> Frames | None:
        """``frames``, or a cleaned and re-signed copy, for a message from the kernel;
        None to drop it (it could not be read well enough to clean: fail closed)."""
        try:
            return self._clean(channel, frames)
        except Exception:  # malformed beyond what the checks foresaw: nothing passes unread
            log.exception("Could not clean a %s message from the kernel; dropped", channel)
            return None

    def _clean(self, channel: str, frames: Frames) -> Frames:
        index = find_delimiter(frames)
        if index is None or channel not in ("iopub", "shell"):
            return frames
        msg_type = str(load_dict(frames[index + 2]).get("msg_type", ""))
        if channel == "iopub" and msg_type in _DISPLAYS | _COMMS:
            pass
        elif channel == "shell" and msg_type in ("inspect_reply", "execute_reply"):
            pass
        else:
            return frames
        content = load_dict(frames[index + 5], limit=None)
        if not self._clean_content(msg_type, content):
            return frames
        self.cleaned[msg_type] = self.cleaned.get(msg_type, 0) + 1
        parts = [frame_bytes(frame) for frame in frames[index + 2 : index + 5]]
        parts.append(json.dumps(content).encode())  # ASCII: any lone surrogate escaped
        return [*frames[:index], frames[index], self._session.sign(parts), *parts, *frames[index + 6 :]]

    def _clean_content(self, msg_type: str, content: dict[str, Any]) -> bool:
        if msg_type in _DISPLAYS or msg_type == "inspect_reply":
            return _clean_bundle_in(content)
        if msg_type == "execute_reply":
            payloads = content.get("payload")
            changed = False
            for payload in payloads if isinstance(payloads, list) else []:
                if isinstance(payload, dict):
                    changed |= _clean_bundle_in(payload)
            return changed
        return self._clean_comm(msg_type, content)

    def _remember(self, comm_id: str, model: str) -> None:
        self._widgets.pop(comm_id, None)
        self._widgets[comm_id] = model
        while len(self._widgets) > _MAX_COMMS:
            self._widgets.popitem(last=False)

    def _clean_comm(self, msg_type: str, content: dict[str, Any]) -> bool:
        data = content.get("data")
        if not isinstance(data, dict):
            return False
        changed = False
        states = data.get("states")
        if data.get("method") == "update_states" and isinstance(states, dict):
            # every widget's state at once, for a page that loads the kernel's widgets
            for comm_id, entry in states.items():
                state = entry.get("state") if isinstance(entry, dict) else None
                if isinstance(state, dict):
                    model = str(state.get("_model_name") or entry.get("model_name") or "")
                    self._remember(str(comm_id), model)
                    changed |= clean_widget_state(model, state)
        state = data.get("state")
        if not isinstance(state, dict):
            return changed
        comm_id = str(content.get("comm_id", ""))
        if msg_type == "comm_open":
            self._remember(comm_id, str(state.get("_model_name", "")))
        return clean_widget_state(self._widgets.get(comm_id, ""), state) or changed
