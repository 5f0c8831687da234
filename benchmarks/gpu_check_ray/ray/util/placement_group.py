"""`ray.util.placement_group` of the stand-in (see the package docstring)."""

from __future__ import annotations

from typing import Any

from ray import _refuse


class PlacementGroup:
    """Ray's placement group type."""


def placement_group(*args: Any, **kwargs: Any) -> PlacementGroup:
    raise _refuse("util.placement_group")
