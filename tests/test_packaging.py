"""What a user gets from `pip install switchhead` (a wheel or the sdist), not from an editable install: the data
files the code reads at run time are package data, every third-party module the package imports is a declared
dependency, the sdist carries what its own test suite needs, and a missing `serve` extra is one line."""

import ast
import fnmatch
import glob
import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import switchhead
from switchhead.cli import main

tomllib = pytest.importorskip("tomllib")

PKG = Path(switchhead.__file__).resolve().parent
REPO = PKG.parent
PYPROJECT = REPO / "pyproject.toml"
pytestmark = pytest.mark.skipif(not PYPROJECT.is_file(), reason="needs the source tree (pyproject.toml)")


def _pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


def _package_data_files() -> tuple[list[str], set[Path]]:
    """The package-data patterns of `switchhead` and the files they select, globbed as setuptools does."""
    patterns = _pyproject()["tool"]["setuptools"]["package-data"]["switchhead"]
    files = set()
    for pattern in patterns:
        files |= {Path(p).resolve() for p in glob.glob(str(PKG / pattern), recursive=True) if os.path.isfile(p)}
    return patterns, files


def test_every_package_data_pattern_selects_a_file():
    # A pattern that matches nothing ships nothing: "py.typed" was declared while the file did not exist.
    for pattern in _package_data_files()[0]:
        assert [p for p in glob.glob(str(PKG / pattern), recursive=True) if os.path.isfile(p)], pattern


def test_files_read_at_run_time_are_package_data():
    from switchhead.evals.run import TASKS_DIR
    from switchhead.model.checkpoint import DEFAULT_CHECKPOINT

    shipped = _package_data_files()[1]
    needed = [PKG / "py.typed"]
    needed += [p for p in Path(DEFAULT_CHECKPOINT).iterdir() if p.is_file()]
    needed += [p for p in Path(TASKS_DIR).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert {"config.json", "model.safetensors", "tokenizer.model"} <= {p.name for p in needed}
    assert any(p.suffix == ".yaml" for p in needed)
    missing = [str(p.relative_to(PKG)) for p in needed if p.resolve() not in shipped]
    assert not missing, f"read at run time but not package data: {missing}"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], set[str]]:
    """Distribution names of [project].dependencies and of the optional extras."""
    project = _pyproject()["project"]

    def names(reqs):
        return {_norm(re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)) for r in reqs}

    return names(project["dependencies"]), set().union(*map(names, project["optional-dependencies"].values()))


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party modules imported anywhere in the package -> the files importing them."""
    found: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                if top != "switchhead" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(PKG)))
    return found


def test_imported_modules_are_declared_dependencies():
    # `datasets` (imported by switchhead.evals.data) came only through lm-eval's requirements.
    deps, extras = _declared()
    dists = importlib.metadata.packages_distributions()
    imports = _third_party_imports()
    assert {"torch", "numpy", "click"} <= imports.keys()
    undeclared, extra_only = [], []
    for mod, files in sorted(imports.items()):
        names = {_norm(d) for d in dists.get(mod, [mod])}
        if names & deps:
            continue
        if names & extras:
            extra_only += [f for f in files if not f.startswith("serve" + os.sep)]
        else:
            undeclared.append(f"{mod} ({', '.join(sorted(files))})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    # Modules of an optional extra are imported only by the code that needs it (switchhead serve).
    assert not extra_only, f"optional-extra modules imported outside switchhead/serve: {extra_only}"


def test_serve_without_its_extra_is_one_line(monkeypatch):
    # What a plain `pip install switchhead` user sees: no FastAPI/uvicorn means one line, exit code 2.
    for mod in ("uvicorn", "fastapi", "switchhead.serve.app"):
        monkeypatch.setitem(sys.modules, mod, None)  # None in sys.modules: `import` raises ImportError
    r = CliRunner().invoke(main, ["serve", "--port", "1"])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "pip install 'switchhead[serve]'" in lines[0], r.output


def _sdist_files(monkeypatch) -> list[str]:
    """The files MANIFEST.in adds to the sdist (setuptools' own template processing)."""
    from setuptools.command.egg_info import FileList

    manifest = REPO / "MANIFEST.in"
    lines = manifest.read_text(encoding="utf-8").splitlines() if manifest.is_file() else []
    monkeypatch.chdir(REPO)
    fl = FileList()
    fl.allfiles = []
    for root, dirs, names in os.walk("."):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv")]
        fl.allfiles += [os.path.relpath(os.path.join(root, n)) for n in names]
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            fl.process_template_line(line)
    return fl.files


def test_sdist_carries_its_test_suite(monkeypatch):
    pytest.importorskip("setuptools")
    files = _sdist_files(monkeypatch)
    # setuptools alone takes tests/test*.py only: without these the sdist's test suite cannot even start.
    for needed in ("tests/conftest.py", "tests/naive.py", "benchmarks/kernels.py"):
        assert os.path.normpath(needed) in files, needed
    assert all(os.path.normpath(t) in files for t in glob.glob("tests/test_*.py", root_dir=REPO))
    junk = [f for f in files if "__pycache__" in Path(f).parts or fnmatch.fnmatch(f, "*.py[cod]")]
    assert not junk, junk
