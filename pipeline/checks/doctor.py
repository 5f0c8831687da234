"""`promptr1 doctor`: a node's first five minutes as one command, before anyone pays for its GPUs.

Ten steps, in order, each printing one line `pass|fail|skipped: <step>: <figures or reason>`; the first
failure stops the run (exit 1) with what to change. Everything is written to `reports/doctor/doctor.json`
(atomically) with each step's status, figures and seconds, also when a step fails.

1. `driver`: nvidia-smi's driver and CUDA versions and the GPUs; the CUDA 13 wheels need driver >= 580.
2. `imports`: torch and verl import (everywhere); vLLM and flash-attn too where there is a GPU.
3. `check`: `pipeline.checks.layout.layout_problems` (what `promptr1 check` runs) and the host's GPU count
   against the highest device id the layout places on this node.
4. `weights`: every model the params need is in the Hugging Face cache (`promptr1 weights --check`'s logic).
5. `resources`: pipeline/checks/doctor_train.py: the train stage's start checks, with the Ray the profile says
   found or started, and probed for the CUDA devices it owns (GPU nodes, backend verl).
6-7. `environment`, `rows`: pipeline/checks/doctor_environment.py (the server starts; `--rows` real evaluation
   rows through `EnvironmentClient`: p50/p95 latency, failures, empty-after-length, and the decode speed
   measured against the timeout rule).
8-10. `verl step`, `merge`, `trajectories`: pipeline/checks/doctor_train.py (one verl step of the smallest batch on
   the GPU path, its merge, two decoded trajectories).

Decisions:
- **Skipped is not passed.** A step that needs a GPU, or inputs not built yet (`data/rl/` before
  `dvc repro`), prints `skipped: <reason>` and the run goes on; the CPU default profile ends with exit 0.
- **The machine before the environment**: step 5 runs before GPT-OSS loads (minutes), as the train stage
  checks its machine before it starts the server.
- **The environment stays up from step 6 to step 8**, as the train stage holds it: verl's agent loop talks
  to the server step 6 started (run_verl reuses a healthy server at the URL), and it is stopped at the end.
- **Figures, not just verdicts**: every line carries the numbers a person would otherwise look up (driver
  version, GPU count, latencies), so a pasted doctor output answers the first support questions.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.checks.doctor_state import (
    DEFAULT_ROWS,
    ROWS_DEADLINE_S,
    Doctor,
    Status,
    Step,
    StepResult,
    failed,
    passed,
    skipped,
)
from pipeline.config import Params

if TYPE_CHECKING:
    from pipeline.checks.layout import Placement

log = logging.getLogger(__name__)

MIN_DRIVER = 580
"""The CUDA 13.0 runtime of torch 2.11's wheels needs an NVIDIA driver of the 580 series or newer."""
CPU_ROWS = 16
"""`--rows` unset with a llama.cpp environment (a CPU server). Measured on a 2-core machine shared with other
work (load average 4-7): 16 rows took 29-120 s (the whole doctor 42-139 s); of 64 rows only 12 were answered
within the 180 s deadline (long-form rows decode 128 tokens at 3-4 tokens/s a slot, pass the 60 s call
timeout and are sent again)."""


# ------------------------------------------------------------------------------------------- 1. driver
def _nvidia_smi(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=False)


def step_driver(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    if shutil.which("nvidia-smi") is None:
        return skipped("no nvidia-smi on PATH: no NVIDIA GPU on this machine (the GPU steps are skipped)")
    listing = _nvidia_smi(
        "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader,nounits"
    )
    if listing.returncode != 0:
        return failed(
            f"nvidia-smi exited with code {listing.returncode} ({listing.stderr.strip()[:200]}): "
            f"install or repair the NVIDIA driver (>= {MIN_DRIVER} for the CUDA 13 wheels)"
        )
    for line in listing.stdout.strip().splitlines():
        index, name, driver, memory = (part.strip() for part in line.split(",", 3))
        doc.gpus.append({"index": index, "name": name, "driver": driver, "memory_mib": memory})
    if not doc.gpus:
        return skipped("nvidia-smi lists no GPU on this machine (the GPU steps are skipped)")
    driver = doc.gpus[0]["driver"]
    header = _nvidia_smi().stdout
    cuda = header.split("CUDA Version:", 1)[1].split()[0] if "CUDA Version:" in header else "unknown"
    figures = {
        "driver": driver,
        "driver_cuda": cuda,
        "gpus": len(doc.gpus),
        "gpu_names": sorted({g["name"] for g in doc.gpus}),
        "memory_mib": doc.gpus[0]["memory_mib"],
    }
    first = doc.gpus[0]
    summary = f"driver {driver} (CUDA {cuda}), {len(doc.gpus)} x {first['name']} ({first['memory_mib']} MiB)"
    try:
        major = int(driver.split(".")[0])
    except ValueError:
        return failed(f"cannot read the driver version {driver!r} from nvidia-smi", **figures)
    if major < MIN_DRIVER:
        return failed(
            f"{summary}: the CUDA 13 wheels (torch 2.11, vLLM) need NVIDIA driver >= {MIN_DRIVER}: "
            "upgrade the driver (docs/gpu.md)",
            **figures,
        )
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
            return failed(
                f"{module_name} does not import ({type(exc).__name__}: {exc}): reinstall the project "
                "(pip install -e . with constraints/cpu.txt or scripts/install-gpu.sh)",
                **versions,
            )
    import torch

    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    figures: dict[str, Any] = {
        **versions,
        "torch_cuda": torch.version.cuda,
        "torch_cuda_devices": cuda_devices,
    }
    missing: list[str] = []
    for module_name, distribution in (("vllm", "vllm"), ("flash_attn", "flash-attn")):
        try:
            figures[module_name] = _version(importlib.import_module(module_name), distribution)
        except ImportError as exc:
            missing.append(f"{module_name} ({exc})")
        except Exception as exc:  # noqa: BLE001 - installed but broken (a CUDA/ABI mismatch)
            return failed(
                f"{module_name} is installed but does not import ({type(exc).__name__}: {exc}): "
                "reinstall the GPU extra with scripts/install-gpu.sh",
                **figures,
            )
    found = ", ".join(
        f"{name} {figures[name]}" for name in ("torch", "verl", "vllm", "flash_attn") if name in figures
    )
    if doc.gpus:
        if missing:
            return failed(
                f"{found}; GPU extra not installed: {'; '.join(missing)}: run scripts/install-gpu.sh "
                "(docs/gpu.md)",
                **figures,
            )
        if cuda_devices != len(doc.gpus):
            return failed(
                f"{found}; torch sees {cuda_devices} CUDA devices, nvidia-smi {len(doc.gpus)} "
                f"(torch built for CUDA {torch.version.cuda}): check CUDA_VISIBLE_DEVICES and the "
                f"driver (>= {MIN_DRIVER})",
                **figures,
            )
        return passed(f"{found}; torch CUDA {torch.version.cuda} sees {cuda_devices} GPUs", **figures)
    if missing:
        return passed(f"{found}; vllm, flash-attn skipped: GPU extra not installed (no GPU here)", **figures)
    return passed(f"{found} (no GPU here)", **figures)


# ------------------------------------------------------------------------------------------- 3. check
def layout_gpus_needed(place: Placement) -> int:
    """GPUs this node must have for the layout: the highest CUDA device id placed on it, plus one."""
    placed = [*place.environment_gpus, *place.training_gpus]
    return max(placed) + 1 if placed else 0


def step_check(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.checks.layout import Placement, describe, layout_problems

    problems = [str(p) for p in layout_problems(doc.params)]
    needed = layout_gpus_needed(Placement.for_layout(doc.params))
    figures = {"problems": problems, "gpus_needed": needed, "host_gpus": len(doc.gpus)}
    if problems:
        more = f" (and {len(problems) - 1} more: promptr1 check lists them)" if len(problems) > 1 else ""
        return failed(f"{problems[0]}{more}", **figures)
    summary = f"layout ok: {describe(doc.params)}"
    if needed == 0:
        return passed(f"{summary}; no GPU placed on this node", **figures)
    if not doc.gpus:
        return passed(
            f"{summary}; GPU count skipped: no GPU on this machine (the layout needs {needed})", **figures
        )
    if len(doc.gpus) < needed:
        return failed(
            f"{summary}; but the layout places GPUs up to device {needed - 1} on this node and nvidia-smi "
            f"lists {len(doc.gpus)}: choose the profile for this node (paper-1node for 8 GPUs) or set "
            "train.verl.gpus / environment.server.gpus",
            **figures,
        )
    return passed(f"{summary}; host GPUs {len(doc.gpus)} >= {needed} needed", **figures)


# ------------------------------------------------------------------------------------------- 4. weights
def step_weights(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.commands.weights import required_weights
    from pipeline.weights import ensure_weights

    statuses = ensure_weights(required_weights(doc.params), fetch=False)
    figures = {s.key: {"ref": s.ref, "state": s.state} for s in statuses}
    bad = [s for s in statuses if not s.ok]
    if bad:
        return failed(
            "; ".join(f"{s.key}={s.ref!r} is {s.state}: {s.detail}" for s in bad)
            + ": run `promptr1 weights` (with network) before the GPU job",
            **figures,
        )
    return passed(", ".join(f"{s.key} {s.ref}" for s in statuses) + ": present offline", **figures)


# ------------------------------------------------------------------------------------------- run
def steps() -> list[tuple[str, Step]]:
    """The steps in the order they run (5 and 8-10 from pipeline.checks.doctor_train)."""
    from pipeline.checks.doctor_environment import step_environment, step_rows
    from pipeline.checks.doctor_train import step_merge, step_resources, step_trajectories, step_verl

    return [
        ("driver", step_driver),
        ("imports", step_imports),
        ("check", step_check),
        ("weights", step_weights),
        ("resources", step_resources),
        ("environment", step_environment),
        ("rows", step_rows),
        ("verl step", step_verl),
        ("merge", step_merge),
        ("trajectories", step_trajectories),
    ]


def report_path(reports_dir: Path) -> Path:
    return reports_dir / "doctor" / "doctor.json"


def default_rows(environment_backend: str) -> int:
    """Rows sent when `--rows` is not given: 64, or `CPU_ROWS` for a llama.cpp (CPU) environment."""
    return CPU_ROWS if environment_backend == "llamacpp" else DEFAULT_ROWS


def run_doctor(
    params: Params,
    rows: int | None = None,
    echo: Callable[[str], None] = print,
    rows_deadline_s: float = ROWS_DEADLINE_S,
) -> int:
    """Run the steps, echo one line each, write the JSON report; 0 when nothing failed, else 1."""
    from pipeline.data.schema import write_json_atomic

    rows = default_rows(params.environment.backend) if rows is None else rows
    doc = Doctor(params=params, rows=rows, rows_deadline_s=rows_deadline_s,
                 reports_dir=params.path(params.paths.reports_dir))
    started = time.perf_counter()
    exit_code = 0
    with doc.stack:
        for name, step in steps():
            step_started = time.perf_counter()
            try:
                status, detail, figures = step(doc)
            except Exception as exc:
                log.debug("doctor step %s crashed", name, exc_info=True)
                status, detail, figures = failed(f"{type(exc).__name__}: {exc}")
            result = StepResult(name, status, detail, figures, round(time.perf_counter() - step_started, 2))
            doc.results[name] = result
            echo(result.line)
            if status == "fail":
                exit_code = 1
                break
    report = {
        "profile": params.profile,
        "exit_code": exit_code,
        "rows_requested": rows,
        "wall_s": round(time.perf_counter() - started, 1),
        "steps": [asdict(r) for r in doc.results.values()],
        "not_run": [name for name, _ in steps() if name not in doc.results],
    }
    write_json_atomic(report, report_path(doc.reports_dir))
    return exit_code
