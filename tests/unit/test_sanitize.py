"""Cleaning what the kernel shows (sandbox_kernel/sanitize.py), on real signed messages.

What the browser then does with it is tested in test_lab_browser.py."""

from __future__ import annotations

from typing import Any

import pytest
from jupyter_client.session import Session

from sandbox_kernel.sanitize import REMOVED_NOTE, OutputSanitizer, clean_bundle, clean_html
from sandbox_kernel.wire import Signatures, find_delimiter

KEY = b"k" * 32


def frames_of(msg_type: str, content: dict[str, Any], session: Session) -> list[bytes]:
    msg = session.msg(msg_type, content)
    return list(session.serialize(msg, ident=[b"kernel.iopub"]))


def content_of(frames: list[Any], session: Session) -> dict[str, Any]:
    index = find_delimiter(frames)
    assert index is not None
    assert Signatures(KEY).valid(frames, index), "a cleaned message is signed again"
    return dict(session.deserialize(frames[index + 1 :], content=True)["content"])


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
    cleaned = clean_html(attack).lower()
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


def test_html_keeps_what_data_looks_like() -> None:
    """pandas' table, its Styler's styles, images and links."""
    table = (
        "<div><style scoped>.dataframe tbody tr th {vertical-align: top;}</style>"
        '<table border="1" class="dataframe"><thead><tr style="text-align: right;">'
        '<th></th><th>a</th></tr></thead><tbody><tr><th>0</th><td id="T_x_row0_col0" '
        'style="background-color: #ff0000">1</td></tr></tbody></table></div>'
        '<img src="data:image/png;base64,iVBORw0KGgo=" alt="plot"><a href="https://example.com">doc</a>'
    )
    cleaned = clean_html(table)
    for kept in (
        "<style>",
        ".dataframe tbody tr th {vertical-align: top;}",
        'class="dataframe"',
        'style="background-color: #ff0000"',
        'id="T_x_row0_col0"',
        'src="data:image/png;base64,iVBORw0KGgo="',
        'href="https://example.com"',
    ):
        assert kept in cleaned, (kept, cleaned)


def test_a_bundle_keeps_safe_types_and_drops_code() -> None:
    data = {
        "text/plain": "<Figure>",
        "image/png": "iVBORw0KGgo=",
        "image/svg+xml": "<svg onload='x'></svg>",  # JupyterLab shows SVG in an <img>
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
    ]
    assert cleaned["text/html"] == "<b>bold</b>"
    assert {k: v for k, v in cleaned.items() if k != "text/html"} == {
        k: v for k, v in data.items() if k not in [*removed, "text/html"]
    }


@pytest.mark.parametrize(
    ("mime", "value"),
    [
        ("text/markdown", "<img src=x onerror=alert(1)>"),
        ("text/markdown", "[click](javascript:alert(1))"),
        ("text/markdown", "[click](JaVa\nScRiPt:alert(1))"),
        ("text/markdown", "[click](&#106;avascript:alert(1))"),
        ("text/latex", r"\href{javascript:alert(1)}{x}"),
    ],
)
def test_markdown_or_latex_that_could_run_is_dropped(mime: str, value: str) -> None:
    cleaned, removed = clean_bundle({"text/plain": "x", mime: value})
    assert (cleaned, removed) == ({"text/plain": "x"}, [mime])


def test_a_bundle_of_nothing_safe_says_what_was_removed() -> None:
    cleaned, _ = clean_bundle({"application/javascript": "alert(1)"})
    assert cleaned == {"text/plain": REMOVED_NOTE.format(types="application/javascript")}


def test_displays_are_cleaned_and_signed_again(session: Session) -> None:
    sanitizer = OutputSanitizer(session)
    for msg_type in ("display_data", "execute_result", "update_display_data"):
        frames = frames_of(
            msg_type,
            {"data": {"text/plain": "x", "application/javascript": "alert(1)"}, "metadata": {}},
            session,
        )
        cleaned = sanitizer.clean("iopub", frames)
        assert content_of(list(cleaned), session)["data"] == {"text/plain": "x"}, msg_type


def test_messages_needing_nothing_pass_untouched(session: Session) -> None:
    sanitizer = OutputSanitizer(session)
    for msg_type, content in [
        ("display_data", {"data": {"text/plain": "x", "image/png": "iVBOR"}, "metadata": {}}),
        ("stream", {"name": "stdout", "text": "<script>alert(1)</script>"}),  # shown as text
        ("status", {"execution_state": "idle"}),
    ]:
        frames = frames_of(msg_type, content, session)
        assert sanitizer.clean("iopub", frames) is frames
    assert sanitizer.cleaned == {}


def test_help_and_pager_bundles_on_shell_are_cleaned(session: Session) -> None:
    sanitizer = OutputSanitizer(session)
    inspect = frames_of(
        "inspect_reply", {"status": "ok", "found": True, "data": {"text/html": "<script>x</script>"}}, session
    )
    assert content_of(list(sanitizer.clean("shell", inspect)), session)["data"] == {"text/html": ""}
    payload = {
        "source": "page",
        "data": {"text/plain": "p", "text/html": "<img src=x onerror=y>"},
        "start": 0,
    }
    reply = frames_of("execute_reply", {"status": "ok", "payload": [payload]}, session)
    assert content_of(list(sanitizer.clean("shell", reply)), session)["payload"][0]["data"] == {
        "text/plain": "p",
        "text/html": '<img src="x">',
    }


def test_widgets_cannot_carry_html_that_runs(session: Session) -> None:
    """ipywidgets' HTML widget puts its value into the page as it is; any widget may ask
    for an HTML description; an Output widget's state holds outputs."""
    sanitizer = OutputSanitizer(session)

    def comm(msg_type: str, comm_id: str, state: dict[str, Any]) -> dict[str, Any]:
        data: dict[str, Any] = {"state": state, "buffer_paths": []}
        if msg_type == "comm_msg":
            data["method"] = "update"
        content = {"comm_id": comm_id, "data": data}
        if msg_type == "comm_open":
            content["target_name"] = "jupyter.widget"
        cleaned = sanitizer.clean("iopub", frames_of(msg_type, content, session))
        return dict(content_of(list(cleaned), session)["data"]["state"])

    opened = comm("comm_open", "c1", {"_model_name": "HTMLModel", "value": "<img src=x onerror=alert(1)>"})
    assert opened["value"] == '<img src="x">'
    # later updates of that widget, by comm id alone
    assert comm("comm_msg", "c1", {"value": "<script>alert(1)</script><b>ok</b>"})["value"] == "<b>ok</b>"
    # a Text widget's value is text, whatever it looks like
    comm("comm_open", "c2", {"_model_name": "TextModel", "value": "a<b"})
    assert comm("comm_msg", "c2", {"value": "<script>x</script>"})["value"] == "<script>x</script>"
    assert comm("comm_msg", "c2", {"description_allow_html": True})["description_allow_html"] is False
    comm("comm_open", "c3", {"_model_name": "OutputModel", "outputs": []})
    outputs = comm(
        "comm_msg",
        "c3",
        {
            "outputs": [
                {"output_type": "display_data", "data": {"application/javascript": "x"}, "metadata": {}}
            ]
        },
    )["outputs"]
    assert outputs[0]["data"] == {"text/plain": REMOVED_NOTE.format(types="application/javascript")}


def test_a_message_that_cannot_be_read_is_dropped_not_passed(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    sanitizer = OutputSanitizer(session)
    frames = frames_of("display_data", {"data": {"text/html": "<b>x</b>"}, "metadata": {}}, session)

    def broken(*args: Any, **kwargs: Any) -> str:
        raise ValueError("unforeseen")

    monkeypatch.setattr("sandbox_kernel.sanitize.nh3.clean", broken)
    assert sanitizer.clean("iopub", frames) is None
