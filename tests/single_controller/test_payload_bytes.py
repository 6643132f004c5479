"""transport.payload_bytes, the sizes a traced call records: tensors, arrays, text and containers by
size; objects it cannot size (configs, a TensorDict-like object with `numel` but no `element_size`)
count 0 instead of failing the call."""

import numpy as np
import torch

from rlframe.single_controller.transport import payload_bytes


class _NumelOnly:
    def numel(self):
        return 10


def test_sizes_of_what_calls_carry():
    t = torch.zeros(4, 3, dtype=torch.float32)
    assert payload_bytes(t) == 48
    assert payload_bytes(np.zeros(5, dtype=np.int64)) == 40
    assert payload_bytes(("ab", 1, 2.0, [t], {"k": b"xyz"})) == 2 + 8 + 8 + 48 + 3
    assert payload_bytes(_NumelOnly()) == 0
    assert payload_bytes(object()) == 0
