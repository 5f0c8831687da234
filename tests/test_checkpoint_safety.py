"""Resume reads checkpoints safely: tensors and plain data only, never arbitrary pickles."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.errors import UserError
from pipeline.train.checkpoint import load_safely, restore_optimizer_and_rng, rng_state


class Payload:
    """Stands for an attacker's object: unpickling it would call `__reduce__`'s callable."""

    def __reduce__(self):
        return (Path.touch, (Path("/nonexistent-dir/pwned"),))


def test_rng_and_optimizer_round_trip_with_weights_only(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())

    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    restore_optimizer_and_rng(fresh, tmp_path)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    state = fresh.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_a_pickled_object_in_a_checkpoint_is_refused_naming_the_file(tmp_path):
    torch.save({"python": Payload()}, tmp_path / "rng.pt")
    with pytest.raises(UserError, match=r"rng\.pt holds objects beyond tensors"):
        load_safely(tmp_path / "rng.pt")
    # The same file loads (and would run the payload) without the guard: the guard is what stops it.
    with pytest.raises(FileNotFoundError):
        torch.load(tmp_path / "rng.pt", weights_only=False)
