"""Finding transformers' experts interface: a failed import says why, and none of the project's
scripts can make it fail by shadowing a package transformers imports."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from mira.errors import MiraError
from mira.models import interface

ROOT = Path(__file__).resolve().parents[2]
SCRIPT_DIRS = ("benchmarks", "tools")  # run as `python DIR/x.py`: DIR comes first on sys.path


def _failing_import(error: ImportError):
    def fail(name: str):
        if name == interface.INTERFACE_MODULE:
            raise error
        return importlib.import_module(name)
    return fail


def test_a_broken_import_names_its_cause(monkeypatch):
    error = ImportError("cannot import name 'CUDAProperties' from 'kernels' (/somewhere/kernels.py)")
    monkeypatch.setattr(interface.importlib, "import_module", _failing_import(error))
    with pytest.raises(MiraError, match="could not import transformers.integrations.moe: cannot import name"):
        interface.moe_integration()


def test_a_missing_dependency_names_it(monkeypatch):
    error = ModuleNotFoundError("No module named 'kernels'", name="kernels")
    monkeypatch.setattr(interface.importlib, "import_module", _failing_import(error))
    with pytest.raises(MiraError, match="could not import .*No module named 'kernels'"):
        interface.moe_integration()


def test_a_transformers_without_the_module_is_told_to_upgrade(monkeypatch):
    error = ModuleNotFoundError(f"No module named '{interface.INTERFACE_MODULE}'", name=interface.INTERFACE_MODULE)
    monkeypatch.setattr(interface.importlib, "import_module", _failing_import(error))
    with pytest.raises(MiraError, match="has no experts interface .* install transformers 5 or later"):
        interface.moe_integration()


@pytest.mark.parametrize("directory", SCRIPT_DIRS)
def test_no_script_shadows_an_installed_module(directory, monkeypatch):
    """A script `x.py` beside one run as `python DIR/y.py` is what `import x` finds first: named
    like an installed package (transformers imports `kernels`), it breaks that import."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT / directory])
    stems = sorted(path.stem for path in (ROOT / directory).glob("*.py"))
    assert stems
    shadowing = [stem for stem in stems if importlib.util.find_spec(stem) is not None]
    assert shadowing == []
