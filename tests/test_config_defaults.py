"""One truth for every default: the config models' defaults are exactly params.yaml's values.

Choice: `params.yaml` is the default profile and the file DVC tracks, so it is the truth. The pydantic models
keep defaults (code and tests may build one section alone, e.g. `RewardConfig(preset="released")`), but every
default must equal the value params.yaml sets, and params.yaml must set every field. A changed default in one
place and not the other fails here, naming the dotted key and both values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pipeline.config import Params, RewardConfig

ROOT = Path(__file__).resolve().parents[1]


def default_mismatches(model: type[BaseModel], values: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys where `model`'s default differs from `values`, or that `values` does not set."""
    problems: list[str] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if field.exclude:
            continue  # not a parameter (e.g. Params.root, set by load_params)
        if name not in values:
            problems.append(f"{key}: a field of {model.__name__} that params.yaml does not set")
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            problems += default_mismatches(annotation, values[name] or {}, f"{key}.")
            continue
        if field.default is PydanticUndefined and field.default_factory is None:
            continue  # required: params.yaml is its only source
        default = field.get_default(call_default_factory=True)
        if default != values[name]:
            problems.append(f"{key}: config.py default {default!r} != params.yaml {values[name]!r}")
    return problems


def test_config_defaults_equal_params_yaml() -> None:
    values = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    assert default_mismatches(Params, values) == []


def test_a_disagreeing_default_is_reported() -> None:
    """The check can fail: a params.yaml that says another reward preset, or omits a key, is named."""
    problems = default_mismatches(RewardConfig, {"preset": "released", "alpha": None, "beta": None,
                                                 "gamma": None, "delta": None})
    assert problems == ["preset: config.py default 'paper' != params.yaml 'released'",
                        "eps: a field of RewardConfig that params.yaml does not set"]
