"""The schema of a run: a shallow tree of dataclasses. Hydra composes the YAML; these validate it.

Sections: model, data, algorithm, actor, critic, ref, rollout, reward, resources, ray, trainer.
Every field has a default that suits the tiny CPU run (`configs/ppo_tiny.yaml`); cluster configs
override what they need. The range of every numeric field and the choices of every named one are
in `rlframe/config/ranges.py`; cross-field checks live in `rlframe/config/validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass
class ModelConfig:
    path: str | None = None  # a local HF directory; None builds the tiny model below
    tiny_preset: str = "demo"  # rlframe.data.tiny_model.PRESETS
    tiny_pretrain_steps: int | None = None  # None: the builder's default SFT budget
    critic_path: str | None = None  # None: the actor's model with a value head
    cache_dir: str | None = None  # where built tiny models/data are cached (None: ~/.cache/rlframe)
    # Dims for dry runs of cluster configs (no weights needed); None reads config.json at `path`.
    hf_config: dict | None = None
    # Load model/critic/reward weights stored only as pickle (.bin/.pt): a pickle can run code when
    # loaded, so safetensors are required unless this is set (rlframe/utils/model_files.py).
    allow_pickle_weights: bool = False


@dataclass
class DataConfig:
    # Synthetic task made on first use, for each split that lists no files: arithmetic | countdown |
    # series | tool_arithmetic (agent.enabled, preset agent); without model.path the tiny model
    # pre-trained on it.
    # train_files / val_files, when given, are used whatever the task (None: files only; docs/data.md).
    task: str | None = "arithmetic"
    train_files: list[str] = field(default_factory=list)
    # [] (none given): the task's held-out split, no validation for task=null; null: no validation at all
    val_files: list[str] | None = field(default_factory=list)
    train_size: int = 5000
    val_size: int = 256
    prompt_length: int = 16
    response_length: int = 8
    train_batch_size: int = 64  # prompts per step
    seed: int = 0


@dataclass
class AlgorithmConfig:
    name: str = "ppo"  # a registered algorithm (rlframe/config/algorithms.py): its dataflow and defaults
    trainer: str | None = None  # "package.module:Class": a custom trainer (dataflow); None: by name
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    n_samples: int = 1  # responses per prompt (GRPO-style groups when > 1)
    kl_in_reward: bool = False
    kl_coef: float = 0.001
    kl_estimator: str = "k1"
    kl_target: float | None = None  # set: adaptive KL controller (Ziegler et al. 2019)
    kl_horizon: int = 10000
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_estimator: str = "k3"
    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound (policy_loss=dual_clip)
    # null: the policy loss's own (token-mean; seq-mean-token-mean for gspo, the paper's sequence-level
    # objective). Set it to override (rlframe.algos.registry.resolve_loss_agg_mode).
    loss_agg_mode: str | None = None
    # seq-mean-token-sum-norm (Dr. GRPO) divides each response's token sum by this constant;
    # null: data.response_length, the maximum response length.
    loss_scale_factor: float | None = None
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False  # DAPO: drop groups with equal rewards, refill
    max_gen_batches: int = 4
    # when max_gen_batches rounds leave the batch short of groups whose rewards differ: refill (top up with
    # equal-reward groups, advantage 0: the gradient shrinks with the informative fraction), train_kept (a
    # smaller batch of the kept groups), stop (end the run). docs/algorithms.md, dynamic_sampling.py.
    dynamic_sampling_at_cap: str = "refill"
    overlong_buffer_len: int = 0  # DAPO overlong shaping (0: off)
    overlong_penalty_factor: float = 1.0
    dpo_beta: float = 0.1  # online DPO
    # Off-policy correction for rollouts older than the weights being trained (trainer.max_staleness
    # > 0 or rollout.partial_budget > 0): none (PPO's ratio against the current weights' log-probs),
    # behaviour (PPO's ratio against the rollout engine's own log-probs), tis (decoupled PPO: each
    # token's advantage weighted by min(pi_old / pi_behaviour, tis_cap)), seq_tis (the response's
    # product of ratios, truncated), icepop (tokens whose ratio is outside [mask_low, mask_high]
    # masked, the rest weighted by it), seq_mask_tis (tis, and responses whose geometric-mean ratio is
    # outside the band masked), mis (that mask alone). rlframe/algos/rollout_correction.py.
    off_policy_correction: str = "none"
    tis_cap: float = 2.0
    mask_low: float | None = None  # the band the masking methods keep; null: the method's default
    mask_high: float | None = None
    rejection_kl: float | None = None  # mask responses whose mean k3 KL(behaviour -> old) exceeds this; null: off


@dataclass
class TrainRoleConfig:
    """Training layout and optimisation of one role (actor or critic)."""

    strategy: str = "fsdp"  # a registered training engine (rlframe.plugins.TRAIN_ENGINES): fsdp, megatron, ...
    worker_cls: str | None = None  # "package.module:Class", a subclass of the role's worker; None: built-in
    dp: int = 2
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False  # megatron, tp > 1
    # Ulysses sequence parallelism (strategy=fsdp): sp ranks split each sequence's positions (all-to-all
    # around attention), for sequences whose activations do not fit one rank. The role's processes are
    # dp * sp * tp * pp; the reference policy follows the actor's layout (docs/long_context.md).
    sp: int = 1
    # Context parallelism (strategy=megatron, megatron-core's own): refused in validation, since
    # megatron-core runs it only in TransformerEngine's attention (CUDA); use strategy=fsdp with sp.
    cp: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0  # optimizer steps (config/schedule.py counts them)
    min_lr_ratio: float = 0.0  # cosine decays to min_lr_ratio * lr
    ppo_epochs: int = 1
    mini_batch_size: int = 64  # samples per optimizer step
    micro_batch_size: int | None = 32
    max_tokens_per_micro_batch: int | None = None
    cliprange_value: float = 0.5  # critic only
    # auto: bf16 on GPU, fp32 on CPU. bf16: bf16 forward/backward with fp32 master weights, fp32
    # gradient reduction and fp32 log-probs; the actor's rollout engine then generates in bf16 too.
    # On a CPU with AMX (Intel Sapphire Rapids and later) bf16 matmuls are several times faster
    # than fp32 (docs/benchmarks.md); elsewhere bf16 on CPU is slower.
    precision: str = "auto"  # auto | fp32 | bf16
    # Recompute each decoder layer's activations in the backward instead of keeping them (fsdp:
    # checkpoint per decoder layer; megatron: full recompute per layer): activation memory of one
    # layer instead of all of them, for about one more forward per step.
    activation_checkpointing: bool = False
    # LoRA (strategy=fsdp): lora_rank > 0 trains low-rank adapters on lora_target_modules of every
    # decoder layer instead of the whole model (the base stays frozen; the actor's reference policy
    # is then its base model with adapters off). The adapters' output is scaled by lora_alpha / lora_rank.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lora_dropout: float = 0.0

    @property
    def rows_per_rank(self) -> int:
        """The rows of one mini-batch each dp rank trains on (mini_batch_size / dp; a replica's sp, tp and
        pp ranks share them): the per-rank mini-batch, computed here only (the workers' split, validation,
        the memory estimate, the planner and calibration read it)."""
        return self.mini_batch_size // max(self.dp, 1)


@dataclass
class RefConfig:
    enabled: bool | None = None  # None: on when any KL is used


@dataclass
class RolloutSection:
    backend: str = "auto"  # vllm | hf | auto
    tp: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    val_temperature: float = 0.0
    val_n: int = 1  # samples per validation prompt (pass@k with k = val_n)
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.1
    # null: 256 MiB on CPU (capped at what max_num_seqs x max_model_len take); on GPU what gpu_memory_utilization leaves
    kv_cache_bytes: int | None = None
    bucket_bytes: int = 256 << 20  # resharding bucket size
    # full: every sync moves every weight; delta: only the elements that changed since the last sync (in
    # the rollout's dtype: with bf16 most do not change in a step), every delta_full_every-th sync in
    # full. Each side then keeps a copy of what it sends or receives (rlframe/resharding/delta.py).
    weight_sync: str = "full"
    delta_full_every: int = 10
    # How split placement's weight channel moves bytes (rlframe/resharding/transport.py): auto (per pair
    # of ranks: shm on one host, gloo between hosts); gloo (TCP); shm (rings in /dev/shm, every rank on
    # one host); file (safetensors files in weight_transport_dir, storage every rank mounts); nccl (GPU
    # clusters; not in this CPU build).
    weight_transport: str = "auto"
    weight_transport_dir: str | None = None
    # Split placement with several generation replicas: direct = the training ranks send every replica
    # its slices; chain = they send each slice once, to the first replica, and each replica passes it
    # on to the next while receiving the following bucket (rlframe/resharding/executor.Relay).
    weight_fanout: str = "direct"
    # Partial rollouts (0: off): each generation round gives an unfinished response at most this many
    # tokens; the rest is carried over and continued with the weights of later steps.
    partial_budget: int = 0
    # vLLM's CUDA graphs (enforce_eager=false) and prefix caching (GRPO's n samples share a prompt);
    # null: on GPU CUDA graphs and prefix caching on, on CPU both off (the CPU backend is eager).
    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    # auto: vLLM starts with dummy weights when the actor syncs every weight before the first
    # generation (not with LoRA: the base weights are then the checkpoint's), instead of every rank
    # reading the checkpoint; real: always read the checkpoint (a custom worker that generates before
    # its first sync). An engine with dummy weights refuses to generate before a sync.
    load_format: str = "auto"
    # Further vllm.LLM(...) keywords (vllm.EngineArgs), applied last; keys rlframe derives from other
    # settings are refused (config/validate.py names the setting to use).
    engine_kwargs: dict = field(default_factory=dict)

    def delta_syncs(self) -> int | None:
        """None for full weight syncs; with weight_sync=delta, every how many syncs one is full anyway."""
        return self.delta_full_every if self.weight_sync == "delta" else None


@dataclass
class RewardConfig:
    function_path: str | None = None  # a .py file with a reward function; None: built-in verifiers
    function_name: str = "compute_score"
    num_workers: int = 0  # reward processes; 0 scores inline (cheaper for rule rewards, see docs/benchmarks.md)
    model_paths: list[str] = field(default_factory=list)  # reward models (sequence classifiers)
    ensemble: str = "mean"  # mean | min over reward models
    # A batch in which more than this fraction of the reward function's calls fail (raise, or return
    # no usable score) stops the run with the first traceback; failures below it score 0 and are
    # counted in reward/errors. 1.0: never stop.
    max_error_fraction: float = 0.5


@dataclass
class ResourcesConfig:
    nodes: int = 1
    procs_per_node: int = 2
    use_gpu: bool = False
    placement: str = "colocated"  # colocated (hybrid engine) | split
    # split placement: processes of each separate pool (actor, rollout: generation, critic, ref);
    # a role not named gets the actor's count
    split_procs: dict = field(default_factory=dict)
    cpus_per_proc: float = 1.0
    # After a node is lost (trainer.max_restarts > 0): go on with fewer nodes and a smaller dp when
    # that layout is valid (true), else wait this many seconds for the cluster to have room again
    # (the node back, or another one) before failing (controller/lifecycle/node_loss.py).
    elastic: bool = False
    node_wait_s: float = 300.0
    # GiB of one GPU that the dry run's memory estimate compares with (what torch.cuda.mem_get_info
    # reports as total, e.g. 79.19 for an H100 80GB); None: the GPU visible where the dry run runs,
    # else an H100 80GB's 79.19.
    device_memory_gib: float | None = None


@dataclass
class RayConfig:
    """Which Ray the driver uses (docs/ray.md). `address` null and no RAY_ADDRESS: a private Ray on
    this machine, started for the run and stopped with it, even when another cluster runs here.
    Set (an ip:port, a ray:// URL, or "auto" for the cluster `ray start` made on this machine): join it."""

    address: str | None = None
    num_cpus: int | None = None  # logical CPUs of a private Ray (None: max(16, this machine's cores))


@dataclass
class TrainerConfig:
    total_steps: int = 20
    val_every: int = 5
    save_every: int = 0  # 0: only at the end
    # also a checkpoint whenever this many minutes passed since the last (0: off): a crash, OOM or lost
    # node then costs at most this much work
    save_every_minutes: float = 30.0
    # SIGTERM/SIGINT: the step in flight finishes and a checkpoint is written if it fits in this many
    # seconds from the signal (schedulers' grace periods: SLURM 30-60 s, Kubernetes 30 s by default)
    preempt_grace_s: float = 30.0
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | off | a checkpoint path
    output_dir: str = "outputs"
    experiment: str = "ppo_tiny"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    export_hf: bool = True
    plot: bool = True
    dry_run: bool = False
    # choose placement and layouts before starting: the fastest plan `rlframe plan` estimates with the
    # constants in ~/.cache/rlframe/plan_constants.json (or its defaults); docs/plan.md
    auto_plan: bool = False
    seed: int = 0
    progress_bar: bool = True
    # A worker process that dies mid-run (killed, out of memory): tear the groups down, start them
    # again and resume from the newest complete checkpoint, at most this many times.
    max_restarts: int = 1
    # Steps in a row whose optimizer steps were all skipped (non-finite gradients) or whose loss
    # was non-finite before the run stops with an error.
    max_nonfinite_steps: int = 3
    # How long a collective (barrier, all-reduce) in a worker group waits for its slowest rank: long
    # enough for one rank's multi-GB checkpoint write or model load while the others wait.
    collective_timeout_s: float = 1800.0
    # Asynchronous training (placement=split): the rollout for step t may come from the weights of step
    # t-1-k or later, so generation of the next batches overlaps training. 0: synchronous.
    max_staleness: int = 0
    # How asynchronous training generates (max_staleness > 0): batch = whole batches, up to k ahead,
    # refilled every k steps after one push (controller/trainers/async_rollout.py); stream = the generation group never waits:
    # prompt groups are admitted as others complete, while the staleness bound allows, in rounds of
    # rollout.partial_budget tokens, new weights loading between rounds (stream_rollout.py, docs/async.md).
    async_mode: str = "batch"
    # Every this many steps and at the last one, check that the rollout engine holds exactly the trainer's
    # weights after the sync (per-slice checksums, controller/trainers/weight_check.py). 0: never.
    check_weight_sync_every: int = 0
    # A timeline of the run (docs/observability.md): every worker group call per rank, the driver's phases,
    # weight pushes and generation rounds, written to <run dir>/trace.json (Chrome trace: ui.perfetto.dev).
    trace: bool = False
    # Serve the latest step's metrics for Prometheus at http://<prometheus_host>:<port>/metrics on the
    # driver (docs/observability.md). 0: no endpoint. 127.0.0.1 answers this machine only; 0.0.0.0 all.
    prometheus_port: int = 0
    prometheus_host: str = "127.0.0.1"
    # PPO with a critic: the first this many steps update only the critic (the actor does not learn
    # from a value head that is still random; verl's critic_warmup). 0: off.
    critic_warmup: int = 0
    # What the model generated (docs/generations.md): every this many steps the step's samples go to
    # <run dir>/generations/train.jsonl, and while on every held-out evaluation's to val.jsonl. 0: off.
    rollout_dump_every: int = 0
    rollout_dump_rows: int = 64  # rows per dump at most: the batch's first groups (a prompt's samples), whole
    rollout_dump_logprobs: bool = False  # each row also holds the rollout engine's log-prob of every response token
    # A generations file that reaches this many MiB is rotated (train.jsonl -> train.jsonl.1 -> .2, the
    # oldest deleted): a kind of dump takes at most about 3x this.
    rollout_dump_max_mb: float = 100.0


@dataclass
class AgentConfig:
    # Multi-turn rollouts with tools (docs/agents.md): the policy calls tools between its turns.
    enabled: bool = False
    tools_path: str | None = None  # a .py file defining tools (rlframe.agents.tools); None: built-ins only
    builtin_tools: list[str] = field(default_factory=lambda: ["calculator"])
    max_turns: int = 3  # assistant turns per trajectory
    max_result_chars: int = 256  # a tool result is cut to this many characters
    max_calls_per_turn: int = 8  # calls past this in one turn are not run: answered with an error
    # A trajectory whose tool calls have taken this many seconds (wall clock, all turns) ends there.
    max_tool_seconds_per_trajectory: float = 20.0
    # tools: the in-process loop above. openai: `environment` (path.py:function, an
    # `async def episode(client, row)` using an openai.AsyncOpenAI client) drives the policy through an
    # OpenAI-compatible endpoint, its episodes recorded token for token (docs/agents.md).
    mode: str = "tools"
    environment: str | None = None
    concurrency: int = 0  # episodes at once (0: all of a rollout's, as the in-process loop batches them)
    episode_timeout_s: float = 300.0  # past it an episode is scored 0
    endpoint_host: str = "127.0.0.1"  # where the endpoint listens (only this machine's processes by default)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: TrainRoleConfig = field(default_factory=TrainRoleConfig)
    critic: TrainRoleConfig = field(default_factory=TrainRoleConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardConfig = field(default_factory=RewardConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    imports: list[str] = field(default_factory=list)  # modules that register custom algorithms/workers

    @property
    def off_policy(self) -> bool:
        """Whether a batch may hold tokens sampled by weights older than those being trained:
        asynchronous rollouts, or partial rollouts continued across updates."""
        return self.trainer.max_staleness > 0 or self.rollout.partial_budget > 0

    @property
    def uses_critic(self) -> bool:
        """The run has a critic: its algorithm takes advantages from an estimator whose traits ask for
        values (rlframe.algos.register_advantage_estimator(..., needs_critic=True)). An unknown
        algorithm or estimator has none (validation names them)."""
        from rlframe.config.algorithms import estimator_traits

        traits = estimator_traits(self.algorithm)
        return traits is not None and traits.needs_critic

    @property
    def max_model_len(self) -> int:
        """The longest sequence the engines hold: a partial rollout's continuation may sample a whole
        budget past the response length (cut off after); a later agent turn's prompt holds the
        earlier turns and may ask for all tokens left."""
        d = self.data
        return d.prompt_length + d.response_length + self.rollout.partial_budget + \
            (d.response_length if self.agent.enabled else 0)

    @property
    def uses_ref(self) -> bool:
        if self.ref.enabled is not None:
            return self.ref.enabled
        return self.algorithm.kl_in_reward or self.algorithm.use_kl_loss
