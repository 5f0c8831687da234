"""A stand-in for Ray, only for benchmarks/gpu_actor_check.py on a GPU machine without network access.

It ships only in the wheel set `scripts/gpu-check-wheels.sh` gathers for that machine (Ray's own wheel, ~75 MiB,
does not fit in what may travel there), never in the project's install. `import verl` imports Ray
(verl/protocol.py, single_controller/base/worker.py, checkpoint_engine/base.py, workers/rollout/replica.py and
utils.py, single_controller/ray/base.py): this package holds exactly the names those modules use while they are
imported, plus `is_initialized`, so the check's path (verl's actor worker driven in-process, no Ray actor) runs.
A Ray actor or placement group asked of it raises `RayStandInError`, and there is no `ray.init`: verl's trainer
(`verl.trainer.main_ppo`), its worker groups (`verl.single_controller.ray`), the rollout servers
(`verl.workers.rollout.replica`) and the checkpoint engines need the real Ray.
"""

from __future__ import annotations

from typing import Any

# `ray.actor.ActorHandle` is named in verl's signatures: the submodule is an attribute, as with the real Ray.
from ray import actor as actor

__version__ = "2.60.0+standin"
STAND_IN = True


class RayStandInError(RuntimeError):
    """Something asked the stand-in for Ray to do what only the real Ray does."""


def _refuse(what: str) -> RayStandInError:
    return RayStandInError(f"ray.{what}: this is the stand-in for Ray that benchmarks/gpu_actor_check.py travels "
                           "with; install the real ray to start or use a Ray cluster")


class ObjectRef:
    """Ray's object reference type (verl names it in type hints and isinstance checks)."""


class _Remote:
    """What `@ray.remote` makes of a class or function: the object itself, with `.remote` and `.options` refused."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self.__name__ = getattr(target, "__name__", "remote")
        self.__doc__ = getattr(target, "__doc__", None)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"remote({self.__name__})")

    def options(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"remote({self.__name__}).options")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"remote({self.__name__}) called directly")


def remote(*args: Any, **kwargs: Any) -> Any:
    """`@ray.remote` and `@ray.remote(num_gpus=…)`, applied at import time by verl's modules."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return _Remote(args[0])
    return _Remote


def is_initialized() -> bool:
    """False: verl's process-group setup then takes its path without Ray (verl/utils/distributed.py)."""
    return False
