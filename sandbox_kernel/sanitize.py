"""Output a browser can show without running the kernel's code.

JupyterLab trusts the output a notebook produces in its own session: HTML from the kernel
goes into the page as it is and its ``<script>`` tags run, ``application/javascript``
runs, HTML in Markdown runs, and so does HTML in an ``ipywidgets.HTML`` value. Script in
the page acts with the user's Jupyter session: it can open a terminal on the host and type
into it. So the bridge cleans, on the host, everything from the kernel that a front end
renders as rich output, before any client sees it:

- ``display_data``, ``execute_result`` and ``update_display_data`` on IOPub, the bundles
  of ``inspect_reply`` (the help panel) and of ``execute_reply``'s pager payloads on shell;
- widget state in ``comm_open`` and ``comm_msg``: the value of HTML widgets, the outputs
  an Output widget holds, and ``description_allow_html`` (always off).

In a bundle, only the MIME types in :data:`SHOWN` stay: HTML is cleaned by ammonia (the
Rust sanitizer, as ``nh3``) to tags and attributes that cannot run code (tables, styles
and images stay, so pandas and its Styler look as before); Markdown and LaTeX that could
carry HTML or a script URL are dropped; JavaScript and types whose renderers run code
or fetch URLs (Bokeh, HoloViews, Vega) are dropped. ``text/plain`` stays, so nothing
goes missing; a bundle left without anything says what was removed. Images (SVG too:
JupyterLab shows it in an ``<img>``) pass as they are.

A cleaned message is signed again with the session key. Messages needing nothing pass
untouched.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import nh3
import zmq
from jupyter_client.session import Session

from .wire import find_delimiter, frame_bytes, load_dict

Frames = Sequence[zmq.Frame | bytes]
log = logging.getLogger(__name__)

#: MIME types shown as they are.
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
REMOVED_NOTE = "[sandbox-kernel removed output that could run code in your browser: {types}]"

_DISPLAYS = frozenset({"display_data", "execute_result", "update_display_data"})
_COMMS = frozenset({"comm_open", "comm_msg"})
_HTML_WIDGETS = frozenset({"HTMLModel", "HTMLMathModel"})
#: Widgets remembered at once (by comm id), to know an HTML widget's later updates.
_MAX_COMMS = 10_000

_TAGS = (nh3.ALLOWED_TAGS - {"map", "area"}) | {"style", "font", "center", "section", "main", "article"}
_ATTRIBUTES: dict[str, set[str]] = {
    "*": {"class", "id", "style", "title", "align", "valign", "lang", "dir", "width", "height"},
    "a": {"href", "name", "target"},
    "img": {"src", "alt"},
    "td": {"colspan", "rowspan", "headers"},
    "th": {"colspan", "rowspan", "scope", "headers"},
    "col": {"span"},
    "colgroup": {"span"},
    "ol": {"start", "type"},
    "font": {"color", "size", "face"},
}
#: After removing what a browser ignores in a URL's scheme (tabs, newlines, spaces).
_SCRIPT_URL = re.compile(r"(?:java|vb)script:|data:text/html|&#|&colon;", re.IGNORECASE)
_IGNORED_IN_URLS = re.compile(r"[\x00-\x20]+")


def clean_html(html: str) -> str:
    """``html`` without anything that runs code: no scripts, event handlers, frames,
    objects, forms or script URLs."""
    return nh3.clean(
        html,
        tags=_TAGS,
        clean_content_tags={"script"},
        attributes=_ATTRIBUTES,
        url_schemes={"http", "https", "mailto", "data"},
        link_rel="noopener noreferrer",
    )


def _could_run(text: str, markers: Sequence[str]) -> bool:
    squeezed = _IGNORED_IN_URLS.sub("", text)
    return bool(_SCRIPT_URL.search(squeezed)) or any(marker in text for marker in markers)


def clean_bundle(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A MIME bundle with only what a browser may render safely, and the types removed."""
    cleaned: dict[str, Any] = {}
    removed: list[str] = []
    for mime, value in data.items():
        if mime in PASSED:
            cleaned[mime] = value
        elif mime == "text/html" and isinstance(value, (str, list)):
            cleaned[mime] = clean_html(value if isinstance(value, str) else "".join(map(str, value)))
        elif (
            mime == "text/markdown"
            and isinstance(value, str)
            and not _could_run(value, ("<",))  # HTML in Markdown is rendered as it is
        ) or (mime == "text/latex" and isinstance(value, str) and not _could_run(value, ("\\href", "\\url"))):
            cleaned[mime] = value
        else:
            removed.append(mime)
    if removed and not cleaned:
        cleaned["text/plain"] = REMOVED_NOTE.format(types=", ".join(removed))
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
        return self._clean_widget(msg_type, content)

    def _clean_widget(self, msg_type: str, content: dict[str, Any]) -> bool:
        comm_id = str(content.get("comm_id", ""))
        data = content.get("data")
        state = data.get("state") if isinstance(data, dict) else None
        if not isinstance(state, dict):
            return False
        if msg_type == "comm_open":
            self._widgets.pop(comm_id, None)
            self._widgets[comm_id] = str(state.get("_model_name", ""))
            while len(self._widgets) > _MAX_COMMS:
                self._widgets.popitem(last=False)
        model = self._widgets.get(comm_id, "")
        changed = False
        if state.get("description_allow_html"):
            state["description_allow_html"] = False
            changed = True
        if model in _HTML_WIDGETS and isinstance(state.get("value"), str):
            value = clean_html(state["value"])
            changed |= value != state["value"]
            state["value"] = value
        outputs = state.get("outputs")
        if model == "OutputModel" and isinstance(outputs, list):
            for output in outputs:
                if isinstance(output, dict):
                    changed |= _clean_bundle_in(output)
        return changed
