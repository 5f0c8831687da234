"""The retraining flow's definitions, checked without a Prefect server (fast).

Deployments (served and prefect.yaml) against params.yaml's `flow:` section and the flow's own parameter
schema; overrides applied the way `dvc exp run -S` applies them and restored byte for byte; the
workspace lock; the run summary; the failure-notification automation template.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import jsonschema
import pytest
import yaml

from flows import dvc_steps
from flows.deploy import build_deployment, cli_flow_serve
from flows.policies import STAGE_POLICIES
from flows.retrain import ENVIRONMENT_BACKENDS, FLOW_NAME, retrain, run_overrides
from flows.run_lock import RunLockBusy, lock_path, workspace_lock
from flows.run_report import RunReport, to_markdown
from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.stages.figures import promotion_line
from pipeline.tracking.links import MlflowRunInfo, strip_credentials

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def repo_params():
    return load_params(REPO / "params.yaml")


def _flow_schema() -> dict:
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(retrain.fn).model_dump()


def test_served_deployment_follows_params(repo_params):
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    deployment = build_deployment(repo_params.profile, repo_params.flow, project_dir="/srv/project")
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == repo_params.flow.cron
    assert schedule.schedule.timezone == repo_params.flow.timezone
    assert schedule.active
    assert deployment.concurrency_limit == repo_params.flow.concurrency_limit
    assert deployment.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
    assert deployment.entrypoint.endswith("flows/retrain.py:retrain")
    assert deployment.parameters["profile"] == repo_params.profile
    assert deployment.parameters["lock_timeout_s"] == repo_params.flow.scheduled_lock_timeout_s
    assert deployment.parameters["project_dir"] == "/srv/project"
    jsonschema.validate(deployment.parameters, deployment._parameter_openapi_schema.model_dump())


def test_served_deployment_follows_changed_params(repo_params):
    repo_params.flow.cron = "30 1 * * *"
    repo_params.flow.timezone = "Europe/Paris"
    repo_params.flow.concurrency_limit = 2
    deployment = build_deployment(repo_params.profile, repo_params.flow)
    assert deployment.schedules[0].schedule.cron == "30 1 * * *"
    assert deployment.schedules[0].schedule.timezone == "Europe/Paris"
    assert deployment.concurrency_limit == 2


def test_prefect_yaml_deployment_for_gpu_pool(repo_params):
    from prefect.cli.deploy._models import PrefectYamlModel

    config = PrefectYamlModel.model_validate(yaml.safe_load((REPO / "prefect.yaml").read_text()))
    (deployment,) = config.deployments
    assert deployment.entrypoint == "flows/retrain.py:retrain"
    module, _, name = deployment.entrypoint.partition(":")
    assert (REPO / module).is_file() and name == retrain.fn.__name__
    assert deployment.work_pool.name == repo_params.flow.work_pool
    (schedule,) = deployment.schedules
    assert schedule.cron == repo_params.flow.cron
    assert schedule.timezone == repo_params.flow.timezone
    assert deployment.concurrency_limit.limit == repo_params.flow.concurrency_limit
    assert deployment.concurrency_limit.collision_strategy == "ENQUEUE"
    parameters = deployment.parameters
    jsonschema.validate(parameters, _flow_schema())
    assert parameters["profile"] == "paper"
    assert parameters["environment"] in ENVIRONMENT_BACKENDS
    assert parameters["lock_timeout_s"] == repo_params.flow.scheduled_lock_timeout_s
    paper = load_params(REPO / "params.yaml", {"profile": "paper"})
    assert paper.train.backend == "verl"
    assert paper.environment.backend == ENVIRONMENT_BACKENDS[parameters["environment"]]


def test_flow_parameters_are_typed():
    schema = _flow_schema()
    props = schema["properties"]
    assert set(props) == {"profile", "overrides", "environment", "force", "lock_timeout_s", "project_dir"}
    jsonschema.validate({"environment": "vllm", "overrides": ["train.steps=2"], "force": True}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"environment": "gpu-cluster"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"overrides": "train.steps=2"}, schema)


def test_serve_without_server_says_how(repo_params):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: None}), pytest.raises(UserError, match="prefect server start"):
        cli_flow_serve(repo_params)


def test_retry_policies_are_the_documented_ones():
    assert STAGE_POLICIES["train"].retries == 1  # resumes from its checkpoint, so one retry is safe
    assert STAGE_POLICIES["evaluate"].retries >= 1 and STAGE_POLICIES["register"].retries >= 1
    for stage in ("sample", "validate", "build", "merge"):
        assert STAGE_POLICIES[stage].retries == 0
    # the stages that talk to the environment: GEPA's optimisation, training, evaluation
    assert {s for s, p in STAGE_POLICIES.items() if p.needs_environment} == {"gepa", "train", "evaluate"}
    dvc_yaml = yaml.safe_load((REPO / "dvc.yaml").read_text())
    assert set(STAGE_POLICIES) == set(dvc_yaml["stages"])


def test_run_overrides_map_profile_and_environment():
    assert run_overrides(None, [], None) == []
    assert run_overrides("paper", ["train.steps=2"], "local") == [
        "profile=paper", "environment.backend=llamacpp", "train.steps=2"]
    assert run_overrides(None, [" "], "api") == ["environment.backend=api"]
    with pytest.raises(UserError, match="choose one of"):
        run_overrides(None, [], "gpu")  # type: ignore[arg-type]


def _copy_params(tmp_path: Path) -> Path:
    (tmp_path / "params.yaml").write_bytes((REPO / "params.yaml").read_bytes())
    (tmp_path / "profiles").mkdir()
    for profile in (REPO / "profiles").glob("*.yaml"):
        (tmp_path / "profiles" / profile.name).write_bytes(profile.read_bytes())
    return tmp_path


def test_overrides_apply_like_dvc_exp_run_and_restore(tmp_path):
    root = _copy_params(tmp_path)
    before = {p: p.read_bytes() for p in [root / "params.yaml", root / "profiles" / "paper.yaml"]}
    originals = dvc_steps.apply_overrides(
        root, ["train.steps=2", "profile=paper", "profiles/paper.yaml:train.lr=2.0e-6"])
    assert set(originals) == {p.resolve() for p in before}
    text = (root / "params.yaml").read_text()
    assert "# Every knob of the pipeline" in text  # comments survive, as with `dvc exp run -S`
    params = load_params(root / "params.yaml")
    assert params.profile == "paper" and params.train.steps == 2 and params.train.lr == pytest.approx(2e-6)
    dvc_steps.restore_files(root, originals)
    assert all(p.read_bytes() == content for p, content in before.items())


@pytest.mark.parametrize("bad", ["train.no_such_knob=1", "profiles/missing.yaml:a=1", "../x.yaml:a=1"])
def test_bad_override_fails_and_changes_nothing(tmp_path, bad):
    root = _copy_params(tmp_path)
    before = (root / "params.yaml").read_bytes()
    with pytest.raises(UserError):
        dvc_steps.apply_overrides(root, ["train.steps=3", bad])
    assert (root / "params.yaml").read_bytes() == before


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flows.run_lock import workspace_lock
    with workspace_lock(Path(sys.argv[1]), 0, flow_run="holder-run"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
""")


def test_workspace_lock_refuses_then_waits(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "2"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockBusy, match="holder-run"), workspace_lock(tmp_path, 0):
            pass
        start = time.monotonic()
        with workspace_lock(tmp_path, 30, flow_run="second"):
            assert time.monotonic() - start > 0.2  # it waited for the holder to finish
    finally:
        holder.kill()
        holder.wait()
    assert lock_path(tmp_path).exists()


def test_markdown_summary_has_table_decision_and_link():
    report = RunReport(flow_run="calm-otter", profile="paper", overrides=["train.steps=2"],
                       environment_backend="vllm", forced=False,
                       stages=[{"stage": "train", "result": "reproduced", "seconds": 12.5,
                                "key_figure": "8 steps (last step 8), mean reward -0.500 → -0.250"},
                               {"stage": "(failed)", "result": "StageFailed: a | b", "seconds": 0.0}],
                       experiment="retrain-x", eval_summary="| dataset | F1 |\n|---|---:|\n| hotpotqa | 41.0 |",
                       promotion={"promoted": False, "reason": "ID F1 +0.2 < margin 0.5", "alias": "champion"},
                       mlflow=MlflowRunInfo(run_id="abc123", link="http://mlflow:5000/#/experiments/1/runs/abc123"))
    markdown = to_markdown(report)
    assert "| hotpotqa | 41.0 |" in markdown
    assert "not promoted to @champion: ID F1 +0.2 < margin 0.5" in markdown
    assert "http://mlflow:5000/#/experiments/1/runs/abc123" in markdown
    assert "| train | reproduced | 12.5 |" in markdown
    assert "| train | reproduced | 12.5 | 8 steps (last step 8), mean reward -0.500 → -0.250 |" in markdown
    assert "| (failed) | StageFailed: a \\| b | 0.0 |  |" in markdown  # a cell never breaks the table
    assert promotion_line(None).startswith("no promotion decision")
    assert strip_credentials("https://user:secret@mlflow.example:8443/x") == "https://mlflow.example:8443/x"


# What `dvc repro --single-item train` printed when the stage raised (the tail run_dvc keeps).
FAILED_TAIL = """Running stage 'train':
> promptr1 train
2026-11-23 20:52:50,756 INFO pipeline.environment.servers: starting the llamacpp environment server
Traceback (most recent call last):
  File "pipeline/train/local/backend.py", line 88, in run_local
    loss = step(batch)
RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB""" + " (details)" * 60 + """

To track the changes with git, run:
ERROR: failed to reproduce 'train': failed to run: promptr1 train, exited with 1"""


def test_failed_stage_message_leads_with_the_stage_error_and_stays_readable():
    exc = dvc_steps.StageFailed("train", 255, FAILED_TAIL)
    headline, _, rest = str(exc).partition("\n")
    assert headline.startswith("stage 'train' failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert headline.endswith("… (dvc exit code 255); last output:")
    lines = rest.splitlines()
    assert lines[0] == "2026-11-23 20:52:50,756 INFO pipeline.environment.servers: starting the llamacpp environment server"
    assert lines[-1] == "ERROR: failed to reproduce 'train': failed to run: promptr1 train, exited with 1"
    assert not any(line.startswith(("Running stage", "> promptr1", "To track")) or not line.strip() for line in lines)
    assert max(len(line) for line in lines) <= dvc_steps.ERROR_LINE_CHARS
    assert exc.tail == FAILED_TAIL  # the whole tail is kept for whoever needs it
    many = "\n".join(f"line {i}" for i in range(100))
    assert dvc_steps.error_excerpt(many) == [f"line {i}" for i in range(100 - dvc_steps.ERROR_LINES, 100)]


def test_stage_artifact_keys_are_what_prefect_accepts():
    from flows.artifacts import stage_artifact_key

    assert stage_artifact_key("sample@hotpotqa") == "stage-sample-hotpotqa"
    assert stage_artifact_key("dvc.yaml:sample@2wiki_multi_hop") == "stage-dvc-yaml-sample-2wiki-multi-hop"
    assert stage_artifact_key("train") == "stage-train"


def test_failure_notification_template_is_a_valid_automation():
    from prefect.events.schemas.automations import AutomationCore

    data = yaml.safe_load((REPO / "docs" / "prefect-automation.yaml").read_text())
    data["actions"][0]["block_document_id"] = str(uuid.uuid4())
    automation = AutomationCore.model_validate(data)
    assert automation.trigger.match_related.root["prefect.resource.name"] == FLOW_NAME
    assert "prefect.flow-run.Failed" in automation.trigger.expect
