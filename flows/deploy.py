"""Deployments of the retraining flow: its cron schedule, concurrency and parameters, and `promptr1 flow serve`.

    prefect server start & export PREFECT_API_URL=http://127.0.0.1:4200/api
    promptr1 flow serve                                                   # weekly (flow.cron in params)
    prefect deploy --all                                                  # prefect.yaml: GPU work pool

Design decisions:
- **Two deployments, one source of truth.** `promptr1 flow serve` serves `build_deployment(...)` from this
  process: schedule `flow.cron` in `flow.timezone`, `flow.concurrency_limit` runs at once, built without a
  server so a test can check it. `prefect.yaml` declares the same flow (`flows/retrain.py:retrain`) for a
  GPU work pool with the paper profile; tests/test_flow_deployment.py keeps its schedule and concurrency
  equal to params.yaml's `flow:` section.
- **Scheduled runs wait, manual runs do not.** A deployment's runs get `flow.scheduled_lock_timeout_s` as
  their lock timeout (a weekly run should queue behind a manual one, not fail), no overrides and no
  `force`; the deployment's concurrency limit uses ENQUEUE, so a run due while another runs waits for it.
- **Serving needs a real Prefect server:** cron schedules do not run on the temporary local server a plain
  flow run starts, so `cli_flow_serve` refuses without `PREFECT_API_URL` and says how to start one. It also
  creates the global concurrency limit the flow takes (flows/run_lock.py).
- **Failure notifications are Prefect's**, configured outside the code (docs/prefect.md): an automation
  with trigger "flow run of `promptr1-retrain` enters Failed/Crashed" and action "send a notification" to a
  webhook/Slack/e-mail block (`prefect block create slack-webhook`, then `prefect automation create
  --from-file docs/prefect-automation.yaml`). Nothing here changes when the channel changes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.retrain import FLOW_NAME, retrain
from flows.run_lock import ensure_prefect_limit
from pipeline.config import FlowConfig, Params
from pipeline.errors import UserError

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

log = logging.getLogger(__name__)

DEPLOYMENT_NAME = "retrain"


def deployment_parameters(profile: str, cfg: FlowConfig, *, scheduled: bool = True) -> dict[str, Any]:
    """Parameters a deployment's runs get: the profile the params name, no overrides, the scheduled wait
    (`flow.scheduled_lock_timeout_s`)."""
    return {
        "profile": profile,
        "overrides": [],
        "force": False,
        "lock_timeout_s": cfg.scheduled_lock_timeout_s if scheduled else cfg.lock_timeout_s,
    }


def build_deployment(profile: str, cfg: FlowConfig, *, project_dir: str | Path | None = None) -> RunnerDeployment:
    """The served deployment of `profile`: cron schedule and concurrency from the `flow` section (`cfg`);
    built without a server."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.schedules import Cron

    parameters = deployment_parameters(profile, cfg)
    if project_dir is not None:
        parameters["project_dir"] = str(project_dir)
    return retrain.to_deployment(
        name=DEPLOYMENT_NAME,
        schedules=[Cron(cfg.cron, timezone=cfg.timezone)],
        parameters=parameters,
        concurrency_limit=ConcurrencyLimitConfig(limit=cfg.concurrency_limit,
                                                 collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        description=f"Scheduled Prompt-R1 retraining, profile {profile!r}",
        tags=["prompt-r1", f"profile:{profile}"],
    )


def prefect_api_url() -> str | None:
    """The configured Prefect API (`PREFECT_API_URL`), or None when runs would use a temporary server."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def cli_flow_serve(params: Params) -> None:
    """`promptr1 flow serve`: serve the deployment on its cron schedule (blocks; Ctrl-C pauses it)."""
    if not prefect_api_url():
        raise UserError(
            "`promptr1 flow serve` needs a Prefect server: schedules do not run on the temporary one. "
            "Start one (`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api "
            "(or `prefect config set PREFECT_API_URL=...`)"
        )
    from prefect import serve

    ensure_prefect_limit(params.flow.concurrency_limit)
    deployment = build_deployment(params.profile, params.flow, project_dir=params.root)
    log.info("serving %s/%s: cron %r (%s), %d concurrent run(s)", FLOW_NAME, DEPLOYMENT_NAME,
             params.flow.cron, params.flow.timezone, params.flow.concurrency_limit)
    serve(deployment)
