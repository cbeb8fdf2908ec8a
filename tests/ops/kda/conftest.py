"""Fill fresh float tensors with NaN (fla's trick) so a read of memory never written shows up."""

import pytest
import torch

_EMPTY, _EMPTY_LIKE = torch.empty, torch.empty_like


def _nan_filled(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    return tensor


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _nan_filled(_EMPTY(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _nan_filled(_EMPTY_LIKE(*a, **k)))
