"""`ray.experimental.state.api` of the stand-in (see the package docstring)."""

from __future__ import annotations

from typing import Any

from ray import _refuse


def get_actor(*args: Any, **kwargs: Any) -> Any:
    raise _refuse("experimental.state.api.get_actor")
