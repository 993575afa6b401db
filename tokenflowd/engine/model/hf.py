"""Hugging Face model directories: config.json + *.safetensors + tokenizer files."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenflowd.engine.model.config import ModelConfig
from tokenflowd.engine.model.weights import LoadedModel, ModelLoadError, check_weights, expected_weight_shapes
from tokenflowd.text.tokenizer import Tokenizer

# Buffers some checkpoints carry that are recomputed, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_dir(path: str | Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    path = Path(path)
    config = _read_config(path)
    tokenizer = _read_tokenizer(path)
    # config.json often names only the base eos; the tokenizer adds the chat turn end.
    config = dataclasses.replace(
        config,
        eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids)),
        bos_token_id=config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id,
        extra={"source": str(path)},
    )
    weights = _read_weights(path, config, dtype, device)
    check_weights(config, weights, path)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer)


def _read_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"missing config.json in {path}: expected a Hugging Face model directory")
    try:
        return ModelConfig.from_hf_config(json.loads(cfg_file.read_text(encoding="utf-8")), name=path.name)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from e
    except KeyError as e:
        raise ModelLoadError(f"{cfg_file} lacks the field {e.args[0]!r}") from e
    except ValueError as e:
        raise ModelLoadError(f"{cfg_file}: {e}") from e


def _read_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_hf_dir(path)
    except FileNotFoundError as e:
        raise ModelLoadError(f"{e} (a Hugging Face directory needs tokenizer.json)") from e
    except Exception as e:  # tokenizers raises bare Exception on a malformed tokenizer.json
        raise ModelLoadError(f"cannot read the tokenizer in {path}: {e}") from e


def _read_weights(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"missing weights: no *.safetensors file in {path}")
    expected = expected_weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.endswith(_IGNORED_SUFFIXES):
                        continue
                    if key == "lm_head.weight" and "lm_head.weight" not in expected:
                        continue  # tied: some checkpoints store the copy anyway
                    # One tensor at a time, so host memory peaks at one tensor, not the model.
                    weights[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from e
    return weights
