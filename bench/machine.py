"""What a bench result names about the CPU it was measured on (/proc/cpuinfo): a figure holds only
where it was measured."""
from __future__ import annotations

import os
from pathlib import Path


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags, "avx2": "avx2" in flags,
            "avx512f": "avx512f" in flags}
