"""A griffe extension: the package's reST markup in docstrings as Markdown on the API page.

``code`` becomes `code`, ``:class:`~distsgd.x.Y``` becomes `Y`, ``Example::`` blocks
become fenced code and ``docs/protocols.md §2`` a link to that section, so mkdocstrings
renders the docstrings as they read in the source.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`~?([^`]+)`")
# The package's docstrings cite the docs as ``docs/protocols.md §2``; on the API page
# (docs/reference/api.md) such a citation becomes a link that mkdocs checks.
SECTIONS = {
    "1": "1-synchronous-sgd-hardsync",
    "2": "2-rudras-parameter-server-parameter_server",
    "3": "3-omnivores-compute-groups-compute_groups-and-its-optimizer",
    "4": "4-crossbows-synchronous-model-averaging-sma",
    "5": "5-local-sgd-local_sgd-and-the-baselines",
}
_CITATION = re.compile(r"docs/([\w-]+)\.md(?: §(\d)(?:[–-]§?\d)?)?")


def _link(m: re.Match) -> str:
    page, section = m.group(1), m.group(2)
    anchor = f"#{SECTIONS[section]}" if page == "protocols" and section in SECTIONS else ""
    return f"[{m.group(0)}](../{page}.md{anchor})"


def to_markdown(text: str) -> str:
    """reST inline markup and ``::`` literal blocks of ``text`` as Markdown."""
    text = _ROLE.sub(lambda m: "`" + m.group(1).rsplit(".", 1)[-1] + "`", text)
    text = text.replace("``", "`")
    text = _CITATION.sub(_link, text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            out.append(line.rstrip()[:-1] if not line.rstrip().endswith(" ::") else line[:-3])
            indent = len(line) - len(line.lstrip())
            j = i + 1
            block: list[str] = []
            while j < len(lines) and (
                not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
            ):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            body = [b for b in block if b.strip()]
            if body:
                cut = min(len(b) - len(b.lstrip()) for b in body)
                out.append("")
                out.append(" " * indent + "```python")
                out.extend(" " * indent + b[cut:] if b.strip() else "" for b in block if True)
                out.append(" " * indent + "```")
                out.append("")
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


class RstRoles(griffe.Extension):
    """Rewrite every docstring of the loaded objects once, as they are loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
