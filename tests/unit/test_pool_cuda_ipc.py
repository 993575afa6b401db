"""cuda_ipc.open_export's reach, without a GPU: a peer's export opens in this engine's own device
where it sits on this engine's GPU or on one its GPU has peer access to, and is refused with why
elsewhere (the peer is then served through host staging). The mapping itself runs in
tests/gpu/test_gpu.py."""
from __future__ import annotations

import inspect
import pickle

import pytest
import torch

from tokenflowd.pool import cuda_ipc


def _rebuild(*args):
    return args


def test_an_export_opens_in_this_engines_own_device_on_its_gpu_or_one_within_peer_access(tmp_path, monkeypatch):
    path = tmp_path / "export"

    def exported(gpu: str) -> str:
        args = tuple(f"arg{i}" for i in range(15))  # torch's rebuild_cuda_tensor takes 15, the device 7th
        path.write_bytes(pickle.dumps({"gpu": gpu, "rebuild": _rebuild, "args": args}))
        return str(path)

    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device=None: "GPU-a")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    same = cuda_ipc.open_export(exported("GPU-a"), {})
    assert same[cuda_ipc.STORAGE_DEVICE] == 3, "mapped in this process's own device"
    assert [a for i, a in enumerate(same) if i != cuda_ipc.STORAGE_DEVICE] == \
        [f"arg{i}" for i in range(15) if i != cuda_ipc.STORAGE_DEVICE]
    assert cuda_ipc.open_export(exported("GPU-b"), {"GPU-b": True})[cuda_ipc.STORAGE_DEVICE] == 3
    with pytest.raises(ValueError, match="GPU GPU-a has no peer access to it"):
        cuda_ipc.open_export(exported("GPU-b"), {"GPU-b": False})
    with pytest.raises(ValueError, match="GPU GPU-c, which this engine .* does not see"):
        cuda_ipc.open_export(exported("GPU-c"), {"GPU-b": True})


def test_the_device_argument_rewritten_is_torchs_storage_device():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    assert list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device") == cuda_ipc.STORAGE_DEVICE
