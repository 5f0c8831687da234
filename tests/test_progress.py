"""pipeline.progress: a bar on a terminal, periodic one-line log records in a pipe."""

from __future__ import annotations

import logging

import pytest

from pipeline.progress import LogProgress, progress


def test_in_a_pipe_progress_logs_lines_not_a_bar(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PROMPTR1_PROGRESS", raising=False)
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    bar = progress(total=4, desc="evaluate prompt_r1", unit="q", interval_s=0.0)  # pytest's stderr is no tty
    assert isinstance(bar, LogProgress)
    with bar:
        bar.update(2)
        bar.set_postfix(reward="0.50")
        bar.update(2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("evaluate prompt_r1: 2/4 q (50%)")
    assert lines[1].startswith("evaluate prompt_r1: 4/4 q (100%)") and lines[1].endswith("reward=0.50")
    assert len(lines) == 2  # one line per update; close adds none when nothing changed since the last line
    bar.close()
    assert len(caplog.records) == 2


def test_log_progress_waits_for_its_interval_and_reports_once_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    out = list(LogProgress(range(100), desc="GRPO", unit="step", interval_s=3600))
    assert out == list(range(100))
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["GRPO: 100/100 step (100%)"]


def test_quiet_bars_are_silent_in_a_pipe_and_the_mode_can_be_forced(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    monkeypatch.delenv("PROMPTR1_PROGRESS", raising=False)
    with progress(total=3, desc="rollout", quiet=True, interval_s=0.0) as bar:
        bar.update(3)
    monkeypatch.setenv("PROMPTR1_PROGRESS", "off")
    with progress(total=3, desc="evaluate", interval_s=0.0) as bar:
        bar.update(3)
    assert caplog.records == []
    monkeypatch.setenv("PROMPTR1_PROGRESS", "bar")
    from tqdm.auto import tqdm

    bar = progress(total=3, desc="evaluate")
    assert isinstance(bar, tqdm)
    bar.close()
