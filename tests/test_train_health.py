"""The training health gate (pipeline/train/health_gate.py, verl_health.py): scripted degenerate and healthy runs,
grace and window scaled to the run's length, the recorded runs replayed (tests/fixtures/health_runs: the healthy
ones never trip, the collapsed terse seed 2 does by step 10), verl's metric lines, total and rollout dumps,
stopping a real streamed process, the verl checkpoints set aside, and register refusing a breached train run.

The real micro run of the local backend that trips the gate is tests/test_train_health_run.py (slow).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import load_params
from pipeline.config.health_gate import HealthConfig
from pipeline.config.specs import tracking_spec
from pipeline.train.health_gate import (
    LOCAL_METRICS,
    VERL_METRICS,
    ZERO_VARIANCE_METRIC,
    HealthGate,
    judge,
    zero_variance_share,
)
from pipeline.train.plan import TrainPlan
from pipeline.train.verl.health_gate import BreachSeen, VerlHealthWatch, parse_step_line, rollout_figures

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
RECORDED = Path(__file__).resolve().parent / "fixtures" / "health_runs"
CFG = HealthConfig()  # the defaults params.yaml ships


def healthy(step: int, **change: float) -> dict[str, float]:
    """A local-backend step's health figures as a healthy run logs them (names of step_metrics.py)."""
    metrics = {ZERO_VARIANCE_METRIC: 0.5, "reward/answer/mean": 0.3, "reward/format/mean": 1.0,
               "response_length/agent_tokens_mean": 120.0, "actor/kl_loss": 0.01}
    metrics.update(change)
    return metrics


def run(steps: list[dict[str, float]], cfg: HealthConfig = CFG):
    """Feed `steps` (1, 2, ...) of a run of that many steps to a gate; the first breach, or None."""
    gate = HealthGate(cfg, LOCAL_METRICS, len(steps))
    for step, metrics in enumerate(steps, start=1):
        if (breach := gate.observe(step, metrics)) is not None:
            return breach
    return None


# ------------------------------------------------------------------------------------------------ figures


def test_zero_variance_share_worked_examples():
    # two questions x G=4: one group all 0 (no signal), one with a spread -> half the groups are flat
    assert zero_variance_share([0, 0, 0, 0, 0, 1, 0.5, 0], ["a"] * 4 + ["b"] * 4) == 0.5
    assert zero_variance_share([-1.5] * 8, ["a"] * 4 + ["b"] * 4) == 1.0  # all-same scores, as a random model
    assert zero_variance_share([1, 1, 1, 1, 0, 0, 0, 0], ["a"] * 4 + ["b"] * 4) == 1.0  # solved / failed
    assert zero_variance_share([0.2, 0.2 + 1e-12, 0.3], ["a", "a", "b"]) == 1.0  # float noise is "the same"
    assert zero_variance_share([], []) == 0.0


def test_healthy_run_never_trips():
    assert run([healthy(s) for s in range(1, 41)]) is None


def test_flat_early_steps_within_the_grace_period_do_not_trip_but_after_it_they_do():
    flat = {ZERO_VARIANCE_METRIC: 1.0, "reward/answer/mean": 0.0}
    early = [healthy(s, **flat) for s in range(1, 11)] + [healthy(s) for s in range(11, 41)]
    assert run(early) is None
    # the same flat stretch once the grace period is over: judged when the window is full of it
    late = [healthy(s) for s in range(1, 11)] + [healthy(s, **flat) for s in range(11, 41)]
    breach = run(late)
    assert breach is not None and breach.figure == "zero_variance_share" and breach.step == 18
    assert breach.value == 1.0 and breach.threshold == 0.95


def test_mixed_flat_steps_in_a_window_do_not_trip():
    """learn's pattern after its grace period (steps 15-21: flat, spread, flat, ...): a mean below 0.95."""
    steps = [healthy(s, **{ZERO_VARIANCE_METRIC: 1.0 if s % 2 else 0.5}) for s in range(1, 41)]
    assert run(steps) is None


def test_format_rising_while_answers_fall_trips():
    steps = [healthy(s, **{"reward/answer/mean": 0.6, "reward/format/mean": 0.9}) for s in range(1, 19)]
    steps += [healthy(s, **{"reward/answer/mean": 0.1, "reward/format/mean": 1.1}) for s in range(19, 41)]
    breach = run(steps)
    # m steps into the new regime the answer window mean has fallen by 0.5 * m/8 and the format's risen 0.2 * m/8:
    # step 22 (m=4) 0.25, step 23 (m=5) 0.3125 > 0.3
    assert breach is not None and breach.figure == "answer_drop" and breach.threshold == 0.3
    assert breach.step == 23 and breach.value == pytest.approx(0.3125)
    # answers falling with the format flat is a harder task or noise, not reward hacking
    flat_format = [dict(m, **{"reward/format/mean": 1.0}) for m in steps]
    assert run(flat_format) is None


def test_collapsing_lengths_trip():
    steps = [healthy(s) for s in range(1, 21)]
    steps += [healthy(s, **{"response_length/agent_tokens_mean": 8.0}) for s in range(21, 41)]
    breach = run(steps)
    # baseline: the first 8 steps' 120 tokens; step 26: (2*120 + 6*8)/8 = 36 -> 0.30; step 27: 22 -> 0.183
    assert breach is not None and breach.figure == "length_ratio" and breach.threshold == 0.25
    assert breach.step == 27 and breach.value == pytest.approx(22 / 120)


def test_kl_runaway_trips():
    steps = [healthy(s) for s in range(1, 21)] + [healthy(s, **{"actor/kl_loss": 5.0}) for s in range(21, 41)]
    breach = run(steps)
    assert breach is not None and breach.figure == "kl" and breach.step == 22  # (6*0.01 + 2*5)/8 = 1.26 > 1
    line = breach.line("kept checkpoint step_20")
    assert "\n" not in line and line.startswith("training health gate: kl 1.25")
    assert " breaches 1 at step 22 (mean actor/kl_loss over the last 8 steps)" in line
    assert line.endswith("kept checkpoint step_20")


def test_disabled_gate_never_trips():
    steps = [healthy(s, **{"actor/kl_loss": 5.0, ZERO_VARIANCE_METRIC: 1.0}) for s in range(1, 41)]
    assert run(steps) is not None
    assert run(steps, HealthConfig(enabled=False)) is None


# ------------------------------------------------------------------------------------------------ run length


def test_grace_and_window_scale_with_the_run_s_total_steps():
    assert CFG.schedule(12) == (3, 4)  # first judged at step 7
    assert CFG.schedule(8) == (2, 3)  # min_steps: the shortest run judged, first at step 5
    assert CFG.schedule(40) == (10, 8) == CFG.schedule(1000)  # the caps
    assert CFG.schedule(7) is None and CFG.schedule(2) is None
    assert CFG.model_copy(update={"enabled": False}).schedule(40) is None


def test_a_12_step_run_is_judged_and_the_default_profile_s_2_step_run_never_is():
    """The default profile (params.yaml, train.steps 2) is never stopped, whatever its figures; a 12-step run is
    judged from step 7 (grace 3, window 4)."""
    default = load_params(REPO_ROOT / "params.yaml").train
    assert default.steps == 2
    awful = {"actor/kl_loss": 5.0, ZERO_VARIANCE_METRIC: 1.0, "response_length/agent_tokens_mean": 1.0}
    assert run([healthy(s, **awful) for s in range(1, default.steps + 1)], default.health) is None
    assert run([healthy(s, **awful) for s in range(1, 8)], default.health) is None  # 7 < min_steps 8
    eight = run([healthy(s, **awful) for s in range(1, 9)], default.health)
    assert (eight.figure, eight.step) == ("zero_variance_share", 5)  # grace 2, window 3
    steps = [healthy(s) for s in range(1, 7)] + [healthy(s, **{"actor/kl_loss": 5.0}) for s in range(7, 13)]
    breach = run(steps, default.health)
    assert breach is not None and (breach.figure, breach.step) == ("kl", 7)
    assert breach.value == pytest.approx((3 * 0.01 + 5.0) / 4)  # steps 4-7
    assert breach.line("kept").endswith("at step 7 (mean actor/kl_loss over the last 4 steps); training stopped, kept")


def recorded(name: str) -> list[tuple[int, dict[str, float]]]:
    """A recorded run's steps.csv (tests/fixtures/health_runs) as (step, metrics) pairs."""
    frame = pd.read_csv(RECORDED / name)
    return [(int(r.pop("step")), r) for r in frame.to_dict("records")]


def first_breach(rows: list[tuple[int, dict[str, float]]], cfg: HealthConfig):
    """Judge each prefix of a run of len(rows) steps, as the local loop does after every step."""
    return next((b for end in range(1, len(rows) + 1)
                 if (b := judge(rows[:end], cfg, LOCAL_METRICS, len(rows))) is not None), None)


def test_learn_thresholds_stop_the_recorded_collapse_by_step_10_and_no_healthy_run():
    """The learn profile's 12-step terse runs: seed 2 ran away from its reference (per-step KL 0.74 at step 9,
    0.88 at step 10; held-out F1 6.2 -> 0.0) and is stopped at step 9 (window of steps 6-9); seeds 1 and 3 and
    the question-mode seed, all healthy, run to the end."""
    learn = load_params(REPO_ROOT / "params.yaml", {"profile": "learn"}).train
    assert learn.steps == 12 and learn.health.max_kl == 0.35
    seed2 = recorded("terse_seed2.csv")
    assert len(seed2) == 12 and seed2[9][1]["actor/kl_loss"] > 0.5
    breach = first_breach(seed2, learn.health)
    assert breach is not None and breach.figure == "kl" and breach.step == 9  # at or before step 10
    assert breach.value == pytest.approx(sum(m["actor/kl_loss"] for s, m in seed2 if 6 <= s <= 9) / 4)
    for name in ("terse_seed1.csv", "terse_seed3.csv", "question_seed1.csv"):
        rows = recorded(name)
        assert len(rows) == 12 and first_breach(rows, learn.health) is None, name
    # the check can fail: the default max_kl (1.0) lets seed 2 run to the end, and a threshold at healthy
    # seed 1's level (window mean 0.25 at step 12) stops seed 1 too
    assert first_breach(seed2, CFG) is None
    touchy = first_breach(recorded("terse_seed1.csv"), learn.health.model_copy(update={"max_kl": 0.2}))
    assert (touchy.figure, touchy.step) == ("kl", 11)


def test_recorded_default_profile_runs_are_never_judged():
    """The default profile trains 2 steps, fewer than `min_steps`: the gate has nothing to judge."""
    for csv in sorted(RESULTS.glob("*train_steps*.csv")):
        frame = pd.read_csv(csv)
        steps = [(int(r.pop("step")), r) for r in frame.to_dict("records")]
        assert judge(steps, CFG, LOCAL_METRICS, len(steps)) is None, csv.name


def test_recorded_40_step_question_run_trips_neither_the_defaults_nor_the_learn_thresholds():
    """The learn profile's 40 GRPO steps in the question mode (held-out F1 42 -> 80; the steps of
    benchmarks/results/learning/previous_question_mode.json, tests/fixtures/health_runs/question_40_steps.json):
    its early flat steps included, against the defaults and the learn profile's thresholds. The record has each step's answer and format reward; its zero-variance share is bounded
    from the reward's CI: a step whose 8 trajectories all scored the same (CI of width 0) has both groups flat
    (1.0); otherwise we take 0.5, what one flat group of two gives (a spread step's groups are rarely both
    flat: they would have to be uniform at different values)."""
    steps = json.loads((RECORDED / "question_40_steps.json").read_text())["steps"]
    assert len(steps) == 40
    rows = []
    for s in steps:
        low, high = s["reward_ci95"]
        rows.append((s["step"], {ZERO_VARIANCE_METRIC: 1.0 if low == high else 0.5,
                                 "reward/answer/mean": s["reward_parts"]["answer"],
                                 "reward/format/mean": s["reward_parts"]["format"]}))
    assert sum(1 for _, m in rows if m[ZERO_VARIANCE_METRIC] == 1.0) == 6  # steps 2, 15, 17, 20, 21, 38
    learn = load_params(REPO_ROOT / "params.yaml", {"profile": "learn"}).train.health
    for end in range(1, 41):
        assert judge(rows[:end], CFG, LOCAL_METRICS, 40) is None, rows[end - 1][0]
        assert judge(rows[:end], learn, LOCAL_METRICS, 40) is None, rows[end - 1][0]
    # the check can fail: a stricter share (0.7) trips on the stretch of flat steps 15-21, and the answer rule
    # at 0.15 on the answer dip around it (0.215 -> 0.054 while the format rose 0.877 -> 0.967)
    def first_breach(cfg: HealthConfig):
        return next(b for end in range(1, 41) if (b := judge(rows[:end], cfg, LOCAL_METRICS, 40)) is not None)

    assert first_breach(CFG.model_copy(update={"max_zero_variance_share": 0.7})).figure == "zero_variance_share"
    touchy = first_breach(CFG.model_copy(update={"max_answer_drop": 0.15}))
    assert (touchy.figure, touchy.step) == ("answer_drop", 20)


def test_a_resumed_run_judges_with_its_history():
    """The local loop seeds the gate with steps.csv's rows: a resume at step 20 judges the same windows."""
    steps = [healthy(s) for s in range(1, 21)] + [healthy(s, **{"actor/kl_loss": 5.0}) for s in range(21, 41)]
    gate = HealthGate(CFG, LOCAL_METRICS, 40, [(s, m) for s, m in enumerate(steps[:20], start=1)])
    assert gate.observe(21, steps[20]) is None
    assert gate.observe(22, steps[21]).step == 22


# ------------------------------------------------------------------------------------------------ verl

VERL_LINE = ("(TaskRunner pid=52731) step:{step} - global_seqlen/mean:9043.0 - actor/pg_loss:np.float64(-0.0123) - "
             "actor/kl_loss:{kl} - actor/kl_coef:0.001 - actor/grad_norm:np.float64(0.41) - actor/lr:1e-06 - "
             "training/global_step:{step} - training/epoch:0 - critic/score/mean:0.41 - critic/score/max:1.55 - "
             "critic/score/min:-1.5 - critic/advantages/mean:np.float64(-2.1e-09) - response_length/mean:{length} - "
             "response_length/max:2048.0 - response_length/clip_ratio:0.0 - prompt_length/mean:412.5 - "
             "num_turns/mean:5.2 - timing_s/gen:95.43 - perf/throughput:1532.7 - val-core/hotpotqa/reward/mean@1:nan")


def verl_line(step: int, kl: float = 0.004, length: float = 780.5) -> str:
    return VERL_LINE.format(step=step, kl=kl, length=length)


def test_verl_step_line_is_parsed_with_its_names():
    step, metrics = parse_step_line(verl_line(7, kl=0.0042))
    assert step == 7 and metrics[VERL_METRICS.kl] == 0.0042 and metrics[VERL_METRICS.length] == 780.5
    assert metrics["actor/pg_loss"] == -0.0123 and metrics["actor/grad_norm"] == 0.41  # numpy 2 reprs
    assert metrics["critic/advantages/mean"] == -2.1e-09 and metrics["actor/lr"] == 1e-06
    assert metrics["training/global_step"] == 7.0
    assert str(metrics["val-core/hotpotqa/reward/mean@1"]) == "nan"
    assert parse_step_line("(TaskRunner pid=1) Training Progress:  10%|#  | 7/70") is None


def dump_rows(step: int, flat: bool, answer: float = 0.3, fmt: float = 1.2) -> list[dict]:
    """verl's `<step>.jsonl` rows for 2 questions x G=5 (ray_trainer._write_generations + our reward parts)."""
    rows = []
    for q in range(2):
        for g in range(5):
            score = 0.5 if flat else 0.1 * g
            rows.append({"input": f"system ... question {q}", "output": "<think>...", "gts": ["x"], "score": score,
                         "step": step, "answer": answer, "format": fmt, "gated": 1.0})
    return rows


def test_verl_rollout_dump_gives_the_group_figures():
    figures = rollout_figures(dump_rows(3, flat=True, answer=0.25, fmt=1.1))
    assert figures == {ZERO_VARIANCE_METRIC: 1.0, "reward/answer/mean": 0.25, "reward/format/mean": 1.1}
    assert rollout_figures(dump_rows(3, flat=False))[ZERO_VARIANCE_METRIC] == 0.0
    assert rollout_figures([]) == {}


def feed_verl(tmp_path: Path, flat_from: int, steps: int = 30, kl_from: int = 10**9):
    """Lines as verl prints them: the dump line before or after its step line (a background thread writes it)."""
    dump_dir = tmp_path / "verl_rollouts"
    dump_dir.mkdir(exist_ok=True)
    watch = VerlHealthWatch(CFG, dump_dir, 40)
    for step in range(1, steps + 1):
        path = dump_dir / f"{step}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in dump_rows(step, flat=step >= flat_from)) + "\n")
        dump = f"(TaskRunner pid=52731) Dumped generations to {path}"
        step_line = verl_line(step, kl=5.0 if step >= kl_from else 0.004)
        for line in ((dump, step_line) if step % 2 else (step_line, dump)):
            watch(line)


def test_verl_watch_trips_on_dumped_flat_groups_and_on_kl(tmp_path):
    feed_verl(tmp_path, flat_from=10**9)  # healthy: no exception
    with pytest.raises(BreachSeen) as seen:
        feed_verl(tmp_path, flat_from=11)
    assert seen.value.breach.figure == "zero_variance_share" and seen.value.breach.step == 18
    with pytest.raises(BreachSeen) as seen:
        feed_verl(tmp_path, flat_from=10**9, kl_from=21)
    assert seen.value.breach.figure == "kl" and seen.value.breach.step == 22


@pytest.mark.slow
def test_verl_s_own_line_and_dump_writers_feed_the_watch(tmp_path, capsys):
    """verl 0.9.1's console logger (`concat_dict_to_str`) and rollout dump writer (`_write_generations`, which
    prints the dump line) produce what the watch reads: the format assumptions pinned to verl's code (slow only
    because importing verl's trainer takes ~30-50 s here)."""
    import numpy as np
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.logger.aggregate_logger import concat_dict_to_str

    watch = VerlHealthWatch(CFG, tmp_path, 40)
    for step in range(1, 19):
        flat = step > 10
        scores = [0.5] * 10 if flat else [0.1 * g for g in range(5)] * 2
        extra = {"score": scores, "answer": [0.3] * 10, "format": [1.2] * 10, "gated": [1.0] * 10}
        RayPPOTrainer._write_generations([f"question {i // 5}" for i in range(10)], ["<think>"] * 10, [["x"]] * 10,
                                         scores, extra, str(tmp_path), step)
        metrics = {"training/global_step": step, "critic/score/mean": np.float32(np.mean(scores)),
                   "actor/kl_loss": np.float64(0.004), "response_length/mean": np.float64(700.0)}
        lines = capsys.readouterr().out.splitlines() + [concat_dict_to_str(metrics, step=step)]
        assert any(line.startswith("Dumped generations to ") for line in lines)
        if step == 18:
            with pytest.raises(BreachSeen) as seen:
                for line in lines:
                    watch(f"(TaskRunner pid=7) {line}")
            assert seen.value.breach.figure == "zero_variance_share" and seen.value.breach.step == 18
        else:
            for line in lines:
                watch(f"(TaskRunner pid=7) {line}")
    assert watch.gate.steps[-1][1]["actor/kl_loss"] == 0.004
    assert watch.gate.steps[-1][1]["reward/format/mean"] == 1.2


def test_verl_watch_scales_with_the_total_verl_prints():
    """The recorded collapse (terse seed 2) as verl's step lines: judged over verl's own total (its `Total
    training steps: 12` line), not the composed estimate the watch starts from."""
    learn = load_params(REPO_ROOT / "params.yaml", {"profile": "learn"}).train.health
    lines = [verl_line(step, kl=m["actor/kl_loss"], length=m["response_length/mean"])
             for step, m in recorded("terse_seed2.csv")]
    estimate = VerlHealthWatch(learn, None, 1000)  # a 1000-step run: grace 10, window 8, nothing judged by 12
    for line in lines:
        estimate(line)
    watch = VerlHealthWatch(learn, None, 1000)
    watch("(TaskRunner pid=52731) Total training steps: 12")
    assert watch.gate.total_steps == 12
    with pytest.raises(BreachSeen) as seen:
        for line in lines:
            watch(line)
    assert seen.value.breach.figure == "kl" and seen.value.breach.step == 9


def test_verl_total_is_counted_as_verl_counts_it(tmp_path):
    """verl 0.9.1 trains len(dataloader) x total_epochs steps (full batches of data.train_batch_size), or
    trainer.total_training_steps when set: computed on the composed config and the training set's rows."""
    from helpers import QUESTIONS, write_train_parquet

    from pipeline.errors import DataError
    from pipeline.train.verl.config import compose_plan
    from pipeline.train.verl.schedule import schedule_from_config, verl_schedule

    def planned_total_steps(plan):  # the total the launch gives the gate and the resume check
        return verl_schedule(plan).total_steps

    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "models").mkdir()
    write_train_parquet(tmp_path / "data" / "rl" / "train.parquet", QUESTIONS * 5)  # 30 rows

    def plan(**train):
        overrides = {"agent": {"model": str(tmp_path / "models")},
                     "train": {"backend": "verl", "batch_size": 4, **train}}
        return TrainPlan.from_params(load_params(tmp_path / "params.yaml", overrides))

    assert planned_total_steps(plan()) == 7  # 30 // 4, the last 2 rows dropped
    assert planned_total_steps(plan(total_epochs=3)) == 21
    assert schedule_from_config(compose_plan(plan()).value, 10).total_steps == 2
    fixed = plan(verl={"extra_overrides": ["trainer.total_training_steps=5"]})
    assert planned_total_steps(fixed) == 5
    # a run with no total judges nothing; a training set that gives verl no step is refused before launch
    assert CFG.schedule(0) is None
    write_train_parquet(tmp_path / "data" / "rl" / "train.parquet", QUESTIONS[:2])
    with pytest.raises(DataError, match="no training step"):
        planned_total_steps(plan())


def test_verl_watch_judges_a_step_without_its_dump_when_the_next_step_arrives(tmp_path):
    watch = VerlHealthWatch(CFG, tmp_path / "never_written", 40)
    for step in range(1, 19):
        watch(verl_line(step, kl=5.0 if step >= 17 else 0.004))  # no dump lines at all
    assert watch.judged == set(range(1, 18)) and list(watch.pending) == [18]
    with pytest.raises(BreachSeen) as seen:  # step 18: (6*0.004 + 2*5)/8 = 1.25 > 1, judged when 19 arrives
        watch(verl_line(19, kl=5.0))
    assert seen.value.breach.step == 18 and seen.value.breach.figure == "kl"
    ignored = VerlHealthWatch(CFG.model_copy(update={"enabled": False}), None, 40)
    for step in range(1, 30):
        ignored(verl_line(step, kl=5.0))
    assert ignored.judged == set()


def test_stream_stops_the_process_group_on_a_breach(tmp_path):
    """A real child printing verl's step lines: the watch raises inside the stream loop, the child is killed."""
    from pipeline.train.verl.backend import _stream

    script = tmp_path / "fake_verl.py"
    script.write_text("import sys, time\nline = sys.argv[1]\n"
                      "for step in range(1, 100):\n"
                      "    print(line.replace('STEP', str(step)), flush=True)\n    time.sleep(0.02)\n"
                      "time.sleep(60)\n")
    template = VERL_LINE.format(step="STEP", kl=5.0, length=700.0)
    watch = VerlHealthWatch(CFG, None, 99)
    t0 = time.monotonic()
    with pytest.raises(BreachSeen) as seen:
        _stream([sys.executable, str(script), template], env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path,
                log_file=tmp_path / "verl.log", on_line=watch)
    assert seen.value.breach.step == 18 and time.monotonic() - t0 < 30
    assert "step:18 -" in (tmp_path / "verl.log").read_text()


def test_verl_checkpoints_of_the_breaching_step_are_set_aside(tmp_path):
    from pipeline.train.checkpoint import latest_verl_step, set_aside_verl_steps

    for step in (10, 20, 30):
        (tmp_path / f"global_step_{step}" / "actor").mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30")
    kept = set_aside_verl_steps(tmp_path, 20)
    assert kept == tmp_path / "global_step_10" / "actor" == latest_verl_step(tmp_path)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "breached-global_step_20", "breached-global_step_30", "global_step_10"]
    assert set_aside_verl_steps(tmp_path, 1) is None and latest_verl_step(tmp_path) is None
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()


def test_verl_overrides_dump_rollouts_only_with_the_gate(tmp_path):
    from pipeline.train.verl.overrides import build_overrides

    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "models").mkdir()
    overrides = {"agent": {"model": str(tmp_path / "models")}, "train": {"backend": "verl"}}
    on = build_overrides(TrainPlan.from_params(load_params(tmp_path / "params.yaml", overrides)))
    dump = f"trainer.rollout_data_dir='{tmp_path.resolve()}/.cache/verl_rollouts'"
    assert dump in on
    off = build_overrides(TrainPlan.from_params(load_params(tmp_path / "params.yaml", {**overrides, "train": {
        "backend": "verl", "health": {"enabled": False}}})))
    assert not any(o.startswith("trainer.rollout_data_dir") for o in off)


# ------------------------------------------------------------------------------------------------ register


def test_register_refuses_a_train_run_the_gate_stopped(tmp_path, repo_root, monkeypatch):
    import mlflow

    from pipeline.errors import UserError
    from pipeline.stages.register import check_training_health, run_register
    from pipeline.tracking.runs import HEALTH_BREACH_TAG, configure, stage_run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(repo_root / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "agent").mkdir()
    params = load_params(tmp_path / "params.yaml", {"paths": {"model_dir": str(tmp_path / "agent")}})
    metrics = {"mode": "ours", "rows_per_dataset": 4, "averages": {"prompt_r1": {
        "id": {m: {"mean": 30.0, "low": 29.0, "high": 31.0} for m in ("em", "f1", "ssim")},
        "ood": {m: {"mean": 40.0, "low": 39.0, "high": 41.0} for m in ("em", "f1", "ssim")}}}}
    (tmp_path / "reports" / "eval").mkdir(parents=True)
    (tmp_path / "reports" / "eval" / "metrics.json").write_text(json.dumps(metrics))

    with pytest.raises(RuntimeError), stage_run(tracking_spec(params), "train", new_parent=True):
        mlflow.set_tags({HEALTH_BREACH_TAG: "kl", "health.breach_step": "22"})
        raise RuntimeError("stopped")
    with pytest.raises(UserError, match=r"stopped by the training health gate \(health.breach=kl at step 22\)"):
        run_register(params)
    configure(tracking_spec(params))
    assert mlflow.MlflowClient().search_registered_models() == []
    assert not (tmp_path / "reports" / "promotion.json").exists()
    # a later, healthy train run under the same parent (a rerun continues it) is not refused
    time.sleep(0.05)
    with stage_run(tracking_spec(params), "train"):
        pass
    check_training_health(tracking_spec(params))


def test_the_flow_does_not_retry_a_stage_the_health_gate_stopped():
    """flows/retrain.py retries train once (it resumes); after a breach it must not: same weights, same breach."""
    from prefect.states import Failed

    from flows.dvc_steps import StageFailed
    from flows.policies import retry_unless_unhealthy

    breach = StageFailed("train", 1, "error: training health gate: kl 2.1 breaches 1 at step 14 (...)")
    crash = StageFailed("train", 1, "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert retry_unless_unhealthy(None, None, Failed(data=breach)) is False
    assert retry_unless_unhealthy(None, None, Failed(data=crash)) is True


def recorded_hops(seed: int) -> list[tuple[int, dict[str, float]]]:
    """The recorded `hops` seed's steps.csv (benchmarks/results/learning/hops/seed<N>, lr 1e-4, 12 planned steps)."""
    frame = pd.read_csv(RESULTS / "learning" / "hops" / f"seed{seed}" / "steps.csv")
    return [(int(r.pop("step")), r) for r in frame.to_dict("records")]


def first_breach_of(rows: list[tuple[int, dict[str, float]]], cfg: HealthConfig, total: int):
    return next((b for end in range(1, len(rows) + 1)
                 if (b := judge(rows[:end], cfg, LOCAL_METRICS, total)) is not None), None)


def test_the_recorded_hops_collapses_stop_at_the_first_judged_step_and_the_healthy_runs_run_on():
    """Seeds 1 and 3 of the recorded hops run earned answer reward at steps 1-2, then switched to a behaviour
    that never answers right (seed 1: one request then nothing; seed 3: requests until the turn limit) and
    stayed there; the gate stops both at step 7, its first judged step of 12 (grace 3, window 4). The healthy
    recorded runs (question seed 1, terse seeds 1 and 3) are not stopped."""
    learn = load_params(REPO_ROOT / "params.yaml", {"profile": "learn"}).train.health
    for seed in (1, 3):
        breach = first_breach_of(recorded_hops(seed), learn, 12)
        assert breach is not None and (breach.figure, breach.step) == ("answer_vanished", 7), seed
    for name in ("question_seed1.csv", "terse_seed1.csv", "terse_seed3.csv"):
        assert first_breach_of(recorded(name), learn, 12) is None, name
    # the check can fail: without the two behaviour rules seed 1 is stopped only at step 11 by its KL (as it
    # was recorded), and seed 3's switch is seen by the stop-reason rule alone (answer share 0.667 over steps
    # 1-3 -> 0 over steps 4-7)
    old = learn.model_copy(update={"answer_vanished": False, "max_stop_shift": 1.0})
    late = first_breach_of(recorded_hops(1), old, 12)
    assert (late.figure, late.step) == ("kl", 11)
    shift = first_breach_of(recorded_hops(3), learn.model_copy(update={"answer_vanished": False}), 12)
    assert (shift.figure, shift.step) == ("stop_shift", 7) and shift.value == pytest.approx(2 / 3)
    assert "rollout/stop_answer 0.667 -> 0.000" in shift.detail


def test_a_stop_reason_switch_trips_and_a_drift_does_not():
    """One stop reason's window mean moving by more than `max_stop_shift` (0.5) from the window before trips;
    a 0.375 move does not; an answer reward that stays above 0 never trips `answer_vanished`."""
    def steps(late_share: float) -> list[dict[str, float]]:
        return [healthy(s, **{"rollout/stop_answer": 1.0 if s <= 6 else late_share,
                              "rollout/stop_max_turns": 0.0 if s <= 6 else 1 - late_share}) for s in range(1, 13)]

    breach = run(steps(0.0))
    assert breach is not None and breach.figure == "stop_shift" and breach.value > 0.5
    assert run(steps(0.625)) is None
    vanished = run([healthy(s, **{"reward/answer/mean": 0.3 if s <= 3 else 0.0}) for s in range(1, 13)])
    assert vanished is not None and (vanished.figure, vanished.step) == ("answer_vanished", 7)
    never = run([healthy(s, **{"reward/answer/mean": 0.0}) for s in range(1, 13)])
    assert never is None  # no earlier step earned an answer: nothing vanished
