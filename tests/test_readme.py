"""The README and docs/ say only what runs: their Python snippets run as pasted, their links lead
somewhere, the commands, scripts, paths and names they cite exist."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_specdec import cli

from .conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def _blocks(text: str, lang: str) -> list[tuple[int, str]]:
    """(line, code) of each fenced block whose info string is `lang`."""
    return [(text.count("\n", 0, m.start()) + 1, m[2]) for m in FENCE.finditer(text) if m[1] == lang]


def _prose(text: str) -> str:
    """The text outside fenced blocks (a link or heading inside a code block is code)."""
    return FENCE.sub("", text)


def _code(text: str) -> str:
    """Everything written as code: fenced blocks and inline spans."""
    return "\n".join([m[2] for m in FENCE.finditer(text)] + INLINE_CODE.findall(_prose(text)))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, code marks and punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(_prose(page.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


SNIPPETS = [
    pytest.param(code, id=f"{page.relative_to(ROOT)}:{line}")
    for page in PAGES
    for line, code in _blocks(page.read_text(), "python")
]


def test_the_readme_has_its_use_snippet():
    assert any(p.id.startswith("README.md:") for p in SNIPPETS)


@pytest.mark.slow
@pytest.mark.parametrize("code", SNIPPETS)
def test_python_snippet_runs_as_pasted(code, smollm2_path, tmp_path):
    """Each snippet in a fresh interpreter, against the offline demo model (built by the fixture,
    which skips only when it cannot be built); the checkout's package first on the path."""
    env = child_env(HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file.relative_to(ROOT) if ROOT in file.parents else file}")
        elif anchor and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, broken


def _cited(pattern: str) -> dict[str, str]:
    """Each distinct match of `pattern` in the pages' code, with the first page citing it."""
    found: dict[str, str] = {}
    for page in PAGES:
        for match in re.findall(pattern, _code(page.read_text())):
            found.setdefault(match, str(page.relative_to(ROOT)))
    return found


SUBCOMMANDS = _cited(r"\bhf-specdec ([a-z][a-z-]*)")


@pytest.mark.parametrize("sub", sorted(SUBCOMMANDS))
def test_hf_specdec_subcommand_exists(sub, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([sub, "--help"])
    assert exit_.value.code == 0, f"`hf-specdec {sub}` (cited in {SUBCOMMANDS[sub]}) is not a command"


def _cited_options() -> dict[tuple[str, str], str]:
    """(subcommand, --option) for each option written after `hf-specdec SUB` on the same command line
    (backslash continuations joined), with the first page citing it."""
    found: dict[tuple[str, str], str] = {}
    for page in PAGES:
        code = _code(page.read_text()).replace("\\\n", " ")
        for sub, rest in re.findall(r"\bhf-specdec ([a-z][a-z-]*)([^\n]*)", code):
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest.split("#")[0]):
                found.setdefault((sub, option), str(page.relative_to(ROOT)))
    return found


OPTIONS = _cited_options()


@pytest.mark.parametrize("sub,option", sorted(OPTIONS))
def test_cited_hf_specdec_options_exist(sub, option, capsys):
    with pytest.raises(SystemExit):
        cli.main([sub, "--help"])
    assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", capsys.readouterr().out), (
        f"`hf-specdec {sub} {option}` (cited in {OPTIONS[(sub, option)]}) is not an option of {sub}"
    )


def test_cited_paths_exist():
    """Scripts run with python/bash and files named by their path in the repository."""
    paths = _cited(r"(?:^|[\s(])((?:benchmarks|docs|examples|configs|tests|hf_specdec)/[\w./*-]*\w)")
    missing = [f"{p} ({page})" for p, page in paths.items() if not any(ROOT.glob(p))]
    assert not missing, missing


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_no_script_overwrites_a_page_of_figures():
    """BENCHMARKS*.md are written by hand from several commands' reports, each section naming its
    command: a script that wrote one whole would drop every section it does not measure."""
    pages = "|".join(re.escape(page.name) for page in ROOT.glob("BENCHMARKS*.md"))
    writes = re.compile(rf"(?:>|--markdown)\s*[\"']?(?:\./)?({pages})")
    scripts = [s for s in (ROOT / "benchmarks").rglob("*") if s.suffix in (".sh", ".py")]
    found = [f"{s.relative_to(ROOT)} writes {m[1]}" for s in scripts for m in writes.finditer(s.read_text())]
    assert not found, found


def test_cited_names_import():
    """`hf_specdec.x.y` in the pages is a module or an attribute one can import."""
    names = _cited(r"\bhf_specdec(?:\.\w+)+")
    missing = [f"{n} ({page})" for n, page in names.items() if not _resolves(n)]
    assert not missing, missing
