"""Delta weight sync: send only the words of a message that changed since the last sync.

The executor's messages are fixed by the plan: the same pieces, in the same order and at the same
offsets, at every sync. So each side keeps, per message, the bytes of the last sync (`DeltaState`):
the sender compares the new message with them word by word and sends the cheaper of

  sparse: the changed words' indices (int32) and their new values, or
  dense:  the message as is,

after a 16-byte header (mode, count) that tells the receiver what follows; the receiver writes the
new values into its copy and hands on the whole message, which is then bit-identical to what a full
sync would have moved (values are replaced, never added, so nothing accumulates). A word is the
smallest element size of the pieces in the message (2 bytes for bf16 weights): a bf16 weight that an
optimizer step moves by less than half its last bit does not change, which is most of them.

Every `full_every`-th sync (and the first) is dense for every message, so a receiver that lost its
copy (or any error) cannot persist; a receiver that gets a sparse message without a copy refuses it.
Memory: each side holds one copy of the bytes it sends or receives (its share of the synced weights
in the sync dtype), kept between syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DENSE, SPARSE = 0, 1
HEADER_WORDS = 2  # int64: mode, count (changed words for SPARSE, bytes for DENSE)
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
INDEX_BYTES = 4


@dataclass
class DeltaStats:
    """One sync's encoding, on the sending side (bytes of payload, headers excluded)."""

    messages: int = 0
    sparse_messages: int = 0
    words: int = 0
    changed_words: int = 0
    full_bytes: int = 0  # what a full sync would have sent
    sent_bytes: int = 0

    @property
    def changed_fraction(self) -> float:
        return self.changed_words / self.words if self.words else 0.0


@dataclass
class DeltaState:
    """Per-message copies of the last sync, on one rank (sender and receiver side alike)."""

    full_every: int = 10
    syncs: int = 0  # syncs started
    previous: dict = field(default_factory=dict)  # message key -> uint8 tensor of its last bytes
    stats: DeltaStats = field(default_factory=DeltaStats)

    def begin_sync(self) -> None:
        self.syncs += 1
        self.stats = DeltaStats()

    @property
    def full_sync(self) -> bool:
        """This sync sends every message dense (the first, then every full_every-th)."""
        return (self.syncs - 1) % self.full_every == 0

    # ---- sender ----------------------------------------------------------------------------------
    def encode(self, key, message: torch.Tensor, word: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, payload) for `message` (uint8); remembers `message` for the next sync."""
        words = message.view(_WORD_DTYPES[word])
        n = words.numel()
        if n >= 2**31:
            raise ValueError(f"delta sync: a message of {n} words does not fit int32 indices; lower "
                             "rollout.bucket_bytes (at most 4 GiB for bf16 weights)")
        prev = self.previous.get(key)
        s = self.stats
        s.messages += 1
        s.words += n
        s.full_bytes += message.numel()
        if prev is None or self.full_sync or prev.numel() != message.numel():
            if prev is None or prev.numel() != message.numel():
                s.changed_words += n
                self.previous[key] = message.clone()
            else:
                s.changed_words += int((words != prev.view(words.dtype)).sum())
                prev.copy_(message)
            return self._header(DENSE, message.numel(), message.device), self._sent(message)
        old = prev.view(words.dtype)
        changed = (words != old).nonzero().flatten()
        count = changed.numel()
        s.changed_words += count
        if count * (INDEX_BYTES + word) >= n * word:
            old.copy_(words)
            return self._header(DENSE, message.numel(), message.device), self._sent(message)
        values = words[changed]
        old[changed] = values
        index = changed.to(torch.int32).view(torch.uint8)
        pad = _index_bytes(count) - index.numel()  # values start 8-byte aligned, for any word
        payload = torch.cat([index, index.new_zeros(pad), values.view(torch.uint8)])
        s.sparse_messages += 1
        return self._header(SPARSE, count, message.device), self._sent(payload)

    def _sent(self, payload: torch.Tensor) -> torch.Tensor:
        self.stats.sent_bytes += payload.numel()
        return payload

    @staticmethod
    def _header(mode: int, count: int, device) -> torch.Tensor:
        return torch.tensor([mode, count], dtype=torch.int64, device=device)

    # ---- receiver --------------------------------------------------------------------------------
    @staticmethod
    def payload_bytes(header: torch.Tensor, word: int) -> int:
        mode, count = (int(x) for x in header.tolist())
        return count if mode == DENSE else _index_bytes(count) + count * word

    @staticmethod
    def is_dense(header: torch.Tensor) -> bool:
        return int(header[0]) == DENSE

    def decode(self, key, header: torch.Tensor, payload: torch.Tensor, out: torch.Tensor, word: int) -> None:
        """Write the message into `out` (uint8) from `payload` and this side's copy of the last sync."""
        mode, count = (int(x) for x in header.tolist())
        if mode == DENSE:  # `payload` may be `out` itself (received in place)
            if payload.numel() != out.numel():
                raise ValueError(f"delta sync: dense message of {payload.numel()} bytes for a {out.numel()}-byte slot")
            if payload.data_ptr() != out.data_ptr():
                out.copy_(payload)
            prev = self.previous.get(key)
            if prev is None or prev.numel() != out.numel():
                self.previous[key] = payload.clone()
            else:
                prev.copy_(payload)
            return
        prev = self.previous.get(key)
        if prev is None or prev.numel() != out.numel():
            raise ValueError(
                "delta sync: a sparse update arrived for a message this rank holds no previous copy of (the "
                "receiver restarted or missed a sync); the sender's next full sync repairs it: set "
                "rollout.delta_full_every lower, or rollout.weight_sync=full")
        dtype = _WORD_DTYPES[word]
        index = payload[:count * INDEX_BYTES].view(torch.int32).long()
        prev.view(dtype)[index] = payload[_index_bytes(count):].view(dtype)
        out.copy_(prev)


def _index_bytes(count: int) -> int:
    """Bytes of `count` int32 indices, padded to a multiple of 8."""
    return -(-count * INDEX_BYTES // 8) * 8
