"""`ray.experimental.state` of the stand-in (see the package docstring)."""
