"""`train.lr_warmup_steps`: the local trainer's learning rate rises linearly over the first GRPO steps, from the
step number alone (so a resumed run trains at the lr the killed one would have), then stays at `train.lr`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.config import TrainConfig
from pipeline.train.local.trainer import LocalTrainer


def lr_at(step: int, **train) -> float:
    return LocalTrainer.lr_at(SimpleNamespace(cfg=TrainConfig(**train)), step)


def test_linear_warmup_then_constant():
    assert [lr_at(s, lr=1e-5, lr_warmup_steps=2) for s in (1, 2, 3, 10)] == pytest.approx([5e-6, 1e-5, 1e-5, 1e-5])
    assert [lr_at(s, lr=2e-5, lr_warmup_steps=4) for s in (1, 3, 4)] == pytest.approx([5e-6, 1.5e-5, 2e-5])


def test_no_warmup_is_the_constant_lr_of_before():
    assert TrainConfig().lr_warmup_steps == 0
    assert [lr_at(s, lr=1e-4) for s in (1, 2, 12)] == [1e-4, 1e-4, 1e-4]


def test_a_negative_warmup_is_refused():
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        TrainConfig(lr_warmup_steps=-1)
