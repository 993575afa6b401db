"""The API server process (HTTP, supervisor, tokenizer) never imports torch: it computes nothing, and
torch costs it ~300 MB of RSS and ~200k objects the collector walks."""
from __future__ import annotations

import subprocess
import sys

FRONT = """
import sys
from tokenflowd.daemon.api.app import build_app
from tokenflowd.daemon.api.front import Front
from tokenflowd.cli import build_parser
from tokenflowd.config.flags import engine_config
from tokenflowd.config import ServerConfig
from tokenflowd.daemon.supervisor import Supervisor
from tokenflowd.text.source import load_tokenizer

args = build_parser().parse_args(["serve", "--model", {model!r}])
engine = engine_config(args)
front = Front(Supervisor(ServerConfig(), engine), load_tokenizer(engine.model), ServerConfig(), "m")
build_app(front)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(len(loaded), engine.device, front.tokenizer.vocab_size)
"""


def test_building_the_front_app_imports_no_torch():
    for model in ("smollm2-135m", "dummy:llama3-8b"):
        out = subprocess.run([sys.executable, "-c", FRONT.format(model=model)], capture_output=True, text=True,
                             timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr[-2000:]
        n, device, vocab = out.stdout.split()
        assert n == "0" and device == "cpu" and int(vocab) > 256, out.stdout
