"""The `rlframe` command: run the main job here, or submit it to a Ray cluster and follow it.

    rlframe run [-cn CONFIG] [key=value ...]           # the main job in this process (= python -m rlframe.main)
    rlframe preflight [--steps N] [-cn CONFIG] [key=value ...]  # run it N (2) steps, check the RL invariants
    rlframe plan [-cn CONFIG] [key=value ...] [--write FILE]  # rank its placements and layouts by step time
    rlframe submit CONFIG [key=value ...] [--follow]   # a Ray job; prints its id and run directory
    rlframe status JOB_ID                              # status, run directory, latest metrics
    rlframe logs JOB_ID [--follow] [--tail N]
    rlframe metrics JOB_ID [--name critic/score/mean]
    rlframe stop JOB_ID
    rlframe export CHECKPOINT_DIR OUT_DIR [--merge-lora]  # a checkpoint as an HF model directory (here, on CPU)

The cluster is `--address` (the dashboard URL), else RAY_API_SERVER_ADDRESS, else
http://127.0.0.1:8265; see docs/jobs.md. Exit codes: 0 success, 1 the job failed or was stopped,
2 a usage or connection error (the message says how to fix it).
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_JOB_FAILED, EXIT_USAGE = 1, 2


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="job server (dashboard) URL; default RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlframe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the main job in this process", add_help=False)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="arguments of python -m rlframe.main")
    p = sub.add_parser("preflight", help="run a config for 2 steps and check the RL invariants", add_help=False)
    p.add_argument("argv", nargs=argparse.REMAINDER,
                   help="--steps N and the arguments of python -m rlframe.main, in any order")
    p = sub.add_parser("plan", help="rank the config's placements and layouts by estimated step time", add_help=False)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="--top N, --write FILE, --calibrate, then a config and overrides")
    p = sub.add_parser("submit", help="submit the main job to a Ray cluster")
    p.add_argument("config_name", help="a file of configs/ without .yaml, e.g. grpo_tiny")
    p.add_argument("overrides", nargs="*", help="Hydra overrides such as trainer.total_steps=2")
    p.add_argument("--output-dir", default=None, help="absolute run root (shared storage for a remote cluster)")
    p.add_argument("--follow", action="store_true", help="stream the logs and exit with the job's result")
    _add_address(p)
    for name, text in (("status", "a job's status, run directory and latest metrics"), ("stop", "stop a job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("job_id")
        _add_address(p)
    p = sub.add_parser("logs", help="print a job's logs")
    p.add_argument("job_id")
    p.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--tail", type=int, default=None, help="only the last N lines")
    _add_address(p)
    p = sub.add_parser("metrics", help="print a run's metrics.jsonl rows (JSON lines)")
    p.add_argument("job_id")
    p.add_argument("--name", default=None, help="only this metric, as `step value` lines")
    _add_address(p)
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory (CPU, no Ray)",
                       description="Export a run checkpoint (outputs/<experiment>/checkpoints/step_NNNNNN, or one "
                       "of its role directories) to a directory transformers and vLLM load: config, tokenizer, "
                       "safetensors weights. The checkpoint is verified against its manifest first (docs/checkpoints.md).")
    p.add_argument("checkpoint_dir", help="checkpoints/step_NNNNNN of a run, or an engine checkpoint directory")
    p.add_argument("out_dir", help="the HF directory to write (must not exist or be empty, unless --overwrite)")
    p.add_argument("--role", default="actor", help="which role of a run checkpoint to export (default: actor)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA checkpoints: write the merged model (default: PEFT's adapter directory)")
    p.add_argument("--model-path", default=None,
                   help="the model the run started from (config, tokenizer, LoRA base), when it is no longer at "
                   "the model_path recorded in the checkpoint's layout.json")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    return parser


def _follow(handle) -> int:
    for chunk in handle.follow_logs():
        print(chunk, end="", flush=True)
    status = handle.wait(raise_on_failure=False)
    print(f"\nrlframe: job {handle.job_id} {status}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else EXIT_JOB_FAILED


def _cmd_submit(args) -> int:
    from rlframe import jobs

    handle = jobs.submit(args.config_name, args.overrides, address=args.address, output_dir=args.output_dir)
    print(f"job_id: {handle.job_id}\nrun_dir: {handle.run_dir}\naddress: {handle.address}", flush=True)
    return _follow(handle) if args.follow else 0


def _cmd_status(args) -> int:
    from rlframe import jobs

    handle = jobs.attach(args.job_id, address=args.address)
    info, rows = handle.info(), handle.metrics()
    print(f"job_id: {handle.job_id}\nstatus: {info.status.value}\nmessage: {info.message or ''}\n"
          f"run_dir: {handle.run_dir}\nsteps logged: {len(rows)}")
    if rows:
        print(f"latest: {json.dumps(rows[-1])}")
    return 0


def _cmd_logs(args) -> int:
    from rlframe import jobs

    handle = jobs.attach(args.job_id, address=args.address)
    if args.follow:
        return _follow(handle)
    print(handle.log_tail(args.tail) if args.tail else handle.logs(), end="")
    return 0


def _cmd_metrics(args) -> int:
    from rlframe import jobs

    handle = jobs.attach(args.job_id, address=args.address)
    if args.name:
        for step, value in zip(*handle.metric(args.name)):
            print(step, value)
    else:
        for row in handle.metrics():
            print(json.dumps(row))
    return 0


def _cmd_stop(args) -> int:
    from rlframe import jobs

    status = jobs.attach(args.job_id, address=args.address).stop()
    print(f"job {args.job_id}: {status}")
    return 0


def _cmd_export(args) -> int:
    from rlframe.export import export_checkpoint

    done = export_checkpoint(args.checkpoint_dir, args.out_dir, role=args.role, merge_lora=args.merge_lora,
                             model_path=args.model_path, overwrite=args.overwrite)
    print(f"rlframe: exported {done['checkpoint']} ({done['backend']} {done['layout']}) as a {done['kind']} "
          f"to {done['out_dir']}")
    return 0


COMMANDS = {"submit": _cmd_submit, "status": _cmd_status, "logs": _cmd_logs, "metrics": _cmd_metrics,
            "stop": _cmd_stop, "export": _cmd_export}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `run` forwards everything (including -h) to the main job's own parser.
    if argv[:1] == ["run"]:
        from rlframe.main import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["plan"]:
        from rlframe.plan.command import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["preflight"]:
        from rlframe.main import preflight_main

        return preflight_main(argv[1:])
    args = build_parser().parse_args(argv)
    from rlframe.jobs import ClusterNotFoundError, JobFailedError

    try:
        return COMMANDS[args.command](args)
    except JobFailedError as err:
        print(f"rlframe: {err}", file=sys.stderr)
        return EXIT_JOB_FAILED
    except (ValueError, ClusterNotFoundError, PermissionError) as err:
        print(f"rlframe: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
