"""The streaming safetensors writer: what it writes is read back by safetensors itself."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.checkpoint.stream_safetensors import StreamedSafetensors


def test_tensors_written_one_by_one_read_back_unchanged(tmp_path):
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(3, 5, dtype=torch.bfloat16), "b.bias": torch.randn(7),
               "mask": torch.tensor([True, False, True]), "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
               "empty": torch.zeros(0, 4), "col": torch.randn(4, 6)[:, 1]}  # a non-contiguous view
    path = tmp_path / "x.safetensors"
    with StreamedSafetensors(str(path), [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()],
                             {"format": "pt"}) as f:
        for k, t in tensors.items():
            f.write(k, t)
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_tensor_out_of_order_or_missing_is_refused(tmp_path):
    layout = [("a", (2,), torch.float32), ("b", (3,), torch.float32)]
    with pytest.raises(ValueError, match="expected tensor a"):
        with StreamedSafetensors(str(tmp_path / "x.safetensors"), layout) as f:
            f.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match=r"expected tensor a \(2,\)"):
        with StreamedSafetensors(str(tmp_path / "y.safetensors"), layout) as f:
            f.write("a", torch.zeros(4))
    with pytest.raises(RuntimeError, match="1 tensors were not written"):
        with StreamedSafetensors(str(tmp_path / "z.safetensors"), layout) as f:
            f.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="cannot store dtype"):
        StreamedSafetensors(str(tmp_path / "w.safetensors"), [("c", (1,), torch.complex64)])
