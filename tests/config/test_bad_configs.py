"""One bad config per rule: each fails in the driver before any worker (or Ray) starts, and its first
message names the key the user got wrong and how to fix it.

Most cases call the validation in-process (Hydra composition + checks); a handful run
`python -m rlframe.main key=value` to show the user-facing side: exit code 2, no traceback.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlframe.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[2]
USER_FILES = REPO / "tests" / "config" / "fixtures" / "user_files"  # a reward file and tools files

# (overrides, text the first problem must contain (the key), text of the fix)
CASES = [
    # ---- ranges of single fields
    ("resources.nodes=0", "resources.nodes=0", "resources.nodes=1"),
    ("data.train_batch_size=-1", "data.train_batch_size=-1", "data.train_batch_size=64"),
    ("actor.micro_batch_size=0", "actor.micro_batch_size=0", "actor.micro_batch_size=32"),
    ("algorithm.clip_ratio_low=-0.1", "algorithm.clip_ratio_low=-0.1", "algorithm.clip_ratio_low=0.2"),
    ("actor.lr=-1e-4", "actor.lr=-0.0001", "actor.lr=0.0001"),
    ("rollout.temperature=-0.5", "rollout.temperature=-0.5", "rollout.temperature=1.0"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5", "rollout.top_p=1.0"),
    ("data.response_length=0", "data.response_length=0", "data.response_length=8"),
    ("data.prompt_length=0", "data.prompt_length=0", "data.prompt_length=16"),
    ("data.train_size=0", "data.train_size=0", "data.train_size=5000"),
    ("data.val_size=-1", "data.val_size=-1", "data.val_size=256"),
    ("algorithm.gamma=1.5", "algorithm.gamma=1.5", "algorithm.gamma=1.0"),
    ("algorithm.lam=-0.1", "algorithm.lam=-0.1", "algorithm.lam=1.0"),
    ("algorithm.n_samples=0", "algorithm.n_samples=0", "algorithm.n_samples=1"),
    ("algorithm.kl_coef=-1", "algorithm.kl_coef=-1.0", "algorithm.kl_coef=0.001"),
    ("algorithm.kl_target=0", "algorithm.kl_target=0.0", "algorithm.kl_target=null"),
    ("algorithm.clip_ratio_high=-0.2", "algorithm.clip_ratio_high=-0.2", "algorithm.clip_ratio_high=0.2"),
    ("algorithm.clip_ratio_c=0.5", "algorithm.clip_ratio_c=0.5", "algorithm.clip_ratio_c=3.0"),
    ("algorithm.entropy_coef=-0.01", "algorithm.entropy_coef=-0.01", "algorithm.entropy_coef=0.0"),
    ("algorithm.max_gen_batches=0", "algorithm.max_gen_batches=0", "algorithm.max_gen_batches=4"),
    ("algorithm.overlong_buffer_len=-1", "algorithm.overlong_buffer_len=-1", "algorithm.overlong_buffer_len=0"),
    ("algorithm.dpo_beta=0", "algorithm.dpo_beta=0.0", "algorithm.dpo_beta=0.1"),
    ("actor.dp=0", "actor.dp=0", "actor.dp=2"),
    ("actor.ppo_epochs=0", "actor.ppo_epochs=0", "actor.ppo_epochs=1"),
    ("actor.mini_batch_size=0", "actor.mini_batch_size=0", "actor.mini_batch_size=64"),
    ("actor.grad_clip=0", "actor.grad_clip=0.0", "actor.grad_clip=1.0"),
    ("actor.weight_decay=-0.1", "actor.weight_decay=-0.1", "actor.weight_decay=0.0"),
    ("critic.cliprange_value=0", "critic.cliprange_value=0.0", "critic.cliprange_value=0.5"),
    ("critic.lr=nan", "critic.lr=nan", "critic.lr=0.0001"),
    ("rollout.tp=0", "rollout.tp=0", "rollout.tp=1"),
    ("rollout.top_k=0", "rollout.top_k=0", "rollout.top_k=-1"),
    ("rollout.val_n=0", "rollout.val_n=0", "rollout.val_n=1"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization=1.5", "gpu_memory_utilization=0.1"),
    ("rollout.bucket_bytes=1000", "rollout.bucket_bytes=1000", "rollout.bucket_bytes=268435456"),
    ("reward.num_workers=-1", "reward.num_workers=-1", "reward.num_workers=0"),
    ("reward.max_error_fraction=1.5", "reward.max_error_fraction=1.5", "reward.max_error_fraction=0.5"),
    ("resources.procs_per_node=0", "resources.procs_per_node=0", "resources.procs_per_node=2"),
    ("resources.cpus_per_proc=0", "resources.cpus_per_proc=0.0", "resources.cpus_per_proc=1.0"),
    ("trainer.total_steps=0", "trainer.total_steps=0", "trainer.total_steps=20"),
    ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints=0", "trainer.keep_checkpoints=2"),
    ("trainer.val_every=-1", "trainer.val_every=-1", "trainer.val_every=5"),
    ("trainer.max_restarts=-1", "trainer.max_restarts=-1", "trainer.max_restarts=1"),
    ("trainer.max_nonfinite_steps=0", "trainer.max_nonfinite_steps=0", "trainer.max_nonfinite_steps=3"),
    ("trainer.check_weight_sync_every=-1", "trainer.check_weight_sync_every=-1",
     "trainer.check_weight_sync_every=0"),
    ("ray.num_cpus=0", "ray.num_cpus=0", "ray.num_cpus=null"),
    ("agent.max_calls_per_turn=0", "agent.max_calls_per_turn=0", "agent.max_calls_per_turn=8"),
    ("agent.max_tool_seconds_per_trajectory=0", "agent.max_tool_seconds_per_trajectory=0",
     "agent.max_tool_seconds_per_trajectory=20.0"),
    ("trainer.critic_warmup=-1", "trainer.critic_warmup=-1", "trainer.critic_warmup=0"),
    ("trainer.save_every_minutes=-5", "trainer.save_every_minutes=-5", "trainer.save_every_minutes=30.0"),
    ("trainer.preempt_grace_s=-1", "trainer.preempt_grace_s=-1", "trainer.preempt_grace_s=30.0"),
    ("trainer.rollout_dump_every=-1", "trainer.rollout_dump_every=-1", "trainer.rollout_dump_every=0"),
    ("trainer.rollout_dump_rows=0", "trainer.rollout_dump_rows=0", "trainer.rollout_dump_rows=64"),
    ("trainer.rollout_dump_max_mb=0", "trainer.rollout_dump_max_mb=0", "trainer.rollout_dump_max_mb=100.0"),
    ("actor.min_lr_ratio=1.5", "actor.min_lr_ratio=1.5", "actor.min_lr_ratio=0.0"),
    ("trainer.prometheus_port=70000", "trainer.prometheus_port=70000", "trainer.prometheus_port=0"),
    ("trainer.prometheus_port=9464 trainer.prometheus_host=", "trainer.prometheus_host, which is empty",
     "trainer.prometheus_host=127.0.0.1"),
    # ---- choices
    ("trainer.loggers=[jsonl,foo]", "trainer.loggers", "one of console, jsonl"),
    ("actor.strategy=deepspeed", "actor.strategy='deepspeed'", "one of fsdp, megatron"),
    ("critic.lr_schedule=linear", "critic.lr_schedule='linear'", "one of constant, cosine"),
    ("actor.precision=fp16", "actor.precision='fp16'", "one of auto, fp32, bf16"),
    ("rollout.backend=sglang", "rollout.backend='sglang'", "one of auto, hf, vllm"),
    ("resources.placement=spread", "resources.placement='spread'", "one of colocated, split"),
    ("reward.ensemble=max", "reward.ensemble='max'", "one of mean, min"),
    ("model.tiny_preset=huge", "model.tiny_preset='huge'", "set model.tiny_preset to one of"),
    ("data.task=sudoku", "data.task='sudoku'", "null, arithmetic, countdown"),
    # ---- cross-field rules
    ("algorithm.overlong_buffer_len=9", "algorithm.overlong_buffer_len=9", "lower it, or 0"),
    ("algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling=true", "raise n_samples"),
    ("ref.enabled=false algorithm.use_kl_loss=true", "ref.enabled=false", "set ref.enabled=true"),
    ("algorithm.kl_target=0.1", "algorithm.kl_target=0.1", "kl_target=null"),
    # a KL key of a term that is off does nothing: refused, naming the key that acts
    ("algorithm=grpo algorithm.kl_coef=0.05", "algorithm.kl_coef=0.05 has no effect",
     "set algorithm.kl_loss_coef=0.05 instead"),
    ("algorithm=gspo algorithm.kl_loss_coef=0.1", "algorithm.kl_loss_coef=0.1 has no effect",
     "set algorithm.use_kl_loss=true"),
    ("algorithm=grpo algorithm.kl_estimator=k3", "algorithm.kl_estimator=k3 has no effect",
     "set algorithm.kl_loss_estimator=k3 instead"),
    ("algorithm.kl_in_reward=true algorithm.kl_horizon=500", "algorithm.kl_horizon=500 has no effect",
     "set algorithm.kl_target"),
    ("data.train_size=100", "data.train_batch_size=128", "raise train_size"),
    ("data.task=countdown data.val_size=600", "data.val_size=600 asks for more rows than the countdown task's",
     "set data.val_size=500 or lower"),
    # the tiny model's preset and task, the tool task's prompts: found after Ray had started before (pretrain,
    # the dataset's "no usable rows")
    ("model.tiny_preset=agent", "model.tiny_preset=agent with data.task=arithmetic",
     "set data.task=tool_arithmetic (with data.prompt_length>=113"),
    ("data.task=tool_arithmetic", "data.task=tool_arithmetic with model.tiny_preset=demo", "set model.tiny_preset=agent"),
    ("data.task=tool_arithmetic model.tiny_preset=agent", "data.prompt_length=16 is shorter than every prompt of "
     "data.task=tool_arithmetic (113 tokens", "set data.prompt_length=113 or more"),
    ("actor.max_tokens_per_micro_batch=10", "actor.max_tokens_per_micro_batch=10", "set it >= 24"),
    ("actor.lr_schedule=cosine actor.warmup_steps=60", "actor.warmup_steps=60", "lower warmup_steps"),
    ("algorithm.name=grpo algorithm.adv_estimator=grpo algorithm.n_samples=2 trainer.critic_warmup=2",
     "trainer.critic_warmup=2", "trainer.critic_warmup=0"),
    ("trainer.critic_warmup=60", "trainer.critic_warmup=60", "lower it"),
    ("algorithm.name=grpo algorithm.adv_estimator=grpo algorithm.n_samples=2 trainer.rollout_dump_every=1 "
     "trainer.rollout_dump_rows=1", "trainer.rollout_dump_rows=1", "set trainer.rollout_dump_rows=2"),
    ("resources.split_procs={actor:2}", "resources.split_procs", "set placement=split"),
    ("resources.placement=split resources.split_procs={reward:2}", "resources.split_procs has unknown roles",
     "use actor, critic, ref and rollout"),
    ("resources.placement=split resources.split_procs={rollout:1} rollout.tp=2", "larger than the rollout group",
     "use rollout.tp <= 1"),
    ("trainer.max_staleness=1", "trainer.max_staleness=1 overlaps generation", "set resources.placement=split"),
    ("trainer.max_staleness=1 resources.placement=split algorithm.adv_estimator=remax algorithm.name=remax",
     "not available with algorithm.name=remax", "use max_staleness=0"),
    ("trainer.async_mode=stream", "trainer.async_mode=stream bounds how old", "set max_staleness >= 1"),
    ("trainer.async_mode=stream trainer.max_staleness=2 resources.placement=split",
     "generates in rounds of rollout.partial_budget tokens", "rollout.partial_budget=32"),
    ("trainer.async_mode=streaming", "trainer.async_mode='streaming'", "batch, stream"),
    ("algorithm.off_policy_correction=is", "algorithm.off_policy_correction", "behaviour"),
    ("algorithm.mask_low=0.8", "algorithm.mask_low=0.8 set the band of a masking correction",
     "leave mask_low / mask_high null"),
    ("algorithm.off_policy_correction=icepop algorithm.mask_high=0.9", "which leaves out 1",
     "choose mask_low <= 1 <= mask_high"),
    ("algorithm.off_policy_correction=behaviour algorithm.rejection_kl=0.1 rollout.partial_budget=4", "makes them the same",
     "rejection_kl=null"),
    ("algorithm.off_policy_correction=mis", "but this run is synchronous", "set max_staleness > 0"),
    ("algorithm.off_policy_correction=icepop rollout.partial_budget=4 rollout.top_p=0.9",
     "the rollout's are of the truncated distribution", "top_p=1, top_k=-1"),
    ("algorithm.rejection_kl=-1", "algorithm.rejection_kl=-1", "algorithm.rejection_kl=null"),
    ("algorithm=online_dpo algorithm.off_policy_correction=tis rollout.partial_budget=4",
     "online_dpo's loss compares the chosen and rejected", "leave algorithm.off_policy_correction=none"),
    ("trainer.experiment=a/b", "trainer.experiment='a/b'", "<trainer.output_dir>/<trainer.experiment>"),
    ("actor.tp=2", "actor layout dp(2) * tp(2)", "set actor.dp/tp/pp"),
    ("rollout.tp=4", "rollout.tp=4", "use rollout.tp <= 2"),
    ("data.train_batch_size=63", "data.train_batch_size (63)", "make it a multiple of 2"),
    ("actor.mini_batch_size=48", "actor.mini_batch_size=48", "use a divisor of 128"),
    ("actor.micro_batch_size=48", "actor.micro_batch_size=48", "use a divisor of 64"),
    ("actor.sequence_parallel=true", "actor.sequence_parallel=true", "strategy=megatron supports it"),
    ("actor.sp=0", "actor.sp=0", "actor.sp=1"),
    ("rollout.weight_sync=partial", "rollout.weight_sync='partial'", "full"),
    ("rollout.delta_full_every=0", "rollout.delta_full_every=0", "rollout.delta_full_every=10"),
    ("rollout.weight_transport=shm", "rollout.weight_transport=shm chooses how split placement", "auto"),
    ("rollout.weight_fanout=chain", "rollout.weight_fanout=chain passes the weights", "set it back to direct"),
    ("rollout.weight_fanout=tree", "rollout.weight_fanout='tree'", "direct"),
    ("resources.placement=split resources.split_procs={actor:1,rollout:1,critic:1} actor.dp=1 critic.dp=1 "
     "rollout.weight_transport=file", "rollout.weight_transport=file needs rollout.weight_transport_dir",
     "storage every rank"),
    ("resources.placement=split resources.split_procs={actor:1,rollout:1,critic:1} actor.dp=1 critic.dp=1 "
     "rollout.weight_transport=nccl", "rollout.weight_transport=nccl is written for GPU clusters", "use auto"),
    ("critic.sp=2", "critic layout dp(2) * sp(2) * tp(1) * pp(1) = 4 != its 2 processes", "set critic.dp/sp/tp/pp"),
    ("actor.sp=4 actor.dp=1", "actor.sp(4) * tp(1) = 4 ranks", "lower actor.sp or actor.tp"),
    ("actor.cp=2", "actor.cp=2: megatron-core runs context parallelism only inside TransformerEngine",
     "actor.sp=2 (Ulysses: strategy=fsdp supports it)"),
    ("actor.strategy=megatron actor.sp=2 actor.dp=1", "actor.sp=2: strategy=megatron",
     "(strategy=fsdp supports it); use actor.sp=1 or another strategy"),
    (f"model.path={REPO}/tests/config/fixtures/tied_lm resources.procs_per_node=8 actor.dp=1 actor.sp=8 critic.sp=4",
     "actor.sp=8", "tp * sp divides the attention heads"),
    ("algorithm.name=ppo2", "algorithm.name='ppo2'", "choose one of ppo, grpo"),
    ("algorithm.name=grpo", "algorithm.name=grpo contradicts algorithm.adv_estimator=gae", "algorithm=grpo"),
    ("algorithm.name=remax algorithm.adv_estimator=rloo algorithm.n_samples=4",
     "algorithm.name=remax contradicts algorithm.adv_estimator=rloo", "set algorithm.adv_estimator=remax"),
    ("algorithm=raft algorithm.dynamic_sampling=true", "algorithm.name=raft contradicts algorithm.dynamic_sampling=true",
     "set algorithm.dynamic_sampling=false"),
    # what DAPO does at algorithm.max_gen_batches with the batch still short of informative groups
    ("algorithm=dapo algorithm.dynamic_sampling_at_cap=skip", "algorithm.dynamic_sampling_at_cap='skip'",
     "refill, train_kept, stop"),
    ("algorithm.dynamic_sampling_at_cap=stop", "algorithm.dynamic_sampling_at_cap=stop has no effect",
     "set algorithm.dynamic_sampling=true"),
    ("algorithm=dapo algorithm.dynamic_sampling_at_cap=train_kept actor.mini_batch_size=64 actor.lr_schedule=cosine",
     "actor.mini_batch_size=64 splits the step's 256 rows into 4 optimizer steps", "set actor.mini_batch_size=256"),
    ("algorithm.adv_estimator=gea", "algorithm.adv_estimator='gea'", "use one of them"),
    ("algorithm.adv_estimator=grpo", "algorithm.adv_estimator='grpo'", "set algorithm.n_samples=4"),
    ("algorithm=sft trainer.auto_plan=true", "trainer.auto_plan=true chooses layouts", "set trainer.auto_plan=false"),
    ("algorithm=sft data.task=countdown", "countdown's ground truth is the target and the numbers",
     "train countdown with an RL algorithm"),
    ("algorithm.name=online_dpo algorithm.adv_estimator=grpo algorithm.n_samples=3",
     "algorithm.name=online_dpo ranks two samples per prompt",
     "set algorithm.n_samples=2"),
    ("actor.worker_cls=nope:Cls", "actor.worker_cls", "check the module is on PYTHONPATH"),
    ("imports=[no_such_module_xyz]", "imports: module 'no_such_module_xyz'", "check the module name"),
    # ---- paths and resources
    ("model.path=/no/such/model", "model.path='/no/such/model'", "model.path=null"),
    ("reward.function_path=/no/such.py", "reward.function_path='/no/such.py'", "give the path of a .py file"),
    ("reward.model_paths=[/no/such/rm]", "reward.model_paths[0]='/no/such/rm' has no config.json",
     "AutoModelForSequenceClassification"),
    (f"reward.model_paths=[{REPO}/tests/config/fixtures/rm_causal_lm]", "is not a sequence classifier",
     "num_labels=1"),
    (f"reward.model_paths=[{REPO}/tests/config/fixtures/rm_no_tokenizer]", "has no tokenizer",
     "tokenizer.save_pretrained(path)"),
    ("trainer.resume=/no/such/ckpt", "trainer.resume='/no/such/ckpt'", "trainer.resume=auto"),
    # the megatron engine's refusals of a model, read from config.json before any worker starts
    (f"model.path={REPO}/tests/config/fixtures/tied_lm actor.strategy=megatron",
     "tie_word_embeddings=True is not supported by the megatron engine", "use strategy=fsdp"),
    # model.hf_config (shapes for dry runs) does not stand in for the weights of a real run
    ("model.path=/no/such/model model.hf_config={model_type:llama}",
     "model.path='/no/such/model' has no config.json (the directory does not exist)", "only in a dry run"),
    ("model.critic_path=/no/such/critic", "model.critic_path='/no/such/critic' has no config.json",
     "model.critic_path=null"),
    (f"model.critic_path={REPO}/tests/config", "has no config.json", "model.critic_path=null"),
    # user files, imported and checked before Ray
    (f"reward.function_path={USER_FILES}/reward_fns.py reward.function_name=no_such_fn",
     "reward.function_name='no_such_fn'", "fix reward.function_name"),
    (f"reward.function_path={USER_FILES}/reward_fns.py reward.function_name=wrong_signature",
     "reward.function_name='wrong_signature'", "rename or add parameters to match"),
    (f"agent.enabled=true agent.tools_path={USER_FILES}/tools_wrong_signature.py",
     "agent.tools_path=", "rename the parameters to match"),
    (f"agent.enabled=true agent.tools_path={USER_FILES}/tools_slow.py", "agent.tools_path=",
     "lower their timeout_s or raise the budget"),
    ("agent.enabled=true agent.tools_path=/no/such/tools.py", "agent.tools_path='/no/such/tools.py'",
     "fix agent.tools_path"),
    ("agent.enabled=true agent.mode=openai", "agent.mode=openai needs agent.environment",
     "async def function(client, row)"),
    ("agent.enabled=true agent.mode=chat", "agent.mode='chat'", "tools"),
    (f"agent.enabled=true agent.environment={USER_FILES}/environment_sync.py:episode",
     "agent.environment=", "set agent.mode=openai"),
    (f"agent.enabled=true agent.mode=openai agent.environment={USER_FILES}/environment_sync.py:episode",
     "agent.environment=", "must be `async def episode(client, row)`"),
    ("agent.enabled=true agent.mode=openai agent.environment=/no/such/env.py:episode", "agent.environment=",
     "is not a file"),
    ("agent.concurrency=-1", "agent.concurrency=-1", "agent.concurrency=0"),
    ("agent.enabled=true agent.builtin_tools=[calculator,search]", "agent.builtin_tools=['calculator', 'search']",
     "built-in tools: ['calculator']"),
    # optional packages of trainer.loggers (skipped where installed)
    ("trainer.loggers=[console,wandb]", "trainer.loggers=['console', 'wandb'] names wandb", "pip install -e .[wandb]"),
    ("trainer.loggers=[console,mlflow]", "trainer.loggers=['console', 'mlflow'] names mlflow",
     "pip install -e .[mlflow]"),
    ("data.task=null", "data.task is null and data.train_files is empty", "give parquet/jsonl files"),
    ("data.train_files=[/no/such.jsonl]", "data file '/no/such.jsonl' (data.train_files) does not exist",
     "data.train_files=[]"),
    ("resources.nodes=2 actor.dp=4 critic.dp=4", "resources.nodes=2 needs a multi-node Ray cluster",
     "ray.address=auto"),
    ("resources.use_gpu=true", "resources.use_gpu=true needs 2 GPUs", "resources.use_gpu=false"),
    ("resources.cpus_per_proc=64", "resources.cpus_per_proc=64", "lower resources.cpus_per_proc"),
    ("resources.placement=split resources.use_gpu=true actor.dp=1 critic.dp=1 +resources.split_procs={actor:1}",
     "resources.placement=split with resources.use_gpu=true", "resources.placement=colocated on GPU"),
    ("rollout.engine_kwargs={seed:3}", "rollout.engine_kwargs.seed is set by rlframe from trainer.seed",
     "remove it from rollout.engine_kwargs"),
    ("rollout.load_format=dummy", "rollout.load_format='dummy': 'dummy' is not one of auto, real",
     "set rollout.load_format to one of them"),
    ("resources.node_wait_s=-5", "resources.node_wait_s=-5", "resources.node_wait_s=300"),
    ("resources.device_memory_gib=0", "resources.device_memory_gib=0", "resources.device_memory_gib=null"),
    ("resources.elastic=true resources.placement=split actor.dp=1 critic.dp=1 +resources.split_procs={actor:1}",
     "resources.elastic=true shrinks a colocated run", "set resources.elastic=false"),
    ("resources.elastic=true trainer.max_restarts=0", "resources.elastic=true acts when the run restarts",
     "set trainer.max_restarts=1"),
]


def first_problem(overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(load_config("ppo_tiny", overrides.split()))
    return err.value.problems[0]


def _skip_if_logger_installed(overrides: str) -> None:
    import importlib.util

    for package in ("wandb", "mlflow"):
        if f"trainer.loggers=[console,{package}]" in overrides and importlib.util.find_spec(package) is not None:
            pytest.skip(f"{package} is installed here")


def _skip_if_gpus(overrides: str) -> None:
    if overrides.startswith("resources.use_gpu"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has GPUs")


def test_the_table_has_one_case_per_rule():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("overrides,key,fix", CASES, ids=[c[0] for c in CASES])
def test_bad_config_fails_fast_naming_key_and_fix(overrides, key, fix, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # resources are checked for a private Ray
    _skip_if_gpus(overrides)
    _skip_if_logger_installed(overrides)
    problem = first_problem(overrides)  # from validation alone: nothing is started
    assert key in problem, problem
    assert fix in problem, problem


# `python -m rlframe.main OVERRIDES` exits 2 naming the key (the first problem's line starts with it)
MAIN_CASES = [
    ("resources.nodes=0", "resources.nodes=0"),
    ("data.train_batch_size=-1", "data.train_batch_size=-1"),
    ("actor.micro_batch_size=0", "actor.micro_batch_size=0"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5"),
    ("resources.use_gpu=true", "resources.use_gpu=true"),
    # found only after Ray had started before (18-32 s, a traceback, exit code 1, a config.yaml left behind)
    (f"reward.function_path={USER_FILES}/reward_fns.py reward.function_name=no_such_fn",
     "reward.function_name='no_such_fn'"),
    (f"reward.function_path={USER_FILES}/reward_fns.py reward.function_name=wrong_signature",
     "reward.function_name='wrong_signature'"),
    (f"agent.enabled=true agent.tools_path={USER_FILES}/tools_wrong_signature.py", "agent.tools_path="),
    ("agent.enabled=true agent.tools_path=/no/such/tools.py", "agent.tools_path='/no/such/tools.py'"),
    ("agent.enabled=true agent.builtin_tools=[calculator,search]", "agent.builtin_tools="),
    ("trainer.loggers=[console,wandb]", "trainer.loggers="),
    ("trainer.loggers=[console,mlflow]", "trainer.loggers="),
    ("model.tiny_preset=agent", "model.tiny_preset=agent with data.task=arithmetic"),
    ("data.task=tool_arithmetic model.tiny_preset=agent", "data.prompt_length=16 is shorter"),
    # a cluster config on a machine without its weights: the model, not the node count
    ("--config-name ppo_llama70b data.task=arithmetic data.train_files=[] data.val_files=[]",
     "model.path='/models/Meta-Llama-3-70B-Instruct' has no config.json"),
]


def _run_main(override: str, out_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlframe.main", *override.split(), f"trainer.output_dir={out_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module", autouse=True)
def main_runs(request, tmp_path_factory):
    """The `python -m rlframe.main` runs of the selected MAIN_CASES, {override: (output dir, future)}.

    Started when the module's first test starts, two at a time in background threads, so that they overlap
    the in-process cases (each is still a process of its own, run exactly as alone, with its own empty
    output directory); each test waits for its own run. All have ended when the module's tests have."""
    selected = {item.callspec.params["override"] for item in request.session.items
                if getattr(item, "module", None) is request.module
                and getattr(item, "originalname", None) == "test_main_exits_2_without_traceback"}
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": "", "CUDA_VISIBLE_DEVICES": ""}
    runs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for override, _ in MAIN_CASES:
            if override not in selected:
                continue
            try:
                _skip_if_logger_installed(override)
                _skip_if_gpus(override)
            except pytest.skip.Exception:
                continue
            out_dir = tmp_path_factory.mktemp("main") / "outputs"
            runs[override] = (out_dir, pool.submit(_run_main, override, out_dir, env))
        yield runs


@pytest.mark.parametrize("override,key", MAIN_CASES)
def test_main_exits_2_without_traceback(override, key, main_runs):
    _skip_if_logger_installed(override)
    _skip_if_gpus(override)
    out_dir, run = main_runs[override]
    proc = run.result()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Started a local Ray" not in proc.stderr + proc.stdout, proc.stderr
    first = proc.stderr.splitlines()[1]  # "rlframe: invalid configuration:" then one line per problem
    assert first.startswith(f"  - {key}"), proc.stderr
    # nothing written: no run directory, so no config.yaml, run.lock or metrics of a run that never started
    assert not out_dir.exists(), sorted(str(p) for p in out_dir.rglob("*"))


def test_a_config_error_never_reaches_run_training(tmp_path, monkeypatch):
    """main validates first and only then calls run_training, which writes config.yaml (and takes the
    run directory's lock): a config error leaves the output directory untouched."""
    import rlframe.controller.run as run
    from rlframe.main import main

    calls = []
    monkeypatch.setattr(run, "run_training", lambda cfg, **kw: calls.append(cfg) or {})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out_dir = tmp_path / "outputs"
    for bad in ("reward.function_path=/no/such.py", "agent.enabled=true agent.builtin_tools=[search]",
                f"reward.function_path={USER_FILES}/reward_fns.py reward.function_name=no_such_fn"):
        assert main([*bad.split(), f"trainer.output_dir={out_dir}"]) == 2, bad
    assert calls == [] and not out_dir.exists()
    # the same main with a sound config does reach run_training (so the check above is not vacuous)
    assert main([f"trainer.output_dir={out_dir}", "trainer.loggers=[console]"]) == 0
    assert len(calls) == 1


def test_a_taken_metrics_port_fails_before_anything_starts():
    """trainer.prometheus_port: a port another process listens on is a config problem, found by the
    validation (before Ray and the workers), naming the port and how to pick another."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            validate(load_config("ppo_tiny", [f"trainer.prometheus_port={port}"]))
    [problem] = err.value.problems
    assert problem.startswith(f"trainer.prometheus_port={port}: the /metrics endpoint cannot listen on 127.0.0.1")
    assert "pick a free port" in problem
    validate(load_config("ppo_tiny", [f"trainer.prometheus_port={port}", "trainer.dry_run=true"]))  # not bound then
