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


def test_the_top_layers_name_every_module_of_the_engine():
    """The engine's modules are listed one by one in the top contract (its process sits a layer
    above the rest): a new module missing there would escape it."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    top = next(c for c in contracts if c["name"] == "tokenflowd's layers, top first")
    listed = {m.strip() for layer in top["layers"] for m in layer.replace("|", ":").split(":")}
    engine = ROOT / "tokenflowd" / "engine"
    children = {p.stem for p in engine.glob("*.py") if p.stem != "__init__"}
    children |= {p.name for p in engine.iterdir() if (p / "__init__.py").exists()}
    assert {f"tokenflowd.engine.{c}" for c in children} <= listed
    assert not any(m == "tokenflowd.engine" for m in listed)
