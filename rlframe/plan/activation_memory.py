"""Bytes of activations a training micro-batch keeps for its backward, from the model's shapes.

Counted per token, per decoder layer, on one device, as the tensors autograd saves in the engines'
own model code (tests/plan/test_activation_memory.py measures them with
`torch.autograd.graph.saved_tensors_hooks` on tiny models and holds these formulas to them).
Notation: H hidden, q = heads * head_dim, kv = kv_heads * head_dim, I intermediate, V vocabulary,
s the micro-batch's sequence length, b the compute dtype's bytes (2 for bf16), tp tensor parallel.

Which formulas apply is the engine spec's `activations` (rlframe.plugins.EngineSpec), passed as `modules`:

"transformers" (the fsdp engine: transformers' Llama/Qwen2 layers, flash-attention or sdpa: no s x s tensor is kept; the
norms and residual stream are replicated over tp, no sequence parallelism):
- each of the 2 RMSNorms keeps its input upcast to fp32 (4H), the fp32 rsqrt (4), the normalised
  input cast back (bH); the linear after it keeps the weighted output (bH): 4H + 4 + 2bH;
- attention: q and k after rotary, v, the output (which o_proj reads), the fp32 log-sum-exp per
  head: (b(2q + 2kv) + 4 heads) / tp;
- MLP: gate and up outputs, silu(gate), their product (down_proj's input): 4bI / tp.

"mcore" (the megatron engine: megatron-core's local spec, which rlframe builds: torch RMSNorm and the unfused
`DotProductAttention`, which materialises the s x s scores because rlframe passes an explicit mask):
- each norm: fp32 input (4H), rsqrt (4), fp32 normalised (4H), its output in b (bH), divided by
  tp under sequence parallelism (the column-parallel linear keeps the sequence shard);
- rotary: cos and sin for q and k (4b head_dim, sequence gathered: not divided by tp);
- attention: q, k and v with the kv heads expanded to all heads and the context (4bq / tp), and per
  head the softmax's fp32 output plus the probabilities cast back to b: heads s (4 + b) / tp
  (fp32: the softmax output is the probabilities, heads s 4 / tp);
- MLP: the fused gate|up output (2bI), silu(gate), up, their product: 5bI / tp;
- the (s, s) boolean mask, once per micro-batch (shared by the layers): s bytes per token.

The LM head (last stage): the final norm, and the fp32 logits the vocab-parallel log-softmax keeps
(4V / tp); its backward then adds the fp32 probabilities, the fp32 gradient and its cast (8 + b) V / tp
on top of everything still saved. The critic's value head keeps only the final norm's tensors.

Activation checkpointing (`activation_checkpointing=true`, recompute per decoder layer): each layer
keeps only its input (bH per token, / tp under megatron's sequence parallelism) and the layer being
back-propagated is recomputed, so one layer's full activations are live at a time.

Ulysses sequence parallelism (fsdp, sp > 1): each of the sp ranks keeps the tensors above for its
1/sp of the micro-batch's tokens (the attention tensors after the all-to-all hold all positions of
1/sp of the heads: the same bytes), plus attention's output a second time (the attention kernel keeps
it before the all-to-all back, o_proj its input after: bq / tp). Key/value heads that do not split
over sp are repeated to the query heads first (kv counts as q then), and each layer's forward holds the all-to-all's send and
receive buffers of q, k and v for a moment (2b(q + 2kv) / tp per local token, not kept).

Pipeline parallel (megatron's 1F1B schedule): stage k of pp runs pp - k forwards before its first
backward, so it holds up to pp - k micro-batches' activations (stage 0: pp of them).
"""

from __future__ import annotations

from rlframe.resharding.formats import ModelDims

FP32 = 4


def norm_bytes(dims: ModelDims, *, modules: str, itemsize: int) -> int:
    """Per token: one RMSNorm and the input the linear after it keeps."""
    H, b = dims.hidden_size, itemsize
    if modules == "transformers":
        return FP32 * H + FP32 + 2 * b * H
    return 2 * FP32 * H + FP32 + b * H


def _kv_width(dims: ModelDims, *, tp: int, ulysses: int) -> int:
    """Key (or value) width per token as the attention keeps it: repeated to the query heads when the
    kv heads of a tp rank do not split over Ulysses' sp ranks."""
    if ulysses > 1 and (dims.num_kv_heads // tp) % ulysses:
        return dims.num_heads * dims.head_dim
    return dims.num_kv_heads * dims.head_dim


def ulysses_buffer_bytes(dims: ModelDims, *, itemsize: int, tp: int, ulysses: int) -> float:
    """Per local token: the all-to-all send and receive buffers of q, k and v (fsdp, sp > 1)."""
    if ulysses == 1:
        return 0.0
    q = dims.num_heads * dims.head_dim
    return 2 * itemsize * (q + 2 * _kv_width(dims, tp=tp, ulysses=ulysses)) / tp


def layer_bytes(dims: ModelDims, *, modules: str, itemsize: int, tp: int, sequence_parallel: bool,
                seq_len: int, ulysses: int = 1) -> float:
    """Per token: what one decoder layer keeps for its backward, on one tp rank."""
    b, heads = itemsize, dims.num_heads
    q, kv, inter = heads * dims.head_dim, _kv_width(dims, tp=tp, ulysses=ulysses), dims.intermediate_size
    norms = 2 * norm_bytes(dims, modules=modules, itemsize=b)
    if modules == "transformers":
        out = 2 if ulysses > 1 else 1  # Ulysses: attention's output before and after the all-to-all back
        return norms + (b * (q + out * q + 2 * kv) + FP32 * heads) / tp + 4 * b * inter / tp
    sp = tp if sequence_parallel and tp > 1 else 1
    softmax = heads * seq_len * (FP32 + (b if b < FP32 else 0))
    return norms / sp + 4 * b * dims.head_dim + (4 * b * q + softmax) / tp + 5 * b * inter / tp


def layer_input_bytes(dims: ModelDims, *, modules: str, itemsize: int, tp: int, sequence_parallel: bool) -> float:
    """Per token: what a checkpointed decoder layer keeps (its input)."""
    sp = tp if modules == "mcore" and sequence_parallel and tp > 1 else 1
    return itemsize * dims.hidden_size / sp


def head_bytes(dims: ModelDims, *, modules: str, itemsize: int, tp: int, sequence_parallel: bool,
               head: str) -> tuple[float, float]:
    """Per token: (kept by the final norm and the LM head's log-softmax, added during its backward)."""
    sp = tp if modules == "mcore" and sequence_parallel and tp > 1 else 1
    norm = norm_bytes(dims, modules=modules, itemsize=itemsize) / sp
    if head == "value":
        return norm, 0.0
    vocab = dims.vocab_size / tp
    return norm + FP32 * vocab, (2 * FP32 + itemsize) * vocab


def mask_bytes(*, modules: str, seq_len: int) -> int:
    """Per token: megatron's (s, s) boolean attention mask, shared by the layers of a micro-batch."""
    return seq_len if modules == "mcore" else 0


def micro_batch_bytes(dims: ModelDims, *, modules: str, itemsize: int, tp: int, sequence_parallel: bool,
                      tokens: int, seq_len: int, layers: int, last_stage: bool, head: str,
                      checkpointing: bool, in_flight: int = 1, ulysses: int = 1) -> float:
    """Peak activation bytes of a training step on one device: `in_flight` micro-batches of `tokens`
    tokens (sequences of at most `seq_len`) through `layers` decoder layers (this pipeline stage's),
    plus the head's on the last stage (one micro-batch there: 1F1B runs its backward at once).
    ulysses: the fsdp engine's sp; this device computes tokens / sp of each micro-batch."""
    kw = dict(modules=modules, itemsize=itemsize, tp=tp, sequence_parallel=sequence_parallel)
    tokens = -(-tokens // ulysses)
    layer = layer_bytes(dims, seq_len=seq_len, ulysses=ulysses, **kw)
    per_mb = mask_bytes(modules=modules, seq_len=seq_len)
    buffers = ulysses_buffer_bytes(dims, itemsize=itemsize, tp=tp, ulysses=ulysses)
    if checkpointing:  # every layer's input, and one layer recomputed at a time
        per_mb += layers * layer_input_bytes(dims, **kw)
        live = layer + buffers
    else:
        per_mb += layers * layer
        live = buffers
    saved, backward = head_bytes(dims, head=head, **kw) if last_stage else (0.0, 0.0)
    return tokens * (in_flight * per_mb + live + saved + backward)
