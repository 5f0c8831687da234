"""A one-off real-browser look at what the pipeline writes into MLflow: the Traces tab sorted by an assessment,
the Prompt Registry page and the LoggedModel page, as screenshots under benchmarks/results/ui/.

    apt-get install chromium && pip install playwright      # not part of the project's install or the suite
    python benchmarks/ui_screenshots.py [--out benchmarks/results/ui]

A fresh SQLite store (in a temporary folder) is filled through the pipeline's own code, on the figures of a
recorded default-profile evaluation (benchmarks/results/pipeline_avx512_final_eval_metrics.json):
- 12 conversations as the evaluate stage traces them (`pipeline.tracking.traces.log_trajectory_trace`, with
  the assessments `f1`, `em`, `format` and the environment's token usage), one system's answers per row;
- GEPA's instruction registered as the gepa stage does (`pipeline.tracking.prompts.register_instruction`),
  twice with different texts, so the page shows two versions and the `production` alias;
- a logged model described as the register stage does (`pipeline.tracking.model_record`), with the
  params.yaml `agent` and `train` sections and the recorded per-set metrics.
Then `mlflow ui` serves the store and headless Chromium (Debian's, driven by Playwright) opens each page,
sorts the Traces tab by its `f1` column where that column offers a sort (MLflow 3.17.2's table sorts by Time
only: `pages.json` records which columns offer one), and saves the screenshots with a `pages.json` of what it
opened. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECORDED = ROOT / "benchmarks" / "results" / "pipeline_avx512_final_eval_metrics.json"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fill_store(uri: str, folder: Path) -> dict[str, str]:
    """The store's content (module docstring); returns the ids the pages need."""
    import mlflow
    import pandas as pd

    from pipeline.config import load_params
    from pipeline.tracking.model_record import describe_logged_model, model_params
    from pipeline.tracking.prompts import register_instruction
    from pipeline.tracking.traces import flush_traces, log_trajectory_trace

    mlflow.set_tracking_uri(uri)
    experiment = mlflow.set_experiment("prompt-r1-ui-check").experiment_id
    evaluation = json.loads(RECORDED.read_text())
    params = load_params(ROOT / "params.yaml")
    with mlflow.start_run(run_name="gepa"):
        register_instruction("Answer the question.", kept_seed=True)
        register_instruction("Answer with the name only, no sentence.", kept_seed=False)
    with mlflow.start_run(run_name="evaluate") as run:
        for row in range(12):
            f1 = [1.0, 0.0, 0.5, 0.25][row % 4]
            turns = [{"text": "<think>ask</think><interaction_prompt>Who directed X?</interaction_prompt>",
                      "interaction_prompt": "Who directed X?", "agent_tokens": 14, "generation_s": 0.8,
                      "started_s": 0.0, "complete_final": False,
                      "environment": {"text": f"X was directed by Director {row}.", "prompt_tokens": 120 + row,
                                      "completion_tokens": 9, "latency_s": 0.4, "cost_usd": 0.0},
                      "env_wait_s": 0.4},
                     {"text": f"<think>so</think><answer>Director {row}</answer>", "answer": f"Director {row}",
                      "agent_tokens": 9, "generation_s": 0.5, "started_s": 1.3, "complete_final": True}]
            log_trajectory_trace(name=f"prompt_r1 · hotpotqa #{row}",
                                 tags={"stage": "evaluate", "system": "prompt_r1", "dataset": "hotpotqa", "row": row},
                                 question=f"Who directed film {row}?", gold_answers=[f"Director {row}"], turns=turns,
                                 prediction=f"Director {row}", scores={"f1": f1}, stop_reason="answer",
                                 assessments={"f1": f1, "em": float(f1 == 1.0), "format": 1.0})
        flush_traces()
        files = {}
        for name in evaluation["per_dataset"]:  # a stand-in file per evaluation set: its rows' digest
            files[name] = folder / f"{name}.parquet"
            pd.DataFrame({"question": [f"{name} question {i}" for i in range(4)]}).to_parquet(files[name])
        model = mlflow.create_external_model(name="agent")
        describe_logged_model(model.model_id, model_params({"agent": params.agent.model_dump(mode="json"),
                                                            "train": params.train.model_dump(mode="json")}),
                              evaluation, files)
    return {"experiment": experiment, "run": run.info.run_id, "model": model.model_id}


def serve(uri: str, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    import urllib.request

    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"mlflow ui did not answer on port {port}: see {log}")


def shoot(base: str, ids: dict[str, str], out: Path) -> list[dict[str, str]]:
    """Open each page in headless Chromium and save its screenshot; the Traces tab sorted by `f1`."""
    from playwright.sync_api import sync_playwright

    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    pages = [("traces.png", f"{base}/#/experiments/{ids['experiment']}/traces", "f1",
              "prompt_r1 · hotpotqa"),
             ("prompt_registry.png", f"{base}/#/prompts/prompt-r1-environment-instruction", None, "production"),
             ("logged_model.png", f"{base}/#/experiments/{ids['experiment']}/models/{ids['model']}", None,
              "train.lr")]
    shot = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 2200, "height": 1000})
        for name, url, sort_by, shown in pages:
            page.goto(url)
            try:
                page.get_by_text(shown).first.wait_for(timeout=90_000)  # the page's own content has loaded
                loaded = True
            except Exception:  # noqa: BLE001 - the screenshot shows what the page shows instead
                loaded = False
            page.wait_for_timeout(2000)
            for name_ in ("Got it", "Close"):  # a feature tip, the assistant side panel
                button = page.get_by_role("button", name=name_)
                if button.count():
                    button.first.click(timeout=5000)
            page.wait_for_timeout(1500)
            clicked = False
            sortable: list[str] = []
            if sort_by:  # which columns offer a sort button (MLflow 3.17.2: Time only)
                sortable = page.evaluate("""() => Array.from(document.querySelectorAll('[role=columnheader]'))
                    .filter(h => h.querySelector('[aria-label="Sort"]')).map(h => h.innerText.trim())""")
                header = page.locator("[role=columnheader]").filter(has_text=sort_by).first
                button = header.locator('[aria-label="Sort"]')
                if button.count():
                    button.first.click()
                    page.wait_for_timeout(2500)
                    clicked = True
            page.screenshot(path=str(out / name), full_page=False)
            shot.append({"file": name, "url": url.replace(base, "<mlflow ui>"),
                         "sorted_by": sort_by if clicked else None, "sortable_columns": sortable,
                         "found": shown if loaded else None,
                         "title": page.title()})
        browser.close()
    return shot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ui")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        ids = fill_store(uri, Path(tmp))
        port = free_port()
        proc = serve(uri, port, Path(tmp) / "ui.log")
        try:
            shot = shoot(f"http://127.0.0.1:{port}", ids, args.out)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
    import mlflow

    record = {"command": "python benchmarks/ui_screenshots.py", "mlflow": mlflow.__version__, "pages": shot}
    (args.out / "pages.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
