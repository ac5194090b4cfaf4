"""The docs name what exists: every repository path and `ds_ppo.` module a page names, every
relative link (and its #anchor) resolves; nothing in the docs or the code cites an issue
number; the README's quick start installs torch first and ends with the test suite."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from support.quick_start import commands

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
         REPO / "ds_configs" / "README.md", REPO / "examples" / "README.md"]
TOP = ("ds_ppo", "tests", "launch", "examples", "docs", "ds_configs")

_PATH = re.compile(r"`((?:%s)/[\w./-]*)(?:::\w+)?`" % "|".join(TOP))
_MODULE = re.compile(r"(?<![\w./-])ds_ppo(?:\.\w+)+(?::\w+)?")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_ISSUE = re.compile(r"\bissues? #?\d+|\(#\d+\)", re.I)


def named_paths(text: str) -> set[str]:
    """Repository paths a page names in backticks: `ds_ppo/engine/generation/loop.py`, `launch/`."""
    return set(_PATH.findall(text))


def module_names(source: str) -> set[str]:
    """The names a module offers: what it defines or imports at its top level, and the
    strings of its top-level assignments (`__all__`, a lazy-import table)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            names |= {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)
                      and isinstance(c.value, str) and c.value.isidentifier()}
    return names


def module_problem(name: str, root: Path = REPO) -> str | None:
    """Why a dotted name (`ds_ppo.engine.generation.loop`, `ds_ppo.rewards:positive_words`,
    `ds_ppo.trainer.train`) names nothing, or None: its longest prefix that is a module or
    package, then at most one name that module offers."""
    parts = name.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            rest = parts[cut:]
            if not rest or len(rest) == 1 and rest[0] in module_names(source.read_text()):
                return None
            return f"{'.'.join(parts[:cut])} has no {'.'.join(rest)}"
    return f"no module {name}"


def anchors(markdown: str) -> set[str]:
    """The #anchors of a page's headings, as GitHub makes them (code blocks left out)."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def link_problems(page: Path, root: Path = REPO) -> list[str]:
    """Relative links of a page whose file or #anchor is not there."""
    bad = []
    text = page.read_text()
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            bad.append(f"{page.relative_to(root)}: {target} (no {file})")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            bad.append(f"{page.relative_to(root)}: {target} (no heading #{anchor})")
    return bad


def test_the_docs_name_paths_that_exist():
    missing = [f"{page.relative_to(REPO)}: {path}" for page in PAGES
               for path in sorted(named_paths(page.read_text()))
               if not (REPO / path).exists()]
    assert not missing, missing


def test_the_docs_name_modules_that_exist():
    problems = [f"{page.relative_to(REPO)}: {problem}" for page in PAGES
                for name in sorted(set(_MODULE.findall(page.read_text())))
                if (problem := module_problem(name))]
    assert not problems, problems


def test_the_docs_links_resolve():
    problems = [p for page in PAGES for p in link_problems(page)]
    assert not problems, problems


def test_the_checks_catch_what_they_look_for(tmp_path):
    assert named_paths("in `ds_ppo/engine/generation/loop.py` and `tests/e2e/test_resume.py::test_x`") \
        == {"ds_ppo/engine/generation/loop.py", "tests/e2e/test_resume.py"}
    assert module_problem("ds_ppo.engine.ds_templates.default_template") is None
    assert module_problem("ds_ppo.rewards:positive_words") is None
    assert module_problem("ds_ppo.trainer.train") is None
    assert module_problem("ds_ppo.ds_templates.default_template") == \
        "ds_ppo has no ds_templates.default_template"
    assert module_problem("ds_ppo.rewards:no_such_function") == \
        "ds_ppo.rewards has no no_such_function"
    assert anchors("# A run's output\n```\n# not a heading\n```\n## H200: `ds-ppo bench`\n"
                   "## Tests\n## Tests\n") == {"a-runs-output", "h200-ds-ppo-bench", "tests",
                                               "tests-1"}
    page = tmp_path / "page.md"
    page.write_text("# Top\n[a](#top) [b](#bottom) [c](missing.md) [d](https://x.org/y)\n")
    problems = [p.split(": ", 1)[1] for p in link_problems(page, tmp_path)]
    assert problems == ["#bottom (no heading #bottom)", "missing.md (no missing.md)"]
    assert _ISSUE.findall("fixed in issue 31, item 9; see Issue #8 (#12); the issue's shape") \
        == ["issue 31", "Issue #8", "(#12)"]


def test_no_doc_or_code_cites_an_issue_number():
    files = [*PAGES, REPO / ".ci" / "run"]
    for top in TOP:
        files += [p for p in (REPO / top).rglob("*")
                  if p.suffix in (".py", ".md", ".sh", ".yaml", ".json", ".sbatch")]
    this = Path(__file__).resolve()
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for path in sorted(set(files)) if path.resolve() != this and path.is_file()
             for n, line in enumerate(path.read_text().splitlines(), 1) if _ISSUE.search(line)]
    assert not found, found


def test_the_quick_start_installs_torch_first_and_ends_with_the_test_suite():
    lines = commands((REPO / "README.md").read_text())
    assert len(lines) == 2, lines
    assert all(line.startswith("pip install torch==") for line in lines), lines
    assert lines[0].endswith("&& ds-ppo train"), lines
    assert lines[-1].endswith("&& python -m pytest -q"), lines
