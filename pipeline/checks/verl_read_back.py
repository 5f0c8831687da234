"""What the verl stage reads back from verl is kept as it reads it: overrides that would silence or change it
are refused by the layout check (`pipeline.checks.layout`, which wraps each problem into a LayoutProblem).

What is read back, and so what is judged:
- verl's console logger, whose step lines the watchdog, the resume check and the health gate read
  (`trainer.logger` without `console` prints none: verl/utils/tracking.py adds the console logger only for
  it), and its MLflow logger, which steps.csv is exported from (`REQUIRED_LOGGERS`);
- resuming as the resume check assumes (`READ_BACK_VALUES`: `trainer.resume_mode=auto`, no
  `resume_from_path`, the checkpoint kept after its load, the marker written after each save, which
  `actor.checkpoint.async_save` skips: ray_trainer.py `_save_checkpoint`);
- the Ray verl joins, which `train.verl.ray_address` decides (`pipeline.train.verl.overrides.ray_overrides`),
  not `ray_kwargs.ray_init.address`.
"""

from __future__ import annotations

from typing import Any

from pipeline.train.verl.config import EXTRA_OVERRIDES, VerlRun
from pipeline.train.verl.overrides import RAY_INIT_ADDRESS

READ_BACK_VALUES: dict[str, tuple[Any, str]] = {
    "trainer.resume_mode": (
        "auto", ("the resume check holds a launch to the checkpoint verl's `auto` mode resumes from (verl's "
                 "marker) and reads its fit-start line, which `disable` does not print")),
    "trainer.resume_from_path": (
        None, "verl would resume from that folder, not from the marker the resume check and the watchdog read"),
    "trainer.del_local_ckpt_after_load": (
        False, ("verl would delete the checkpoint it resumed from, the one a stopped restart is pointed back at "
                "and `promptr1 merge` reads")),
    "actor_rollout_ref.actor.checkpoint.async_save": (
        False, ("verl then skips latest_checkpointed_iteration.txt after a save (ray_trainer.py _save_checkpoint), "
                "the marker the next launch resumes from and the resume check reads (verl issue 7952)")),
}
"""verl keys whose value the stage's resume check assumes, and why another value is refused."""
REQUIRED_LOGGERS = {
    "console": "the step lines the watchdog, the resume check and the health gate read (without it the watchdog "
               "stops a healthy run: verl/utils/tracking.py adds the console logger only for 'console')",
    "mlflow": "the per-step metrics reports/train/steps.csv is exported from",
}
"""verl loggers the stage reads from, and what it reads."""


def read_back_problems(run: VerlRun) -> list[tuple[tuple[str, ...], str]]:
    """(the param keys that decide it, what is wrong) for each override that would silence or change what
    the stage reads back from verl (module docstring)."""
    problems: list[tuple[tuple[str, ...], str]] = []
    logger = run.value("trainer.logger")
    loggers = [logger] if isinstance(logger, str) else list(logger or [])
    for name, why in REQUIRED_LOGGERS.items():
        if name not in loggers:
            problems.append((run.ours("trainer.logger") or (EXTRA_OVERRIDES,),
                             f"trainer.logger={loggers} leaves out '{name}': {why}"))
    for key, (expected, why) in READ_BACK_VALUES.items():
        value = run.value(key)
        if value != expected:
            problems.append((run.ours(key) or (EXTRA_OVERRIDES,),
                             f"{key}={value!r} is refused (the stage needs {expected!r}): {why}"))
    if RAY_INIT_ADDRESS in run.overridden:
        problems.append(((EXTRA_OVERRIDES, "train.verl.ray_address"),
                         (f"{RAY_INIT_ADDRESS} is set by train.verl.ray_address ('' for a private Ray, "
                          "started with address 'local'), whose value the stage's Ray probe uses")))
    return problems
