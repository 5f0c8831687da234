"""`ray.util.scheduling_strategies` of the stand-in (see the package docstring): the types only."""


class NodeAffinitySchedulingStrategy:
    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs


class PlacementGroupSchedulingStrategy:
    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs
