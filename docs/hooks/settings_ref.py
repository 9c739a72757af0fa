"""The settings and command-line references, generated from the package when the site is
built (an mkdocs hook).

Every field of :class:`distsgd.config.RunConfig` and of its sections becomes one row: the
dotted key, its default (from the dataclass), what values are allowed (read from the
check declared on the field, ``metadata["check"]``, and from the ``check_*`` / ``fail``
calls of the section's ``__post_init__``) and its description
(the ``Attributes:`` entry of the section's docstring, where units and special values
are stated). ``docs/reference/settings.md`` holds the marker this hook replaces;
``docs/reference/cli.md`` holds the one replaced by every command's ``--help``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import textwrap
from typing import Any

MARKER = "<!-- settings-reference -->"

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`~?([^`]+)`")


def rst_to_markdown(text: str) -> str:
    """``code`` and Sphinx roles as Markdown code: ``:class:`~a.B``` → `` `B` ``."""
    text = _ROLE.sub(lambda m: "`" + m.group(1).rsplit(".", 1)[-1] + "`", text)
    return text.replace("``", "`")


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of the docstrings of ``cls`` and its dataclass bases
    (Google style), name → text; a base's ``READ_BY`` (who alone reads its settings)
    starts each of its entries."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            only = vars(base).get("READ_BY")
            for name, text in _own_attribute_docs(base).items():
                out[name] = f"{rst_to_markdown(only)} only: {text}" if only else text
    return out


def _own_attribute_docs(cls: type) -> dict[str, str]:
    doc = cls.__doc__ and inspect.cleandoc(cls.__doc__) or ""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return out
    name = None
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the section ended
        m = re.match(r"    (\w+): ?(.*)$", line)
        if m:
            name = m.group(1)
            out[name] = m.group(2)
        elif name and line.strip():
            out[name] += " " + line.strip()
    return {k: rst_to_markdown(v) for k, v in out.items()}


def _value(node: ast.expr, namespace: dict[str, Any]) -> Any:
    try:
        return eval(compile(ast.Expression(node), "<settings>", "eval"), namespace)  # noqa: S307
    except Exception:  # a name of a local variable: no static range
        return None


def _number(x: Any) -> str:
    if x == math.inf:
        return "∞"
    if isinstance(x, int) and abs(x) >= 10_000:
        return f"{x:,}"
    return f"{x:g}" if isinstance(x, float) else str(x)


def _allowed_from_call(call: ast.Call, namespace: dict[str, Any]) -> tuple[str, str] | None:
    """(dotted key, allowed values) of one ``check_*``/``fail`` call, if it names a key."""
    func = call.func.id if isinstance(call.func, ast.Name) else None
    if func is None or not call.args:
        return None
    key = _value(call.args[0], namespace)
    if not isinstance(key, str):
        return None
    args = [_value(a, namespace) for a in call.args[2:]]
    kw = {k.arg: _value(k.value, namespace) for k in call.keywords}
    allowed = _allowed(func, args, kw)
    return None if allowed is None else (key, allowed)


def _allowed(func: str, args: list[Any], kw: dict[str, Any]) -> str | None:
    """The allowed values that the check ``func`` with arguments ``args`` and ``kw``
    (after the setting and its value) states."""
    if func == "check_choice" and args and args[0] is not None:
        return "one of " + ", ".join(f"`{c}`" for c in args[0])
    if func in ("check_int", "check_float", "_check_list") and args:
        if func == "_check_list":
            kind = getattr(args[0], "__name__", "value") if args else "value"
            args = args[1:]
        else:
            kind = "integer" if func == "check_int" else "number"
        lo = args[0] if args else None
        hi = args[1] if len(args) > 1 else None
        if lo is None and hi is None:
            return None
        lo_br = "[" if kw.get("min_inclusive", True) else "("
        hi_br = "]" if kw.get("max_inclusive", True) else ")"
        if hi is None or hi == math.inf:
            rng = ("≥ " if lo_br == "[" else "> ") + _number(lo)
        else:
            rng = f"{lo_br}{_number(lo)}, {_number(hi)}{hi_br}"
        return f"list of {kind}s, each {rng}" if func == "_check_list" else f"{kind} {rng}"
    if func in ("check_import_path",):
        return '`""` or an import path `"package.module:function"`'
    if func == "_import_class" and len(args) == 4 and all(isinstance(a, str) for a in args[1:]):
        _, what, builtin, example = args
        return f"{builtin} or an import path 'module:Class' of {what}, e.g. {example!r}"
    if func == "_check_builtin_or_path" and args:
        return ", ".join(f"`{c}`" for c in args[0]) + ' or an import path `"module:function"`'
    allowed = {"fail": 0, "_check_str": 0, "_check_range": 2}.get(func)
    if allowed is not None and len(args) > allowed and isinstance(args[allowed], str):
        return args[allowed]
    return None


def allowed_values(cls: type, namespace: dict[str, Any]) -> dict[str, str]:
    """Dotted key → allowed values, from the checks of ``cls`` and of its dataclass
    bases (:func:`_own_allowed_values`)."""
    out: dict[str, str] = {}
    for base in cls.__mro__:
        if dataclasses.is_dataclass(base):
            out = {**_own_allowed_values(base, namespace), **out}
    return out


def _own_allowed_values(cls: type, namespace: dict[str, Any]) -> dict[str, str]:
    """The checks declared on the fields of ``cls`` (``metadata["check"]``), then those
    called in its ``__post_init__``."""
    out: dict[str, str] = {}
    sections = namespace.get("_SECTIONS", {}).items()
    section = next((name for name, c in sections if issubclass(c, cls)), "")
    for f in dataclasses.fields(cls):
        if "check" in f.metadata:
            check, args, kw = f.metadata["check"]
            allowed = _allowed(check.__name__, list(args), kw)
        elif f.type in ("bool", bool):
            allowed = "`true` or `false`"
        else:
            continue
        if allowed is not None:
            out[f"{section}.{f.name}" if section else f.name] = allowed
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return out

    def visit(node: ast.AST, names: dict[str, Any]) -> None:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            values = _value(node.iter, namespace)  # ``for key in ("a", "b"):`` checks
            if isinstance(values, tuple | list) and all(isinstance(v, str) for v in values):
                for v in values:
                    for child in node.body:
                        visit(child, {**names, node.target.id: v})
                return
        if isinstance(node, ast.Call):
            found = _allowed_from_call(node, {**namespace, **names})
            if found and isinstance(found[0], str) and found[0] not in out:
                out[found[0]] = found[1]
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
            visit(node, {})
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _allowed_by_type(value: Any) -> str:
    if isinstance(value, bool):
        return "`true` or `false`"
    if isinstance(value, dict):
        return "a table of keyword arguments"
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings() -> list[tuple[str, str, str, str]]:
    """One ``(key, default, allowed, description)`` per setting, sections in RunConfig's
    order, fields in their dataclass's order."""
    from distsgd import config

    namespace = vars(config)
    rows: list[tuple[str, str, str, str]] = []
    top = config.RunConfig
    top_docs, top_allowed = attribute_docs(top), allowed_values(top, namespace)
    for f in dataclasses.fields(top):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            cls = type(default)
            docs, allowed = attribute_docs(cls), allowed_values(cls, namespace)
            for g in dataclasses.fields(cls):
                key = f"{f.name}.{g.name}"
                value = _default(g)
                rows.append(
                    (
                        key,
                        _toml(value),
                        allowed.get(key) or _allowed_by_type(value),
                        docs.get(g.name, ""),
                    )
                )
        else:
            rows.append(
                (f.name, _toml(default), top_allowed.get(f.name, ""), top_docs.get(f.name, ""))
            )
    return rows


def sections() -> list[tuple[str, str]]:
    """``(section name, its docstring's summary line)`` in RunConfig's order."""
    from distsgd import config

    out = [("", "Top-level settings of a run.")]
    for f in dataclasses.fields(config.RunConfig):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            summary = (inspect.getdoc(type(default)) or "").split("\n\n")[0].replace("\n", " ")
            out.append((f.name, rst_to_markdown(summary)))
    return out


def settings_markdown() -> str:
    """The settings reference as Markdown: one table per section."""
    rows = settings()
    parts: list[str] = []
    for name, summary in sections():
        mine = [r for r in rows if (r[0].split(".")[0] == name if name else "." not in r[0])]
        title = f"`[{name}]`" if name else "Top level"
        parts.append(f"## {title}\n\n{summary}\n")
        parts.append("| setting | default | allowed | meaning |\n|---|---|---|---|")
        for key, default, allowed, doc in mine:
            anchor = key.replace(".", "-")
            parts.append(
                f'| <span id="{anchor}"></span>`{key}` | `{_cell(default)}` | '
                f"{_cell(allowed) or '—'} | {_cell(doc)} |"
            )
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """mkdocs hook: replace the marker of the settings page with the generated tables."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, settings_markdown())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_markdown())
    return markdown


CLI_MARKER = "<!-- cli-reference -->"


def cli_markdown() -> str:
    """``distsgd --help`` and each command's ``--help``, from the real argument parser."""
    import argparse

    from distsgd.commands import build_parser

    parser = build_parser()
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=84)
    parts = ["```text\n" + parser.format_help().rstrip() + "\n```\n"]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        command.formatter_class = parser.formatter_class
        parts.append(f"## `distsgd {name}`\n\n```text\n{command.format_help().rstrip()}\n```\n")
    return "\n".join(parts)
