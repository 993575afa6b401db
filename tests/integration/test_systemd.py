"""The systemd units: `systemd-analyze verify` accepts them, `systemd-analyze security` rates the
service's exposure, and the example configuration validates."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenflowd.cli import main

UNITS = Path(__file__).parents[2] / "systemd"
ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def installed_copy(tmp_path: Path, name: str) -> Path:
    """The unit with its binaries pointed at ones that exist here (verify checks ExecStart's)."""
    tokenflowd = Path(sys.executable).with_name("tokenflowd")
    text = (UNITS / name).read_text()
    text = text.replace("/opt/tokenflowd/.venv/bin/tokenflowd", str(tokenflowd))
    text = text.replace("/usr/bin/nvidia-cuda-mps-control", shutil.which("true"))
    path = tmp_path / name
    path.write_text(text)
    return path


@needs_systemd
@pytest.mark.parametrize("name", ["tokenflowd.service", "tokenflowd-mps.service"])
def test_systemd_analyze_verify_accepts_the_units(tmp_path, name):
    r = subprocess.run([ANALYZE, "verify", str(installed_copy(tmp_path, name))], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert name not in r.stderr, r.stderr  # no warning about the unit itself


@needs_systemd
def test_service_exposure_is_low(tmp_path):
    unit = installed_copy(tmp_path, "tokenflowd.service")
    r = subprocess.run([ANALYZE, "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for tokenflowd.service: ([0-9.]+) (\w+)", r.stdout + r.stderr)
    assert m, r.stdout[-500:] + r.stderr[-500:]
    exposure = float(m.group(1))
    print(f"systemd-analyze security: {exposure} {m.group(2)}")
    assert exposure <= 2.0 and m.group(2) == "OK"


def test_the_unit_is_type_notify_with_a_watchdog_and_a_drain_window():
    text = (UNITS / "tokenflowd.service").read_text()
    keys = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    assert keys["Type"] == "notify" and keys["NotifyAccess"] == "main" and keys["Restart"] == "on-failure"
    assert keys["KillMode"] == "mixed" and int(keys["WatchdogSec"]) > 0
    assert keys["DynamicUser"] == "yes" and keys["ProtectSystem"] == "strict" and keys["CapabilityBoundingSet"] == ""


def test_example_config_validates(capsys):
    assert main(["config", "check", str(UNITS / "tokenflowd.toml")]) == 0
    out = capsys.readouterr().out
    assert 'policy = "tokenflow"' in out and "shutdown_timeout = 30.0" in out
