"""dvc.yaml's `params:` lists are exact: each stage lists the keys its code reads, and only those.

DVC reruns a stage when a listed param changes. A key the code reads but the stage does not list lets
`dvc repro` call a changed result "up to date"; a listed key the code does not read (a whole `mlflow` section
for the sake of one key) reruns training when `mlflow.trace_evaluation`, which only evaluate's MLflow traces
read, is edited. The keys a stage reads are computed from its code (scripts/stage_code/param_reads.py:
attribute chains on `Params` and its section models in the functions the stage's command reaches); a section
may be listed whole only when the stage reads every key of it, and `environment`, `mlflow` and `paths` never
whole (they hold keys for every stage: listed leaf by leaf, a key added later reruns only the stages that
read it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from pipeline.config import Params

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from stage_code.closure import ROOT, render
from stage_code.code_index import NODES, dotted, leaves, parse_key
from stage_code.param_reads import code_reads, overdeclared, stage_reads, uncovered

LEAF_ONLY_SECTIONS = ("environment", "mlflow", "paths")
"""Sections no stage may list whole."""


def declared_params() -> list[tuple[str, str, list[str]]]:
    """(stage, verb, its `params:` list) for every stage of dvc.yaml (a foreach stage: its `do` block)."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    out = []
    for name, stage in dvc["stages"].items():
        body = stage.get("do", stage)
        verb = body["cmd"].split()[1]
        keys = [k if isinstance(k, str) else next(iter(k)) for k in body.get("params", [])]
        out.append((name, verb, keys))
    return out


STAGES = declared_params()
READS = {verb: stage_reads(verb) for verb in {verb for _, verb, _ in STAGES}}


def _hint(verb: str, key: str) -> str:
    """Where a read comes from when it is a whole-section read (they are the surprising ones)."""
    whole = [
        f"{dotted(k)} read whole at {', '.join(sorted(set(w))[:3])}"
        for k, w in READS[verb].whole.items()
        if parse_key(key)[: len(k)] == k
    ]
    return f"{key} ({'; '.join(whole)})" if whole else key


@pytest.mark.parametrize(("stage", "verb", "declared"), STAGES, ids=[s[0] for s in STAGES])
def test_stage_declares_every_key_its_code_reads(stage: str, verb: str, declared: list[str]) -> None:
    missing = uncovered(READS[verb].keys, declared)
    assert not missing, (
        f"dvc.yaml stage {stage!r}: its code reads params it does not list, so editing them "
        f"would not rerun it: {[_hint(verb, k) for k in missing]}"
    )


@pytest.mark.parametrize(("stage", "verb", "declared"), STAGES, ids=[s[0] for s in STAGES])
def test_stage_declares_no_key_its_code_does_not_read(stage: str, verb: str, declared: list[str]) -> None:
    extra = overdeclared(READS[verb].keys, declared)
    assert not extra, (
        f"dvc.yaml stage {stage!r} lists params its code does not read (editing them reruns it "
        f"for nothing): {extra}"
    )


@pytest.mark.parametrize(("stage", "verb", "declared"), STAGES, ids=[s[0] for s in STAGES])
def test_no_stage_lists_a_whole_shared_section(stage: str, verb: str, declared: list[str]) -> None:
    whole = [k for k in declared if k in LEAF_ONLY_SECTIONS]
    assert not whole, f"dvc.yaml stage {stage!r} lists whole sections {whole}: list the keys it reads instead"


def test_every_stage_depends_on_the_profile() -> None:
    """Profiles are merged over params.yaml by pipeline.config, which DVC cannot see."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    for name, stage in dvc["stages"].items():
        body = stage.get("do", stage)
        assert "profile" in body.get("params", []), (
            f"dvc.yaml stage {name!r} does not list the `profile` param"
        )
        assert "profiles" in body.get("deps", []), f"dvc.yaml stage {name!r} does not depend on profiles/"


def test_trace_evaluation_reruns_only_evaluate() -> None:
    """The MLflow-display key that started this: only evaluate's code reads it and only evaluate lists it."""
    key = ("mlflow", "trace_evaluation")
    listing = sorted(
        name
        for name, _, declared in STAGES
        if any(key[: len(parse_key(d))] == parse_key(d) for d in declared)
    )
    reading = sorted(name for name, verb, _ in STAGES if key in READS[verb].keys)
    assert listing == reading == ["evaluate"]
    # Likewise the training-trace key: train alone.
    key = ("mlflow", "trace_train_samples")
    assert sorted(name for name, _, declared in STAGES if dotted(key) in declared) == ["train"]


def test_a_missing_param_is_reported() -> None:
    """The check can fail: drop a key evaluate reads, or a section train reads, and it is named."""
    _, verb, declared = next(s for s in STAGES if s[0] == "evaluate")
    assert uncovered(READS[verb].keys, [d for d in declared if d != "mlflow.trace_evaluation"]) == [
        "mlflow.trace_evaluation"
    ]
    _, verb, declared = next(s for s in STAGES if s[0] == "train")
    assert uncovered(READS[verb].keys, [d for d in declared if d != "reward"]) == sorted(
        dotted(k) for k in leaves(("reward",))
    )


def test_an_unread_param_is_reported() -> None:
    """The other direction: a whole `mlflow` (what train listed before) and a misspelt key are both named."""
    _, verb, declared = next(s for s in STAGES if s[0] == "train")
    extra = overdeclared(READS[verb].keys, [*declared, "mlflow", "train.lrr"])
    assert extra == {
        "mlflow": ["mlflow.trace_evaluation"],
        "train.lrr": ["(no such key in pipeline.config.Params)"],
    }


SAMPLE = """
import json
from dataclasses import dataclass
from pipeline.config import EnvironmentConfig, Params, RewardConfig
from pipeline.train.plan import TrainPlan


@dataclass(frozen=True)
class Plan:
    seed: int
    reward: RewardConfig


class Runner:
    def __init__(self, params: Params) -> None:
        self.params = params

    def go(self) -> float:
        return self.params.train.lr


def run(params: Params) -> None:
    t = params.train
    env = params.environment
    helper(env, params.agent.max_turns)
    print(t.warmup.steps, params.mirror, Runner(params).go())
    json.dumps(params.register)                     # handed to a library: every register key
    g, a = params.gepa, params.agent
    print(g.seed)
    plan = Plan(seed=params.seed, reward=params.reward)
    print(plan.reward.preset)


def helper(cfg: EnvironmentConfig, turns: int) -> None:
    quiet = cfg.model_copy(update={"temperature": 0.0})
    print(quiet.url, quiet.server.n_ctx)


def never_called(params: Params) -> None:
    print(params.evaluate.confidence)
"""


def test_the_analysis_follows_aliases_sections_and_properties(tmp_path: Path) -> None:
    """The checker itself, on a file it has never seen: aliases (`t = params.train`, tuple unpacking), a
    section handed to a function annotated to take it, `model_copy`, properties of `Params` and of a section
    (`mirror`, `url`), an attribute set in `__init__`, a section kept in a dataclass field, a section handed
    to a library (read whole), and a function nothing calls (not read)."""
    module = tmp_path / "sample_stage.py"
    module.write_text(SAMPLE, encoding="utf-8")
    reads = code_reads({module}, {"run"}).keys
    expected = {
        ("profile",),
        ("train", "lr"),
        ("train", "warmup", "steps"),
        ("agent", "max_turns"),
        ("paths", "mirror"),
        ("environment", "base_url"),
        ("environment", "host"),
        ("environment", "port"),
        ("environment", "server", "n_ctx"),
        ("gepa", "seed"),
        ("seed",),
        ("reward", "preset"),
        *leaves(("register",)),
    }
    assert reads == expected, {"missing": sorted(expected - reads), "extra": sorted(reads - expected)}
    assert all(k in NODES for k in reads)


def _placeholder_project(project: Path) -> None:
    """A git+DVC copy of the project (params, profiles, code, dvc.yaml) whose data deps and outs are
    placeholder files, locked with `dvc commit` as if every stage had run: no data, no model, no training."""
    for name in ("params.yaml", "dvc.yaml", ".dvcignore", "profiles", "pipeline"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, project / name)
    params = yaml.safe_load((project / "params.yaml").read_text(encoding="utf-8"))
    for stage in yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8"))["stages"].values():
        items = yaml.safe_load(render(stage["foreach"], params, None)) if "foreach" in stage else [None]
        body = stage.get("do", stage)
        for item in items:
            for entry in [
                e for section in ("deps", "outs", "metrics", "plots") for e in body.get(section, [])
            ]:
                path = project / render(next(iter(entry)) if isinstance(entry, dict) else entry, params, item)
                if not path.exists():
                    folder = path.parent if path.suffix else path
                    folder.mkdir(parents=True, exist_ok=True)
                    (path if path.suffix else path / "placeholder.txt").write_text("{}\n", encoding="utf-8")
    for command in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "commit", "-f", "-q"]):
        subprocess.run(command, cwd=project, check=True, capture_output=True, text=True)


def _changed_stages(project: Path) -> list[str]:
    out = subprocess.run(["dvc", "status", "--json"], cwd=project, check=True, capture_output=True, text=True)
    return sorted(name for name in json.loads(out.stdout) if name != "sources")  # sources: always_changed


def _set(project: Path, section: str, key: str, value: str) -> None:
    """Edit one `section.key` line of params.yaml in place (comments and order kept, as a person would)."""
    lines = (project / "params.yaml").read_text(encoding="utf-8").split("\n")
    start = lines.index(f"{section}:")
    at = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith(f"{key}:"))
    lines[at] = f"  {key}: {value}"
    (project / "params.yaml").write_text("\n".join(lines), encoding="utf-8")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dvc") is None, reason="needs the dvc command")
def test_dvc_status_after_editing_an_mlflow_display_key(tmp_path: Path) -> None:
    """Real DVC on a locked placeholder copy of the project: editing `mlflow.trace_evaluation` marks evaluate
    alone as changed (with whole `mlflow` sections it marked gepa, train, evaluate and register), and
    `mlflow.trace_train_samples` adds train alone."""
    _placeholder_project(tmp_path)
    assert _changed_stages(tmp_path) == []
    _set(tmp_path, "mlflow", "trace_evaluation", "false")
    assert _changed_stages(tmp_path) == ["evaluate"]
    _set(tmp_path, "mlflow", "trace_train_samples", "0")
    assert _changed_stages(tmp_path) == ["evaluate", "train"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dvc") is None, reason="needs the dvc command")
def test_dvc_status_after_compiling_or_editing_a_code_folder_dep(tmp_path: Path) -> None:
    """Real DVC on a locked placeholder copy: a code folder listed whole as a stage's dep keeps its hash when
    Python compiles the code in it (.dvcignore: `__pycache__/`, `*.pyc`; without them it would change), and
    changes when a module in it does."""
    _placeholder_project(tmp_path)
    stage, folder = next(
        (name, dep)
        for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"].items()
        for dep in stage.get("do", stage)["deps"]
        if dep.startswith("pipeline/") and (ROOT / dep).is_dir() and not stage.get("always_changed")
    )
    compiled = tmp_path / folder / "__pycache__"
    compiled.mkdir(exist_ok=True)
    (compiled / "probe.cpython-311.pyc").write_bytes(b"compiled")
    (tmp_path / folder / "probe.pyc").write_bytes(b"compiled")
    assert _changed_stages(tmp_path) == []
    ignore = tmp_path / ".dvcignore"
    kept = ignore.read_text(encoding="utf-8")
    ignore.write_text(kept.replace("__pycache__/\n", "").replace("*.pyc\n", ""), encoding="utf-8")
    assert stage in {name.split("@")[0] for name in _changed_stages(tmp_path)}  # the control: not ignored
    ignore.write_text(kept, encoding="utf-8")
    assert _changed_stages(tmp_path) == []
    module = next((tmp_path / folder).rglob("*.py"))
    module.write_text(module.read_text(encoding="utf-8") + "\n# edited\n", encoding="utf-8")
    assert stage in {name.split("@")[0] for name in _changed_stages(tmp_path)}


@contextmanager
def recording(params: Params) -> Iterator[set[tuple[str, ...]]]:
    """Every params leaf read through attribute access on `params`' own section objects while inside.

    Copies (`model_copy`) and pydantic's own serialisation (`model_dump`) are not seen: what this records is
    a lower bound, for checking that the static analysis misses nothing on the paths a test can run."""
    keys_of: dict[int, tuple[str, ...]] = {}

    def walk(obj: BaseModel, key: tuple[str, ...]) -> None:
        keys_of[id(obj)] = key
        for name in type(obj).model_fields:
            if isinstance(value := obj.__dict__.get(name), BaseModel):
                walk(value, (*key, name))

    walk(params, ())
    read: set[tuple[str, ...]] = set()
    classes = {type(params)} | {m for m in NODES.values() if m is not None}

    def recorder(original: Callable[[object, str], object]) -> Callable[[object, str], object]:
        def __getattribute__(self: object, name: str) -> object:
            key = keys_of.get(id(self))
            if key is not None and (*key, name) in NODES and NODES[(*key, name)] is None:
                read.add((*key, name))
            return original(self, name)

        return __getattribute__

    for cls in classes:
        cls.__getattribute__ = recorder(cls.__getattribute__)
    try:
        yield read
    finally:
        for cls in classes:
            del cls.__getattribute__  # back to BaseModel's (no section model defines its own)


def test_what_stage_code_reads_at_run_time_is_in_the_static_reads(
    shared_datasets: Path, tmp_path: Path
) -> None:
    """The analysis against the running code, where that is cheap: the sources stage and one sample stage on
    the mirror, and the pure parts of two heavy stages (verl's overrides for train, the pyfunc's environment
    for register). Every key they read is in the stage's static reads."""
    from pipeline.config import load_params
    from pipeline.stages.register import environment_json
    from pipeline.stages.sample import run_sample
    from pipeline.stages.sources import run_sources
    from pipeline.train.plan import TrainPlan
    from pipeline.train.verl.overrides import build_overrides

    folders = {k: str(tmp_path / k) for k in ("sampled_dir", "rl_dir", "reports_dir", "cache_dir")}
    data = load_params(
        ROOT / "params.yaml",
        {"paths": {"mirror": str(shared_datasets), **folders}, "data": {"sample_size": 8}},
    )
    paper = load_params(ROOT / "params.yaml", {"profile": "paper"})
    runs = {
        "sources": (data, lambda: run_sources(data)),
        "sample": (data, lambda: run_sample(data, "gsm8k")),
        "train": (paper, lambda: build_overrides(TrainPlan.from_params(paper))),
        "register": (paper, lambda: environment_json(paper)),
    }
    recorded = {}
    for verb, (params, call) in runs.items():
        with recording(params) as recorded[verb]:
            call()
        missed = sorted(dotted(k) for k in recorded[verb] - READS[verb].keys)
        assert not missed, (
            f"`promptr1 {verb}` read {missed} at run time, which scripts/stage_code/param_reads.py "
            "did not find"
        )
    # The comparison can fail: what sample reads at run time is not all in what sources' code reads.
    assert {("data", "sample_size"), ("seed",)} <= recorded["sample"] - READS["sources"].keys
