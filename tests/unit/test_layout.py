"""The package's layout holds: a small root, the layer contracts kept, no import circle."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_package_root_holds_only_the_entry_point_and_the_protocol():
    modules = sorted(p.name for p in (ROOT / "tokenflowd").glob("*.py"))
    assert modules == ["__init__.py", "cli.py", "protocol.py"]


def test_the_layer_contracts_are_kept_and_no_import_circle_exists():
    exe = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (the test extra)")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "0 broken" in out.stdout
