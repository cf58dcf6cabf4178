"""The user docs stay true to the code: the tables of ``docs/strategy.md`` list exactly the keywords and fields the
classes take, and every relative link of ``README.md`` and ``docs/*.md`` reaches a file (and heading) that exists."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import lightning_het
from lightning_het import HeterogeneousStrategy

REPO = Path(__file__).resolve().parents[1]
STRATEGY_DOC = REPO / "docs" / "strategy.md"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a ``#`` there is a shell comment, a ``[x](y)`` is code)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _table_after(heading: str, path: Path = STRATEGY_DOC) -> list[list[str]]:
    """The body rows (cells stripped) of the first Markdown table after the heading that starts with ``heading``."""
    lines = _prose_lines(path.read_text(encoding="utf-8"))
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    assert start is not None, f"{path.name} has no heading {heading!r}"
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table after {heading!r} in {path.name}"
    return rows[2:]  # without the header and the |---| line


def _names(cell: str) -> list[str]:
    """The names a cell gives in backticks: `a`, `b=1` -> ['a', 'b']."""
    return [token.split("=")[0].strip() for token in re.findall(r"`([^`]+)`", cell)]


def _parameters(obj) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [field.name for field in dataclasses.fields(obj) if field.init]
    return [
        name
        for name, p in inspect.signature(obj).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def _assert_same(documented: list[str], real: list[str], what: str) -> None:
    missing = [name for name in real if name not in documented]
    unknown = [name for name in documented if name not in real]
    assert not missing, f"docs/strategy.md's table of {what} lacks a row for {missing}"
    assert not unknown, f"docs/strategy.md's table of {what} names {unknown}, which {what} does not take"
    assert len(documented) == len(set(documented)), f"a row of {what} appears twice: {documented}"


def test_keyword_table_matches_the_strategy_signature():
    documented = [name for row in _table_after("## Keywords") for name in _names(row[0])]
    _assert_same(documented, _parameters(HeterogeneousStrategy.__init__), "HeterogeneousStrategy")


@pytest.mark.parametrize(
    ("heading", "cls"),
    [
        ("### `profiling=Profiling(...)`", lightning_het.Profiling),
        ("### `reliability=Reliability(...)`", lightning_het.Reliability),
        ("### Emulated platforms", lightning_het.EmulatedPlatform),
    ],
    ids=["Profiling", "Reliability", "EmulatedPlatform"],
)
def test_settings_tables_match_the_fields(heading, cls):
    documented = [name for row in _table_after(heading) for name in _names(row[0])]
    _assert_same(documented, _parameters(cls), cls.__name__)


def test_comm_table_matches_the_algorithm_objects():
    fields: dict[str, list[str]] = {}
    current = None
    for row in _table_after("### `comm=`"):
        if row[0]:
            (current,) = _names(row[0])
            assert current not in fields, f"{current} has two rows that name it"
            fields[current] = []
        assert current is not None, "the comm table starts with a row that names no object"
        fields[current] += _names(row[1])
    real = {name for name in dir(lightning_het.comm) if name in lightning_het.__all__}
    real = {name for name in real if dataclasses.is_dataclass(getattr(lightning_het, name))}
    assert real, "no comm algorithm classes found in lightning_het"
    assert sorted(fields) == sorted(real), f"the comm table lists {sorted(fields)}, the package has {sorted(real)}"
    for name, documented in fields.items():
        _assert_same(documented, _parameters(getattr(lightning_het, name)), name)


def test_deprecated_table_lists_every_deprecated_keyword():
    options = pytest.importorskip("lightning_het.config")
    deprecated = getattr(options, "DEPRECATED_KEYWORDS", None)
    if deprecated is None:
        pytest.skip("no DEPRECATED_KEYWORDS to check against")
    documented = [name for row in _table_after("### Deprecated keywords") for name in _names(row[0])]
    _assert_same(documented, list(deprecated), "the deprecated keywords")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    return [target for line in _prose_lines(path.read_text(encoding="utf-8")) for target in _LINK.findall(line)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_links_resolve_inside_the_repository(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            broken.append(f"{target} (leaves the repository)")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if REPO not in resolved.parents and resolved != REPO:
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert not broken, f"{page.relative_to(REPO)} has broken links: {broken}"


def test_slug_follows_github():
    assert _slug("SLURM `--signal` and `--requeue`") == "slurm---signal-and---requeue"
    assert _slug("Elastic training: no step lost") == "elastic-training-no-step-lost"
    assert _slug("`all_gather` with uneven shares") == "all_gather-with-uneven-shares"
