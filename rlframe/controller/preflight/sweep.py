"""The configuration space preflight is swept over, and a pairwise-covering set of its points.

Each factor is a setting a user changes; its levels are what the sweep tries. `pairwise_rows()`
picks rows greedily (the candidate that covers most not-yet-covered pairs of levels, over the rows
that `valid` allows) until every allowed pair of levels appears in some row: every two settings are
tried together at least once. Rows are ordered by how much they add, so a prefix of them is the most
useful subset (the test suite runs one; benchmarks/preflight_sweep.py runs all).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from rlframe.plugins import engine_spec

FACTORS: dict[str, tuple] = {
    "algorithm": ("grpo", "ppo"),
    "temperature": (1.0, 0.7),
    "minibatches": ("1x1", "2x2"),  # ppo_epochs x mini-batches per step
    "layout": ("dp2", "tp2", "sp2"),  # the trained roles' layout (sp2: Ulysses, dp1 sp2)
    "replicas": (2, 1),  # generation replicas (rollout tp = 2 / replicas)
    "placement": ("colocated", "split"),
    "strategy": ("fsdp", "megatron"),
    "lora": ("off", "dropout"),
    "partial": ("off", "on"),
    "agent": ("off", "on", "openai"),  # openai: the tool task as an OpenAI-API environment (agent.mode=openai)
    "async": (0, 1, 2, "stream"),  # trainer.max_staleness=1 or 2; stream: async_mode=stream in rounds of 3 tokens
    "precision": ("fp32", "bf16"),
    "recompute": ("off", "on"),  # activation_checkpointing of the trained roles
    "sync": ("full", "delta"),  # rollout.weight_sync (delta: every 2nd sync full)
    "fanout": ("direct", "chain"),  # rollout.weight_fanout (split placement, 2 generation replicas)
    # algorithm.off_policy_correction of off-policy rows (async or partial); kl: mis with rejection_kl
    "correction": ("none", "icepop", "kl"),
}
DEFAULTS = {k: v[0] for k, v in FACTORS.items()}
# the worked example of agent.mode=openai (docs/agents.md), from the repository
ENVIRONMENT = Path(__file__).resolve().parents[3] / "examples" / "openai_agent" / "environment.py"
ROWS = 16  # one step's rows in every config: grpo 4 prompts x 4 samples, ppo 16 prompts

BASE = ["model.tiny_preset=demo", "data.response_length=6", "data.val_size=16", "trainer.loggers=[jsonl]",
        "trainer.plot=false", "rollout.kv_cache_bytes=33554432", "actor.micro_batch_size=4",
        "critic.micro_batch_size=4"]


def valid(row: dict) -> bool:
    """What the config validation refuses, as predicates (a chosen row is validated for real too)."""
    engine = engine_spec(row["strategy"])
    return not ((row["async"] and row["placement"] != "split")
                or (row["lora"] != "off" and not engine.lora) or (row["layout"] == "sp2" and not engine.supports("sp"))
                or (row["agent"] != "off" and row["partial"] == "on")
                or (row["async"] and (row["partial"] == "on" or row["agent"] != "off"))
                or (row["fanout"] == "chain" and (row["placement"] != "split" or row["replicas"] != 2))
                or (row["correction"] != "none" and not (row["async"] or row["partial"] == "on")))


def _pairs(row: dict) -> set:
    items = sorted(row.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def pairwise_rows(*, seed: int = 0, candidates: int = 60) -> list[dict]:
    """Rows covering every valid pair of levels, greedily, the most covering first.

    Each round draws `candidates` allowed rows at random, adds the first `candidates` rows (in the
    order of `itertools.product`) that still cover a pair, and takes the first of the pool that covers
    most pairs not yet covered. A pair of levels is numbered once, so a row is its array of pair
    numbers and each round counts every row's uncovered pairs in one array lookup (comparing `_pairs`
    sets row by row took 10-20 s for the same rows).
    """
    import numpy as np

    rng = random.Random(seed)
    names, levels = list(FACTORS), list(FACTORS.values())
    allowed, index = [], []
    for idx, values in zip(itertools.product(*(range(len(v)) for v in levels)), itertools.product(*levels)):
        row = dict(zip(names, values))
        if valid(row):
            allowed.append(row)
            index.append(idx)
    # level numbers as `_pairs` compares levels: by equality (the first equal level of the factor)
    first_equal = [np.array([v.index(x) for x in v]) for v in levels]
    ids = np.array(index, dtype=np.int64).reshape(len(index), len(levels))
    ids = np.stack([first_equal[f][ids[:, f]] for f in range(len(levels))], axis=1) if len(levels) else ids
    # pair (factor i at level a, factor j at level b), i < j: number offset(i, j) + a * len(levels[j]) + b
    columns, offset = [], 0
    for i, j in itertools.combinations(range(len(levels)), 2):
        columns.append(offset + ids[:, i] * len(levels[j]) + ids[:, j])
        offset += len(levels[i]) * len(levels[j])
    pairs = np.stack(columns, axis=1) if columns else np.zeros((len(allowed), 0), dtype=np.int64)
    todo = np.zeros(offset, dtype=bool)
    todo[pairs] = True
    rows = []
    while todo.any():
        gain = todo[pairs].sum(axis=1)  # each row's pairs not yet covered
        pool = rng.sample(range(len(allowed)), min(candidates, len(allowed)))
        pool += np.flatnonzero(gain)[:candidates].tolist()  # keep progress possible
        best = max(pool, key=gain.__getitem__)
        rows.append(allowed[best])
        todo[pairs[best]] = False
    return rows


# the algorithm factor's levels: (config, samples per prompt, whether it trains a critic)
ALGORITHM_LEVELS = {"grpo": ("grpo_tiny", 4, False), "ppo": ("ppo_tiny", 1, True)}


def config_for(row: dict) -> tuple[str, list[str]]:
    """(config name, overrides) of a sweep row."""
    name, samples, critic = ALGORITHM_LEVELS[row["algorithm"]]
    o = list(BASE) + [f"data.train_batch_size={ROWS // samples}", f"rollout.temperature={row['temperature']}"]
    epochs, mini = (1, ROWS) if row["minibatches"] == "1x1" else (2, ROWS // 2)
    dp, sp, tp = {"dp2": (2, 1, 1), "tp2": (1, 1, 2), "sp2": (1, 2, 1)}[row["layout"]]
    roles = ["actor"] + (["critic"] if critic else [])
    for role in roles:
        o += [f"{role}.ppo_epochs={epochs}", f"{role}.mini_batch_size={mini}", f"{role}.dp={dp}", f"{role}.tp={tp}",
              f"{role}.sp={sp}", f"{role}.strategy={row['strategy']}"]
    o.append(f"rollout.tp={2 // row['replicas']}")
    if row["placement"] == "split":
        o += ["resources.placement=split", "+resources.split_procs={actor: 2, rollout: 2" + (", critic: 2" if critic
                                                                                        else "") + "}"]
    if row["lora"] == "dropout":
        o += ["actor.lora_rank=8", "actor.lora_alpha=16", "actor.lora_dropout=0.1", "actor.lr=1e-3"]
    if row["partial"] == "on":
        o.append("rollout.partial_budget=3")
    if row["agent"] != "off":
        o = [x for x in o if not x.startswith(("model.tiny_preset", "data.response_length"))]
        o += ["model.tiny_preset=agent", "data.task=tool_arithmetic", "agent.enabled=true", "data.prompt_length=128",
              "data.response_length=48"]
    if row["agent"] == "openai":
        o += ["agent.mode=openai", f"agent.environment={ENVIRONMENT}:episode"]
    if row["async"] == "stream":
        o += ["trainer.max_staleness=1", "trainer.async_mode=stream", "rollout.partial_budget=3"]
    elif row["async"]:
        o.append(f"trainer.max_staleness={row['async']}")
    if row["precision"] == "bf16":
        o.append("actor.precision=bf16")
    if row["recompute"] == "on":
        o += [f"{role}.activation_checkpointing=true" for role in roles]
    if row["sync"] == "delta":
        o += ["rollout.weight_sync=delta", "rollout.delta_full_every=2"]
    if row["fanout"] == "chain":
        o.append("rollout.weight_fanout=chain")
    if row["correction"] == "icepop":
        o.append("algorithm.off_policy_correction=icepop")
    elif row["correction"] == "kl":
        o += ["algorithm.off_policy_correction=mis", "algorithm.rejection_kl=0.05"]
    return name, o


def describe(row: dict) -> str:
    """The row's settings that differ from the first level of each factor."""
    changed = [f"{k}={v}" for k, v in row.items() if v != DEFAULTS[k]]
    return ", ".join(changed) or "defaults"
