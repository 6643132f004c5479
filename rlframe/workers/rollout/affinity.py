"""Session affinity over generation replicas: a multi-turn conversation's turns go to the replica that
generated its earlier turns, so that replica's prefix cache (rollout.enable_prefix_caching) holds
its context, while every replica still gets an equal share of each call.

A generate call's batch is padded to a multiple of the replicas and cut into equal contiguous
chunks, chunk r to replica r (phases.launch_generation, Dispatch.DP_COMPUTE). `order` returns the
rows' order for that cut: each row whose conversation has a home replica goes into that replica's
chunk while it has room; the rest (first turns, and the overflow of a replica that has more of its
conversations in this call than its share) fill the chunks' room left in order (a first turn's
samples of one prompt, adjacent, stay together as in a plain cut), and that replica becomes their
home.

    affinity = ReplicaAffinity()
    perm = affinity.order(keys, replicas)      # keys: one conversation id per row
    gen_in = batch.index(perm); out = generate(gen_in); out row k is row perm[k]
"""

from __future__ import annotations

from typing import Hashable


class ReplicaAffinity:
    def __init__(self):
        self.home: dict[Hashable, int] = {}
        self.kept = self.moved = 0  # rows of a known conversation placed on its home replica / elsewhere

    def order(self, keys: list[Hashable], replicas: int) -> list[int]:
        """A permutation of range(len(keys)): row perm[k] goes to position k of the call's batch."""
        n = len(keys)
        if replicas <= 1 or n == 0:  # one row is placed (and counted) like any other: on chunk 0
            return list(range(n))
        per = -(-n // replicas)  # chunk size after padding to a multiple of `replicas`
        room = [max(0, min(per, n - r * per)) for r in range(replicas)]  # real rows each chunk holds
        chunks: list[list[int]] = [[] for _ in range(replicas)]
        rest = []
        for i, key in enumerate(keys):
            r = self.home.get(key)
            if r is not None and r < replicas and len(chunks[r]) < room[r]:
                chunks[r].append(i)
                self.kept += 1
            else:
                self.moved += r is not None
                rest.append(i)
        for i in rest:
            r = next(c for c in range(replicas) if len(chunks[c]) < room[c])  # in order: a prompt's samples stay together
            chunks[r].append(i)
            self.home[keys[i]] = r
        return [i for chunk in chunks for i in chunk]
