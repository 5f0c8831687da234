"""`ray.experimental` of the stand-in (see the package docstring)."""
