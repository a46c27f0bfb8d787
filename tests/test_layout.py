"""The layout docs/architecture.md describes, held against the code: module and function sizes, the moved
modules' old names, and the public names the README imports."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import mmfast
from mmfast.util.moved import MOVED, REMOVED_IN

PACKAGE = Path(mmfast.__file__).parent
ROOT = PACKAGE.parent
MAX_MODULE_LINES = 490  # a module or function at its cap is a signal to redesign, not to compress
MAX_FUNCTION_LINES = 78


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _capped() -> list[Path]:
    """The library's modules and the tools' scripts: the caps hold them all."""
    return _modules() + sorted((ROOT / "tools").rglob("*.py"))


def test_no_module_at_490_lines_and_no_function_at_78():
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _capped()}
    long_modules = {name: n for name, n in lines.items() if n >= MAX_MODULE_LINES}
    long_functions = {}
    for p in _capped():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n >= MAX_FUNCTION_LINES:
                    long_functions[f"{p.relative_to(ROOT).as_posix()}:{node.name}"] = n
    assert not long_modules, f"modules of {MAX_MODULE_LINES} lines or more: {long_modules}"
    assert not long_functions, f"functions of {MAX_FUNCTION_LINES} lines or more: {long_functions}"


IMPORT = ast.Import | ast.ImportFrom


def _says_why(lines: list[str], lineno: int) -> bool:
    """A comment on the import's own line, or just above it (a comment line, or the ``try:`` guarding it)."""
    here, above = lines[lineno - 1], lines[lineno - 2].strip()
    said = here.partition("#")[2] or (above.partition("#")[2] if above.startswith(("#", "try:")) else "")
    return bool(said.strip()) and not said.strip().startswith(("noqa", "type:"))


def test_every_function_level_import_says_why():
    """docs/architecture.md: a function-level import is for a heavy optional dependency, with the reason beside
    it. A block of imports shares the reason of its first line; one that re-imports a name the module imports at
    its top has no reason to be there."""
    bare, again = [], []
    for p in _modules():
        text = p.read_text()
        lines, tree = text.splitlines(), ast.parse(text)
        top = {a.asname or a.name for n in tree.body if isinstance(n, IMPORT) for a in n.names}
        functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
        inside = {n.lineno: n for f in functions for n in ast.walk(f) if isinstance(n, IMPORT)}
        after = {n.end_lineno + 1: n for n in inside.values()}  # the import just above a line, if one is
        for node in inside.values():
            where, first = f"{p.relative_to(PACKAGE.parent)}:{node.lineno}", node
            while first.lineno in after:  # the block's first import carries its reason
                first = after[first.lineno]
            if not (_says_why(lines, node.lineno) or _says_why(lines, first.lineno)):
                bare.append(where)
            again += [f"{where} {a.asname or a.name}" for a in node.names if (a.asname or a.name) in top]
    assert not bare, f"function-level imports without their reason beside them: {bare}"
    assert not again, f"function-level imports of a name the module imports at its top: {again}"


def test_every_package_says_its_job_and_cites_only_files_in_the_repository():
    root = PACKAGE.parent
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(root)} has no docstring naming its job"
    for p in _modules():
        for cited in ("DESIGN.md", "STYLE.md"):
            assert cited not in p.read_text(), f"{p.relative_to(root)} cites {cited}, not in the repository"


def test_a_moved_module_imports_by_its_old_name_as_the_new_module_and_warns_once():
    # one fresh interpreter for all the names (one each took a second per name): an old name is imported
    # there first, and imported twice, whatever the names before it imported of the new modules
    code = (
        "import importlib, json, sys, warnings\n"
        "got = {}\n"
        "for old, new in json.loads(sys.argv[1]).items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        a = importlib.import_module(old); b = importlib.import_module(old)\n"
        "    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
        "    got[old] = [a is b is importlib.import_module(new), deprecations]\n"
        "print(json.dumps(got))\n"
    )
    argv = [sys.executable, "-c", code, json.dumps(MOVED)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert sorted(got) == sorted(MOVED)
    for old, (same, said) in got.items():
        assert same, f"{old} is not {MOVED[old]}"
        assert len(said) == 1 and MOVED[old] in said[0] and old in said[0], (old, said)


def test_the_old_names_are_gone_by_the_release_their_warning_names():
    """The moved names' warning promises their removal in ``REMOVED_IN``: a version that reaches it must come
    without them (delete mmfast/util/moved.py and its install in mmfast/__init__.py)."""

    def release(v: str) -> tuple[int, ...]:
        return tuple(int(part) for part in v.split(".")[:3])

    version = re.search(r'^version = "([^"]+)"', (PACKAGE.parent / "pyproject.toml").read_text(), re.M)[1]
    assert release(version) < release(REMOVED_IN), f"mmfast {version}: remove the moved names ({sorted(MOVED)})"


def test_an_unknown_old_name_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        __import__("mmfast.no_such_module")


def test_the_public_names_import_from_mmfast():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of them goes through a moved name
        for name in mmfast.__all__:
            assert getattr(mmfast, name) is not None
    assert mmfast.MultimodalLoader.__module__ == "mmfast.loading.multimodal"
    assert mmfast.ImageLoader.__module__ == "mmfast.loading.image_loader"
