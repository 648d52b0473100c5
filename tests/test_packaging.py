"""Packaging: the folder passes/ installs as ``autopar.passes``, never as a top-level ``passes``.

A regular install (``pip install --target``) and an editable one (``pip install -e`` into a venv) are each
built once for this module, then probed by a fresh interpreter started with ``-I`` from a directory outside
the repository, so neither the repository root, nor the current directory, nor ``PYTHONPATH`` can make an
import succeed that the install itself does not provide.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

REPO = Path(__file__).resolve().parents[1]

# Run by the probed interpreter; its arguments are folders to put first on sys.path, where PYTHONPATH
# entries would go (-I ignores PYTHONPATH itself).
_PROBE = """
import json, sys
sys.path[:0] = sys.argv[1:]
import autopar.passes
try:
    import passes
except ModuleNotFoundError:
    top_level = None
else:
    top_level = repr(passes)
print(json.dumps({"autopar.passes": autopar.passes.__file__, "passes": top_level}))
"""


def _run(args: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in ``cwd`` without the caller's PYTHONPATH; fail the test with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _probe(python: str | Path, cwd: Path, *path: Path) -> dict[str, str | None]:
    """What ``python`` imports: the file of ``autopar.passes`` and the repr of ``passes`` (None if absent)."""
    return json.loads(_run([python, "-I", "-c", _PROBE, *path], cwd).stdout)


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def regular_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``--target`` folder of a regular install of the working tree.

    It is built from a copy of only what the build reads (pyproject.toml, the readme and the package-dir
    folders): setuptools builds in-tree, and its reused build/lib would ship modules since deleted from
    the tree, and would leave build/ and *.egg-info in the repository.
    """
    base = tmp_path_factory.mktemp("regular")
    src, target = base / "src", base / "site"
    src.mkdir()
    meta = _pyproject()
    shutil.copy2(REPO / "pyproject.toml", src)
    shutil.copy2(REPO / meta["project"]["readme"], src)
    for folder in set(meta["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            target,
            src,
        ],
        base,
    )
    return target


def _running_environment_paths() -> list[str]:
    """The folders this interpreter imports pip and setuptools from, its own site-packages first.

    Its sysconfig purelib and platlib (a venv's site-packages when the tests run in one), and then wherever
    pip and setuptools were actually found, should that be elsewhere (a user site, a distribution's own
    dist-packages folder).
    """
    paths = sysconfig.get_paths()
    folders = [paths["purelib"], paths["platlib"]]
    for name in ("pip", "setuptools"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, f"{name} is not installed for {sys.executable}"
        folders.append(str(Path(spec.origin).parents[1]))
    return list(dict.fromkeys(folders))


@pytest.fixture(scope="module")
def editable_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a venv (seeing this interpreter's environment) with the repository installed editable.

    The venv is made without pip, which saves ensurepip's seconds, and without --system-site-packages,
    which would show it the base installation's packages (and an old setuptools there) rather than those
    of the environment running the tests: a .pth file in its site-packages names this interpreter's
    folders instead, so this environment's pip installs into the venv, with this environment's setuptools
    (the dev extra's) as the build backend. Folders named in a .pth file are only put on sys.path; their
    own .pth files, such as this environment's editable install of autopar, are not run.
    """
    venv = tmp_path_factory.mktemp("editable") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], venv.parent)
    python = venv / "bin" / "python"
    site_packages = _run(
        [python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], venv.parent
    ).stdout.strip()
    (Path(site_packages) / "running_environment.pth").write_text(
        "".join(f"{folder}\n" for folder in _running_environment_paths())
    )
    _run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-e",
            REPO,
        ],
        venv.parent,
    )
    return python


def test_regular_install_has_autopar_passes_and_no_top_level_passes(regular_install: Path, tmp_path: Path):
    seen = _probe(sys.executable, tmp_path, regular_install)
    assert Path(seen["autopar.passes"]) == regular_install / "autopar" / "passes" / "__init__.py"
    assert seen["passes"] is None, f"a top-level `passes` is importable: {seen['passes']}"


def test_regular_install_ships_every_module(regular_install: Path):
    """Every .py under autopar/ and passes/ is installed; a subpackage missing from pyproject fails this."""

    def modules(root: Path, prefix: str) -> set[str]:
        return {
            f"{prefix}/{p.relative_to(root).as_posix()}"
            for p in root.rglob("*.py")
            if "__pycache__" not in p.parts
        }

    expected = modules(REPO / "autopar", "autopar") | modules(REPO / "passes", "autopar/passes")
    installed = modules(regular_install / "autopar", "autopar")
    assert installed == expected, (
        f"not installed: {sorted(expected - installed)}, installed but not in the source: "
        f"{sorted(installed - expected)}; new packages go in [tool.setuptools] packages of pyproject.toml"
    )


def test_editable_install_has_autopar_passes_and_no_top_level_passes(editable_venv: Path, tmp_path: Path):
    seen = _probe(editable_venv, tmp_path)
    assert Path(seen["autopar.passes"]).resolve() == REPO / "passes" / "__init__.py"
    assert seen["passes"] is None, f"a top-level `passes` is importable: {seen['passes']}"
