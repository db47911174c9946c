"""What the MCP server's tools return: bounded, valid, and safe to show.

A tool result goes into an assistant's context window (a few tens of KB) and may be
printed on a terminal, and everything in it came from hostile kernel code. So:

- ``run_code``'s text is cut to a budget of characters shared fairly by stdout, stderr,
  the results' text and the error (:func:`allot`); what is cut keeps its head and tail
  around a marker that says how much went and how to get the rest (:func:`cut`);
- terminal control sequences are removed (:func:`~.session.strip_ansi`), and error
  messages are made one line (:func:`one_line`);
- an image goes out as image content only when it is valid base64 of a PNG, JPEG, GIF
  or WebP image of the type it claims (:func:`sniff_image`), and a downloaded file only
  when its bytes are one;
- listings come in pages (:func:`page`); an upload's size is known before it is decoded
  (:func:`base64_size`).

Pure functions of their arguments; :mod:`~.mcp_server` does the I/O.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, TypeVar

import pydantic_core
from mcp.types import CallToolResult, ContentBlock, ImageContent, TextContent
from typing_extensions import TypedDict

from sandbox_kernel.agents.files import printable
from sandbox_kernel.agents.session import strip_ansi

T = TypeVar("T")

#: The image types returned as MCP image content (Jupyter keeps them base64).
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
#: Most images one result carries, and the most base64 characters each may have (the
#: 5 MB per image that assistants' APIs take).
MAX_IMAGES = 10
MAX_IMAGE_CHARS = 5 * 1024 * 1024
#: Most rich results one run_code result lists; the rest are counted in its notes.
MAX_RESULTS = 50
#: Most characters of a tool error's message.
MAX_ERROR_CHARS = 2000

#: The streams whose whole text the server can save to a workspace file when cut.
STREAMS = ("stdout", "stderr")


# What the tools return: the ``structuredContent`` of each result, also sent as JSON text.


class RunResult(TypedDict):
    """One rich result of a cell (an ``execute_result`` or ``display_data``)."""

    text: str
    """Its ``text/plain`` form ("" when it has none)."""
    mime_types: list[str]
    """Every MIME type it came in; a valid image is also returned as image content."""
    is_main_result: bool
    """It is the cell's value (its last expression's), not something it displayed."""


class RunError(TypedDict):
    ename: str
    evalue: str
    traceback: list[str]
    """IPython's formatted traceback, terminal control sequences removed."""


class RunCodeOutput(TypedDict):
    kernel_id: str
    status: Literal["ok", "error", "aborted"]
    stdout: str
    stderr: str
    results: list[RunResult]
    text: str | None
    """The text/plain of the cell's value (its last expression), if it had one: the
    result with is_main_result."""
    error: RunError | None
    duration: float
    """Seconds from sending the code to its reply."""
    cpu_time: float | None
    """CPU seconds the sandbox used during the run, when the host can tell."""
    peak_memory: int | None
    """The most memory the sandbox held during the run, in bytes, when the host can tell."""
    restarted: bool
    """The kernel was restarted, its variables are gone: it died or hit a limit during the
    cell (the error says why), or before it (restart_reason says why)."""
    restart_reason: str | None
    """Why the kernel had stopped before this cell, if it had."""
    truncated: bool
    """Output was cut: over max_output_chars here (a marker in the text says where and how
    much), or over the kernel's own output limit (its notice is in stderr)."""
    full_output: dict[str, str]
    """Where the whole of a cut stdout or stderr was saved: its path in the sandbox."""
    notes: list[str]
    """What else was left out of this result, and why."""


class RunCommandOutput(TypedDict):
    kernel_id: str
    exit_code: int | None
    """The command's exit status (0: success; negative: killed by that signal); None when
    it did not end by itself (error says why)."""
    stdout: str
    stderr: str
    duration: float
    timed_out: bool
    """It ran past its timeout and was killed, with its children."""
    truncated: bool
    """stdout or stderr was cut (a marker in the text says where and how much)."""
    error: str | None
    """Why it did not run to its end: could not start, timed out, the kernel stopped."""


class StartKernelOutput(TypedDict):
    kernel_id: str
    kernel_name: str
    policy: dict[str, Any]
    """The narrowing asked for; the kernelspec's policy applies to everything else."""


class KernelOutput(TypedDict):
    kernel_id: str
    status: Literal["restarted", "shut down", "interrupted"]


class KernelEntry(TypedDict):
    kernel_id: str
    default: bool
    """run_code and the file tools use this kernel when called without a kernel_id."""
    busy: bool
    """A run_code call is running a cell in it now."""
    policy: dict[str, Any]
    """The narrowing start_kernel asked for ({} for the kernelspec's own policy)."""


class ListKernelsOutput(TypedDict):
    kernels: list[KernelEntry]
    kernel_name: str
    """The kernelspec every kernel of this server runs."""
    max_kernels: int
    """Most kernels this server runs at once."""


class PolicyOutput(TypedDict):
    kernel_id: str
    kernel_name: str
    memory: str
    cpus: float
    pids: int
    tmp_size: str
    file_size: str
    exec_timeout: float
    """Seconds a cell may run before it is stopped; 0: no limit."""
    idle_timeout: float
    """Seconds the kernel may sit idle before it is stopped; 0: no limit."""
    network: Literal["none", "allowlist"]
    """'none': no network at all; 'allowlist': HTTP(S) to allowed_domains only."""
    allowed_domains: list[str]
    approval: str
    """'egress': a request to another domain the server allows waits for a person's
    answer; 'off': such requests are refused."""
    output_limit: str
    """The kernel's own limit on one run's output (before max_output_chars)."""
    lifecycle: str
    image: str
    workspace: str
    """Where the sandbox sees the workspace."""
    working_folder: str
    """The kernel's working folder, which relative paths start from."""


class DeleteOutput(TypedDict):
    path: str
    status: Literal["deleted"]


class UploadOutput(TypedDict):
    path: str
    size: int


class DownloadOutput(TypedDict):
    path: str
    size: int
    encoding: Literal["utf-8", "base64"]
    content: str


class FileEntry(TypedDict):
    name: str
    path: str
    size: int
    is_dir: bool
    modified: str
    """ISO 8601."""
    undecodable: bool
    """The name (or a folder's on its path) is not UTF-8: name and path show each byte
    that is not as \\xNN; download_file and list_files take the path as shown."""


class ListFilesOutput(TypedDict):
    path: str
    files: list[FileEntry]
    total: int
    """Entries in the folder; ``files`` holds those from ``offset`` on, at most ``limit``."""
    offset: int
    more: bool
    """More entries follow: call again with offset=next_offset."""
    next_offset: int | None


# ---------------------------------------------------------------- the result


def tool_result(structured: Mapping[str, Any], extra: Sequence[ContentBlock] = ()) -> CallToolResult:
    """A successful result: ``structured`` as structured content and as JSON text, then ``extra``.

    Every string in it is made valid UTF-8 first (see :func:`~.files.printable`): one
    that is not (a file name kernel code chose) cannot be sent, and would end the server.
    The JSON text is ``json.dumps(structured, indent=2, ensure_ascii=False)``'s, made by
    pydantic's serializer (a tenth of the time); it refuses such a string, which is how
    one is found without walking every result.
    """
    try:
        text = pydantic_core.to_json(structured, indent=2).decode()
    except pydantic_core.PydanticSerializationError:
        structured = _printable_strings(structured)
        text = pydantic_core.to_json(structured, indent=2).decode()
    content = TextContent(type="text", text=text)
    return CallToolResult(content=[content, *extra], structured_content=dict(structured))


#: Keywords that hold for every instance, not only for those of the schema's ``type``.
_FOR_EVERY_TYPE = frozenset({"enum", "const", "anyOf", "allOf", "oneOf", "not", "$ref", "if", "then", "else"})


def plain_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` (pydantic's, of a result type) as one that takes exactly the same
    results and is cheaper to check: each ``$ref`` to its ``$defs`` written in place, and
    each "this or null" (``anyOf`` of one typed schema and ``{"type": "null"}``) one
    schema whose ``type`` lists both.

    A client checks every structured result against the tool's output schema (the mcp
    package's does it with ``jsonschema``, which pays for each subschema and reference it
    follows): for ``run_code`` that took ~0.13 ms of a call, and a third less so. A
    schema with a recursive type (none here) is left as it is.
    """
    definitions = schema.get("$defs", {})
    kept_refs: list[str] = []

    def plain(node: Any, seen: frozenset[str]) -> Any:
        if isinstance(node, list):
            return [plain(item, seen) for item in node]
        if not isinstance(node, Mapping):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.removeprefix("#/$defs/")
            definition = definitions.get(name) if ref.startswith("#/$defs/") else None
            siblings = {key: value for key, value in node.items() if key != "$ref"}
            if not isinstance(definition, Mapping) or name in seen or set(siblings) & set(definition):
                kept_refs.append(ref)
                return dict(node)
            return plain({**definition, **siblings}, seen | {name})
        done = {key: plain(value, seen) for key, value in node.items() if key != "$defs"}
        choices = done.get("anyOf")
        if isinstance(choices, list) and len(choices) == 2 and {"type": "null"} in choices:
            typed = choices[0] if choices[1] == {"type": "null"} else choices[1]
            if (
                isinstance(typed, dict)
                and isinstance(typed.get("type"), str)
                and not _FOR_EVERY_TYPE & set(typed)
                and not set(typed) & set(done)
            ):
                others = {key: value for key, value in done.items() if key != "anyOf"}
                done = {**typed, **others, "type": [typed["type"], "null"]}
        return done

    flat = plain(schema, frozenset())
    return dict(schema) if kept_refs else flat


def _printable_strings(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, Mapping):
        return {key: _printable_strings(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_printable_strings(item) for item in value]
    return value


_SPACE_WITH_NEWLINE = re.compile(r"\s*[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]\s*")


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` as one line of valid UTF-8 for a tool error: no control sequences, each
    line break (and the space around it) one space, the middle left out past ``limit``."""
    flat = _SPACE_WITH_NEWLINE.sub(" ", strip_ansi(printable(text))).strip()
    if len(flat) <= limit:
        return flat
    half = limit // 2
    return f"{flat[:half]} [... {len(flat) - 2 * half:,} characters cut ...] {flat[-half:]}"


_VALIDATION = re.compile(
    r"Error executing tool (?P<tool>\S+): \d+ validation errors? for \S+\n(?P<body>.*)", re.S
)
_FIELD_ERROR = re.compile(r"^(?P<where>\S[^\n]*)\n  (?P<what>[^\n]*?)(?: \[type=[^\n]*)?$", re.M)


def tidy_tool_error(text: str) -> str:
    """A tool error's text as :func:`one_line`; pydantic's account of arguments that do
    not fit the tool's input schema (several lines, and a link) as one sentence."""
    match = _VALIDATION.fullmatch(text)
    if match is not None:
        problems = [f"{found['where']}: {found['what']}" for found in _FIELD_ERROR.finditer(match["body"])]
        text = (
            f"{match['tool']} was called with arguments that do not fit its input schema: "
            f"{'; '.join(problems) or match['body']}"
        )
    return one_line(text)


# ---------------------------------------------------------------- cutting text


def allot(lengths: Sequence[int], budget: int) -> list[int]:
    """How many characters each of several texts keeps within ``budget`` in all: a text
    shorter than an even share keeps all of it, the longer ones share what is left evenly."""
    kept = [0] * len(lengths)
    left = max(0, budget)
    waiting = sorted(range(len(lengths)), key=lambda index: lengths[index])
    while waiting:
        share = left // len(waiting)
        shortest = waiting[0]
        if lengths[shortest] > share:
            for index in waiting:
                kept[index] = share
            break
        kept[shortest] = lengths[shortest]
        left -= lengths[shortest]
        waiting.pop(0)
    return kept


def cut(text: str, keep: int, what: str, hint: str) -> str:
    """``text`` cut to its first and last ``keep // 2`` characters or so, at line breaks
    near there when there are some, around a one-line marker naming ``what`` was cut and
    ``hint`` (how to get the rest); ``text`` itself when it is no longer than ``keep``."""
    if len(text) <= keep:
        return text
    head_end, tail_start = keep - keep // 2, len(text) - keep // 2
    # Whole lines read better: end the head after a line break in its last quarter,
    # start the tail after one in its first quarter.
    newline = text.rfind("\n", head_end - head_end // 4, head_end)
    if newline >= 0:
        head_end = newline + 1
    newline = text.find("\n", tail_start, tail_start + (len(text) - tail_start) // 4)
    if newline >= 0:
        tail_start = newline + 1
    gone = text[head_end:tail_start]
    lines = gone.count("\n")
    size = f"{len(gone):,} of {len(text):,} characters" + (f" ({lines:,} lines)" if lines else "")
    head = text[:head_end]
    if head and not head.endswith("\n"):
        head += "\n"
    return f"{head}[... {size} of {what} cut here: {hint} ...]\n{text[tail_start:]}"


def run_texts(execution: Any) -> dict[str, str]:
    """Every text of a run that counts against its result's budget, by name, as the
    result shows it (without control sequences): stdout, stderr, each listed result's
    text/plain, the error's value and traceback."""
    texts = {"stdout": strip_ansi(execution.stdout), "stderr": strip_ansi(execution.stderr)}
    for index, result in enumerate(execution.results[:MAX_RESULTS]):
        texts[f"result {index}"] = strip_ansi(str(result.data.get("text/plain", "")))
    error = execution.error
    if error is not None:
        texts["evalue"] = strip_ansi(str(error.evalue))
        texts["traceback"] = strip_ansi("\n".join(str(line) for line in error.traceback))
    return texts


def over_budget(texts: Mapping[str, str], max_chars: int) -> list[str]:
    """The streams (``stdout``, ``stderr``) of :func:`run_texts` that ``max_chars`` cuts."""
    kept = dict(zip(texts, allot([len(text) for text in texts.values()], max_chars), strict=True))
    return [name for name in STREAMS if kept[name] < len(texts[name])]


def run_output(
    kernel_id: str,
    execution: Any,
    texts: Mapping[str, str],
    max_chars: int,
    saved: Mapping[str, str] | None = None,
    more: str = "",
) -> RunCodeOutput:
    """A session ``Execution`` as ``run_code``'s structured result, its :func:`run_texts`
    ``texts`` within ``max_chars`` characters in all (markers aside). ``saved``: where
    the whole of a cut stream was saved, for its marker to say; ``more``: how else to get
    more (say, the larger max_output_chars to pass)."""
    saved = saved or {}
    kept = dict(zip(texts, allot([len(text) for text in texts.values()], max_chars), strict=True))

    def shown(name: str, what: str) -> str:
        again = f"run again {more}" if more else "print less of it"
        hint = f"all of it is in the workspace file {saved[name]}; or {again}" if name in saved else again
        return cut(texts[name], kept[name], what, hint)

    notes: list[str] = []
    listed = execution.results[:MAX_RESULTS]
    results: list[RunResult] = [
        {
            "text": shown(f"result {index}", "this result's text/plain"),
            "mime_types": sorted(result.data),
            "is_main_result": bool(getattr(result, "is_main_result", False)),
        }
        for index, result in enumerate(listed)
    ]
    main = [result["text"] for result in results if result["is_main_result"]]
    if len(execution.results) > len(listed):
        notes.append(
            f"{len(execution.results) - len(listed)} more rich results are not listed (at most "
            f"{MAX_RESULTS} are): display fewer"
        )
    error: RunError | None = None
    if execution.error is not None:
        traceback = [strip_ansi(str(line)) for line in execution.error.traceback]
        if kept["traceback"] < len(texts["traceback"]):
            traceback = [shown("traceback", "the traceback")]
        error = {
            "ename": one_line(str(execution.error.ename), 200),
            "evalue": shown("evalue", "the error's value"),
            "traceback": traceback,
        }
    return {
        "kernel_id": kernel_id,
        "status": execution.status if execution.status in ("ok", "aborted") else "error",
        "stdout": shown("stdout", "stdout"),
        "stderr": shown("stderr", "stderr"),
        "results": results,
        "text": main[0] if main else None,
        "error": error,
        "duration": round(float(execution.duration), 4),
        "cpu_time": getattr(execution, "cpu_time", None),
        "peak_memory": getattr(execution, "peak_memory", None),
        "restarted": bool(getattr(execution, "restarted", False)),
        "restart_reason": getattr(execution, "restart_reason", None),
        "truncated": any(kept[name] < len(text) for name, text in texts.items())
        or bool(getattr(execution, "truncated", False)),
        "full_output": {name: saved[name] for name in STREAMS if name in saved},
        "notes": notes,
    }


def command_output(kernel_id: str, done: Any, max_chars: int) -> RunCommandOutput:
    """A session ``CommandResult`` as ``run_command``'s structured result, stdout and
    stderr within ``max_chars`` characters in all (markers aside)."""
    texts = {"stdout": strip_ansi(done.stdout), "stderr": strip_ansi(done.stderr)}
    kept = dict(zip(texts, allot([len(text) for text in texts.values()], max_chars), strict=True))
    hint = "run it again writing its output to a file (> out.txt), then read the part you need"
    shown = {name: cut(text, kept[name], name, hint) for name, text in texts.items()}
    return {
        "kernel_id": kernel_id,
        "exit_code": done.exit_code,
        "stdout": shown["stdout"],
        "stderr": shown["stderr"],
        "duration": round(float(done.duration), 4),
        "timed_out": bool(done.timed_out),
        "truncated": bool(done.truncated) or any(kept[name] < len(text) for name, text in texts.items()),
        "error": one_line(done.error) if done.error else None,
    }


# ---------------------------------------------------------------- images


def sniff_image(data: bytes) -> str | None:
    """The image type whose structure ``data`` has, of :data:`IMAGE_TYPES`; None if none.

    More than magic bytes, so that text that begins like an image (``GIF89a...``) is not
    one: a PNG's first chunk is its header, a JPEG holds an end-of-image marker, a GIF ends
    with its trailer, a WebP's RIFF size fits the data. A cheap check of the structure,
    not a decoder: nothing here parses pixels of hostile data on the host.
    """
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        if len(data) >= 33 and data[8:16] == b"\x00\x00\x00\x0dIHDR":
            return "image/png"
        return None
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg" if len(data) >= 4 and data.find(b"\xff\xd9", 3) >= 0 else None
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif" if len(data) >= 14 and data.rstrip(b"\0").endswith(b";") else None
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        size = int.from_bytes(data[4:8], "little")  # of what follows the size itself
        if data[12:16] in (b"VP8 ", b"VP8L", b"VP8X") and 12 <= size <= len(data) - 8:
            return "image/webp"
    return None


def decode_base64(text: str) -> bytes | None:
    """Strict base64 (whitespace between lines allowed, as Jupyter wraps it); None if not."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def run_images(execution: Any) -> tuple[list[ImageContent], list[str]]:
    """The images among a cell's rich results as MCP image content, in output order,
    and notes on those left out: not valid base64 of the image type they claim, or past
    :data:`MAX_IMAGES` or :data:`MAX_IMAGE_CHARS`."""
    images: list[ImageContent] = []
    notes: list[str] = []
    for result in execution.results:
        for mime in IMAGE_TYPES:
            data = result.data.get(mime)
            if data is None:
                continue
            # Jupyter may wrap base64 across lines; MCP wants it in one piece.
            joined = "".join(data.split()) if isinstance(data, str) else ""
            decoded = decode_base64(joined) if joined else None
            if decoded is None or sniff_image(decoded) != mime:
                notes.append(f"an output claiming to be {mime} is not a valid base64 {mime} image: not shown")
            elif len(joined) > MAX_IMAGE_CHARS:
                notes.append(
                    f"a {mime} image of {len(decoded):,} bytes is over the {MAX_IMAGE_CHARS:,} characters "
                    "an image may have here: save it to a file, or make it smaller"
                )
            elif len(images) >= MAX_IMAGES:
                notes.append(f"a {mime} image is past the {MAX_IMAGES} images one result shows")
            else:
                images.append(ImageContent(type="image", data=joined, mime_type=mime))
    return images, notes


# ---------------------------------------------------------------- files


def encode_download(path: str, data: bytes) -> tuple[DownloadOutput, list[ContentBlock]]:
    """A downloaded file: text when it is UTF-8, base64 otherwise; and image content when
    its bytes are an image (see :func:`sniff_image`), whatever its name says."""
    try:
        output: DownloadOutput = {
            "path": path,
            "size": len(data),
            "encoding": "utf-8",
            "content": data.decode("utf-8"),
        }
    except UnicodeDecodeError:
        encoded = base64.b64encode(data).decode("ascii")
        output = {"path": path, "size": len(data), "encoding": "base64", "content": encoded}
    mime = sniff_image(data)
    extra: list[ContentBlock] = []
    if mime is not None:
        encoded = output["content"] if output["encoding"] == "base64" else base64.b64encode(data).decode()
        extra.append(ImageContent(type="image", data=encoded, mime_type=mime))
    return output, extra


def base64_size(content: str) -> int:
    """How many bytes the base64 ``content`` decodes to (if it is valid), uncounted padding
    and whitespace aside; without decoding it."""
    length = len(content) - sum(content.count(space) for space in " \t\r\n")
    padding = len(content.rstrip()) - len(content.rstrip().rstrip("="))
    return max(0, (length * 3) // 4 - padding)


def file_entry(info: Any) -> FileEntry:
    """One ``FileInfo`` of the session's file listing, JSON-able."""
    modified = info.modified
    if isinstance(modified, datetime):
        modified = modified.isoformat()
    elif isinstance(modified, int | float):
        modified = datetime.fromtimestamp(modified).astimezone().isoformat()
    name, path = printable(str(info.name)), printable(str(info.path))
    return {
        "name": name,
        "path": path,
        "size": int(info.size),
        "is_dir": bool(info.is_dir),
        "modified": str(modified),
        "undecodable": name != info.name or path != info.path,
    }


def page(items: Sequence[T], offset: int, limit: int) -> tuple[list[T], int | None]:
    """``items[offset:offset + limit]`` and the offset of the next page (None: the last)."""
    shown = list(items[offset : offset + limit])
    following = offset + len(shown)
    return shown, following if following < len(items) else None
