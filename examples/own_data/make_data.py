"""Regenerate train.jsonl (200 rows) and val.jsonl (40 rows): sums of two numbers (60 + 39 at most).

    python examples/own_data/make_data.py

Each row is in the layout docs/data.md describes: chat messages under `prompt`, a `data_source`
that names no built-in verifier (so the reward comes from reward.py), the answer under
`reward_model.ground_truth`, and anything the reward function wants under `extra_info`.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(n: int, rng: random.Random, seen: set) -> list[dict]:
    out = []
    while len(out) < n:
        a, b = rng.randint(1, 60), rng.randint(1, 39)
        prompt = f"{a}+{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({
            "prompt": [{"role": "user", "content": prompt}],
            "data_source": "my_sums",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"operands": [a, b]},
        })
    return out


def main() -> None:
    rng, seen = random.Random(0), set()
    for name, n in (("train.jsonl", 200), ("val.jsonl", 40)):
        with (HERE / name).open("w") as fh:
            for row in rows(n, rng, seen):
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
