"""DataProto: the one batch type that crosses process boundaries.

In rlframe's dataflow (the design card's PPO loop) the driver holds one DataProto per step and
passes it through the worker groups: the prompt batch from the dataloader, `union`-ed with the
rollout's responses, then with rewards, reference/old log-probs, values and advantages. A worker
group splits it over its data-parallel ranks (`chunk`), every rank computes on its part, and the
parts are put back together (`concat`). GRPO-style algorithms `repeat` prompts n times;
`pad_to_divisor`/`unpad` make any batch split evenly over any world size; `iter_minibatches`
feeds PPO's update epochs.

A DataProto of B samples holds three things:
- `batch`: a `tensordict.TensorDict` with batch_size [B]: tensors of shape (B, ...) such as
  `input_ids` (B, P+R) or `advantages` (B, R); the keys are fixed in docs/contracts.md;
- `non_tensor_batch`: per-sample Python values as 1-D numpy arrays of length B (usually dtype
  object), e.g. `uid`, `ground_truth`, `raw_prompt`;
- `meta_info`: per-batch settings (`temperature`, `micro_batch_size`, ...), not indexed by sample.

It checks itself on construction: every field has B rows, and every error names the key and sizes.

Conventions of this implementation:
- Operations that return a DataProto (`select`, `union`, `chunk`, `rename`, slicing) share tensor
  storage with their input where indexing allows it (slices are views, index lists copy); the
  `meta_info` dict is copied shallowly. Only `pop` and `reorder` change `self`, in place.
- Pickling carries tensors out-of-band (pickle protocol 5), so `ray.put`/`ray.get` and actor calls
  move the payload through Ray's object store without per-element pickling; see
  `rlframe.protocol.serialize`. Tensors arrive on the CPU, as private copies of the object-store
  bytes unless received inside `receive_zero_copy()`.
"""

from rlframe.protocol.dataproto import DataProto
from rlframe.protocol.serialize import receive_zero_copy

__all__ = ["DataProto", "receive_zero_copy"]
