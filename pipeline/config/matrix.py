"""`evaluate.environments`: the extra environments the evaluate stage runs the agent with (plug-and-play).

The paper's claim is that an agent trained against one environment works, unchanged, with another (trained
with GPT-4o-mini, evaluated with GPT-OSS-20B and others). Each entry here names one more environment; the
evaluate stage runs the trained agent and the baselines that use an environment (`env_only`, `base_agent`,
`gepa`) with it on the same rows, and the report shows the matrix trained-with × evaluated-with
(pipeline/evaluation/matrix.py). Empty (the default): the training environment only.

Design decisions:
- **An entry is a partial `environment` section** plus a `name`: the keys it sets replace the training
  environment's, nested `server` / `knowledge` merged key by key, and the result is validated as a whole
  `environment` section (same bounds, same refusal of credentials in URLs). So a variant that changes only the
  model at the same API endpoint is two lines, and an entry cannot be half-valid.
- **Where it is reached.** `base_url` is inherited only while the entry keeps the training environment's
  endpoint: an entry that sets `backend`, `host` or `port` and no `base_url` is served at `host:port` (a
  local server it starts, like the training environment's). Inheriting the training server's URL there would
  ask the wrong server (or reuse it silently when the served names agree).
- **The evaluation's sampling stays one for all**: `temperature` and `cache` are `evaluate.env_temperature`
  and `evaluate.env_cache` for every environment, so an entry may not set them (the cells of the matrix
  differ in the environment only).
- **Names** go into MLflow metric names (`matrix/<name>/<system>/id/f1`) and the DVC plot's labels: short,
  unique, `[A-Za-z0-9._-]`; `training` is the training environment's row.
- Environments run one after another (one server at a time): on a GPU node the environment's vLLM takes most
  of the card's memory, so two at once would not fit. An entry's local server may therefore reuse the
  training environment's port (under another served name: a server found answering is reused when it serves
  the configured name), but not the agent server's (`evaluate.agent_port`, default port + 1).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.config.environment import EnvironmentConfig

TRAINING_ENVIRONMENT = "training"
"""The matrix row of the environment the agent trained with (the `environment` section)."""
SAMPLING_KEYS = frozenset({"temperature", "cache"})
"""Environment keys an entry may not set: the evaluation's (`evaluate.env_temperature`, `evaluate.env_cache`)."""
ENDPOINT_KEYS = frozenset({"backend", "host", "port"})
"""Keys that move the environment elsewhere: setting one without `base_url` drops the inherited `base_url`."""
NESTED_KEYS = frozenset({"server", "knowledge"})
"""Sections of `environment` merged key by key rather than replaced."""


class EnvironmentVariant(BaseModel):
    """One more environment to evaluate with: a `name` and the `environment` keys it changes."""

    model_config = ConfigDict(extra="allow", frozen=False)

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description=(
            "The matrix row: in summary.md, MLflow metric names (matrix/<name>/...) and the DVC plot."
        ),
    )

    @model_validator(mode="after")
    def _overrides_are_environment_keys(self) -> EnvironmentVariant:
        if self.name == TRAINING_ENVIRONMENT:
            raise ValueError(
                f"name {TRAINING_ENVIRONMENT!r} is the training environment's row: choose another"
            )
        keys = set(self.overrides())
        if not keys:
            raise ValueError(
                f"environment {self.name!r} changes nothing: set the environment keys it differs in "
                "(backend, model, served_name, base_url, ...)"
            )
        fixed = sorted(keys & SAMPLING_KEYS)
        if fixed:
            raise ValueError(
                f"environment {self.name!r} sets {fixed}: the evaluation samples every environment "
                "alike (evaluate.env_temperature, evaluate.env_cache)"
            )
        unknown = sorted(keys - set(EnvironmentConfig.model_fields))
        if unknown:
            raise ValueError(f"environment {self.name!r}: {unknown} are not keys of the environment section")
        return self

    def overrides(self) -> dict[str, Any]:
        """The environment keys this entry sets (everything but `name`)."""
        return dict(self.model_extra or {})


def resolve_variant(base: EnvironmentConfig, variant: EnvironmentVariant) -> EnvironmentConfig:
    """The whole `environment` section the entry describes: its keys over the training environment's."""
    overrides = variant.overrides()
    merged = base.model_dump()
    for key, value in overrides.items():
        if key in NESTED_KEYS and isinstance(value, dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    if overrides.keys() & ENDPOINT_KEYS and "base_url" not in overrides:
        merged["base_url"] = ""
    return type(base).model_validate(merged)


def matrix_problems(params: Any) -> list[str]:
    """Why `evaluate.environments` cannot run (empty = it can): invalid merged sections, clashing names,
    a local server on the agent server's port. Run by `load_params`, so a bad entry fails before any stage."""
    from pydantic import ValidationError

    problems: list[str] = []
    seen: set[str] = set()
    agent_port = params.evaluate.agent_port or params.environment.port + 1
    for i, variant in enumerate(params.evaluate.environments):
        where = f"evaluate.environments[{i}] ({variant.name!r})"
        if variant.name in seen:
            problems.append(f"{where}: the name is used twice (each names one matrix row)")
        seen.add(variant.name)
        try:
            cfg = resolve_variant(params.environment, variant)
        except ValidationError as exc:
            problems += [f"{where}{''.join(f'.{p}' for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
            continue
        base = params.environment
        if cfg.backend != "api" and (cfg.url, cfg.served_name) == (base.url, base.served_name):
            # A server found answering there is reused when it serves that name: the training one, if it
            # still runs (started by hand), would answer for this entry and nobody would notice.
            problems.append(
                f"{where}: a local server at the training environment's URL ({cfg.url}) under its "
                f"served_name {cfg.served_name!r} cannot be told apart from it: set another "
                "served_name or port"
            )
        if cfg.backend != "api" and not cfg.base_url and cfg.port == agent_port:
            problems.append(
                f"{where}.port={cfg.port} is the agent server's port (evaluate.agent_port or "
                "environment.port + 1): pick another"
            )
    return problems
