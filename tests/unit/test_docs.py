"""The documentation's code examples: every one runs here, names the tests that run it, or
says why it is only an illustration (README.md and docs/**/*.md).

A Python, pycon or shell block must follow a marker line, an HTML comment that GitHub and
MyST both hide:

- ``<!-- example: runs -->``: Python is executed here as a config file would be (``c`` is
  a fresh ``Config``), and the settings it sets are then loaded into their classes, so a
  misspelled setting or a refused value fails; a shell block may hold only
  ``jupyter sandbox-kernel install`` commands, run in-process into a temporary prefix.
- ``<!-- example: tested by PATH::NAME, ... -->``: the named tests (or files) exist; they
  run the example's code with real kernels.
- ``<!-- example: illustration: why -->``: shown, not run, and the page says so.

JSON blocks need no marker: each must parse, and a kernelspec's provisioner config in one
may hold only keys a kernelspec may set, with values the settings accept.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from traitlets import Type
from traitlets.config import Config
from traitlets.utils.importstring import import_item

from sandbox_kernel.cli.app import InstallApp
from sandbox_kernel.provisioner import SandboxProvisioner

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [
    ROOT / "README.md",
    *sorted(p for p in DOCS.rglob("*.md") if not {"_build", "generated"} & set(p.relative_to(DOCS).parts)),
]
CODE = {"python", "pycon", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[^\s`]*)\s*$")
MARKER = re.compile(r"^<!-- example: (?P<kind>runs|tested by|illustration:)(?P<rest>.*?) ?-->$")
#: The sections a config example may set, and the classes that read them.
CONFIGURABLES = {
    "SandboxProvisioner": "sandbox_kernel.provisioner.SandboxProvisioner",
    "SandboxMappingKernelManager": "sandbox_kernel.server.SandboxMappingKernelManager",
    "McpLimits": "sandbox_kernel.agents.mcp_server.McpLimits",
    "ServerApp": "jupyter_server.serverapp.ServerApp",
}


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    lang: str
    code: str
    marker: str | None

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples_in(page: Path) -> Iterator[Example]:
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start or not start["lang"] or start["lang"].startswith("{"):
            i += 1
            continue
        indent = len(start["indent"])
        before = [line.strip() for line in lines[:i] if line.strip()]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[indent:] for line in lines[i + 1 : end])
        yield Example(page, i + 1, start["lang"], code + "\n", before[-1] if before else None)
        i = end + 1


EXAMPLES = [example for page in PAGES for example in examples_in(page)]
CODE_EXAMPLES = [e for e in EXAMPLES if e.lang in CODE]
JSON_EXAMPLES = [e for e in EXAMPLES if e.lang == "json"]


def test_the_pages_have_examples_to_check() -> None:
    assert len(PAGES) > 20, PAGES
    assert len(CODE_EXAMPLES) > 10
    assert len(JSON_EXAMPLES) > 5


@pytest.mark.parametrize("example", CODE_EXAMPLES, ids=str)
def test_every_code_example_runs_is_tested_or_says_it_is_an_illustration(
    example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = MARKER.match(example.marker or "")
    assert marker, (
        f"{example}: a {example.lang} example needs a marker line before it: "
        "<!-- example: runs -->, <!-- example: tested by PATH::NAME -->, or "
        "<!-- example: illustration: why -->"
    )
    kind, rest = marker["kind"], marker["rest"].strip()
    if kind == "illustration:":
        assert rest, f"{example}: say why it is only an illustration"
    elif kind == "tested by":
        for reference in rest.split(", "):
            assert_test_exists(example, reference)
    elif example.lang == "python":
        run_config_example(example)
    elif example.lang in {"bash", "sh", "shell"}:
        run_install_commands(example, tmp_path, monkeypatch)
    else:
        pytest.fail(f"{example}: a {example.lang} example cannot run here; name the test that runs it")


def assert_test_exists(example: Example, reference: str) -> None:
    path, _, name = reference.partition("::")
    file = ROOT / path
    assert file.is_file(), f"{example}: {path} does not exist"
    if name:
        defined = re.search(rf"^\s*(async def|def|class) {re.escape(name)}\b", file.read_text(), re.M)
        assert defined, f"{example}: {path} has no {name}"


def run_config_example(example: Example) -> None:
    """Run it as a ``jupyter_server_config.py``, then load what it set into its classes."""
    config = Config()
    exec(compile(example.code, str(example), "exec"), {"c": config, "get_config": lambda: config})  # noqa: S102  # our own docs
    assert config, f"{example}: it sets no setting; mark it as tested or as an illustration"
    for section, values in config.items():
        assert section in CONFIGURABLES, f"{example}: no configurable class is called {section}"
        cls = import_item(CONFIGURABLES[section])
        traits = cls.class_traits(config=True)
        for name, value in values.items():
            assert name in traits, f"{example}: {section} has no setting {name}"
            if isinstance(traits[name], Type):
                import_item(value)
        if section == "SandboxProvisioner":
            provisioner = SandboxProvisioner(config=config)  # a refused value raises here
            for name in values:
                getattr(provisioner, name)


def run_install_commands(example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run each command in-process, installing into a temporary prefix: its options and
    values are checked as the command line checks them."""
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    commands = [shlex.split(line, comments=True) for line in example.code.replace("\\\n", " ").splitlines()]
    commands = [command for command in commands if command]
    assert commands, f"{example}: no command in it"
    for n, command in enumerate(commands):
        assert command[:3] == ["jupyter", "sandbox-kernel", "install"], (
            f"{example}: only `jupyter sandbox-kernel install` runs here; name the test that runs "
            f"{shlex.join(command)!r}"
        )
        InstallApp.clear_instance()
        app = InstallApp()
        argv = [arg for arg in command[3:] if arg not in {"--sys-prefix", "--user"}]
        app.initialize([*argv, "--prefix", str(tmp_path / f"prefix{n}")])
        app.start()


def kernelspec_configs(value: Any, key: str | None = None) -> Iterator[dict[str, Any]]:
    """The provisioner configs in a JSON example: under ``kernel_provisioner``, or a bare
    ``"config"`` key (a fragment of one)."""
    if isinstance(value, dict):
        if key == "kernel_provisioner" and isinstance(value.get("config"), dict):
            yield value["config"]
            return
        for name, item in value.items():
            yield from kernelspec_configs(item, name)
    elif isinstance(value, list):
        for item in value:
            yield from kernelspec_configs(item)


def json_values(text: str) -> list[Any]:
    """The JSON values in ``text`` (JSON lines, or one fragment of an object's members)."""
    decoder = json.JSONDecoder()
    try:
        values, at = [], 0
        while text[at:].strip():
            at += len(text[at:]) - len(text[at:].lstrip())
            value, at = decoder.raw_decode(text, at)
            values.append(value)
        return values
    except json.JSONDecodeError:
        return [json.loads("{" + text.strip().rstrip(",") + "}")]


@pytest.mark.parametrize("example", JSON_EXAMPLES, ids=str)
def test_every_json_example_parses_and_its_kernelspec_config_is_valid(example: Example) -> None:
    try:
        values = json_values(example.code)
    except json.JSONDecodeError as exc:
        pytest.fail(f"{example}: not JSON ({exc})")
    fragment = values[0] if len(values) == 1 and set(values[0]) == {"config"} else None
    configs = [fragment["config"]] if fragment else [c for v in values for c in kernelspec_configs(v)]
    keys = {
        name
        for name, trait in SandboxProvisioner.class_traits(config=True).items()
        if trait.metadata.get("kernelspec")
    }
    for config in configs:
        unknown = set(config) - keys
        assert not unknown, f"{example}: a kernelspec may not set {sorted(unknown)}"
        provisioner = SandboxProvisioner()
        for name, value in config.items():
            setattr(provisioner, name, value)  # a refused value raises


def test_the_readme_starts_with_the_two_commands_ci_runs() -> None:
    """The README's first commands set the machine up and run the demo, then run every
    test; CI runs the second one exactly."""
    first = next(e for e in examples_in(ROOT / "README.md") if e.lang in CODE)
    commands = [line.split("#")[0].strip() for line in first.code.splitlines()]
    assert commands == ["bash .ci/demo", "bash .ci/test"]
    assert (ROOT / ".ci/demo").is_file()
    assert 'bash "$ROOT/.ci/setup"' in (ROOT / ".ci/demo").read_text()
    assert "exec bash .ci/test" in (ROOT / ".ci/run").read_text()


def test_the_readme_is_short_and_links_to_pages_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links
    for link in links:
        assert (ROOT / link).is_file(), link


def test_the_exception_tree_in_errors_py_is_the_code_s() -> None:
    """``errors.py`` draws its tree in its docstring (the docs show it): every error is in
    it, under its base, with the builtins it also is."""
    from sandbox_kernel import errors

    classes = {
        name: obj
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    }
    tree = (errors.__doc__ or "").split("Exception tree::", 1)[1]
    parents: list[str] = []
    drawn: dict[str, tuple[str | None, set[str]]] = {}
    last, root = "", None
    for line in tree.splitlines():
        node = re.match(r"^(?P<lead>[\s│├└─]*)(?P<name>\w+Error)(?: \((?P<builtin>\w+)\))?", line)
        alone = re.match(r"^[\s│]*\((?P<builtin>\w+)\)", line)
        if node:
            root = len(node["lead"]) if root is None else root
            depth = (len(node["lead"]) - root) // 4
            parents[depth:] = [node["name"]]
            last = node["name"]
            drawn[last] = (parents[depth - 1] if depth else None, {node["builtin"]} - {None})
        elif alone:
            drawn[last][1].add(alone["builtin"])
    assert set(drawn) == set(classes), "errors.py's tree must show every error it defines"
    for name, (parent, builtins) in drawn.items():
        bases = {base.__name__ for base in classes[name].__bases__}
        assert bases == ({parent} if parent else {"Exception"}) | builtins, name


def test_the_configuration_page_has_a_row_for_every_key_a_kernelspec_may_set() -> None:
    """Its first table says it lists them all; the settings' tags say which they are."""
    page = (DOCS / "administrators/configuration.md").read_text()
    table = page[page.index("| key (kernelspec)") : page.index("## Server-only settings")]
    rows = {
        name
        for line in table.splitlines()
        if line.startswith("| {configtrait}")
        for name in re.findall(r"`(\w+) <SandboxProvisioner\.\w+>`", line.split(" | ")[0])
    }
    traits = SandboxProvisioner.class_traits(config=True)
    assert rows == {name for name, trait in traits.items() if trait.metadata.get("kernelspec")}
