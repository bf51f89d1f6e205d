"""docs/architecture.md's module map and README's layout stay true to the tree: every path they
name exists, and every module of the code folders has one line of the map, starting with its
full path."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE = ("cluster", "workers", "router", "bench", "cli")
TOPS = (*CODE, "deploy", "tests", "docs", ".ci")
_TOP = "|".join(re.escape(t) for t in TOPS)
_PATH = re.compile(rf"(?<![\w./-])((?:{_TOP})/[\w./-]*)")


def _named_paths(text: str) -> set[str]:
    return {m.group(1).rstrip(".,;:") for m in _PATH.finditer(text)}


def _code_files() -> list[str]:
    files = []
    for top in CODE:
        for path in (ROOT / top).rglob("*"):
            rel = path.relative_to(ROOT).as_posix()
            if not path.is_file() or "__pycache__" in rel or rel.startswith("bench/plots/") or path.suffix == ".pyc":
                continue
            if path.name == "__init__.py" and path.stat().st_size == 0:
                continue  # an empty package marker
            files.append(rel)
    return files


def test_every_path_the_architecture_names_exists() -> None:
    doc = (ROOT / "docs/architecture.md").read_text()
    assert sorted(p for p in _named_paths(doc) if not (ROOT / p).exists()) == []


def test_every_module_has_one_line_of_the_module_map() -> None:
    doc = (ROOT / "docs/architecture.md").read_text()
    section = doc[doc.index("## Modules"):].split("\n## ")[0]
    starts = [line.split()[0] for line in section.splitlines() if line[:1].isalpha() and "/" in line.split()[0]]
    assert sorted(f for f in _code_files() if starts.count(f) != 1) == []
    assert sorted(set(starts) - set(_code_files())) == []


def test_readme_layout_names_the_folders_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):].split("```")[1]
    named = set(re.findall(r"(?m)^([\w.]+)/", layout))
    assert sorted(d for d in named if not (ROOT / d).is_dir()) == []
    for folder in ("tests", "workers"):
        subfolders = {p.name for p in (ROOT / folder).iterdir() if p.is_dir() and p.name != "__pycache__"}
        assert sorted(s for s in subfolders if f"{s}/" not in layout) == [], folder
