"""`promptr1 doctor`: a node's first five minutes as one command, before anyone pays for its GPUs.

Nine steps, in order, each printing one line `pass|fail|skipped: <step>: <figures or reason>`; the first
failure stops the run (exit 1) with what to change. Everything is written to `reports/doctor/doctor.json`
(atomically) with each step's status, figures and seconds, also when a step fails.

1. `driver`: nvidia-smi's driver and CUDA versions and the GPUs; the CUDA 13 wheels need driver >= 580.
2. `imports`: torch and verl import (everywhere); vLLM and flash-attn too where there is a GPU.
3. `check`: `pipeline.layout.layout_problems` (what `promptr1 check` runs) and the host's GPU count
   against the highest device id the layout places on this node.
4. `weights`: every model the params need is in the Hugging Face cache (`promptr1 weights --check`'s logic).
5. `environment`: the environment server starts (or is reused) and answers `GET <url>/models`.
6. `rows`: `--rows` real evaluation rows (math first, then round-robin over the datasets) sent as the
   env-only baseline sends them, through `EnvironmentClient` without its response cache, so the latencies
   are real: p50/p95, failures, empty-after-length.
7-9. `verl step`, `merge`, `trajectories`: pipeline/doctor_train.py (one verl step on the GPU path).

Decisions:
- **Skipped is not passed.** A step that needs a GPU, or inputs not built yet (`data/rl/` before
  `dvc repro`), prints `skipped: <reason>` and the run goes on; the CPU default profile ends with exit 0.
- **The environment stays up from step 5 to step 7**, as the train stage holds it: verl's agent loop talks
  to the server step 5 started (train_verl reuses a healthy server at the URL), and it is stopped at the end.
- **Figures, not just verdicts**: every line carries the numbers a person would otherwise look up (driver
  version, GPU count, latencies), so a pasted doctor output answers the first support questions.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import logging
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.config import Params

log = logging.getLogger(__name__)

Status = Literal["pass", "fail", "skipped"]
MIN_DRIVER = 580
"""The CUDA 13.0 runtime of torch 2.11's wheels needs an NVIDIA driver of the 580 series or newer."""
DEFAULT_ROWS = 64
BUILD_FIRST = "run dvc repro build first"


@dataclass
class StepResult:
    """One step's outcome: what the line says, the figures behind it, and how long it took."""

    name: str
    status: Status
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def line(self) -> str:
        return f"{self.status}: {self.name}: {self.detail}"


def passed(detail: str, **figures: Any) -> tuple[Status, str, dict[str, Any]]:
    return "pass", detail, figures


def failed(detail: str, **figures: Any) -> tuple[Status, str, dict[str, Any]]:
    return "fail", detail, figures


def skipped(detail: str, **figures: Any) -> tuple[Status, str, dict[str, Any]]:
    return "skipped", detail, figures


@dataclass
class Doctor:
    """The state the steps share: params, the host's GPUs, the environment's URL and the results so far."""

    params: Params
    rows: int = DEFAULT_ROWS
    gpus: list[dict[str, str]] = field(default_factory=list)
    """nvidia-smi's GPUs (index, name, driver, memory); empty on a machine without one."""
    environment_url: str | None = None
    results: dict[str, StepResult] = field(default_factory=dict)
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def status(self, name: str) -> Status | None:
        result = self.results.get(name)
        return result.status if result else None


Step = Callable[[Doctor], tuple[Status, str, dict[str, Any]]]


# ------------------------------------------------------------------------------------------- 1. driver
def _nvidia_smi(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=False)


def step_driver(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    if shutil.which("nvidia-smi") is None:
        return skipped("no nvidia-smi on PATH: no NVIDIA GPU on this machine (the GPU steps are skipped)")
    listing = _nvidia_smi("--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader,nounits")
    if listing.returncode != 0:
        return failed(f"nvidia-smi exited with code {listing.returncode} ({listing.stderr.strip()[:200]}): "
                      f"install or repair the NVIDIA driver (>= {MIN_DRIVER} for the CUDA 13 wheels)")
    for line in listing.stdout.strip().splitlines():
        index, name, driver, memory = (part.strip() for part in line.split(",", 3))
        doc.gpus.append({"index": index, "name": name, "driver": driver, "memory_mib": memory})
    if not doc.gpus:
        return skipped("nvidia-smi lists no GPU on this machine (the GPU steps are skipped)")
    driver = doc.gpus[0]["driver"]
    header = _nvidia_smi().stdout
    cuda = header.split("CUDA Version:", 1)[1].split()[0] if "CUDA Version:" in header else "unknown"
    figures = {"driver": driver, "driver_cuda": cuda, "gpus": len(doc.gpus), "gpu_names": sorted(
        {g["name"] for g in doc.gpus}), "memory_mib": doc.gpus[0]["memory_mib"]}
    summary = f"driver {driver} (CUDA {cuda}), {len(doc.gpus)} x {doc.gpus[0]['name']} ({doc.gpus[0]['memory_mib']} MiB)"
    try:
        major = int(driver.split(".")[0])
    except ValueError:
        return failed(f"cannot read the driver version {driver!r} from nvidia-smi", **figures)
    if major < MIN_DRIVER:
        return failed(f"{summary}: the CUDA 13 wheels (torch 2.11, vLLM) need NVIDIA driver >= {MIN_DRIVER}: "
                      "upgrade the driver (docs/gpu.md)", **figures)
    return passed(summary, **figures)


# ------------------------------------------------------------------------------------------- 2. imports
def _version(module: Any, distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


def step_imports(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    versions: dict[str, str] = {}
    for module_name, distribution in (("torch", "torch"), ("verl", "verl")):
        try:
            versions[module_name] = _version(importlib.import_module(module_name), distribution)
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            return failed(f"{module_name} does not import ({type(exc).__name__}: {exc}): reinstall the project "
                          "(pip install -e . with constraints/cpu.txt or scripts/install-gpu.sh)", **versions)
    import torch

    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    figures: dict[str, Any] = {**versions, "torch_cuda": torch.version.cuda, "torch_cuda_devices": cuda_devices}
    missing: list[str] = []
    for module_name, distribution in (("vllm", "vllm"), ("flash_attn", "flash-attn")):
        try:
            figures[module_name] = _version(importlib.import_module(module_name), distribution)
        except ImportError as exc:
            missing.append(f"{module_name} ({exc})")
        except Exception as exc:  # noqa: BLE001 - installed but broken (a CUDA/ABI mismatch)
            return failed(f"{module_name} is installed but does not import ({type(exc).__name__}: {exc}): "
                          "reinstall the GPU extra with scripts/install-gpu.sh", **figures)
    found = ", ".join(f"{name} {figures[name]}" for name in ("torch", "verl", "vllm", "flash_attn") if name in figures)
    if doc.gpus:
        if missing:
            return failed(f"{found}; GPU extra not installed: {'; '.join(missing)}: run scripts/install-gpu.sh "
                          "(docs/gpu.md)", **figures)
        if cuda_devices != len(doc.gpus):
            return failed(f"{found}; torch sees {cuda_devices} CUDA devices, nvidia-smi {len(doc.gpus)} "
                          f"(torch built for CUDA {torch.version.cuda}): check CUDA_VISIBLE_DEVICES and the "
                          f"driver (>= {MIN_DRIVER})", **figures)
        return passed(f"{found}; torch CUDA {torch.version.cuda} sees {cuda_devices} GPUs", **figures)
    if missing:
        return passed(f"{found}; vllm, flash-attn skipped: GPU extra not installed (no GPU here)", **figures)
    return passed(f"{found} (no GPU here)", **figures)


# ------------------------------------------------------------------------------------------- 3. check
def layout_gpus_needed(params: Params) -> int:
    """GPUs this node must have for the layout: the highest CUDA device id placed on it, plus one."""
    from pipeline.layout import environment_gpus, training_gpus

    placed = [*environment_gpus(params), *training_gpus(params)]
    return max(placed) + 1 if placed else 0


def step_check(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.layout import describe, layout_problems

    problems = [str(p) for p in layout_problems(doc.params)]
    needed = layout_gpus_needed(doc.params)
    figures = {"problems": problems, "gpus_needed": needed, "host_gpus": len(doc.gpus)}
    if problems:
        more = f" (and {len(problems) - 1} more: promptr1 check lists them)" if len(problems) > 1 else ""
        return failed(f"{problems[0]}{more}", **figures)
    summary = f"layout ok: {describe(doc.params)}"
    if needed == 0:
        return passed(f"{summary}; no GPU placed on this node", **figures)
    if not doc.gpus:
        return passed(f"{summary}; GPU count skipped: no GPU on this machine (the layout needs {needed})", **figures)
    if len(doc.gpus) < needed:
        return failed(f"{summary}; but the layout places GPUs up to device {needed - 1} on this node and nvidia-smi "
                      f"lists {len(doc.gpus)}: choose the profile for this node (paper-1node for 8 GPUs) or set "
                      "train.verl.gpus / environment.server.gpus", **figures)
    return passed(f"{summary}; host GPUs {len(doc.gpus)} >= {needed} needed", **figures)


# ------------------------------------------------------------------------------------------- 4. weights
def step_weights(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.weights import ensure_weights

    statuses = ensure_weights(doc.params, fetch=False)
    figures = {s.key: {"ref": s.ref, "state": s.state} for s in statuses}
    bad = [s for s in statuses if not s.ok]
    if bad:
        return failed("; ".join(f"{s.key}={s.ref!r} is {s.state}: {s.detail}" for s in bad)
                      + ": run `promptr1 weights` (with network) before the GPU job", **figures)
    return passed(", ".join(f"{s.key} {s.ref}" for s in statuses) + ": present offline", **figures)


# ------------------------------------------------------------------------------------------- 5. environment
def step_environment(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.environment.client import resolve_api_key
    from pipeline.environment.servers import environment_server, served_models, started_server
    from pipeline.errors import EnvironmentUnavailable
    from pipeline.layout import environment_started_here

    params, env = doc.params, doc.params.environment
    if env.backend == "vllm" and environment_started_here(params) and not doc.gpus:
        return skipped(f"environment.backend=vllm serves {env.model} on a GPU: none on this machine")
    if env.backend == "knowledge":
        missing = [s for s in env.knowledge.sources if not params.path(s).exists()]
        if missing:
            return skipped(f"{BUILD_FIRST} (environment.knowledge.sources {missing} not built)")
    try:
        url = doc.stack.enter_context(environment_server(params))
        models = served_models(url, resolve_api_key(env), timeout_s=10.0)
    except EnvironmentUnavailable as exc:
        return failed(f"{exc}", url=env.url)
    if models is None:
        return failed(f"nothing answers at {url}/models (environment.backend={env.backend}): start the server there "
                      "or fix environment.base_url / host / port", url=url)
    doc.environment_url = url
    how = "started here" if started_server(url) is not None else "already running, reused"
    return passed(f"{env.backend} {env.served_name} at {url} ({how})", url=url, backend=env.backend, models=models)


# ------------------------------------------------------------------------------------------- 6. rows
def evaluation_rows(params: Params, n: int) -> tuple[list[dict[str, Any]], str] | None:
    """`n` real evaluation rows (dataset, task type, question), math datasets first, then round-robin;
    from the built sets (data/rl/eval/) if there, else the mirror's authors' files. None when neither is."""
    import pyarrow.parquet as pq

    from pipeline.data.sources import authors_eval_path, get_spec, load_authors_eval

    names = list(params.eval_datasets)
    if not any(get_spec(name).task_type == "math" for name in names):
        names.append("gsm8k")  # the doctor always sends math rows (a reasoning environment's worst case)
    names.sort(key=lambda name: get_spec(name).task_type != "math")
    eval_dir = params.path(params.paths.rl_dir) / "eval"
    per_dataset: dict[str, list[str]] = {}
    source = "data/rl/eval" if any((eval_dir / f"{name}.parquet").is_file() for name in names) else "mirror"
    for name in names:
        built = eval_dir / f"{name}.parquet"
        if source == "data/rl/eval" and built.is_file():
            extra = pq.read_table(built, columns=["extra_info"]).column("extra_info").to_pylist()
            per_dataset[name] = [str(e["question"]) for e in extra]
        elif params.mirror is not None and authors_eval_path(params, get_spec(name)).is_file():
            per_dataset[name] = [row.question for row in load_authors_eval(params, get_spec(name))]
    if not per_dataset:
        return None
    rows: list[dict[str, Any]] = []
    for index in range(max(len(q) for q in per_dataset.values())):
        for name, questions in per_dataset.items():
            if index < len(questions) and len(rows) < n:
                rows.append({"dataset": name, "task_type": get_spec(name).task_type, "question": questions[index]})
    return rows, source


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def step_rows(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.environment.client import LEDGER_FILE, EnvironmentClient
    from pipeline.errors import EnvironmentUnhealthy

    if doc.environment_url is None:
        return skipped("no environment server (the environment step did not pass)")
    if doc.rows <= 0:
        return skipped("--rows 0")
    found = evaluation_rows(doc.params, doc.rows)
    if found is None:
        return skipped(f"no evaluation rows: {BUILD_FIRST} (or set paths.mirror to the datasets mirror)")
    rows, source = found
    params = doc.params
    cfg = params.environment.model_copy(update={"cache": False, "base_url": doc.environment_url})
    client = EnvironmentClient(cfg, None, ledger_path=params.path(params.paths.cache_dir) / LEDGER_FILE)
    instruction = params.evaluate.env_only_instruction

    async def send_all() -> list[Any]:
        try:
            return list(await asyncio.gather(*(client.reply([], f"{r['question']}\n\n{instruction}") for r in rows)))
        finally:
            await client.aclose()

    started = time.perf_counter()
    try:
        replies = asyncio.run(send_all())
    except EnvironmentUnhealthy as exc:
        return failed(f"{exc}", url=doc.environment_url)
    wall = time.perf_counter() - started
    latencies = sorted(r.latency_s for r in replies)
    errors = [r.error for r in replies if r.error]
    by_type: dict[str, int] = {}
    for row in rows:
        by_type[row["task_type"]] = by_type.get(row["task_type"], 0) + 1
    figures = {"rows": len(rows), "source": source, "rows_by_task_type": by_type,
               "datasets": sorted({r["dataset"] for r in rows}), "p50_s": round(_percentile(latencies, 50), 3),
               "p95_s": round(_percentile(latencies, 95), 3), "max_s": round(latencies[-1], 3),
               "failures": len(errors), "empty_after_length": sum(r.empty_after_length for r in replies),
               "truncated": sum(r.truncated for r in replies), "retries": sum(r.retries for r in replies),
               "completion_tokens": sum(r.completion_tokens for r in replies), "wall_s": round(wall, 1),
               "cost_usd": round(sum(r.cost_usd for r in replies), 6), "first_error": errors[0] if errors else None}
    detail = (f"{len(rows)} rows from {source} ({by_type.get('math', 0)} math, {len(figures['datasets'])} datasets) "
              f"in {wall:.1f} s: p50 {figures['p50_s']:.2f} s, p95 {figures['p95_s']:.2f} s, "
              f"{len(errors)} failed, {figures['empty_after_length']} empty after length, "
              f"{figures['truncated']} cut at max_tokens")
    if len(errors) > params.environment.max_failure_rate * len(rows):
        return failed(f"{detail}; more than environment.max_failure_rate={params.environment.max_failure_rate:g} "
                      f"failed (first: {errors[0]}): fix the environment at {doc.environment_url}", **figures)
    return passed(detail, **figures)


# ------------------------------------------------------------------------------------------- run
def steps() -> list[tuple[str, Step]]:
    """The steps in the order they run (7-9 from pipeline.doctor_train)."""
    from pipeline.doctor_train import step_merge, step_trajectories, step_verl

    return [("driver", step_driver), ("imports", step_imports), ("check", step_check), ("weights", step_weights),
            ("environment", step_environment), ("rows", step_rows), ("verl step", step_verl), ("merge", step_merge),
            ("trajectories", step_trajectories)]


def report_path(params: Params) -> Path:
    return params.path(params.paths.reports_dir) / "doctor" / "doctor.json"


def run_doctor(params: Params, rows: int = DEFAULT_ROWS, echo: Callable[[str], None] = print) -> int:
    """Run the steps, echo one line each, write the JSON report; 0 when nothing failed, else 1."""
    from pipeline.data.schema import write_json_atomic

    doc = Doctor(params=params, rows=rows)
    started = time.perf_counter()
    exit_code = 0
    with doc.stack:
        for name, step in steps():
            step_started = time.perf_counter()
            try:
                status, detail, figures = step(doc)
            except Exception as exc:  # noqa: BLE001 - a step that crashes is a failed step, reported like one
                log.debug("doctor step %s crashed", name, exc_info=True)
                status, detail, figures = failed(f"{type(exc).__name__}: {exc}")
            result = StepResult(name, status, detail, figures, round(time.perf_counter() - step_started, 2))
            doc.results[name] = result
            echo(result.line)
            if status == "fail":
                exit_code = 1
                break
    report = {"profile": params.profile, "exit_code": exit_code, "rows_requested": rows,
              "wall_s": round(time.perf_counter() - started, 1),
              "steps": [asdict(r) for r in doc.results.values()],
              "not_run": [name for name, _ in steps() if name not in doc.results]}
    write_json_atomic(report, report_path(params))
    return exit_code
