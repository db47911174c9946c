"""Sphinx extension: the configuration and command-line reference, generated from the traits.

At the start of each build it writes ``reference/generated/*.md`` (MyST) from the
traitlets of :class:`~sandbox_kernel.provisioner.SandboxProvisioner`, the server's
kernel manager, the MCP server's limits and every ``jupyter sandbox-kernel`` subcommand,
as jupyter_server's docs generate theirs: each setting's help text is the one the code
declares, so the reference cannot drift from it. It also declares the ``configtrait``
object type (as jupyter_server does), so a page links to a setting with
``{configtrait}`SandboxProvisioner.memory``` and a renamed setting fails the build.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from traitlets import HasTraits, TraitType
from traitlets.utils.importstring import import_item

#: The configurable classes whose settings the reference lists, by the section name a
#: config file uses; each is imported by the path users and configs name.
CONFIGURABLES = {
    "SandboxProvisioner": "sandbox_kernel.provisioner:SandboxProvisioner",
    "SandboxMappingKernelManager": "sandbox_kernel.jupyter.server:SandboxMappingKernelManager",
    "McpLimits": "sandbox_kernel.agents.mcp_server:McpLimits",
}
APP = "sandbox_kernel.cli.app:SandboxKernelApp"


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _ours(trait: TraitType[Any, Any]) -> bool:
    owner = getattr(trait, "this_class", None)
    return owner is not None and owner.__module__.startswith("sandbox_kernel")


def _has_dynamic_default(cls: type[HasTraits], name: str) -> bool:
    return any(name in getattr(klass, "_trait_default_generators", {}) for klass in cls.__mro__)


def _help(trait: TraitType[Any, Any]) -> str:
    text = inspect.cleandoc(trait.help or "")
    if not text:
        msg = f"{trait.this_class.__name__}.{trait.name} has no help text: every setting needs one"
        raise ValueError(msg)
    return text


def _trait_entry(section: str, cls: type[HasTraits], name: str, trait: TraitType[Any, Any]) -> list[str]:
    kind = type(trait).__name__
    if _has_dynamic_default(cls, name):
        default = "set when read (see below)"
    else:
        default = f"`{trait.default_value_repr()}`"
    facts = [f"**{kind}**, default {default}."]
    meta = trait.metadata
    if meta.get("kernelspec"):
        fact = f"A kernelspec may set it (`{name}`)"
        ceiling = meta.get("ceiling")
        if ceiling:
            fact += f", bounded by {{configtrait}}`{section}.{ceiling}`"
        flag = meta.get("flag", name.replace("_", "-"))
        facts.append(f"{fact}; `jupyter sandbox-kernel install --{flag}`.")
    return [
        f"```{{configtrait}} {section}.{name}",
        " ".join(facts),
        "",
        _help(trait),
        "```",
        "",
    ]


def configuration_reference() -> str:
    """The settings of every configurable class, as MyST, sorted by name."""
    lines: list[str] = []
    for section, path in CONFIGURABLES.items():
        cls = _load(path)
        traits = {n: t for n, t in sorted(cls.class_traits(config=True).items()) if _ours(t)}
        lines += [f"## {section}", "", f"`c.{section}.NAME = ...`, from `{path.replace(':', '.')}`.", ""]
        doc = inspect.getdoc(cls)
        if doc:
            lines += [doc.split("\n\n")[0].replace("\n", " "), ""]
        kernelspec = {n: t for n, t in traits.items() if t.metadata.get("kernelspec")}
        groups = [("", traits)]
        if kernelspec:
            server = {n: t for n, t in traits.items() if n not in kernelspec}
            groups = [("Settings a kernelspec may set too", kernelspec), ("Server-only settings", server)]
        for title, group in groups:
            if title:
                lines += [f"### {title}", ""]
            for name, trait in group.items():
                lines += _trait_entry(section, cls, name, trait)
    return "\n".join(lines)


def command_line_reference() -> str:
    """Every subcommand of ``jupyter sandbox-kernel``: what it does, its options."""
    app = _load(APP)
    lines: list[str] = []
    for command, (target, summary) in app.subcommands.items():
        cls = import_item(target) if isinstance(target, str) else target
        lines += [f"## `jupyter sandbox-kernel {command}`", "", summary.strip(), ""]
        description = inspect.cleandoc(cls.description or "")
        if description:
            lines += ["```text", description, "```", ""]
        options: list[str] = []
        traits = cls.class_traits(config=True)
        for alias, dest in sorted(cls.aliases.items()):
            owner, _, name = str(dest).rpartition(".")
            trait = traits.get(name)
            if owner != cls.__name__ or trait is None or not _ours(trait):
                continue
            help_text = _help(trait).replace("\n", " ")
            options.append(f"`--{alias}`\n: {help_text}\n")
        for flag, (_, flag_help) in sorted(cls.flags.items()):
            if flag in _GENERIC_FLAGS:
                continue
            options.append(f"`--{flag}`\n: {inspect.cleandoc(flag_help).replace(chr(10), ' ')}\n")
        if options:
            lines += ["Options:", "", *options]
        lines.append("")
    return "\n".join(lines)


#: Flags every Jupyter application has; jupyter_core documents them.
_GENERIC_FLAGS = {"debug", "show-config", "show-config-json", "generate-config", "y"}


def _generate(app: Any) -> None:
    out = Path(app.srcdir) / "reference" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("configuration.md", configuration_reference()), ("cli.md", command_line_reference())):
        path = out / name
        if not path.exists() or path.read_text() != text:  # unchanged: Sphinx reads it from cache
            path.write_text(text)


def setup(app: Any) -> dict[str, Any]:
    app.add_object_type("configtrait", "configtrait", objname="configuration setting")
    app.connect("builder-inited", _generate)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
