"""Every path of the package that a docstring or comment names exists: `ds_ppo/...` paths and
`<subpackage>/<file>.py` ones (read relative to ds_ppo/), in the package, tools/, launch/ and
tests/. A move or rename that forgets a docstring fails here."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("ds_ppo", "tools", "launch", "tests")


def _texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    found = [(tok.start[0], tok.string) for tok in
             tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def named_paths(text: str, subpackages: set[str]) -> list[str]:
    """The package paths a text names: `ds_ppo/engine/roles.py`, `ds_ppo/engine/`,
    `ds_ppo/presets/tiny.yaml`, and `engine/roles.py` (the first part a subpackage of ds_ppo);
    placeholders in capitals are skipped."""
    sub = "|".join(sorted(subpackages))
    pattern = re.compile(r"(?<![\w/.-])(ds_ppo/[\w/]*[\w]\.(?:py|yaml|json|jsonl|txt)|ds_ppo/[\w/]+/"
                         rf"|(?:{sub})/[\w/]*\w\.py)(?![\w/])")
    return [p for p in pattern.findall(text) if not re.search(r"[A-Z]{2,}", p)]


def missing_paths(repo: Path = REPO) -> list[str]:
    package = repo / "ds_ppo"
    subpackages = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    missing = []
    for folder in SOURCES:
        for file in sorted((repo / folder).rglob("*.py")):
            for line, text in _texts(file.read_text()):
                for path in named_paths(text, subpackages):
                    full = repo / path if path.startswith("ds_ppo/") else package / path
                    if not full.exists():
                        missing.append(f"{file.relative_to(repo)}:{line} {path}")
    return missing


def test_docstrings_and_comments_name_paths_that_exist():
    assert missing_paths() == []


def test_the_path_scan_finds_a_missing_path(tmp_path):
    """Not vacuous: a docstring's missing module, a comment's missing subpackage file and a
    missing preset are found; existing ones, code strings and placeholders are not."""
    (tmp_path / "ds_ppo" / "run").mkdir(parents=True)
    (tmp_path / "ds_ppo" / "run" / "__init__.py").write_text("")
    (tmp_path / "ds_ppo" / "run" / "driver.py").write_text(
        '"""Runs jobs (run/driver.py; run/supervised.py and ds_ppo/forward.py are gone)."""\n'
        'NAME = "ds_ppo/not_a_docstring.py"  # presets: ds_ppo/presets/tiny.yaml\n'
        '# ds_ppo/data/NAME.jsonl, a placeholder\n')
    for folder in SOURCES[1:]:
        (tmp_path / folder).mkdir()
    assert missing_paths(tmp_path) == ["ds_ppo/run/driver.py:2 ds_ppo/presets/tiny.yaml",
                                       "ds_ppo/run/driver.py:1 run/supervised.py",
                                       "ds_ppo/run/driver.py:1 ds_ppo/forward.py"]
