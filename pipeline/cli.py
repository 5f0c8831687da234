"""`promptr1`: one subcommand per pipeline stage (what dvc.yaml calls), plus `ask`, `serve`, `env`, `flow`, `doctor`.

Every command reads params through `pipeline.config.load_params` (params.yaml + the profile it names,
then any `--set key=value` overrides), so the CLI, DVC and Prefect all see one configuration.
Each stage command imports its module, `pipeline.stages.<stage>`, in its body: `promptr1 --help` stays fast
and a CPU install never imports GPU code, while the import stays visible to readers and to "go to definition".
Process setup (telemetry off, logging to stderr) is `pipeline.runtime`'s, shared with `python -m flows.retrain`.
Every stage command goes through `_run_stage`, which ends it with one INFO line
`<stage> done in <s> s: <key figure>` (pipeline.stages.figures, read back from the files the stage wrote).
Errors the user can fix (bad params, bad data, missing key variable) print one clear line and exit 1,
without a traceback; so does a stage that meets a full disk, however deep the error (pipeline/disk_space.py).
A stage refusing the params a workspace `dvc exp run -S` wrote puts back what DVC changed for it first, and
says so in that line (pipeline/refused_experiment.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from pipeline.config import ConfigError, Params, deep_merge, find_root, load_params, parse_override
from pipeline.config.specs import stage_folders
from pipeline.errors import UserError
from pipeline.runtime import configure_logging, quiet_telemetry
from pipeline.stages.figures import key_figure

log = logging.getLogger(__name__)

app = typer.Typer(help="Prompt-R1 pipeline: data, GRPO training, evaluation, registry.", no_args_is_help=True)
env_app = typer.Typer(help="Start, check and stop the environment server (the large LLM).", no_args_is_help=True)
flow_app = typer.Typer(help="Prefect orchestration: run the pipeline as a flow or serve it on a schedule.",
                       no_args_is_help=True)
app.add_typer(env_app, name="env")
app.add_typer(flow_app, name="flow")

SetOption = Annotated[list[str] | None, typer.Option("--set", "-S", help="Override a param: key.sub=value.")]
ParamsOption = Annotated[str | None, typer.Option("--params", help="params.yaml to read (default: nearest).")]


def _load(params_file: str | None, sets: list[str] | None) -> Params:
    overrides: dict = {}
    for item in sets or []:
        overrides = deep_merge(overrides, parse_override(item))
    return load_params(params_file, overrides or None)


def _load_runnable(params_file: str | None, sets: list[str] | None, check: str = "assert_runnable") -> Params:
    """`_load`, then the layout check (`promptr1 check`): a stage never starts on a layout that cannot run.

    `check` names the function of `pipeline.checks.layout` that judges the params: the whole layout
    (`assert_runnable`), or only the environment server's (`assert_environment_runnable`, for `promptr1 env`,
    which may run on a node that holds nothing else). First of all, no stage runs on the overrides a killed
    flow run left in the params files (flows/override_guard.py: it refuses and names `promptr1 flow restore`).
    """
    from flows.override_guard import refuse_dead_run_overrides
    from pipeline.checks import layout

    refuse_dead_run_overrides(Path(params_file).resolve().parent if params_file else find_root())
    params = _load(params_file, sets)
    getattr(layout, check)(params)
    return params


def _run(call: Callable[[], object]) -> None:
    """Load params and call a stage; turn expected failures (bad params included) into one clear line, exit 1."""
    try:
        call()
    except (ConfigError, UserError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def _run_stage(stage: str, params_file: str | None, sets: list[str] | None,
               call: Callable[[Params], object]) -> None:
    """`_run` a stage on the runnable params, then log `<stage> done in <s> s: <key figure>`; a full disk ends it
    in one line (pipeline/disk_space.py)."""
    from pipeline.disk_space import disk_full, quiet_full_store_tracebacks
    from pipeline.progress import heartbeat

    def stage_then_figure() -> None:
        try:
            params = _load_runnable(params_file, sets)
        except (ConfigError, UserError) as exc:
            raise _put_back_refused(exc, params_file) from None
        start = time.perf_counter()
        quiet_full_store_tracebacks()
        try:
            with heartbeat(stage):  # a line at least every minute, also in phases that report nothing
                call(params)
        except Exception as exc:
            full = disk_full(exc, params.root)
            if full is None:
                raise
            raise full from None
        log.info("%s done in %.1f s: %s", stage, time.perf_counter() - start, key_figure(stage_folders(params), stage))

    _run(stage_then_figure)


def _put_back_refused(exc: ConfigError | UserError, params_file: str | None) -> ConfigError | UserError:
    """`exc`, saying what was put back when a workspace `dvc exp run` edited the params files and removed this
    stage's outputs for params the stage refuses (pipeline/refused_experiment.py); `exc` itself otherwise."""
    from pipeline.refused_experiment import put_back_refused_experiment

    try:
        root = Path(params_file).resolve().parent if params_file else find_root()
        done = put_back_refused_experiment(root, getattr(exc, "keys", ()))
        said = done.sentence() if done is not None else ""
    except Exception as failed:  # noqa: BLE001 - the refusal is the news; a failed put-back is told beside it
        said = f"the workspace was not put back ({type(failed).__name__}: {failed})"
    if not said:
        return exc
    message = f"{exc}; {said}"
    return ConfigError(message) if isinstance(exc, ConfigError) else UserError(message)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    quiet_telemetry()
    configure_logging(verbose)


STAGE_COMMANDS: dict[str, Callable[..., None]] = {}
"""The stage commands dvc.yaml calls, in pipeline order (`promptr1 --help` lists them so)."""


def _stage_command(stage: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a command as `promptr1 <stage>`; `command.stage` names the stage whose key figure ends it."""

    def register(command: Callable[..., None]) -> Callable[..., None]:
        command.stage = stage
        STAGE_COMMANDS[stage] = command
        return app.command(stage)(command)

    return register


@_stage_command("sources")
def sources(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 0: fingerprint the raw sources and evaluation files (mirror md5s or Hub revisions) → data/sources/."""
    from pipeline.stages.sources import run_sources

    _run_stage("sources", params, set_, run_sources)


@_stage_command("sample")
def sample(dataset: str, params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 1: normalise, de-leak and sample one training dataset → data/sampled/<dataset>.parquet."""
    from pipeline.stages.sample import run_sample

    _run_stage(f"sample@{dataset}", params, set_, lambda loaded: run_sample(loaded, dataset))


@_stage_command("validate")
def validate(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 2: Great Expectations suites over every sampled and evaluation file."""
    from pipeline.stages.validate import run_validate

    _run_stage("validate", params, set_, run_validate)


@_stage_command("build")
def build(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 3: render the Prompt-R1 template; write the verl RL training set and the evaluation sets."""
    from pipeline.stages.build import run_build

    _run_stage("build", params, set_, run_build)


@_stage_command("train")
def train(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 4: GRPO training of the agent (backend local or verl), resumable."""
    from pipeline.stages.train import run_train

    _run_stage("train", params, set_, run_train)


@_stage_command("merge")
def merge(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 5: checkpoints → one Hugging Face model directory in models/agent."""
    from pipeline.stages.merge import run_merge

    _run_stage("merge", params, set_, run_merge)


@_stage_command("gepa")
def gepa(params: ParamsOption = None, set_: SetOption = None) -> None:
    """GEPA optimises the environment's instruction on a training slice (rival `gepa`) → data/gepa/prompt.json."""
    from pipeline.stages.gepa import run_gepa

    _run_stage("gepa", params, set_, run_gepa)


@_stage_command("evaluate")
def evaluate(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 6: the merged agent + environment on the ID and OOD sets, with baselines."""
    from pipeline.stages.evaluate import run_evaluate

    _run_stage("evaluate", params, set_, run_evaluate)


@_stage_command("register")
def register(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stage 7: log the model to the MLflow registry; move the champion alias if the rule holds."""
    from pipeline.stages.register import run_register

    _run_stage("register", params, set_, run_register)


ENV_ONLY = "assert_environment_runnable"
"""`promptr1 env …` judges the environment server alone: it may run on a node that holds nothing else."""
ENV_COMMANDS: dict[str, Callable[..., None]] = {}
"""`promptr1 env start|stop|status`; `command.check` names the layout check each runs first."""


def _env_command(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(command: Callable[..., None]) -> Callable[..., None]:
        command.check = ENV_ONLY
        ENV_COMMANDS[name] = command
        return env_app.command(name)(command)

    return register


@_env_command("start")
def env_start(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Start (or reuse) the configured environment server and leave it running."""
    from pipeline.commands.env import cli_start

    _run(lambda: cli_start(_load_runnable(params, set_, ENV_ONLY)))


@_env_command("stop")
def env_stop(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Stop the environment server started by `promptr1 env start`."""
    from pipeline.commands.env import cli_stop

    _run(lambda: cli_stop(_load_runnable(params, set_, ENV_ONLY)))


@_env_command("status")
def env_status(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Health-check the configured environment endpoint."""
    from pipeline.commands.env import cli_status

    _run(lambda: cli_status(_load_runnable(params, set_, ENV_ONLY)))


@app.command()
def weights(
    check: Annotated[bool, typer.Option("--check", help="Only report what is missing (exit 1 if anything is).")] = False,
    params: ParamsOption = None,
    set_: SetOption = None,
) -> None:
    """Fetch every model the params need into the Hugging Face cache and verify it (before GPU time)."""
    from pipeline.commands.weights import run_weights

    _run(lambda: run_weights(_load(params, set_), check_only=check))


@app.command()
def check(params: ParamsOption = None, set_: SetOption = None) -> None:
    """Check that the merged params describe a runnable layout (params only: no network, no GPU).

    Exit 0 with a one-line summary; exit 2 with one line per problem, each naming the param keys.
    """
    from pipeline.checks.layout import describe, layout_problems

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
def doctor(
    rows: Annotated[int | None, typer.Option(
        "--rows", help="Evaluation rows sent to the environment (default 64; 16 with llamacpp).")] = None,
    params: ParamsOption = None,
    set_: SetOption = None,
) -> None:
    """A node's first five minutes: driver, imports, layout, weights, environment, rows, one verl step.

    One line per step (`pass|fail|skipped: <step>: ...`), stopping at the first failure (exit 1);
    report in reports/doctor/doctor.json.
    """
    from pipeline.checks.doctor import run_doctor

    try:
        merged = _load(params, set_)
    except ConfigError as exc:
        typer.secho(f"fail: params: {exc}", fg=typer.colors.RED)
        raise typer.Exit(1) from None
    raise typer.Exit(run_doctor(merged, rows, echo=typer.echo))


@app.command()
def ask(
    question: str,
    model: Annotated[str | None, typer.Option(help="Agent model (default: models/agent if merged, else params).")] = None,
    engine: Annotated[str | None, typer.Option(
        help="What generates the agent's turns: auto | llama.cpp | transformers (default: register.serve.agent_engine)."
    )] = None,
    params: ParamsOption = None,
    set_: SetOption = None,
) -> None:
    """Ask one question: the agent prompts the environment for up to max_turns turns, then answers."""
    from pipeline.commands.ask import run_ask

    _run(lambda: run_ask(_load_runnable(params, set_), question, model, engine=engine))


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default: register.serve.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: register.serve.port).")] = None,
    params: ParamsOption = None,
    set_: SetOption = None,
) -> None:
    """Serve the registered champion: POST /invocations answers questions (MLflow scoring server)."""
    from pipeline.commands.serve import run_serve

    code = 0

    def serve_champion() -> None:
        nonlocal code
        code = run_serve(_load(params, set_), host, port)

    _run(serve_champion)
    raise typer.Exit(code)


@flow_app.command("run")
def flow_run(
    profile: Annotated[str | None, typer.Option(help="Profile to run (default: params.yaml's).")] = None,
    set_: SetOption = None,
    force: Annotated[bool, typer.Option(help="Rerun every stage even if DVC finds it up to date.")] = False,
) -> None:
    """Run the whole pipeline once as a Prefect flow."""
    from flows.retrain import cli_flow_run

    _run(lambda: cli_flow_run(profile, set_ or [], force))


@flow_app.command("restore")
def flow_restore() -> None:
    """Put back the params a killed flow run left overridden (what its next run would do first)."""
    from flows.override_guard import restore_dead_run_overrides

    def restore() -> None:
        root = find_root()
        restored = restore_dead_run_overrides(root)
        names = ", ".join(str(p.relative_to(root.resolve())) for p in restored)
        typer.echo(f"restored {names}" if restored else "nothing to restore: no killed flow run left overrides")

    _run(restore)


@flow_app.command("serve")
def flow_serve(params: ParamsOption = None) -> None:
    """Serve the retraining deployment on the cron schedule in params (needs `prefect server start`)."""
    from flows.deploy import cli_flow_serve

    _run(lambda: cli_flow_serve(_load(params, None)))


if __name__ == "__main__":
    app()
