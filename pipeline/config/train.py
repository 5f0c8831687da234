"""`train`: the training stage's section (GRPO, its LoRA, format warm-up and verl sub-sections).

In its own module so `sections.py` stays readable (no module above ~400 lines); import it from
`pipeline.config`, which re-exports every section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.config.health_gate import HealthConfig

# The values verl 0.9.1's core_algos accept (kl_penalty; agg_loss); a "+" suffix means straight-through k2.
KlLossType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full",
                     "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class LoraConfig(_Section):
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class WatchdogConfig(_Section):
    """The progress watchdog of the verl backend (pipeline/train/verl/watchdog.py): verl's process group is stopped
    when no new step line comes within the step's bound, the environment's worst case for one step's rollout
    (derived from `environment.timeout_s`, `environment.concurrency` and `agent.max_turns`) plus these allowances."""

    enabled: bool = Field(True, description="Stop a verl run whose next step line is overdue; false: wait forever.")
    startup_s: float = Field(
        1800.0, gt=0, description="From the launch to verl's fit-start line (`Training from scratch` / `Setting "
        "global step to N`): Ray, loading the weights, starting the rollout engines. Alone: a hang there is stopped "
        "after this, not after the first step's whole bound.")
    update_s: float = Field(
        900.0, gt=0, description="Every step besides waiting on the environment: the agent's generation, the "
        "log-prob passes, the actor update, syncing weights to the rollout.")
    validation_s: float = Field(
        1800.0, gt=0, description="One validation pass (before training, every test_freq steps and at the last "
        "step), besides its environment worst case.")
    rollout_s: float | None = Field(
        None, gt=0, description="One training step's rollout, when measured; null: the environment's worst case "
        "derived from its timeout, concurrency and the turns (a validation pass scales it by its conversations).")
    checkpoint_s: float = Field(
        900.0, gt=0, description="One checkpoint save (every save_freq steps and at the last step; verl saves "
        "before it prints the step's line), and a resumed launch's checkpoint load in its first step's bound.")


class VerlConfig(_Section):
    nnodes: int = 1
    n_gpus_per_node: int = 8
    rollout_name: str = "vllm"
    rollout_tp: int = 8
    rollout_gpu_memory_utilization: float = 0.6
    gpus: list[int] = Field(default_factory=list, description="CUDA device ids verl uses on each node "
                            "(Ray's CUDA_VISIBLE_DEVICES); empty = the first n_gpus_per_node devices.")
    test_freq: int = 10
    save_freq: int = 10
    val_before_train: bool = True
    ray_address: str = Field("auto", description='Ray cluster to join ("auto": the one on this machine); "" = private local Ray.')
    use_v1: bool = Field(False, description="verl's V1 trainer; needs TransferQueue (pip install 'verl[verl-core]').")
    gpu_memory_gb: float = Field(80.0, gt=0, le=4096, description="Memory of one training GPU in GiB (80: A100/H100 "
                                 "80GB): what the rollout's memory fraction leaves of it must hold the FSDP actor "
                                 "(pipeline/train/verl/memory.py; `promptr1 check`).")
    extra_overrides: list[str] = Field(default_factory=list)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)


class WarmupConfig(_Section):
    """Format warm-up ("cold start", as DeepSeek-R1 before RL): supervised steps on demonstration
    trajectories in the exact Prompt-R1 protocol, run by the local backend before GRPO step 1.

    A small agent (the CPU profile's 135M model) never writes the protocol's tags on its own, so every
    trajectory scores -k, every GRPO advantage is 0 and RL has no signal; the warm-up fixes that.
    Off (`steps: 0`) in the paper profile, whose Qwen3-4B follows the format from its instructions.
    See `pipeline.train.local.warmup` (the steps) and `pipeline.train.local.demonstrations` (the demonstrations).
    """

    steps: int = Field(12, ge=0, description="Supervised optimizer steps before GRPO; 0 = no warm-up (paper).")
    batch_size: int = Field(2, gt=0, description="Demonstrations per warm-up step.")
    lr: float = Field(2e-4, gt=0, description="Learning rate of the warm-up's own AdamW.")
    demonstrations: int = Field(
        8, ge=0, description="Distinct demonstrations built (each costs `interaction_turns` environment "
        "calls) and cycled through; 0 = steps x batch_size (every step sees new ones).")
    max_answer_tokens: int = Field(
        24, gt=0, description="Rows whose gold answer is longer (agent tokens) are not used as demonstrations.")
    interaction_turns: int = Field(
        2, ge=0, description="Interaction turns per demonstration before the answer turn (the paper preset "
        "only counts the answer after >= 2 valid interaction turns).")
    replies: Literal["environment", "withheld"] = Field(
        "environment", description="environment: the demonstrations carry the live environment's replies; "
        "withheld: a fixed placeholder instead, so the warm-up teaches the protocol but not how to use a reply "
        "(the learn profile, where the replies hold the answers and using them is the skill under test).")
    answer: Literal["auto", "gold", "reply"] = Field(
        "auto", description="The demonstrations' final answer. reply: grounded in the replies (a gold answer "
        "when a reply states it, else the answer the last reply gives), so the agent learns to answer from "
        "what the environment said; gold: the row's gold answer whatever the replies said (with a weak "
        "environment that teaches the agent to make answers up); auto: reply. Withheld replies always give "
        "the gold (nothing to ground an answer in).")
    request: Literal["framed", "verbatim"] = Field(
        "framed", description="The first request's wording. framed: the question in one of a few short "
        "framings ('Please answer this question: ...'); verbatim: the question alone (the learn profile: its "
        "`terse` environment refuses requests over 8 words, so framing words would make even the shortest "
        "questions refused and GRPO would start with no answered request, measured 0 of 24).")
    followup: Literal["verify", "reask"] = Field(
        "verify", description="The wording of every request after the first. verify: one of a few requests "
        "to check the answer; reask: the first reply's entity followed by the question's words the reply did "
        "not restate (pipeline/environment/simulated/hops.py reask_request; needs live replies): the second request a "
        "2-hop question of the hops mode needs.")
    require_followup: bool = Field(
        False, description="Keep only demonstrations whose gold answer the last reply states and no earlier "
        "reply does (with live replies): demonstrations where the follow-up request was needed, i.e. on the "
        "hops mode the 2-hop questions the re-ask answers.")


class TrainConfig(_Section):
    backend: Literal["local", "verl"] = "local"
    steps: int = Field(2, ge=0)
    batch_size: int = Field(2, gt=0)
    group_size: int = Field(4, ge=2, description="G: trajectories per question.")
    mini_batch_size: int = Field(2, gt=0)
    micro_batch_size: int = Field(4, gt=0)
    ppo_epochs: int = Field(1, gt=0)
    lr: float = Field(1e-5, gt=0, le=1)
    lr_warmup_steps: int = Field(
        0, ge=0, description="Local backend: the learning rate rises linearly over the first this many GRPO "
        "steps (step s of them trains at lr x s / lr_warmup_steps), then stays at `lr`; 0: constant from step 1. "
        "Adam moves every weight by about +-lr in its first steps whatever the signal's strength, so a short "
        "warm-up keeps the first updates, taken on a few dozen trajectories, from deciding the run. Derived "
        "from the step number, so a resumed run trains at the lr the killed one would have.")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    clip_ratio_low: float = Field(0.2, ge=0, le=1)
    clip_ratio_high: float = Field(0.2, ge=0)
    use_kl_loss: bool = True
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: KlLossType = "low_var_kl"
    loss_agg_mode: LossAggMode = "token-mean"
    total_epochs: int = Field(1, ge=1)
    save_every: int = Field(2, gt=0)
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept on disk (local backend; verl: "
                                  "trainer.max_actor_ckpt_to_keep, whose stage refuses to start without the disk).")
    keep_stale_checkpoints: int = Field(
        1, ge=0, le=100, description="Checkpoint folders of changed params set aside (not deleted), newest kept.")
    gradient_checkpointing: bool = False
    share_prompt_forward: bool = Field(
        True, description="Local backend: the update's forwards (policy, reference, old log-probs) read each "
        "question's prompt once for its G trajectories and each response unpadded over the prompt's KV cache "
        "(pipeline/train/local/batch.py shared_prompt_log_probs): same log-probs and gradients to float rounding, "
        "measured 3.4x faster (float32) and 2.6x (bf16) for 8 trajectories of SmolLM2-135M on 2 cores "
        "(benchmarks/results/shared_prompt.json). Micro-batches then keep a question's trajectories together. "
        "Off (the padded verl layout) with gradient_checkpointing, which cannot keep the prompt's cache.")
    autocast: Literal["auto", "bfloat16"] | None = Field(
        "auto", description="Local backend: run the warm-up and the update's forward/backward (policy, "
        "reference, old log-probs) under torch.autocast in this dtype; weights, optimizer and loss stay "
        "float32. bfloat16 halves a CPU update where the CPU has bf16 instructions (AVX512-BF16/AMX; measured "
        "17.7 s -> 8.6 s for 4x520 tokens of SmolLM2-135M) and is ~100x slower where it has not (AVX2). "
        "auto: bfloat16 where the device multiplies bf16 natively, else float32 (pipeline/hardware.py). "
        "null: float32 throughout. verl sets its own mixed precision (bf16 on GPU).")
    rollout_engine: Literal["auto", "llama.cpp", "transformers"] = Field(
        "auto", description="Local backend: what samples the GRPO rollouts. llama.cpp: each step's policy "
        "exported to GGUF from memory and served by llama.cpp's server (pipeline/train/local/rollout_engine.py; each "
        "conversation keeps its KV cache between turns); transformers: the policy in this process. The update "
        "recomputes every log-prob with the policy either way. auto: llama.cpp on a CPU-only machine for a full "
        "fine-tune of a Llama agent whose agent.model is a GGUF file, else transformers.")
    rollout_slots: int = Field(
        0, ge=0, description="rollout_engine llama.cpp: the server's parallel slots for a step's rollout; 0 = one "
        "per trajectory (all decoded in one batch); 1 = one at a time (slower). Either way a repeated step "
        "samples the same tokens: each turn's prompts reach the server in one request, so which sequences "
        "share a decode batch (llama.cpp's numerics depend on it) is the same on every run.")
    rollout_gguf_dtype: Literal["f16", "f32", "bf16", "q8_0"] = Field(
        "f16", description="rollout_engine llama.cpp: the policy's matrices in each step's GGUF export (q8_0: "
        "see evaluate.agent_gguf_dtype; its samples are further off-policy).")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    verl: VerlConfig = Field(default_factory=VerlConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)

    @property
    def shares_prompts(self) -> bool:
        """Whether the update and the warm-up read each prompt once: `share_prompt_forward`, never with
        gradient checkpointing (it drops the prompt's KV cache)."""
        return self.share_prompt_forward and not self.gradient_checkpointing
