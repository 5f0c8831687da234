"""Where things run: the CUDA device ids verl and the environment server take, and which addresses are local.

Pure functions of the config sections they read (`EnvironmentConfig`, `TrainConfig`; no I/O), shared by
the layout check (`pipeline.checks.layout`), the environment client and servers, and the verl launcher.
They live apart from the layout check so that the environment code (imported by most stages) does not
import the check's verl config composition.

- `train.verl.gpus` (per node, Ray's CUDA_VISIBLE_DEVICES) and `environment.server.gpus` (the vLLM server's
  CUDA_VISIBLE_DEVICES) name CUDA device ids; an empty list means what the tools do unasked: Ray takes the
  first `n_gpus_per_node` devices and vLLM the first `tensor_parallel_size`.
- An environment at a `base_url` other than its own host/port runs elsewhere and shares no GPU with training.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig, TrainConfig

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", ""})


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost, 0.0.0.0, ::)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def started_here(env: EnvironmentConfig) -> bool:
    """Whether the pipeline starts the server of environment `env` on this machine (a local backend at its
    own host:port) rather than using one at a `base_url` elsewhere."""
    if env.backend == "api":
        return False
    return not env.base_url or env.url == f"http://{env.host}:{env.port}/v1"


def gpus_of_environment(env: EnvironmentConfig) -> list[int]:
    """CUDA device ids the server of environment `env` takes on this machine ([] when it takes none here)."""
    if env.backend != "vllm" or not started_here(env):
        return []
    return list(env.server.gpus) or list(range(env.server.tensor_parallel_size))


def gpus_of_training(train: TrainConfig) -> list[int]:
    """CUDA device ids verl takes on each node under the train section `train` ([] with the local backend,
    which is not placed here)."""
    if train.backend != "verl":
        return []
    return list(train.verl.gpus) or list(range(train.verl.n_gpus_per_node))


def private_ray_devices(train: TrainConfig) -> str | None:
    """CUDA_VISIBLE_DEVICES for the private Ray verl starts (`train.verl.ray_address: ""`): `train.verl.gpus`,
    so that Ray sees only the training devices; None when they are not given (Ray takes every device)."""
    gpus = gpus_of_training(train)
    return cuda_visible_devices(gpus) if gpus and train.verl.gpus else None


def cuda_visible_devices(gpus: list[int]) -> str:
    """The CUDA_VISIBLE_DEVICES value for a device list."""
    return ",".join(str(g) for g in gpus)
