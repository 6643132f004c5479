"""The plans `rlframe plan` compares: the ways to place and parallelise one run's roles on its cluster
that the config rules accept and, on GPUs, whose devices hold them.

A plan is a handful of settings on top of the user's config: the placement (colocated, or split with
each group's processes), each trained role's engine and layout (strategy, dp, tp, pp) and micro-batch,
the rollout's tensor parallelism (replicas = generating processes / rollout.tp) and, with split
placement, how far generation may run ahead (trainer.max_staleness). The rules that build them are
the validator's, applied constructively (tp divides the kv heads, pp the layers, an engine's spec
says which parallelisms and models it has, colocated roles of an engine with one model-parallel
state per process share tp and pp, micro-batches divide each rank's mini-batch rows); every
plan is then checked by the run's own `validate`, so a listed plan is a config that starts, and a
plan the rules built but the validator refused is reported (`Space.refused`), never dropped quietly.
The memory verdict is the dry run's (`memory_estimate.Estimate`), the one memory model.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from rlframe.config.build import build_config, to_dict
from rlframe.config.resources import has_reference_group
from rlframe.config.schema import RunConfig
from rlframe.config.validate import ConfigError, validate
from rlframe.plugins import TRAIN_ENGINES, backend_spec, engine_spec
from rlframe.resharding.formats import ModelDims

MICRO_CHOICES = 3  # per role on CPUs (no memory verdict): the largest micro-batches that divide a rank's rows


@dataclass(frozen=True)
class Plan:
    """Dotted config keys and their values, in a stable order (what the written config sets)."""

    settings: tuple[tuple[str, Any], ...]

    @property
    def values(self) -> dict[str, Any]:
        return dict(self.settings)

    def overrides(self, base: RunConfig) -> list[str]:
        """The settings as command-line overrides on `base`. Hydra merges `key={...}` into a mapping
        the config already sets, so a mapping `base` sets is deleted first and then added."""
        raw, out = to_dict(base), []
        for key, value in self.settings:
            now = raw
            for part in key.split("."):
                now = now[part]
            replace = isinstance(value, dict) and now
            out += [f"~{key}", f"+{key}={_render(value)}"] if replace else [f"{key}={_render(value)}"]
        return out

    def apply(self, base: RunConfig) -> RunConfig:
        """`base` with this plan's settings (what the overrides give on the command line)."""
        raw = copy.deepcopy(to_dict(base))
        for key, value in self.settings:
            *path, last = key.split(".")
            node = raw
            for part in path:
                node = node[part]
            node[last] = copy.deepcopy(value)
        return build_config(raw)

    def label(self) -> str:
        v = self.values

        def role(name: str) -> str:
            if f"{name}.dp" not in v:
                return ""
            return (f" {name} {v[f'{name}.strategy']} dp{v[f'{name}.dp']} tp{v[f'{name}.tp']} pp{v[f'{name}.pp']}"
                    f" mb{v[f'{name}.micro_batch_size']}")

        place = v["resources.placement"]
        if place == "split":
            place += " " + "/".join(f"{k}{n}" for k, n in v["resources.split_procs"].items())
            if v["trainer.max_staleness"]:
                place += f" k={v['trainer.max_staleness']}"
        return f"{place}:{role('actor')}{role('critic')} rollout tp{v['rollout.tp']}"


ROLE_KEYS = ("strategy", "dp", "tp", "pp", "sp", "sequence_parallel", "micro_batch_size", "max_tokens_per_micro_batch")


def plan_keys(cfg: RunConfig) -> list[str]:
    """The config keys a plan of `cfg` sets."""
    roles = ["actor"] + (["critic"] if cfg.uses_critic else [])
    return ["resources.placement", "resources.split_procs", *(f"{r}.{k}" for r in roles for k in ROLE_KEYS),
            "rollout.tp", "trainer.max_staleness"]


def plan_of(cfg: RunConfig, raw: dict | None = None) -> Plan:
    """The plan `cfg` (or a config dict `raw`, such as a checkpoint records) runs."""
    raw = to_dict(cfg) if raw is None else raw
    settings = []
    for key in plan_keys(cfg):
        value = raw
        for part in key.split("."):
            value = value[part]
        settings.append((key, value))
    return Plan(tuple(settings))


def _render(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@dataclass
class Space:
    """What the enumeration found: plans that validate (with their configs), the plans the
    validator refused (a disagreement between these rules and the validator's: a bug here), and,
    on GPUs, the plans whose devices would not hold them (the dry run's peak, GiB)."""

    plans: list[tuple[Plan, RunConfig]] = field(default_factory=list)
    refused: list[tuple[Plan, list[str]]] = field(default_factory=list)
    too_big: list[tuple[Plan, float]] = field(default_factory=list)


def engine_accepts(strategy: str, tp: int, pp: int, dims: ModelDims, model_type: str) -> bool:
    """What the engines check when they build the model (their specs' check_model; tests/plan compares
    the two): the engine has the parallelisms asked and builds this architecture (its spec's
    model_types, tied embeddings); tp splits the heads, kv heads, MLP and vocabulary evenly, pp the
    layers; tensor parallelism cannot split a tied embedding."""
    spec = engine_spec(strategy)
    if (tp > 1 and not spec.supports("tp")) or (pp > 1 and not spec.supports("pp")):
        return False
    if not spec.builds(model_type, tied=dims.tied_embeddings):
        return False
    if tp > 1 and dims.tied_embeddings:
        return False
    split = (dims.num_heads, dims.num_kv_heads, dims.intermediate_size, dims.vocab_size)
    return not any(n % tp for n in split) and not dims.num_layers % pp


def layouts(n: int, dims: ModelDims, *, strategies=None, lora: bool = False,
            model_type: str = "qwen2") -> list[tuple[str, int, int, int]]:
    """(strategy, dp, tp, pp) with dp * tp * pp = n that the engines build (`engine_accepts`), over the
    registered engines (or `strategies`); with LoRA only engines that have it."""
    out = []
    for strategy in strategies or TRAIN_ENGINES.names():
        if lora and not engine_spec(strategy).lora:
            continue
        for tp in _divisors(n):
            for pp in _divisors(n // tp):
                if engine_accepts(strategy, tp, pp, dims, model_type):
                    out.append((strategy, n // (tp * pp), tp, pp))
    return out


def micro_batches(rows_per_rank: int, choices: int | None = MICRO_CHOICES) -> list[int]:
    """The powers of two dividing a rank's mini-batch rows, largest first; the `choices` largest
    (None: all of them, for GPUs, where the memory estimate decides which fit)."""
    out = [m for m in (2 ** i for i in range(rows_per_rank.bit_length())) if rows_per_rank % m == 0]
    return sorted(out, reverse=True)[:choices]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _role_settings(name: str, layout: tuple[str, int, int, int], micro: int) -> list[tuple[str, Any]]:
    strategy, dp, tp, pp = layout  # an engine with sequence parallelism splits activations over tp when it has tp
    values = (strategy, dp, tp, pp, 1, engine_spec(strategy).sequence_parallel and tp > 1, micro, None)
    return [(f"{name}.{k}", v) for k, v in zip(ROLE_KEYS, values)]


def _role_choices(cfg: RunConfig, name: str, n: int, dims: ModelDims, strategies,
                  layout: tuple[str, int, int, int] | None = None) -> list[list[tuple[str, Any]]]:
    """A role's settings on n processes: every layout (or the one given) x its micro-batches."""
    role = getattr(cfg, name)
    samples = cfg.data.train_batch_size * cfg.algorithm.n_samples
    choices = None if cfg.resources.use_gpu else MICRO_CHOICES
    out = []
    if layout and role.lora_rank > 0 and not engine_spec(layout[0]).lora:
        return []
    for lay in [layout] if layout else layouts(n, dims, strategies=strategies, lora=role.lora_rank > 0,
                                               model_type=model_type_of(cfg)):
        dp = lay[1]
        if samples % dp or role.mini_batch_size % dp:
            continue
        out += [_role_settings(name, lay, m) for m in micro_batches(role.mini_batch_size // dp, choices)]
    return out


def _layout_of(settings: list[tuple[str, Any]]) -> tuple[str, int, int, int]:
    v = {k.split(".", 1)[1]: x for k, x in settings}
    return v["strategy"], v["dp"], v["tp"], v["pp"]


def model_type_of(cfg: RunConfig) -> str:
    from rlframe.plan.dry_run import model_config

    return str(model_config(cfg).get("model_type", ""))


def _rollout_tps(cfg: RunConfig, n: int, dims: ModelDims) -> list[int]:
    """The rollout backend's tensor parallelism (its spec: vLLM's, with whole kv heads per rank); a
    backend without it (transformers generate) runs a whole model per process."""
    if not backend_spec(cfg.rollout.backend).tensor_parallel:
        return [1]
    return [tp for tp in _divisors(n) if dims.num_kv_heads % tp == 0]


def async_allowed(cfg: RunConfig) -> bool:
    """Generation ahead of training (max_staleness > 0) is open to this run's algorithm (the
    validator's rule: one generated batch per step, no extra rollout such as ReMax's greedy pass, an
    algorithm that generates)."""
    from rlframe.config.algorithms import algorithm_spec, estimator_traits

    alg, traits = cfg.algorithm, estimator_traits(cfg.algorithm)
    return (algorithm_spec(alg).generates and not (traits and traits.extra_rollout) and not alg.dynamic_sampling
            and cfg.rollout.partial_budget == 0 and not cfg.agent.enabled)


def candidates(cfg: RunConfig, dims: ModelDims, *, strategies=None, max_staleness: int | None = None) -> list[Plan]:
    """Every plan the rules build for `cfg`'s cluster (nodes x procs_per_node processes). Generation
    runs ahead of training by at most `max_staleness` (default: the config's own
    trainer.max_staleness; 0 keeps the run on-policy, as asynchronous training changes what it learns)."""
    res = cfg.resources
    world = res.nodes * res.procs_per_node
    critic = cfg.uses_critic
    plans = []
    for actor in _role_choices(cfg, "actor", world, dims, strategies):  # colocated: every role on every process
        # the critic in the actor's layout (colocated megatron roles must share tp and pp), its own micro-batch
        critics = _role_choices(cfg, "critic", world, dims, strategies, _layout_of(actor)) if critic else [[]]
        for crit in critics:
            for tp in _rollout_tps(cfg, world, dims):
                plans.append(Plan((("resources.placement", "colocated"), ("resources.split_procs", {}),
                                   *actor, *crit, ("rollout.tp", tp), ("trainer.max_staleness", 0))))
    if res.use_gpu:  # split placement is CPU-only today (the validator refuses it on GPUs)
        return plans
    ref = has_reference_group(cfg)
    bound = cfg.trainer.max_staleness if max_staleness is None else max_staleness
    ks = sorted({0, bound} if async_allowed(cfg) else {0})  # 1 <= k < bound overlap no more than k = bound
    for a, c, g in itertools.product(range(1, world + 1), repeat=3):
        if not critic and c > 1:
            continue
        if a * (2 if ref else 1) + (c if critic else 0) + g > world:
            continue
        procs = {"actor": a, **({"critic": c} if critic else {}), **({"ref": a} if ref else {}), "rollout": g}
        for actor, crit, tp, k in itertools.product(
                _role_choices(cfg, "actor", a, dims, strategies),
                _role_choices(cfg, "critic", c, dims, strategies) if critic else [[]],
                _rollout_tps(cfg, g, dims), ks):
            plans.append(Plan((("resources.placement", "split"), ("resources.split_procs", procs),
                               *actor, *crit, ("rollout.tp", tp), ("trainer.max_staleness", k))))
    return plans


def peak_gib(cfg: RunConfig, dims: ModelDims) -> float:
    """The dry run's estimate of the fullest device, GiB."""
    return fits(cfg, dims)[1]


def fits(cfg: RunConfig, dims: ModelDims) -> tuple[bool, float]:
    """(whether the devices hold the plan, the fullest one's GiB): the dry run's verdict."""
    from rlframe.plan.dry_run import runtime_dtype
    from rlframe.plan.memory_estimate import Estimate
    from rlframe.resharding.formats import hf_param_shapes

    est = Estimate(cfg, dims, hf_param_shapes(dims), runtime_dtype(cfg).itemsize)
    ok, worst, _ = est.verdict(est.devices())
    return ok, worst.peak_gib


def enumerate_plans(base: RunConfig, dims: ModelDims, **kw) -> Space:
    """The plans for `base` (the user's config, trainer.dry_run=true so that only the config is
    checked), each applied and validated; on GPUs, kept when the dry run's peak fits the device."""
    space = Space()
    for plan in candidates(base, dims, **kw):
        try:
            cfg = validate(plan.apply(base))
        except ConfigError as err:
            space.refused.append((plan, err.problems))
            continue
        if cfg.resources.use_gpu:
            ok, peak = fits(cfg, dims)
            if not ok:
                space.too_big.append((plan, peak))
                continue
        space.plans.append((plan, cfg))
    return space
