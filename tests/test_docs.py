"""The documentation's examples: every code block of README.md and docs/ runs or parses.

Python blocks run (slow: some train, at a small size) unless an HTML comment
``<!-- docs-test: parse (why) -->`` on the line before says they only parse (they need
torchrun, a run directory or minutes). Every ``distsgd …`` command line of a shell block
goes through the real argument parser and, where it names a config, through the config
with its ``--set`` overrides, so a renamed command, option or setting fails here. TOML
blocks are built into a RunConfig. The settings and command-line references are
generated from the package (``docs/hooks/settings_ref.py``) and checked complete.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

import distsgd.api
from distsgd.commands import build_parser
from distsgd.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\s*$")
MARK = re.compile(r"<!--\s*docs-test:\s*(?P<how>run|parse)\b(?P<why>[^>]*)-->")
# A run block trains at this size: enough for every code path, seconds per block. The
# fixed device profile skips the calibration a fresh profile cache would measure.
SMALL = [
    "train.max_samples=1024",
    "train.eval_every_samples=512",
    "train.eval_samples=256",
    "train.num_threads=1",
    "cluster.seconds_per_sample=1e-4",
    "cluster.seconds_per_batch=1e-3",
]


@dataclasses.dataclass
class Block:
    page: Path
    line: int
    lang: str
    how: str  # "run" or "parse"
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (indented ones in lists too), dedented."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m.group("indent")), m.group("lang")
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        mark = MARK.search(before)
        j = i + 1
        while not FENCE.match(lines[j]) or lines[j].strip() != "```":
            j += 1
        code = "\n".join(x[indent:] for x in lines[i + 1 : j])
        out.append(Block(page, i + 1, lang, mark.group("how") if mark else "run", code))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]
SHELL = [b for b in ALL if b.lang in ("bash", "sh")]
TOML = [b for b in ALL if b.lang == "toml"]


def test_every_block_has_a_known_language():
    """A block is Python, shell, TOML or text (command output): nothing escapes the
    checks below by an unknown or missing language tag."""
    unknown = [b.name for b in ALL if b.lang not in ("python", "bash", "sh", "toml", "text")]
    assert unknown == []


@pytest.mark.parametrize("block", [b for b in PYTHON if b.how == "parse"], ids=lambda b: b.name)
def test_python_block_parses(block):
    ast.parse(block.code, filename=block.name)


@pytest.fixture
def small_runs(monkeypatch, tmp_path):
    """Run a block in a fresh directory that sees the repository's configs, with every
    config it resolves cut to :data:`SMALL`."""
    resolve = distsgd.api.resolve_config

    def small(config, overrides=None):
        return resolve(config, [*(overrides or []), *SMALL])

    monkeypatch.setattr(distsgd.api, "resolve_config", small)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in PYTHON if b.how == "run"], ids=lambda b: b.name)
def test_python_block_runs(block, small_runs, capsys):
    exec(compile(block.code, block.name, "exec"), {"__name__": "__docs__"})  # noqa: S102
    assert list(small_runs.iterdir()), "the block ran nothing"


# ---- shell blocks: every distsgd command line through the real parser and config ------


def command_lines(code: str) -> list[tuple[str | None, list[str]]]:
    """``(cd directory or None, argv)`` of every command of a shell block: continuation
    lines joined, comments cut, ``&&`` / ``;`` split, ``export`` lines skipped."""
    text = code.replace("\\\n", " ")
    out: list[tuple[str | None, list[str]]] = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        cwd = None
        command: list[str] = []
        for w in [*words, "&&"]:
            if w not in ("&&", ";", "||"):
                command.append(w)
                continue
            if command and command[0] == "cd":
                cwd = command[1]
            elif command:
                out.append((cwd, command))
            command = []
    return out


def distsgd_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``distsgd`` (the console script, ``python -m distsgd`` or
    ``torchrun … -m distsgd``), else None."""
    if argv[0] == "distsgd":
        return argv[1:]
    if argv[0] in ("python", "python3") and argv[1:3] == ["-m", "distsgd"]:
        return argv[3:]
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        if args.module and args.training_script == "distsgd":
            return args.training_script_args
    return None


def script_of(argv: list[str]) -> str | None:
    """The training script a ``torchrun`` or ``python -m distsgd.torch.launch`` line runs."""
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        return None if args.module else args.training_script
    if argv[0] in ("python", "python3") and argv[1:3] == ["-m", "distsgd.torch.launch"]:
        return next(w for w in argv[3:] if w.endswith(".py"))
    return None


def check_distsgd(args: list[str], cwd: Path) -> None:
    """Parse ``distsgd ARGS`` and resolve the config it would train or tune."""
    ns = build_parser().parse_args(args)
    if ns.command not in ("train", "tune", "calibrate"):
        return
    sets = list(ns.set)
    if getattr(ns, "runtime", None):
        sets.insert(0, f"runtime={ns.runtime}")
    if getattr(ns, "num_processes", None) is not None:
        sets.insert(0, f"dist.num_processes={ns.num_processes}")
    if getattr(ns, "resume", None) or getattr(ns, "verify_only", None):
        distsgd.api.resolve_config(None, sets)  # the overrides name real settings
        return
    config = str(cwd / ns.config) if ns.config else None
    distsgd.api.resolve_config(config, sets)


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.name)
def test_shell_block_commands_parse(block, monkeypatch):
    """Every distsgd line parses and resolves; every script a launcher line names exists."""
    for cd, argv in command_lines(block.code):
        cwd = ROOT / cd if cd else ROOT
        monkeypatch.chdir(cwd)
        args = distsgd_argv(argv)
        if args is not None:
            try:
                check_distsgd(args, cwd)
            except SystemExit as e:  # argparse's exit: a renamed command or option
                pytest.fail(f"{block.name}: {shlex.join(argv)!r} does not parse (exit {e})")
            continue
        script = script_of(argv)
        if script is not None:
            assert (cwd / script).is_file(), f"{block.name}: {script} does not exist"


INLINE = re.compile(r"`(?:python3? -m )?distsgd ((?:train|tune|report|export|calibrate) [^`]+)`")


def test_inline_command_lines_parse():
    """A command written in the prose (`` `distsgd train --resume RUN --set k=v` ``) parses
    too, and its ``--set`` settings exist; placeholders such as RUN stand for paths."""
    checked = 0
    for page in PAGES:
        text = re.sub(r"\s*\n\s*", " ", page.read_text())
        for m in INLINE.finditer(text):
            args = shlex.split(m.group(1))
            try:
                ns = build_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{page.name}: `distsgd {m.group(1)}` does not parse")
            if getattr(ns, "set", None):
                distsgd.api.resolve_config(None, ns.set)
            checked += 1
    assert checked >= 5


def test_a_renamed_setting_fails_the_shell_check():
    """The check above can fail: a setting that does not exist is refused."""
    with pytest.raises(ValueError, match="protocol.num_learnerz"):
        check_distsgd(["train", "configs/hardsync.toml", "--set", "protocol.num_learnerz=2"], ROOT)
    with pytest.raises(SystemExit):
        check_distsgd(["train", "--num-procs", "2"], ROOT)


@pytest.mark.parametrize("block", TOML, ids=lambda b: b.name)
def test_toml_block_is_a_valid_config(block):
    raw = tomllib.loads(block.code)
    RunConfig.from_dict(raw)


# ---- the references generated from the package ----------------------------------------


def _hook():
    spec = importlib.util.spec_from_file_location("settings_ref", DOCS / "hooks/settings_ref.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["settings_ref"] = module
    spec.loader.exec_module(module)
    return module


def test_settings_reference_lists_every_setting_with_its_meaning():
    """Each field of every config section has a row with its default and a description
    (a setting added without an ``Attributes:`` entry fails here)."""
    hook = _hook()
    rows = {key: (default, doc) for key, default, _, doc in hook.settings()}
    expected = []
    for f in dataclasses.fields(RunConfig):
        section = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(section):
            expected += [f"{f.name}.{g.name}" for g in dataclasses.fields(section)]
        else:
            expected.append(f.name)
    assert sorted(rows) == sorted(expected)
    assert [k for k, (_, doc) in rows.items() if not doc] == []
    text = hook.settings_markdown()
    assert all(f"`{key}`" in text for key in expected)
    assert "`protocol.num_learners` | `4` | integer [1, 65,536] |" in text
    assert "`cluster.latency_s` | `5e-05` | number [0, 60] |" in text  # bounds inclusive


def test_docstring_citations_link_to_sections_that_exist():
    """The API page turns ``docs/protocols.md §N`` into a link: each N's anchor is a
    heading of the protocols page, and every cited page exists."""
    from markdown.extensions.toc import slugify

    spec = importlib.util.spec_from_file_location("rst_roles", DOCS / "hooks/rst_roles.py")
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    headings = re.findall(r"^#+ (.+)$", (DOCS / "protocols.md").read_text(), re.M)
    slugs = {slugify(h.replace("`", ""), "-") for h in headings}
    assert set(roles.SECTIONS.values()) <= slugs
    cited = {
        m.group(1)
        for p in (ROOT / "distsgd").rglob("*.py")
        for m in roles._CITATION.finditer(p.read_text())
    }
    assert cited and all((DOCS / f"{page}.md").is_file() for page in cited), cited
    assert "(../protocols.md#2-rudras" in roles.to_markdown("rule (docs/protocols.md §2)")


def test_cli_reference_has_every_command():
    text = _hook().cli_markdown()
    for command in ("train", "tune", "report", "export", "calibrate"):
        assert f"## `distsgd {command}`" in text
    assert "--num-processes" in text


def test_api_page_lists_every_public_name():
    """Each name of ``__all__`` of distsgd, distsgd.torch and distsgd.protocols has its
    entry on the API page (generated from its docstring when the site is built)."""
    import distsgd.protocols
    import distsgd.torch

    page = (DOCS / "reference/api.md").read_text()
    entries = set(re.findall(r"^::: ([\w.]+)", page, re.M))
    missing = [
        f"{module.__name__}.{name}"
        for module in (distsgd, distsgd.torch, distsgd.protocols)
        for name in module.__all__
        if name != "__version__"
        and not {f"{module.__name__}.{name}", f"distsgd.config.{name}"} & entries
    ]
    assert missing == []


# ---- what the README and the package say ----------------------------------------------


def test_readme_is_one_short_page_linking_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((ROOT / link).is_file() for link in links), links
    for script in ("scripts/demo.sh", "scripts/test.sh"):  # the two commands
        assert f"bash {script}\n" in readme and (ROOT / script).is_file()


def test_no_docstring_or_message_cites_spec_md():
    """Users do not have SPEC.md: the package points to the docs' protocols page."""
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "distsgd").rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"SPEC(\.md)?\s*§|SPEC\.md", line)
    ]
    assert hits == []


def test_docs_block_counts(capsys):
    """How many blocks run and how many only parse (reported with -s)."""
    run = [b for b in PYTHON if b.how == "run"]
    parsed = [b for b in PYTHON if b.how == "parse"]
    with capsys.disabled():
        print(
            f"\ndocs blocks: {len(run)} Python run, {len(parsed)} Python parsed, "
            f"{len(SHELL)} shell (command lines parsed), {len(TOML)} TOML built, "
            f"{sum(b.lang == 'text' for b in ALL)} text (output shown)"
        )
    assert run and parsed and SHELL and TOML
