"""`promptr1`: one subcommand per pipeline stage (what dvc.yaml calls), plus `ask`, `env` and `flow`.

Every command reads params through `pipeline.config.load_params` (params.yaml + the profile it names,
then any `--set key=value` overrides), so the CLI, DVC and Prefect all see one configuration.
Stage modules are imported lazily: `promptr1 --help` stays fast and a CPU install never imports GPU code.
Errors the user can fix (bad params, bad data, missing key variable) print one clear line and exit 1,
without a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from pipeline.config import ConfigError, Params, deep_merge, load_params, parse_override
from pipeline.errors import UserError

app = typer.Typer(help="Prompt-R1 pipeline: data, GRPO training, evaluation, registry.", no_args_is_help=True)
env_app = typer.Typer(help="Start, check and stop the environment server (the large LLM).", no_args_is_help=True)
flow_app = typer.Typer(help="Prefect orchestration: run the pipeline as a flow or serve it on a schedule.",
                       no_args_is_help=True)
app.add_typer(env_app, name="env")
app.add_typer(flow_app, name="flow")

SetOption = Annotated[list[str] | None, typer.Option("--set", "-S", help="Override a param: key.sub=value.")]
ParamsOption = Annotated[str | None, typer.Option("--params", help="params.yaml to read (default: nearest).")]


def _quiet_telemetry() -> None:
    for key, value in {
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "GX_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)


def _load(params_file: str | None, sets: list[str] | None) -> Params:
    overrides: dict = {}
    for item in sets or []:
        overrides = deep_merge(overrides, parse_override(item))
    return load_params(params_file, overrides or None)


def _run(call: Callable[[], object]) -> None:
    """Load params and call a stage; turn expected failures (bad params included) into one clear line, exit 1."""
    try:
        call()
    except (ConfigError, UserError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    _quiet_telemetry()
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "urllib3", "filelock", "alembic", "openai._base_client"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command()
def check(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Check that the merged params describe a runnable layout (params only: no network, no GPU).

    Exit 0 with a one-line summary; exit 2 with one line per problem, each naming the param keys.
    """
    from pipeline.layout import describe, layout_problems

    try:
        merged = _load(params, set_)
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    problems = layout_problems(merged)
    for problem in problems:
        typer.secho(f"error: {problem}", fg=typer.colors.RED, err=True)
    if problems:
        raise typer.Exit(2)
    typer.echo(f"layout ok: {describe(merged)}")


@app.command()
def sources(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 0: fingerprint the raw sources and evaluation files (mirror md5s or Hub revisions) → data/sources/."""
    from pipeline.data.fingerprint import run_sources

    _run(lambda: run_sources(_load(params, set_)))


@app.command()
def sample(dataset: str, params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 1: normalise, de-leak and sample one training dataset → data/sampled/<dataset>.parquet."""
    from pipeline.data.sample import run_sample

    _run(lambda: run_sample(_load(params, set_), dataset))


@app.command()
def validate(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 2: Great Expectations suites over every sampled and evaluation file."""
    from pipeline.data.validate import run_validate

    _run(lambda: run_validate(_load(params, set_)))


@app.command()
def build(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 3: render the Prompt-R1 template; write the verl RL training set and the evaluation sets."""
    from pipeline.data.build import run_build

    _run(lambda: run_build(_load(params, set_)))


@app.command()
def train(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 4: GRPO training of the agent (backend local or verl), resumable."""
    from pipeline.train.stage import run_train

    _run(lambda: run_train(_load(params, set_)))


@app.command()
def merge(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 5: checkpoints → one Hugging Face model directory in models/agent."""
    from pipeline.train.merge import run_merge

    _run(lambda: run_merge(_load(params, set_)))


@app.command()
def evaluate(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 6: the merged agent + environment on the ID and OOD sets, with baselines."""
    from pipeline.evaluate import run_evaluate

    _run(lambda: run_evaluate(_load(params, set_)))


@app.command()
def register(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 7: log the model to the MLflow registry; move the champion alias if the rule holds."""
    from pipeline.register import run_register

    _run(lambda: run_register(_load(params, set_)))


@app.command()
def ask(
    question: str,
    model: Annotated[str | None, typer.Option(help="Agent model (default: models/agent if merged, else params).")] = None,
    params: ParamsOption = None,
    set_: SetOption = None,
) -> None:
    """Ask one question: the agent prompts the environment for up to max_turns turns, then answers."""
    from pipeline.agent.ask import run_ask

    _run(lambda: run_ask(_load(params, set_), question, model))


@env_app.command("start")
def env_start(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Start (or reuse) the configured environment server and leave it running."""
    from pipeline.environment.servers import cli_start

    _run(lambda: cli_start(_load(params, set_)))


@env_app.command("stop")
def env_stop(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stop the environment server started by `promptr1 env start`."""
    from pipeline.environment.servers import cli_stop

    _run(lambda: cli_stop(_load(params, set_)))


@env_app.command("status")
def env_status(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Health-check the configured environment endpoint."""
    from pipeline.environment.servers import cli_status

    _run(lambda: cli_status(_load(params, set_)))


@flow_app.command("run")
def flow_run(
    profile: Annotated[str | None, typer.Option(help="Profile to run (default: params.yaml's).")] = None,
    set_: SetOption = None,
    force: Annotated[bool, typer.Option(help="Rerun every stage even if DVC finds it up to date.")] = False,
) -> None:
    """Run the whole pipeline once as a Prefect flow."""
    from flows.retrain import cli_flow_run

    _run(lambda: cli_flow_run(profile, set_ or [], force))


@flow_app.command("serve")
def flow_serve(params: ParamsOption = None) -> None:
    """Serve the retraining deployment on the cron schedule in params (needs `prefect server start`)."""
    from flows.retrain import cli_flow_serve

    _run(lambda: cli_flow_serve(_load(params, None)))


if __name__ == "__main__":
    app()
