"""Cross-field checks of a `RunConfig`, run in the driver before any worker starts.

Every problem found is reported at once, each saying what is wrong, why, and how to fix it.
"""

from __future__ import annotations

import importlib

from rlframe.config.algorithms import ALGORITHMS, AlgorithmSpec, algorithm_spec, estimator_traits, known
from rlframe.config.ranges import check_ranges
from rlframe.config.off_policy import check_rollout_correction
from rlframe.config.resources import check_private_cluster, generation_group, role_world_sizes
from rlframe.config.run_files import check_paths
from rlframe.config.schedule import optimizer_steps, optimizer_steps_per_step
from rlframe.config.schema import RunConfig
from rlframe.plugins import ROLLOUT_BACKENDS, TRAIN_ENGINES, backend_spec, engine_spec

PARALLELISM_NAMES = {"tp": "tensor parallelism", "pp": "pipeline parallelism", "sp": "Ulysses sequence parallelism"}


class ConfigError(ValueError):
    """One or more problems in a run's configuration."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def load_class(target: str):
    """The class named by "package.module:Class" (ValueError saying what is wrong otherwise)."""
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"{target!r} must look like 'package.module:ClassName'")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load {target!r} ({type(err).__name__}: {err}); check the module is on "
                         "PYTHONPATH and defines the class") from err
    if not isinstance(obj, type):
        raise ValueError(f"{target!r} is a {type(obj).__name__}, not a class")
    return obj


def import_user_modules(cfg: RunConfig) -> None:
    """Import `imports:` modules (they register custom estimators, losses, workers)."""
    for name in cfg.imports:
        try:
            importlib.import_module(name)
        except Exception as err:
            raise ConfigError([f"imports: module {name!r} failed to import ({type(err).__name__}: {err}); "
                               "check the module name and that its directory is on PYTHONPATH"]) from err


def _check_algorithm(cfg: RunConfig, out: list[str]) -> None:
    from rlframe.algos.registry import (
        ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, resolve_loss_agg_mode,
    )

    alg = cfg.algorithm
    if not known(alg):
        out.append(f"algorithm.name={alg.name!r} is unknown; choose one of {', '.join(ALGORITHMS)} "
                   "(a custom algorithm keeps one of these dataflows and registers its estimator/loss)")
    spec = algorithm_spec(alg) if known(alg) else AlgorithmSpec(alg.name)  # (the PPO family's, to check the rest)
    if cfg.trainer.auto_plan and spec.dataflow:
        out.append(f"trainer.auto_plan=true chooses layouts by the PPO-family step's estimate, and "
                   f"algorithm.name={alg.name} runs {spec.dataflow}; set "
                   "trainer.auto_plan=false and choose the layout (rlframe plan lists the valid ones)")
    for what, target in (("algorithm.trainer", alg.trainer), ("actor.worker_cls", cfg.actor.worker_cls),
                         ("critic.worker_cls", cfg.critic.worker_cls)):
        if target is not None:
            try:
                load_class(target)
            except ValueError as err:
                out.append(f"{what}: {err}")
    for what, value, reg in (("algorithm.adv_estimator", alg.adv_estimator, ADVANTAGE_ESTIMATORS),
                             ("algorithm.policy_loss", alg.policy_loss, POLICY_LOSSES),
                             ("algorithm.kl_estimator", alg.kl_estimator, KL_ESTIMATORS),
                             ("algorithm.kl_loss_estimator", alg.kl_loss_estimator, KL_ESTIMATORS),
                             ("algorithm.loss_agg_mode", resolve_loss_agg_mode(
                                 policy_loss=alg.policy_loss, loss_agg_mode=alg.loss_agg_mode)
                              if alg.policy_loss in POLICY_LOSSES else alg.loss_agg_mode, LOSS_AGG_MODES)):
        if what == "algorithm.adv_estimator" and not spec.uses_estimator:
            continue
        if value not in reg:
            out.append(f"{what}={value!r} is not registered; known: {', '.join(reg.names())}; use one of "
                       "them (or register your own and list its module under imports:)")
    traits = estimator_traits(alg)
    if traits is not None and traits.needs_groups and alg.n_samples < 2:
        out.append(f"algorithm.adv_estimator={alg.adv_estimator!r} compares samples of the same prompt, "
                   f"so algorithm.n_samples must be >= 2 (got {alg.n_samples}); set algorithm.n_samples=4, say")
    if spec.pairs and alg.n_samples != 2:
        out.append(f"algorithm.name={alg.name} ranks two samples per prompt: set algorithm.n_samples=2 "
                   f"(got {alg.n_samples})")
    from rlframe.data.synthetic import GROUND_TRUTH_NOT_ANSWER

    if spec.trains_on_ground_truth and cfg.data.task in GROUND_TRUTH_NOT_ANSWER and not cfg.data.train_files:
        task = cfg.data.task
        out.append(f"algorithm.name={alg.name} trains on each row's ground truth as the answer text, but data.task={task}'s "
                   f"ground truth is {GROUND_TRUTH_NOT_ANSWER[task]}, not the answer text; train {task} with an RL "
                   "algorithm (its reward checks the answer), or give data.train_files whose ground truths are answers")
    if not out:  # keys that contradict the name (an unknown name or estimator is said above)
        from rlframe.config.algorithms import name_problems

        out.extend(name_problems(cfg))


def _check_layouts(cfg: RunConfig, out: list[str]) -> None:
    res = cfg.resources
    sizes = role_world_sizes(cfg)
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.uses_critic else [])
    for name, role in roles:
        n = sizes[name]
        spec = engine_spec(role.strategy)
        if role.sequence_parallel and not spec.sequence_parallel:
            out.append(f"{name}.sequence_parallel=true: strategy={spec.name} has no sequence parallelism inside tp "
                       f"({_engines_with(lambda s: s.sequence_parallel)}); set {name}.sequence_parallel=false "
                       "or another strategy")
        for dim in ("tp", "pp", "sp"):
            size = getattr(role, dim)
            if size > 1 and not spec.supports(dim):
                out.append(f"{name}.{dim}={size}: strategy={spec.name} ({spec.summary}) has no {PARALLELISM_NAMES[dim]} "
                           f"({_engines_with(lambda s: s.supports(dim))}); use {name}.{dim}=1 or another "
                           "strategy")
        _check_sequence_split(name, role, res, out)
        if role.dp * role.sp * role.tp * role.pp != n:
            where = (f"resources.nodes({res.nodes}) * resources.procs_per_node({res.procs_per_node})"
                     if res.placement == "colocated" or name not in (res.split_procs or {})
                     else f"resources.split_procs.{name}")
            sp = f" * sp({role.sp})" if role.sp > 1 else ""
            out.append(f"{name} layout dp({role.dp}){sp} * tp({role.tp}) * pp({role.pp}) = "
                       f"{role.dp * role.sp * role.tp * role.pp} != its {n} processes ({where}); set "
                       f"{name}.dp/{'sp/' if sp else ''}tp/pp so that the product equals the processes, or change the resources")
    shared = {(r.tp, r.pp) for _, r in roles if engine_spec(r.strategy).process_global_state}
    if res.placement == "colocated" and len(shared) > 1:
        which = sorted({r.strategy for _, r in roles if engine_spec(r.strategy).process_global_state})
        out.append(f"colocated {'/'.join(which)} roles use different (tp, pp) {sorted(shared)}; that engine keeps one "
                   "model-parallel state per process, so give actor and critic the same tp and pp (or placement=split)")
    gen_tp, gen = cfg.rollout.tp, generation_group(cfg)
    if gen_tp > sizes[gen]:
        out.append(f"rollout.tp={gen_tp} is larger than the {gen} group ({sizes[gen]} processes); "
                   f"use rollout.tp <= {sizes[gen]}")
    elif sizes[gen] % gen_tp:
        out.append(f"rollout.tp={gen_tp} must divide the {gen} group's {sizes[gen]} processes "
                   "(generation replicas = processes / rollout.tp)")


def _check_sequence_split(name: str, role, res, out: list[str]) -> None:
    """Ulysses (fsdp `sp`) and context parallelism (megatron `cp`): where each can run."""
    if role.sp < 1 or role.cp < 1:
        return  # said by the ranges
    if role.cp > 1:
        out.append(f"{name}.cp={role.cp}: megatron-core runs context parallelism only inside TransformerEngine's "
                   "attention (its own DotProductAttention asserts context_parallel_size == 1), and TransformerEngine "
                   f"needs CUDA, which this build does not use; split long sequences with {name}.sp={role.cp} "
                   f"(Ulysses: {_engines_with(lambda s: s.supports('sp'))}), or set {name}.cp=1")
    if role.sp > 1 and res.procs_per_node % (role.sp * role.tp):
        out.append(f"{name}.sp({role.sp}) * tp({role.tp}) = {role.sp * role.tp} ranks exchange every layer's "
                   f"activations (all-to-all, all-reduce) and must share a host: it must divide "
                   f"resources.procs_per_node={res.procs_per_node}; lower {name}.sp or {name}.tp")


def _check_weight_transport(cfg: RunConfig, out: list[str]) -> None:
    """rollout.weight_transport and weight_fanout: the split placement's channel (the hybrid engine syncs in
    its own group)."""
    ro, res = cfg.rollout, cfg.resources
    if ro.weight_sync == "delta" and res.use_gpu:
        out.append("rollout.weight_sync=delta keeps each rank's copy of what it syncs next to the weights, on the "
                   "device: on GPU that memory is not in the memory estimate and the delta path has not run there; "
                   "use rollout.weight_sync=full on GPU")
    if ro.weight_fanout == "chain" and res.placement != "split":
        out.append("rollout.weight_fanout=chain passes the weights from one generation replica to the next, between "
                   "the groups of split placement; resources.placement=colocated syncs each replica in its own "
                   "processes: set it back to direct or resources.placement=split")
    kind = ro.weight_transport
    if kind == "auto":
        return
    if res.placement != "split":
        out.append(f"rollout.weight_transport={kind} chooses how split placement's weight channel moves bytes; "
                   "resources.placement=colocated syncs inside the actor's own processes: set it back to auto "
                   "or resources.placement=split")
    elif kind == "shm" and res.nodes > 1:
        out.append(f"rollout.weight_transport=shm needs every rank on one host, but resources.nodes={res.nodes}; "
                   "use auto (gloo)")
    elif kind == "file" and not ro.weight_transport_dir:
        out.append("rollout.weight_transport=file needs rollout.weight_transport_dir: a directory on storage every "
                   "rank of both groups mounts")
    elif kind == "nccl":
        out.append("rollout.weight_transport=nccl is written for GPU clusters (rlframe/resharding/transport.py), but "
                   "this build has no NCCL and split placement on GPU is not supported yet (docs/gpu.md); use auto")


def _check_batches(cfg: RunConfig, out: list[str]) -> None:
    samples = cfg.data.train_batch_size * cfg.algorithm.n_samples
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.uses_critic else [])
    for name, role in roles:
        if role.dp < 1:
            continue
        if samples % role.dp:
            out.append(f"data.train_batch_size ({cfg.data.train_batch_size}) * algorithm.n_samples "
                       f"({cfg.algorithm.n_samples}) = {samples} samples is not divisible by {name}.dp={role.dp}; "
                       f"make it a multiple of {role.dp}")
        if samples % role.mini_batch_size:
            out.append(f"{name}.mini_batch_size={role.mini_batch_size} must divide the {samples} samples of a step "
                       f"(data.train_batch_size * algorithm.n_samples); use a divisor of {samples}")
        elif role.mini_batch_size % role.dp:
            out.append(f"{name}.mini_batch_size={role.mini_batch_size} must be divisible by {name}.dp={role.dp}; "
                       f"use a multiple of {role.dp}")
        per_rank = role.rows_per_rank
        if role.micro_batch_size and per_rank % role.micro_batch_size:
            out.append(f"{name}.micro_batch_size={role.micro_batch_size} must divide the per-rank mini-batch "
                       f"{role.mini_batch_size} / dp {role.dp} = {per_rank}; use a divisor of {per_rank}")


def _check_kl_and_sampling(cfg: RunConfig, out: list[str]) -> None:
    alg, data = cfg.algorithm, cfg.data
    if alg.overlong_buffer_len > data.response_length:
        out.append(f"algorithm.overlong_buffer_len={alg.overlong_buffer_len} must be at most "
                   f"data.response_length={data.response_length} (the penalty ramps over the last "
                   "overlong_buffer_len tokens of the budget); lower it, or 0 to turn shaping off")
    k, b = cfg.trainer.max_staleness, cfg.rollout.partial_budget
    spec = algorithm_spec(alg) if known(alg) else None
    traits = estimator_traits(alg)
    extra_rollout = traits.extra_rollout if traits else None
    # name the key the user set: algorithm=remax (or algorithm.name=remax) sets both name and estimator
    estimator_setting = (f"algorithm.name={alg.name}" if alg.name == alg.adv_estimator
                         else f"algorithm.adv_estimator={alg.adv_estimator}")

    def blocking(*extra: tuple[str, bool]) -> list[str]:
        """The settings on that make generation other than one batch of whole responses per step."""
        return [what for what, on in (*extra, (estimator_setting, extra_rollout is not None),
                                      ("algorithm.dynamic_sampling=true", alg.dynamic_sampling),
                                      (f"algorithm.name={alg.name}", spec is not None and not spec.generates)) if on]

    if k > 0:
        if cfg.resources.placement != "split":
            out.append(f"trainer.max_staleness={k} overlaps generation with training, which needs the rollout in "
                       "its own processes: set resources.placement=split (or max_staleness=0)")
        blocked = blocking()
        if blocked:
            out.append(f"trainer.max_staleness={k} is not available with {', '.join(blocked)} (their generation is "
                       "not one batch per step); use max_staleness=0")
    stream = cfg.trainer.async_mode == "stream"
    if stream and k < 1:
        out.append("trainer.async_mode=stream bounds how old a rollout may be by trainer.max_staleness, which is "
                   f"{k}; set max_staleness >= 1 (with resources.placement=split), or async_mode=batch")
    if stream and k > 0 and b <= 0:
        out.append("trainer.async_mode=stream generates in rounds of rollout.partial_budget tokens per response "
                   "(new weights load between rounds), which is 0; set it, for example rollout.partial_budget=32")
    if b > 0:
        blocked = blocking(*(() if stream else (("trainer.max_staleness > 0", k > 0),)))
        if blocked:
            out.append(f"rollout.partial_budget={b} is not available with {', '.join(blocked)} (partial rollouts "
                       "carry unfinished responses from one step's generation to the next, which those "
                       "generate differently); use partial_budget=0")
        elif b >= data.response_length:
            out.append(f"rollout.partial_budget={b} is at least data.response_length={data.response_length}, so no "
                       "response is ever cut; lower it to cut long responses, or 0 to turn partial rollouts off")
    if cfg.agent.enabled:
        blocked = blocking(("rollout.partial_budget > 0", b > 0), ("trainer.max_staleness > 0", k > 0))
        if blocked:
            out.append(f"agent.enabled=true (multi-turn rollouts with tools) is not available with {', '.join(blocked)}; "
                       "turn those off or set agent.enabled=false")
        _check_environment(cfg, out)
    if alg.dynamic_sampling and alg.n_samples < 2:
        out.append(f"algorithm.dynamic_sampling=true keeps groups whose rewards differ, which needs "
                   f"algorithm.n_samples >= 2 (got {alg.n_samples}); raise n_samples or turn dynamic_sampling off")
    from rlframe.config.dynamic_sampling import at_cap_problems

    out.extend(at_cap_problems(cfg))
    if cfg.ref.enabled is False and (alg.use_kl_loss or alg.kl_in_reward):
        which = "algorithm.use_kl_loss" if alg.use_kl_loss else "algorithm.kl_in_reward"
        out.append(f"ref.enabled=false, but {which}=true needs the reference policy's log-probs; "
                   f"set ref.enabled=true (or null), or {which}=false")
    if alg.kl_target is not None and not alg.kl_in_reward:
        out.append(f"algorithm.kl_target={alg.kl_target} adapts the KL penalty in the reward, but "
                   "algorithm.kl_in_reward=false; set kl_in_reward=true or kl_target=null")
    from rlframe.config.kl_settings import kl_setting_problems

    out.extend(kl_setting_problems(alg))  # a KL key of a term that is off (the one that acts is named)
    from rlframe.config.task_fit import task_fit_problems

    out.extend(task_fit_problems(cfg))  # the tiny model's preset and task; the tool task's prompts and prompt_length
    if data.task is not None and not data.train_files and data.train_batch_size > data.train_size:
        out.append(f"data.train_batch_size={data.train_batch_size} is larger than the synthetic task's "
                   f"data.train_size={data.train_size} prompts; lower the batch or raise train_size")
    from rlframe.data.pretrain import TASKS, default_sft

    if data.task in TASKS:  # the split is fixed per task (held out from the tiny model's pre-training)
        split = default_sft(data.task)
        for key, size, have, which in (("train_size", data.train_size, split.num_train, "train_files"),
                                       ("val_size", data.val_size, split.num_test, "val_files")):
            if size > have and getattr(data, which) == []:  # val_files=null: no validation split at all
                out.append(f"data.{key}={size} asks for more rows than the {data.task} task's fixed split has "
                           f"({have}: the problems held out from the tiny model's pre-training stay held out); "
                           f"set data.{key}={have} or lower, or give data.{which}")


def _check_roles_and_trainer(cfg: RunConfig, out: list[str]) -> None:
    seq_len = cfg.data.prompt_length + cfg.data.response_length
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.uses_critic else [])
    for name, role in roles:
        budget = role.max_tokens_per_micro_batch
        if budget is not None and budget * max(role.sp, 1) < seq_len:  # a rank's budget; sp ranks share a sequence
            split = f" x {name}.sp={role.sp}" if role.sp > 1 else ""
            out.append(f"{name}.max_tokens_per_micro_batch={budget}{split} cannot hold one "
                       f"sequence of data.prompt_length + data.response_length = {seq_len} tokens; "
                       f"set it >= {-(-seq_len // max(role.sp, 1))} (or null)")
        steps = optimizer_steps(cfg, role, actor=name == "actor")  # the engine's schedule length
        if role.lr_schedule == "cosine" and role.warmup_steps >= steps:
            out.append(f"{name}.warmup_steps={role.warmup_steps} leaves no steps for the cosine decay: the run takes "
                       f"{steps} optimizer steps (trainer.total_steps {cfg.trainer.total_steps} x "
                       f"{optimizer_steps_per_step(cfg, role)} per step: {name}.ppo_epochs x mini-batches of "
                       f"{name}.mini_batch_size); lower warmup_steps")
    if cfg.trainer.critic_warmup and not cfg.uses_critic:
        out.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} updates only the critic, but this run has none "
                   f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator}); set trainer.critic_warmup=0")
    elif cfg.trainer.critic_warmup >= cfg.trainer.total_steps:
        out.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} leaves the actor no step of trainer.total_steps="
                   f"{cfg.trainer.total_steps}; lower it")
    t, n = cfg.trainer, cfg.algorithm.n_samples
    generates = not known(cfg.algorithm) or algorithm_spec(cfg.algorithm).generates
    if t.rollout_dump_every > 0 and generates and t.rollout_dump_rows < n:
        out.append(f"trainer.rollout_dump_rows={t.rollout_dump_rows} cannot hold one group of algorithm.n_samples={n} "
                   f"samples, and a dump keeps a prompt's samples together (their advantages are relative to each "
                   f"other); set trainer.rollout_dump_rows={n} or more")
    res = cfg.resources
    split = res.split_procs or {}
    unknown = sorted(set(split) - {"actor", "critic", "ref", "rollout"})
    if unknown:
        out.append(f"resources.split_procs has unknown roles {unknown}; use actor, critic, ref and rollout")
    for role, n in split.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            out.append(f"resources.split_procs.{role}={n!r} must be a process count >= 1")
    if split and res.placement == "colocated":
        out.append("resources.split_procs is set but resources.placement=colocated ignores it; "
                   "set placement=split or remove split_procs")
    _check_weight_transport(cfg, out)
    if res.placement == "split" and res.use_gpu:
        out.append("resources.placement=split with resources.use_gpu=true: the weight channel between the actor and "
                   "generation groups is gloo over TCP, which cannot send CUDA tensors; use "
                   "resources.placement=colocated on GPU (the hybrid engine), or resources.use_gpu=false")
    _check_rollout_backend(cfg, out)
    if res.elastic and res.placement != "colocated":
        out.append("resources.elastic=true shrinks a colocated run onto the nodes left after a loss; with "
                   "resources.placement=split a lost node is waited for instead (resources.node_wait_s): set "
                   "resources.elastic=false")
    if res.elastic and cfg.trainer.max_restarts < 1:
        out.append("resources.elastic=true acts when the run restarts after a lost node, but trainer.max_restarts=0 "
                   "ends the run at the first loss: set trainer.max_restarts=1 (or more)")
    every = cfg.trainer.check_weight_sync_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        out.append(f"trainer.check_weight_sync_every={every!r} must be a step count >= 0 (0: never check that the "
                   "rollout engine holds the trainer's weights); set e.g. trainer.check_weight_sync_every=0, or N "
                   "to check after every N-th step's sync")
    for key in ("experiment", "output_dir"):
        value = getattr(cfg.trainer, key)
        if not value.strip() or (key == "experiment" and ("/" in value or value in (".", ".."))):
            out.append(f"trainer.{key}={value!r} must be a non-empty {'name without /' if key == 'experiment' else 'path'}"
                       f"; the run directory is <trainer.output_dir>/<trainer.experiment>")
    if cfg.reward.function_path is not None and not cfg.reward.function_name.isidentifier():
        out.append(f"reward.function_name={cfg.reward.function_name!r} is not a Python function name; "
                   "name the function reward.function_path defines (default compute_score)")


def _check_lora(cfg: RunConfig, out: list[str]) -> None:
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.uses_critic else [])
    for name, role in roles:
        if role.lora_rank == 0:
            continue
        spec = engine_spec(role.strategy)
        if not spec.lora:
            out.append(f"{name}.lora_rank={role.lora_rank}: LoRA is not supported with strategy={role.strategy} "
                       f"({_engines_with(lambda s: s.lora)}); use it, or "
                       f"{name}.lora_rank=0 to train the whole model")
            continue
        targets = list(role.lora_target_modules)
        unknown = [t for t in targets if t not in spec.lora_targets]
        if not targets:
            out.append(f"{name}.lora_target_modules is empty, so no layer would get an adapter; list some of "
                       f"{list(spec.lora_targets)}")
        elif unknown:
            out.append(f"{name}.lora_target_modules has {unknown}, which are not projections of the decoder layers "
                       f"the {role.strategy} engine trains (it knows {list(spec.lora_targets)}); use names from "
                       "that list")


def _check_rollout_backend(cfg: RunConfig, out: list[str]) -> None:
    """What the rollout backend takes: rollout.tp, rollout.engine_kwargs (its spec's traits)."""
    ro = cfg.rollout
    try:
        spec = backend_spec(ro.backend)
    except ValueError as err:
        out.append(str(err))
        return
    named = f"rollout.backend={ro.backend}" + (f" ({spec.name} here)" if ro.backend == "auto" else "")
    if ro.tp > 1 and not spec.tensor_parallel:
        out.append(f"rollout.tp={ro.tp}: {named} runs one whole model per process ({spec.summary}); set rollout.tp=1 "
                   f"or a backend with tensor parallelism ({_backends_with(lambda s: s.tensor_parallel)})")
    if ro.engine_kwargs and not spec.engine_kwargs:
        out.append(f"rollout.engine_kwargs {sorted(ro.engine_kwargs)}: {named} takes no engine keywords; remove them")
    for key in sorted(set(ro.engine_kwargs or {}) & set(spec.owned_engine_kwargs)):
        out.append(f"rollout.engine_kwargs.{key} is set by rlframe from {spec.owned_engine_kwargs[key]}; set that "
                   "instead and remove it from rollout.engine_kwargs")


def _engines_with(trait) -> str:
    """"strategy=a supports it" / "strategy=a, strategy=b support it" for the registered engines with `trait`."""
    names = [f"strategy={s.name}" for s in TRAIN_ENGINES.specs() if trait(s)]
    return f"{', '.join(names)} {'supports' if len(names) == 1 else 'support'} it" if names else "no engine supports it"


def _backends_with(trait) -> str:
    names = [f"rollout.backend={s.name}" for s in ROLLOUT_BACKENDS.specs() if trait(s)]
    return f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} it" if names else "no backend has it"


def _check_cross_field(cfg: RunConfig, out: list[str]) -> None:
    _check_kl_and_sampling(cfg, out)
    _check_roles_and_trainer(cfg, out)
    _check_lora(cfg, out)
    check_rollout_correction(cfg, out)


def _check_environment(cfg: RunConfig, out: list[str]) -> None:
    """agent.mode=openai: an environment file that loads, with an episode coroutine function."""
    agent = cfg.agent
    if agent.mode != "openai":
        if agent.environment:
            out.append(f"agent.environment={agent.environment!r} is used by agent.mode=openai, but agent.mode="
                       f"{agent.mode}; set agent.mode=openai or remove agent.environment")
        return
    if not agent.environment:
        out.append("agent.mode=openai needs agent.environment=path/to/file.py:function, an `async def "
                   "function(client, row)` that runs one episode with the openai client and returns its reward")
        return
    from rlframe.agents.environment import load_environment

    try:
        load_environment(agent.environment)
    except Exception as err:  # the user's file: whatever it raises, say so before any worker starts
        out.append(f"{err}" if isinstance(err, ValueError) else
                   f"agent.environment={agent.environment!r}: importing it raised {type(err).__name__}: {err}")


def _builtin_tool_problems(cfg: RunConfig) -> list[str]:
    """Names in agent.builtin_tools that are not built-in tools (no file is read: also in a dry run)."""
    if not cfg.agent.enabled:
        return []
    from rlframe.agents.tools import BUILTIN_TOOLS

    unknown = [n for n in cfg.agent.builtin_tools if n not in BUILTIN_TOOLS]
    if not unknown:
        return []
    return [f"agent.builtin_tools={list(cfg.agent.builtin_tools)!r} names {unknown}, which are not built-in tools "
            f"(built-in tools: {sorted(BUILTIN_TOOLS)}); remove them, or define them in a tools file given "
            "as agent.tools_path (rlframe/agents/tools.py)"]


def _check_metrics_endpoint(cfg: RunConfig, out: list[str], *, bind: bool) -> None:
    """trainer.prometheus_port/host: a host to listen on, and (`bind`: outside a dry run) a port free
    now, so that a taken port stops the run here rather than after the workers started."""
    t = cfg.trainer
    if t.prometheus_port == 0:
        return
    if not t.prometheus_host.strip():
        out.append(f"trainer.prometheus_port={t.prometheus_port} serves /metrics on trainer.prometheus_host, which is "
                   "empty; set trainer.prometheus_host=127.0.0.1 (this machine only) or 0.0.0.0 (all interfaces)")
    elif bind:
        from rlframe.utils.metrics_endpoint import port_problem

        problem = port_problem(t.prometheus_host, t.prometheus_port)
        if problem:
            out.append(problem)


def _agent_limit_problems(cfg: RunConfig) -> list[str]:
    """The ranges of the tool sandbox's caps (reported with ranges.py's, in its words): a cap must
    bound something, so neither may be null, zero or negative."""
    from rlframe.config.ranges import above, at_least

    rules = {"agent.max_calls_per_turn": (at_least(1, " (tool calls run per turn; the rest are answered with an "
                                                     "error)"), 8),
             "agent.max_tool_seconds_per_trajectory": (above(0, " (seconds of tool time per trajectory)"), 20.0)}
    out = []
    for key, (rule, default) in rules.items():
        value = getattr(cfg.agent, key.split(".")[1])
        if isinstance(value, bool) or not rule.ok(value):
            out.append(f"{key}={value!r} is out of range: it must be {rule.need}{rule.why}; set a value {rule.need}, "
                       f"e.g. {key}={default} (the default)")
    return out


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ConfigError listing every problem; return cfg when it is sound.

    Ranges and choices of single fields come first and alone (ranges.py): cross-field rules fed an
    out-of-range value would blame a key the user did not touch. Then the cross-field rules, then
    what the machine can provide (a private Ray only: a joined cluster is checked once joined).
    Outside a dry run, files the run will read are opened here too: model directories must hold a
    config.json, the reward function and the tools file are imported and their signatures checked,
    and the packages of the loggers named must be installed.
    """
    import_user_modules(cfg)  # first: they may register the engines, backends and estimators named below
    problems = check_ranges(cfg) + _agent_limit_problems(cfg)
    if problems:
        raise ConfigError(problems)
    _check_algorithm(cfg, problems)
    _check_layouts(cfg, problems)
    _check_batches(cfg, problems)
    _check_cross_field(cfg, problems)
    _check_metrics_endpoint(cfg, problems, bind=not cfg.trainer.dry_run)
    problems.extend(_builtin_tool_problems(cfg))
    if not cfg.trainer.dry_run:  # a dry run checks a cluster config on a machine without its files or GPUs
        check_paths(cfg, problems)
        if not problems:
            problems.extend(check_private_cluster(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg
