"""`ray.actor` of the stand-in (see the package docstring): the handle type verl names in type hints."""


class ActorHandle:
    """Ray's actor handle type."""
