"""One training step's time for a plan, estimated from the model's FLOPs, the layout's collectives and
the dataflow's order (what can run at once), with constants fitted on the machine (`calibrate`).

The step, as the PPO-family trainer runs it (controller/trainers/ppo.py):

    gen                                   on the generating processes (the actor's when colocated)
    reward                                in the driver
    ref | old_log_prob | values           issued together: at once when their groups differ (split)
    update_critic | update_actor          likewise
    weight sync                           the actor's new weights into the generation layout

Every phase's time on a group is compute (FLOPs / the rate one process reaches, the phase's share of
the matmul peak) + fixed costs (per worker call, per micro-batch, per decode step) + its collectives
(latency + bytes / bandwidth, ring algorithms). Phases that run at once share the machine: when more
processes compute than there are cores (CPUs; on GPUs one process a device) each runs slower by
active / cores. Asynchronous plans (trainer.max_staleness >= 1) overlap the next batch's generation
with this step's training, so the step is the longer of the two, both slowed by the sharing.

What is estimated, not measured: response lengths (data.response_length x `response_fill`), even
pipeline stages, FSDP's gathers per micro-batch, attention FLOPs at the mean context.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path

from rlframe.plugins import engine_spec
from rlframe.config.algorithms import algorithm_spec, estimator_traits
from rlframe.config.resources import generation_group, has_reference_group, role_world_sizes
from rlframe.config.schema import RunConfig, TrainRoleConfig
from rlframe.resharding.formats import ModelDims, hf_param_shapes


@dataclass(frozen=True)
class Constants:
    """The machine's numbers the estimate scales by (`rlframe plan --calibrate` fits them)."""

    flops: float = 100e9          # FLOP/s of one process alone on a large matmul (the compute dtype)
    cores: float = 2.0            # processes a host computes at full rate at once (its CPU cores; GPUs: a device each)
    train_eff: float = 0.3        # share of `flops` a training micro-batch reaches (forward + backward)
    infer_eff: float = 0.3        # share for forward-only passes (log-probs, values, prefill)
    decode_eff: float = 0.05      # share for a decode step's matmuls (small batches: memory-bound)
    call_s: float = 0.02          # one worker-group call: dispatch, batch transfer, collection
    micro_s: float = 0.005        # per micro-batch per rank: python, kernel launches
    decode_s: float = 0.002       # per decode step per replica: scheduling, sampling
    latency_s: float = 1e-4       # per collective hop between processes of one host
    tp_call_s: float = 0.0        # per tensor-parallel collective beyond its hops: dispatch (DTensor, autograd)
    bandwidth: float = 2e9        # bytes/s a process moves to another on one host
    net_latency_s: float = 1e-3   # likewise between hosts
    net_bandwidth: float = 1e9
    response_fill: float = 1.0    # mean response length / data.response_length
    memory_bandwidth: float = math.inf  # bytes/s a process reads its weights and KV cache at (decode steps)
    source: str = "defaults, not calibrated"

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Constants:
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class StepCost:
    """Seconds per phase (as the trainer's timing_s/<phase> timers show them, but `gen` without the
    weight sync, which the trainer's gen timer includes) and the step's total."""

    phases: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    notes: list[str] = field(default_factory=list)


# ---- the model's arithmetic -----------------------------------------------------------------------
def matmul_params(dims: ModelDims, *, head: str = "lm") -> int:
    """Parameters that take part in a matmul per token: every 2-D weight but the embedding table
    (a lookup), the LM head's H x V (or a value head's H x 1)."""
    shapes = hf_param_shapes(dims)
    n = sum(prod(s) for name, s in shapes.items() if len(s) == 2 and "embed_tokens" not in name and "lm_head" not in name)
    return n + dims.hidden_size * (dims.vocab_size if head == "lm" else 1)


def all_params(dims: ModelDims, *, head: str = "lm") -> int:
    """Every parameter a role trains and its data-parallel ranks gather and reduce (with a value head
    of H x 1 instead of the LM head)."""
    shapes = hf_param_shapes(dims)
    n = sum(prod(s) for name, s in shapes.items() if "lm_head" not in name)
    lm_head = 0 if dims.tied_embeddings else dims.hidden_size * dims.vocab_size
    return n + (lm_head if head == "lm" else dims.hidden_size)


def flops_per_token(dims: ModelDims, *, context: float, head: str = "lm") -> float:
    """Forward FLOPs of one token: 2 per matmul parameter, and attention's scores and weighted sum
    (2 x 2 x hidden per earlier token, every layer) at `context` tokens."""
    return 2.0 * matmul_params(dims, head=head) + 4.0 * dims.num_layers * dims.hidden_size * context


def ring_seconds(nbytes: float, ranks: int, *, latency: float, bandwidth: float, kind: str = "all_reduce") -> float:
    """A ring collective over `ranks` processes: all-reduce moves 2 (n-1)/n of the bytes in 2 (n-1)
    hops; all-gather and reduce-scatter (n-1)/n in n-1."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    hops = (2 if kind == "all_reduce" else 1) * (ranks - 1)
    return hops * latency + hops / ranks * nbytes / bandwidth


# ---- phases ----------------------------------------------------------------------------------------
class CostModel:
    def __init__(self, cfg: RunConfig, dims: ModelDims, c: Constants):
        self.cfg, self.dims, self.c = cfg, dims, c
        d = cfg.data
        self.samples = d.train_batch_size * cfg.algorithm.n_samples
        self.response = d.response_length * c.response_fill
        self.seq = d.prompt_length + self.response
        dataflow = algorithm_spec(cfg.algorithm).dataflow
        if dataflow:
            what = f"algorithm.trainer={cfg.algorithm.trainer}" if cfg.algorithm.trainer is not None else dataflow
            raise ValueError(f"rlframe plan models the PPO-family step; {cfg.algorithm.name}'s trainer ({what}) "
                             "is not modelled")
        self.b = 2 if cfg.actor.precision == "bf16" or (cfg.actor.precision == "auto" and cfg.resources.use_gpu) else 4
        self.cores = math.inf if cfg.resources.use_gpu else c.cores * cfg.resources.nodes  # GPUs: a device per process
        # FSDP on CPUs gathers each layer once per step and keeps it (engines/fsdp: gather_once_per_step)
        self.gather_once = not cfg.resources.use_gpu

    def ring(self, nbytes: float, ranks: int, kind: str = "all_reduce", *, stride: int = 1) -> float:
        """A collective over `ranks` processes `stride` apart in rank order (tp 1, dp tp, pp tp x dp:
        Megatron's order): between hosts when the group spans more than one host's processes."""
        c = self.c
        spans = self.cfg.resources.nodes > 1 and ranks * stride > self.cfg.resources.procs_per_node
        return ring_seconds(nbytes, ranks, latency=c.net_latency_s if spans else c.latency_s,
                            bandwidth=c.net_bandwidth if spans else c.bandwidth, kind=kind)

    def _tp_collectives(self, role: TrainRoleConfig, rows: float, per_layer: int) -> float:
        """Megatron-style tensor parallelism: `per_layer` all-reduces of a micro-batch's activations
        (rows x seq x hidden) per layer of the rank's stage."""
        if role.tp <= 1:
            return 0.0
        layers = self.dims.num_layers / role.pp
        return per_layer * layers * (self.c.tp_call_s + self.ring(rows * self.seq * self.dims.hidden_size * self.b, role.tp))

    def _pass(self, role: TrainRoleConfig, *, head: str, train: bool) -> float:
        """One pass over the step's samples by a role's group (per rank: its dp share, its tp/pp slice)."""
        c, dp, tp, pp = self.c, role.dp * role.sp, role.tp, role.pp
        rows = self.samples / dp
        epochs = role.ppo_epochs if train else 1
        micro = max(1, rows // role.micro_batch_size) * epochs
        per_token = flops_per_token(self.dims, context=self.seq / 2, head=head) * (3 if train else 1)
        compute = per_token * self.samples * self.seq * epochs / (dp * tp * pp) / (c.flops * (c.train_eff if train else c.infer_eff))
        if pp > 1:  # 1F1B: (pp - 1) idle slots per pipeline flush of m micro-batches
            per_flush = role.mini_batch_size // dp if train else rows  # a forward pass runs every row in one flush
            m = max(1, per_flush // role.micro_batch_size)
            compute *= 1 + (pp - 1) / m
        comm = micro * self._tp_collectives(role, role.micro_batch_size, 4 if train else 2)
        shard = all_params(self.dims, head=head) / (tp * pp)
        steps = max(1, self.samples // role.mini_batch_size) * epochs if train else 1
        if dp > 1 and engine_spec(role.strategy).weights_sharded_over_dp:
            if self.gather_once:  # CPUs: each layer gathered once per step (call), gradients reduced per optimizer step
                comm += self.ring(shard * self.b, dp, "all_gather", stride=tp)
                comm += steps * self.ring(shard * 4, dp, "reduce_scatter", stride=tp) if train else 0.0
            else:  # ZeRO-3 per micro-batch: gather forward (and backward), reduce-scatter the gradients
                gathers = 2 if train else 1
                comm += micro * (gathers * self.ring(shard * self.b, dp, "all_gather", stride=tp)
                                 + (self.ring(shard * 4, dp, "reduce_scatter", stride=tp) if train else 0.0))
        elif dp > 1 and train:  # replicated weights: the gradient buffer's all-reduce once per optimizer step
            comm += steps * self.ring(shard * 4, dp, stride=tp)
        return c.call_s + micro * c.micro_s + compute + comm

    def concurrent_sequences(self, tp: int) -> int:
        """Sequences one replica decodes at once: rollout.max_num_seqs, or fewer when its KV cache
        (the dry run's estimate of what vLLM gets) holds fewer whole sequences."""
        from rlframe.plan.memory_estimate import GiB, Estimate

        d, cfg = self.dims, self.cfg
        rows = Estimate(cfg, d, hf_param_shapes(d), self.b).vllm_rows()
        kv_gib = next((g for name, g in rows if name.startswith("vLLM KV cache")), math.inf)
        per_token = 2 * d.num_layers * d.num_kv_heads * d.head_dim * self.b / tp  # K and V, this rank's heads
        longest = cfg.data.prompt_length + cfg.data.response_length
        return max(1, min(cfg.rollout.max_num_seqs, int(max(kv_gib, 0.0) * GiB / per_token // longest)))

    def generate(self, samples: float | None = None) -> float:
        """`samples` (default the step's) by the generation replicas at once: prefill, then one
        decode step per token (at most rollout.partial_budget of them with partial rollouts), in as
        many waves as the replica's KV cache needs."""
        cfg, c, d = self.cfg, self.c, self.dims
        procs = role_world_sizes(cfg).get(generation_group(cfg), 0)
        tp = cfg.rollout.tp
        replicas = max(1, procs // tp)
        seqs = (self.samples if samples is None else samples) / replicas
        steps = min(self.response, cfg.rollout.partial_budget) if cfg.rollout.partial_budget else self.response
        batch = min(seqs, self.concurrent_sequences(tp))
        waves = math.ceil(seqs / batch)
        prompt = cfg.data.prompt_length
        prefill = seqs * prompt * flops_per_token(d, context=prompt / 2) / tp / (c.flops * c.infer_eff)
        context = prompt + self.response / 2
        per_step = batch * flops_per_token(d, context=context) / tp / (c.flops * c.decode_eff)
        # a decode step also reads the rank's weights and its sequences' KV cache once: memory-bound
        # when that takes longer than the step's FLOPs (small batches on GPUs)
        kv = batch * context * 2 * d.num_layers * d.num_kv_heads * d.head_dim * self.b / tp
        per_step = max(per_step, (matmul_params(d) * self.b / tp + kv) / c.memory_bandwidth)
        comm = 2 * d.num_layers * self.ring(batch * d.hidden_size * self.b, tp) if tp > 1 else 0.0
        return c.call_s + prefill + waves * steps * (c.decode_s + per_step + comm)

    def weight_sync(self) -> float:
        """The actor's weights into the generation layout: the planner's exact bytes, the most any
        generating rank receives (the ranks receive at once), in rollout.bucket_bytes buckets."""
        from rlframe.plan.dry_run import layouts
        from rlframe.resharding.planner import ParamMeta, cached_plan

        import torch

        train, gen, _ = layouts(self.cfg)
        dtype = torch.bfloat16 if self.b == 2 else torch.float32
        metas = {n: ParamMeta(s, dtype) for n, s in hf_param_shapes(self.dims).items()}
        plan = cached_plan(metas, src=train, dst=gen, num_layers=self.dims.num_layers)
        from rlframe.resharding.planner import make_buckets

        most = max((plan.bytes_received(r) for r in gen.ranks), default=0)
        buckets = len(make_buckets(plan, bucket_bytes=self.cfg.rollout.bucket_bytes))  # one latency each
        if self.cfg.actor.lora_rank > 0:  # only the adapters move (the base weights never change)
            from rlframe.plan.memory_estimate import lora_fraction

            most *= lora_fraction(hf_param_shapes(self.dims), self.cfg.actor)
            buckets = 1
        spans = self.cfg.resources.nodes > 1  # some of the bytes cross hosts: the slower link sets the pace
        latency, bandwidth = (self.c.net_latency_s, self.c.net_bandwidth) if spans else (self.c.latency_s, self.c.bandwidth)
        return self.c.call_s + latency * max(1, buckets) + most / bandwidth

    # ---- the dataflow --------------------------------------------------------------------------
    def step(self) -> StepCost:
        cfg, c = self.cfg, self.c
        sizes = role_world_sizes(cfg)
        split = cfg.resources.placement == "split"
        world = cfg.resources.nodes * cfg.resources.procs_per_node
        from rlframe.controller.trainers.phases import needs_old_log_probs

        # the reference's pass: its own group when split, else the actor's (with LoRA: adapters off)
        groups = {"ref": "ref" if split and has_reference_group(cfg) else "actor",
                  "old_log_prob": "actor", "values": "critic" if split else "actor",
                  "update_actor": "actor", "update_critic": "critic" if split else "actor"}
        forward, update = {}, {}
        if cfg.uses_ref:
            forward["ref"] = self._pass(cfg.actor, head="lm", train=False)
        if needs_old_log_probs(cfg, rows=self.samples):
            forward["old_log_prob"] = self._pass(cfg.actor, head="lm", train=False)
        if cfg.uses_critic:
            forward["values"] = self._pass(cfg.critic, head="value", train=False)
            update["update_critic"] = self._pass(cfg.critic, head="value", train=True)
        update["update_actor"] = self._pass(cfg.actor, head="lm", train=True)

        def procs(group: str) -> int:
            return sizes.get(group, world) if split else world

        def alone(seconds: float, n: int) -> float:
            """A part's time when nothing else runs: its n processes share the cores."""
            return seconds * max(1.0, n / self.cores)

        def together(parts: list[tuple[float, int]]) -> float:
            """Parts running at once (time alone, processes): the longest of them, or the cores'
            total work when that is longer (n processes keep min(n, cores) cores busy)."""
            if not parts:
                return 0.0
            return max(max(t for t, _ in parts), sum(t * min(n, self.cores) for t, n in parts) / self.cores)

        def stage(phases: dict[str, float]) -> tuple[dict[str, float], float, int]:
            """Phases issued together: a group runs its own in turn, groups run at once. Returns each
            phase's timer (the trainer waits on them in issue order, so a timer is the time from the
            previous one's end to its own finish), the stage's seconds and its processes."""
            by_group: dict[str, list[str]] = {}
            for name in phases:
                by_group.setdefault(groups[name], []).append(name)
            parts = [(alone(sum(phases[n] for n in names), procs(g)), procs(g)) for g, names in by_group.items()]
            total = together(parts)
            stretch = total / max((t for t, _ in parts), default=1.0) if parts else 1.0
            finish = {}
            for g, names in by_group.items():
                clock = 0.0
                for name in names:
                    clock += alone(phases[name], procs(g)) * stretch
                    finish[name] = clock
            timers, clock = {}, 0.0
            for name in phases:  # issue order
                timers[name] = max(0.0, finish[name] - clock)
                clock = max(clock, finish[name])
            return timers, total, sum(procs(g) for g in by_group)

        gen_procs = procs(generation_group(cfg)) if split else world
        work = self.generate()
        traits = estimator_traits(cfg.algorithm)
        if traits is not None and traits.extra_rollout == "greedy":  # and each prompt's greedy answer, its baseline
            work += self.generate(cfg.data.train_batch_size)
        gen = alone(work, gen_procs)
        fwd_t, fwd, fwd_n = stage(forward)
        upd_t, upd, upd_n = stage(update)
        sync = self.weight_sync()
        train = c.call_s + fwd + upd  # the reward call, the forward passes, the updates
        cost = StepCost(phases={"gen": gen, **fwd_t, **upd_t, "update_weights": sync})
        if split and cfg.trainer.max_staleness > 0:  # later batches generate while this one trains
            # the batch pipeline pushes once per k steps (async_rollout.refill); streaming once a step
            pushes = 1.0 if cfg.trainer.async_mode == "stream" else 1.0 / cfg.trainer.max_staleness
            cost.total = together([(gen, gen_procs), (train, max(fwd_n, upd_n))]) + sync * pushes
            cost.notes.append("asynchronous: generation and training at once, sharing the cores")
        else:
            cost.total = gen + train + sync
        return cost


# NVIDIA H100 SXM 80GB, assumed (no GPU has been measured with `--calibrate` yet); every number is
# a datasheet figure times an efficiency taken from published training and serving reports:
H100_ASSUMED = Constants(
    flops=989e12,               # bf16 dense tensor-core peak, no sparsity
    cores=math.inf,             # one device per process: processes never share compute
    train_eff=0.40,             # megatron-core at 7B-70B reports about 40% model FLOPs utilisation
    infer_eff=0.50,             # forward-only passes and prefill: larger kernels, no backward
    decode_eff=0.40,            # decode steps when compute-bound (large batches)
    memory_bandwidth=2.7e12,    # HBM3 3.35 TB/s at about 80%: the bound of small decode batches
    call_s=0.05,                # a worker-group call with its batch (Ray, serialisation)
    micro_s=0.005,              # per micro-batch per rank (launches, python)
    decode_s=0.004,             # vLLM's scheduling and sampling per decode step (with CUDA graphs)
    latency_s=1e-5, bandwidth=360e9,       # NVLink 4: 450 GB/s per direction at 80%, within a node
    net_latency_s=2e-5, net_bandwidth=40e9,  # 400 Gb/s InfiniBand NDR per GPU at 80%, between nodes
    response_fill=1.0,          # every response as long as data.response_length (the worst case)
    source="assumed H100 SXM figures, not measured (rlframe/plan/cost.py H100_ASSUMED)")
PRESETS = {"h100-assumed": H100_ASSUMED}


def estimate(cfg: RunConfig, dims: ModelDims, c: Constants) -> StepCost:
    return CostModel(cfg, dims, c).step()
