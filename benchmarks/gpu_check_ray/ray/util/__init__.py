"""`ray.util` of the stand-in (see the package docstring)."""
