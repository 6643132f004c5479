"""One run directory, one run: who a run is, and which files in its directory are its own.

A run is identified by a run id, made at its first launch and kept in `<run_dir>/run.json`, and by
the config keys that define it (`DEFINING`: the model, the algorithm and its estimator, samples per
prompt, the data, the reward function, the seeds). Every checkpoint records both (its `run.json`,
with the resolved config it was written with), so any file of the directory can be traced to the
run that wrote it.

    claim_run(run_dir, cfg)    # at start, before Ray or any worker: the RunRecord of this run, or
                               # RunDirConflict (a ConfigError, exit code 2) when the directory holds
                               # another run's files (its defining keys differ), naming the keys
    resume_changes(info, cfg)  # one line per setting changed since a checkpoint was written

The directory's run is read from `run.json`; a directory written before run records existed is
judged by its newest checkpoint that records a run, else by its `config.yaml` (a legacy directory
whose config.yaml matches is adopted, its checkpoints with it). A directory that holds none of a
run's files (checkpoints, metrics.jsonl, config.yaml, hf_actor/, ...) starts a new run. The same
defining keys mean the same run: `trainer.resume=off` then starts it over in place, overwriting its
own files, never another run's (docs/checkpoints.md).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rlframe.config.validate import ConfigError

RUN_FILE = "run.json"  # in the run directory, and in every checkpoint (with the config)
# What a run leaves in its directory: another run must never overwrite or delete these.
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml", "hf_actor", "summary.json", "tensorboard", "curves.png",
             "generations", "trace.json")
# The keys that define a run: a checkpoint written under other values is another run's.
DEFINING = ("model.path", "model.tiny_preset", "model.critic_path", "algorithm.name", "algorithm.trainer",
            "algorithm.adv_estimator", "algorithm.n_samples", "data.task", "data.train_files", "data.val_files",
            "reward.function_path", "reward.function_name", "reward.model_paths", "trainer.seed", "data.seed")
_PATHS = ("model.path", "model.critic_path", "data.train_files", "data.val_files", "reward.function_path",
          "reward.model_paths")
_STEP_RE = re.compile(r"^step_(\d{6,})$")


class RunDirConflict(ConfigError):
    """The run directory belongs to another run (or a checkpoint in it does)."""

    def __init__(self, message: str):
        super().__init__([message])


@dataclass
class RunRecord:
    run_id: str
    identity: dict
    created: str = ""
    # checkpoints written before checkpoints recorded their run, adopted with a legacy directory
    adopted: list[str] = field(default_factory=list)
    # 1 + how often trainer.resume=off started the run over: checkpoints of earlier starts are
    # superseded (never resumed from by resume=auto; deleted by retention once this start has a good one)
    attempt: int = 1

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "created": self.created, "identity": self.identity, "adopted": self.adopted,
                "attempt": self.attempt}


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _norm_path(value):
    if value is None or value == "":
        return None
    if isinstance(value, (list, tuple)):
        return [_norm_path(v) for v in value]
    return os.path.abspath(os.path.expanduser(str(value)))


def identity_of(config: dict) -> dict:
    """The defining keys of a run from its resolved config (a dict, as to_dict or config.yaml give it)."""
    out = {}
    for key in DEFINING:
        value = _get(config, key)
        if key in _PATHS:
            value = _norm_path(value)
        if isinstance(value, tuple):
            value = list(value)
        out[key] = value
    if out["model.path"] is not None:  # a model from a path: the tiny preset is not used
        out["model.tiny_preset"] = None
    return out


def identity_diff(theirs: dict, ours: dict) -> dict[str, tuple]:
    """{key: (theirs, ours)} of the defining keys that differ (keys either side lacks count as None)."""
    return {k: (theirs.get(k), ours.get(k)) for k in DEFINING if theirs.get(k) != ours.get(k)}


def config_dict(cfg) -> dict:
    """The resolved config as plain JSON types (tuples as lists), as checkpoints record it."""
    from rlframe.config.build import to_dict

    return json.loads(json.dumps(to_dict(cfg), default=str))


def read_run_record(run_dir: str | Path) -> RunRecord | None:
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return RunRecord(run_id=str(data["run_id"]), identity=dict(data["identity"]),
                         created=str(data.get("created", "")), adopted=list(data.get("adopted", [])),
                         attempt=int(data.get("attempt", 1)))
    except (ValueError, KeyError, TypeError) as err:
        raise RunDirConflict(f"{path} is not a readable run record ({err}); it names the run this directory "
                             "belongs to: restore it, or move the directory's files away and delete it") from err


def write_run_record(run_dir: str | Path, record: RunRecord) -> None:
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(f".{RUN_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=1))
    os.replace(tmp, path)


def checkpoint_run_info(path: str | Path) -> dict | None:
    """What a checkpoint records of the run that wrote it ({run_id, identity, config}); None for a
    checkpoint written before checkpoints recorded it."""
    f = Path(path) / RUN_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError:
        return None  # damaged: verification names it


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / "trainer_state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _run_files(run_dir: Path) -> list[str]:
    present = [name for name in RUN_FILES if (run_dir / name).exists()]
    if present == ["checkpoints"] and not complete_checkpoints(run_dir):
        return []  # an empty checkpoints/ (or only a crashed save's temporary directory)
    return present


def _values(diff: dict[str, tuple]) -> str:
    return "\n".join(f"      {k}: {a!r} there, {b!r} here" for k, (a, b) in diff.items())


def _conflict(run_dir: Path, whose: str, diff: dict[str, tuple], files: list[str], *,
              what: str = "belongs to another run") -> RunDirConflict:
    listed = ", ".join(f + ("/" if (run_dir / f).is_dir() else "") for f in files) or "its files"
    return RunDirConflict(
        f"run directory {run_dir} {what} ({whose}); the settings that define a run differ:\n"
        f"{_values(diff)}\n"
        f"    This run would resume from, overwrite or delete that run's files there ({listed}); "
        "trainer.resume=off does not change that. Either\n"
        "      - give this run a directory of its own: a new trainer.experiment (or trainer.output_dir), or\n"
        "      - continue that run: set the keys above back to its values, or\n"
        f"      - move that run's files out of {run_dir} first (then any trainer.resume starts a new run there)")


def _new_record(identity: dict, adopted: list[str] = ()) -> RunRecord:
    now = time.time()
    run_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + "-" + uuid.uuid4().hex[:8]
    return RunRecord(run_id=run_id, identity=identity, created=time.strftime("%Y-%m-%d %H:%M:%S %z",
                     time.localtime(now)), adopted=list(adopted))


def current_record(run_dir: str | Path) -> RunRecord | None:
    """The record of the run the directory holds, read without claiming or writing anything: its
    run.json, else the run of its newest checkpoint that records one (claim_run's rule); None for a
    fresh directory or one written before runs were recorded."""
    record = read_run_record(run_dir)
    if record is not None:
        return record
    recovered = recovered_run([(s, p, checkpoint_run_info(p)) for s, p in complete_checkpoints(run_dir)])
    return None if recovered is None else recovered[0]


def recovered_run(ckpts) -> tuple[RunRecord, Path] | None:
    """When run.json is gone: the run of the newest checkpoint that records one (`ckpts`: (step, path, its
    run info), oldest first), and that checkpoint's path. Its start (attempt) is the latest any of the
    run's checkpoints records (a start after trainer.resume=off may have saved lower step numbers than
    the one before); None when no checkpoint records a run."""
    recorded = [(path, info) for _, path, info in ckpts if info and "run_id" in info]
    if not recorded:
        return None
    path, info = recorded[-1]
    run_id = str(info["run_id"])
    attempt = max(int(i.get("attempt", 1)) for _, i in recorded if i.get("run_id") == run_id)
    return RunRecord(run_id=run_id, identity=dict(info.get("identity", {})), attempt=attempt), path


def claim_run(run_dir: str | Path, cfg, *, announce=None) -> RunRecord:
    """The RunRecord of the run `cfg` defines in `run_dir`: the directory's own run when its defining
    keys match (made and written on the first launch), else RunDirConflict naming the differing keys.
    Checkpoints of another run's settings in the directory refuse too. Idempotent: a second call
    (the trainer after run_training, a restart) returns the same record."""
    from rlframe.utils.console import say

    announce = say if announce is None else announce
    run_dir = Path(run_dir)
    ours = identity_of(config_dict(cfg))
    ckpts = [(step, path, checkpoint_run_info(path)) for step, path in complete_checkpoints(run_dir)]
    record = read_run_record(run_dir)
    if record is not None:
        diff = identity_diff(record.identity, ours)
        if diff:
            raise _conflict(run_dir, f"run {record.run_id}, {RUN_FILE}", diff, _run_files(run_dir))
    else:
        recovered = recovered_run(ckpts)
        files = _run_files(run_dir)
        if recovered:  # run.json is gone: the directory belongs to the run of its newest recorded checkpoint
            record, path = recovered
            diff = identity_diff(record.identity, ours)
            if diff:
                raise _conflict(run_dir, f"run {record.run_id}, which wrote {path.name}", diff, files)
            record.identity, record.created = ours, time.strftime("%Y-%m-%d %H:%M:%S %z")
            announce(f"run directory {run_dir} had no {RUN_FILE}: continuing run {record.run_id}, which wrote "
                     f"{path.name}")
        elif (run_dir / "config.yaml").is_file():  # written before runs were recorded: judged by its config
            import yaml

            try:
                theirs = identity_of(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
            except yaml.YAMLError:
                theirs = None
            if theirs is None:
                raise _conflict(run_dir, "an unreadable config.yaml", {"config.yaml": ("unreadable", "-")}, files)
            diff = identity_diff(theirs, ours)
            if diff:
                raise _conflict(run_dir, "the run its config.yaml describes", diff, files)
            legacy = [path.name for _, path, info in ckpts if info is None]
            record = _new_record(ours, adopted=legacy)
            if files:
                announce(f"run directory {run_dir} was written before runs were recorded; its config.yaml matches: "
                         f"adopting it as run {record.run_id}" + (f" with checkpoints {legacy}" if legacy else ""))
        elif files:
            raise RunDirConflict(
                f"run directory {run_dir} holds files of a run that cannot be identified ({', '.join(files)}; no "
                f"{RUN_FILE} or config.yaml): this run would overwrite or delete them. Use a new trainer.experiment, "
                f"or move those files out of {run_dir}")
        else:
            record = _new_record(ours)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_record(run_dir, record)
    foreign = [(path, info) for _, path, info in ckpts
               if info and info.get("run_id") != record.run_id and identity_diff(info.get("identity", {}), ours)]
    if foreign:
        path, info = foreign[-1]
        raise _conflict(run_dir, f"{', '.join(p.name for p, _ in foreign)} written by run {info.get('run_id')}",
                        identity_diff(info.get("identity", {}), ours), [f"checkpoints/{p.name}" for p, _ in foreign],
                        what="holds checkpoints of another run")
    if cfg.trainer.resume == "off" and any(checkpoint_attempt(record, path, info) == record.attempt
                                           for _, path, info in ckpts):
        record.attempt += 1  # started over: this start's checkpoints supersede the earlier ones
        write_run_record(run_dir, record)
        announce(f"trainer.resume=off: starting run {record.run_id} over (start {record.attempt}); the checkpoints "
                 "of its earlier start are no longer resumed from and are deleted once this start has saved one "
                 "that verifies")
    return record


def checkpoint_attempt(record: RunRecord, path: Path, info: dict | None) -> int | None:
    """Which start of `record`'s run wrote the checkpoint (None: another run's)."""
    if info is None:
        return 1 if path.name in record.adopted else None
    if info.get("run_id") != record.run_id:
        return None
    return int(info.get("attempt", 1))


# ---- what a resume changes -----------------------------------------------------------------------
_IGNORED = ("trainer.resume",)  # differs on every restart; says nothing about the run
_OPTIM = ("lr", "weight_decay", "betas", "eps", "lr_schedule", "warmup_steps", "min_lr_ratio", "grad_clip")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key.count(".") < 1:  # sections only; dict-valued fields whole
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _note(key: str, new: dict, old: dict) -> str:
    section, _, name = key.partition(".")
    alg = new.get("algorithm", {})
    if section in ("actor", "critic") and name in _OPTIM:
        return "the config's value applies from the next optimizer step (the schedule's position is the checkpoint's)"
    if key == "trainer.total_steps":
        return f"the run now ends at step {new['trainer']['total_steps']}"
    if key == "algorithm.kl_coef":
        if alg.get("kl_target") is None:
            return "fixed coefficient: the config's value applies from this step"
        if alg.get("kl_target") == old.get("algorithm", {}).get("kl_target"):
            return ("ignored: the adaptive KL controller keeps its coefficient from the checkpoint (a changed "
                    "algorithm.kl_target restarts it from algorithm.kl_coef)")
        return "the adaptive KL controller restarts from it (algorithm.kl_target changed)"
    if key == "algorithm.kl_target":
        if alg.get("kl_target") is None:
            return f"the KL coefficient is now fixed at algorithm.kl_coef={alg.get('kl_coef')}"
        return f"the adaptive KL controller restarts from algorithm.kl_coef={alg.get('kl_coef')}"
    if key in DEFINING:
        return "a setting that defines the run: this run continues from another run's checkpoint"
    return "the config's value applies"


def resume_changes(info: dict | None, cfg, *, checkpoint: str | Path) -> list[str]:
    """One line per config key whose value differs from the config `checkpoint` was written with
    (`info` = checkpoint_run_info(checkpoint)), saying what the resumed run does with it. A key that has
    no effect in this config (a KL term's key while that term is off) is not named."""
    from rlframe.config.kl_settings import kl_key_acts

    name = Path(checkpoint).name
    if not info or "config" not in info:
        return [f"resume: {name} does not record the config it was written with (written by an older "
                "version): every setting comes from this config"]
    new, old = config_dict(cfg), info["config"]
    flat_new, flat_old = _flatten(new), _flatten(old)
    lines = []
    for key in sorted(set(flat_new) | set(flat_old)):
        if key in _IGNORED or flat_new.get(key) == flat_old.get(key):
            continue
        if not kl_key_acts(key, new.get("algorithm", {})):  # a KL term that is off: its keys do nothing
            continue
        lines.append(f"resume: {key} changed since {name}: {flat_old.get(key)!r} -> {flat_new.get(key)!r}; "
                     f"{_note(key, new, old)}")
    return lines
