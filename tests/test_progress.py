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


def test_a_quiet_phase_gets_a_heartbeat_line_every_interval_and_a_reporting_one_none(monkeypatch, caplog):
    """A slow stand-in phase that logs nothing (a model loading) gets `<stage>: still running, N s` lines at the
    interval; a phase whose bar already logs within the interval gets none added."""
    import logging
    import time

    from pipeline.progress import heartbeat, progress

    monkeypatch.setenv("PROMPTR1_PROGRESS", "log")
    caplog.set_level(logging.INFO, logger="pipeline.progress")
    with heartbeat("evaluate", interval_s=0.4, poll_s=0.05):
        time.sleep(1.5)  # silent for 1.5 s
    beats = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert 3 <= len(beats) <= 4 and beats[0].startswith("evaluate: still running, 0 s")
    caplog.clear()
    with heartbeat("train", interval_s=0.4, poll_s=0.05), progress(total=30, desc="GRPO", unit="step",
                                                                     interval_s=0.1) as bar:
        for _ in range(15):
            time.sleep(0.1)
            bar.update(1)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("GRPO: ") for m in messages)
    assert not [m for m in messages if "still running" in m]  # the bar reported: no heartbeat needed


def test_no_heartbeat_on_a_terminal_or_when_progress_is_off(monkeypatch, caplog):
    import logging
    import time

    from pipeline.progress import heartbeat

    caplog.set_level(logging.INFO, logger="pipeline.progress")
    for mode in ("bar", "off"):
        monkeypatch.setenv("PROMPTR1_PROGRESS", mode)
        with heartbeat("evaluate", interval_s=0.1, poll_s=0.02):
            time.sleep(0.4)
    assert not [r for r in caplog.records if "still running" in r.getMessage()]
