"""Cost of checkpoint manifests: hashing at save and verification before a load, per preset.

For each preset: 2 gloo ranks build the fsdp actor engine (dp=2), take one optimizer step (so the
Adam moments exist) and save a checkpoint (timed; it includes the manifest, each rank hashing half
the bytes). Then, in one process, `manifest.verify` of that checkpoint (what the driver does for
trainer.resume and for retention, per role checkpoint) and the same files' plain read, both as
the median of 3 runs with the files in the page cache. A run checkpoint of PPO holds two such
directories (actor and critic).
Usage: python benchmarks/checkpoint_verify.py [--presets 12m 50m] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from report import machine_line, markdown_table, median_seconds, write_section

from rlframe.utils import manifest
from rlframe.utils.spawn import run_distributed


def _save(rank, world, model, out):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    engine = get_train_engine("fsdp")(TrainEngineConfig(model_path=model, head="lm", dp=2, tp=1), device_mesh=mesh)
    ids = torch.randint(4, 60, (2, 32))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(32).expand(2, 32),
             "responses": ids[:, 16:], "response_mask": torch.ones(2, 16)}
    engine.train_step(lambda o, mb: (-(o["log_probs"] * mb["response_mask"]).mean(), {}), batch)
    t0 = time.perf_counter()
    engine.save_checkpoint(out)
    return time.perf_counter() - t0


def _read_all(root: Path) -> None:
    for rel in manifest.list_files(root):
        with open(root / rel, "rb") as f:
            while f.read(4 << 20):
                pass


def measure(preset: str, work: Path) -> list:
    from rlframe.data.tiny_model import build_random_model, count_parameters

    model = build_random_model(work / preset / "model", preset=preset, seed=0)
    ck = work / preset / "ck"
    save_s = max(run_distributed(_save, world_size=2, args=(str(model), str(ck)), timeout_s=900))
    size = sum((ck / rel).stat().st_size for rel in manifest.list_files(ck))
    verify_s = median_seconds(lambda: manifest.verify(ck), 3)
    read_s = median_seconds(lambda: _read_all(ck), 3)
    return [preset, f"{count_parameters(preset) / 1e6:.1f}M", f"{size / 2**20:.0f}", len(manifest.list_files(ck)),
            f"{save_s:.2f}", f"{verify_s:.2f}", f"{read_s:.2f}", f"{size / 2**20 / verify_s:.0f}"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["12m", "50m"])
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(preset, Path(tmp)) for preset in args.presets]
    load = os.getloadavg()[0]
    table = markdown_table(["preset", "params", "checkpoint MiB", "files", "save s (incl. manifest)",
                            "verify s", "plain read s", "verify MiB/s"], rows)
    body = (f"Reproduce: `python benchmarks/checkpoint_verify.py` (1-min load average at the end {load:.1f} on "
            f"{os.cpu_count()} cores).\n\n{machine_line()}\n\n"
            "One actor engine checkpoint (fsdp dp=2: fp32 weights and Adam moments, engine state, layout), "
            "files in the page cache; `verify` = `rlframe.utils.manifest.verify` (size and sha256 of every file), "
            "paid by the driver once per checkpoint at resume and once per save (retention). A PPO run "
            "checkpoint holds two of these (actor and critic).\n\n" + table)
    print(body)
    if not args.no_write:
        write_section("## Checkpoint verification", body)


if __name__ == "__main__":
    main()
