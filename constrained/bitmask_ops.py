"""Applying a packed token bitmask to logits: int32 [B, ceil(V/32)], bit 1 = allowed.

Bit j of word w (``(word >> j) & 1``) covers token ``32 * w + j``; a 0 bit sets the logit
to -inf, exactly like ``logits.masked_fill_(~unpack_bitmask(mask, V), -inf)``: disallowed
logits become -inf whatever they held (NaN and +inf included), allowed ones keep their bits.

- CUDA tensors: the Triton kernel in ``constrained.bitmask_triton`` (triton imported lazily).
- CPU tensors: gramsync's C++ op (constrained/bitmask_cpu.cpp: one pass, ~10 us for
  SmolLM2's 49,152 logits where the torch ops below took 130-240 us in bf16) once the CPU
  kernel library is loaded (every CPU scheduler loads it); before that, or without a C++
  compiler, pure torch on the logits' integer view (int32 for fp32, int16 for bf16/fp16),
  exact for any bits. Per tile of 32768 tokens, 4 vectorised ops (and a narrowing copy
  for 16-bit logits): shift each token's bit to
  the sign bit of an int32, smear it into -1 (disallowed) / 0, then ``x |= d`` (disallowed
  -> all ones) and ``x += c * d`` (all ones -> -inf bits). masked_fill_ / where with a bool
  mask are scalar loops, ~5x slower. Tiles stay at 32768 elements because torch runs
  larger ops on its thread pool: faster on an idle 2-core box, but one op can stall ~10 ms
  when other processes hold the cores (measured), so every op here runs on the calling
  thread. Row blocks whose mask is all ones are skipped; rows that allow only a few
  words' tokens (a grammar at a key, a number, punctuation) save those logits, are filled
  with -inf whole and get them back (~0.3 vs ~1.2 ms for [32, 49152]); nearly all-ones rows (free text
  inside a JSON string) go to xgrammar's C loop when the logits are fp32 (it skips
  all-ones words: ~0.04 ms vs ~1 ms for [32, 49152]), else only their 0 bits are touched.
  Scratch buffers are per thread and reused (no page faults).
- Other devices: the portable unpack + masked_fill_.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import torch

_TILE_TOKENS = 32768  # torch's grain size: ops up to this many elements stay single-threaded
_SPARSE_RATIO = 8  # save / fill / restore when <= 1/8 of a row block's words allow a token
# Element-wise path (xgrammar's C loop for fp32) when <= 1/4 of a row block's words have a 0
# bit: a JSON string's rows disallow a few tokens in ~16% of SmolLM2's words (measured on
# bench_constrained's masks: 0.33 ms in C vs 0.9 ms in tiles for 16 such rows).
_NEARLY_ALL_RATIO = 4
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_NEG_INF_BITS = {dt: torch.tensor(float("-inf"), dtype=dt).view(it).item() for dt, it in _INT_VIEW.items()}
_REV_SHIFTS = torch.arange(31, -1, -1, dtype=torch.int32)  # bit j -> the sign bit
_local = threading.local()  # workspaces: apply may run on several threads at once


def allocate_token_bitmask(batch_size: int, vocab_size: int, device="cpu") -> torch.Tensor:
    """All tokens allowed. On the CPU made by numpy: it may run on the mask-fill thread
    beside the forward, and torch.full of this size would start a second OpenMP team."""
    shape = (batch_size, (vocab_size + 31) // 32)
    if torch.device(device).type == "cpu":
        return torch.from_numpy(np.full(shape, -1, dtype=np.int32))
    return torch.full(shape, -1, dtype=torch.int32, device=device)


def reset_token_bitmask(bitmask: torch.Tensor) -> None:
    """In place: allow every token again."""
    bitmask.fill_(-1)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, *,
                                force_triton: bool = False) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    ``logits`` [B, V] (or [V] with ``bitmask`` [W] / [1, W]) fp32/bf16/fp16; ``bitmask`` int32
    [B, W] on the same device with 32 * W >= V (bits past V are ignored). ``force_triton``
    runs the Triton kernel on CPU tensors when ``TRITON_INTERPRET=1`` (tests only).
    """
    logits2d, bitmask2d = _check(logits, bitmask)
    if logits2d.numel() == 0:
        return
    use_triton = logits.is_cuda
    if force_triton and not use_triton:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("force_triton on non-CUDA tensors needs TRITON_INTERPRET=1")
        use_triton = True
    if use_triton:
        from constrained.bitmask_triton import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits2d, bitmask2d)
    elif logits.device.type == "cpu":
        _apply_cpu(logits2d, bitmask2d)
    else:
        logits2d.masked_fill_(~unpack_bitmask(bitmask2d, logits2d.shape[1]), float("-inf"))


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, and return 2-D views of both (views: writes reach the caller's logits)."""
    if logits.dtype not in _INT_VIEW:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if logits.device != bitmask.device:
        raise ValueError(f"logits on {logits.device} but bitmask on {bitmask.device}")
    if logits.dim() not in (1, 2) or bitmask.dim() not in (1, 2):
        raise ValueError(f"need 1-D or 2-D logits and bitmask, got {logits.dim()}-D and {bitmask.dim()}-D")
    logits2d = logits.unsqueeze(0) if logits.dim() == 1 else logits
    bitmask2d = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
    if logits2d.shape[0] != bitmask2d.shape[0]:
        raise ValueError(f"batch size mismatch: logits {tuple(logits.shape)}, "
                         f"bitmask {tuple(bitmask.shape)}")
    if bitmask2d.shape[1] * 32 < logits2d.shape[1]:
        raise ValueError(f"bitmask covers {bitmask2d.shape[1] * 32} tokens but logits have "
                         f"{logits2d.shape[1]}: it needs at least {(logits2d.shape[1] + 31) // 32} "
                         f"int32 words per row")
    return logits2d, bitmask2d


def _native_op():
    """gramsync's C++ op (constrained/bitmask_cpu.cpp), once the process has loaded the CPU
    kernel library (srt/layers/cpu_kernels.py: every CPU scheduler does); None before."""
    global _NATIVE
    if _NATIVE is None and hasattr(torch.ops, "gramsync"):
        _NATIVE = getattr(torch.ops.gramsync, "apply_token_bitmask_", None)
    return _NATIVE


_NATIVE = None


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    native = _native_op()
    if native is not None and logits.stride(1) == 1 and bitmask.is_contiguous():
        native(logits, bitmask)
        return
    batch, vocab = logits.shape
    neg_inf = _NEG_INF_BITS[logits.dtype]
    x_bits = logits.view(_INT_VIEW[logits.dtype])
    mask = bitmask[:, :(vocab + 31) // 32]
    words = mask.shape[1]
    tile = _TILE_TOKENS // 32  # mask words per tile
    cols = -(-words // -(-words // tile))  # even column split of long rows
    rows = max(1, tile // words)  # several short rows per block
    full = vocab // 32  # words whose 32 tokens all exist
    contiguous = x_bits.is_contiguous()  # the sparse path indexes the flat logits
    found = []  # [row, word] of the nearly unconstrained blocks' partial words
    few_allowed = []  # rows of blocks that allow only a few words' tokens
    c_rows = [] if logits.dtype == torch.float32 and contiguous and bitmask.is_contiguous() else None
    for r0 in range(0, batch, rows):
        m, x = mask[r0:r0 + rows], x_bits[r0:r0 + rows]
        if contiguous and int(torch.count_nonzero(m)) * _SPARSE_RATIO <= m.numel():
            few_allowed.extend(range(r0, r0 + m.shape[0]))
            continue
        not_m = _cached(("block", m.shape), lambda: torch.empty(m.shape, dtype=torch.int32))
        torch.bitwise_not(m, out=not_m)  # nonzero where some token is disallowed
        n = int(torch.count_nonzero(not_m))
        if n * _NEARLY_ALL_RATIO > not_m.numel() or not contiguous:
            _apply_tiles(x, not_m, cols, neg_inf)
        elif n and c_rows is not None:
            c_rows.extend(range(r0, r0 + m.shape[0]))
        elif n:  # unconstrained rows (n == 0) need nothing
            found.append(not_m[:, :full].nonzero())
            found[-1][:, 0] += r0
            if full < words:  # the partial last word, tile-wise
                _apply_tiles(x[:, full * 32:], not_m[:, full:], 1, neg_inf)
    for where in _chunks(found, tile):
        _apply_sparse(x_bits, mask, where, neg_inf)
    if few_allowed:
        _apply_few_allowed(x_bits, mask, few_allowed, neg_inf)
    if c_rows:
        import xgrammar  # a dependency anyway (the default grammar backend)

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=c_rows, backend="cpu")


def _apply_tiles(x_bits: torch.Tensor, not_m: torch.Tensor, cols: int, neg_inf: int) -> None:
    """Every token of these rows, in tiles of ``cols`` mask words."""
    for x, nm in zip(x_bits.split(cols * 32, 1), not_m.split(cols, 1)):
        _set_neg_inf(x, nm, *_tile_views(x.dtype, nm.shape, x.shape[1]), neg_inf)


def _apply_sparse(x_bits: torch.Tensor, mask: torch.Tensor, where: torch.Tensor,
                  neg_inf: int) -> None:
    """Only the 0 bits of the words at ``where`` ([N, 2]: row, word; N <= 1024): -inf bits
    go straight to those logits (``x_bits`` contiguous)."""
    r, c = where.unbind(1)
    # Bit j to the sign bit, as in _set_neg_inf: negative = disallowed.
    shifted = torch.bitwise_left_shift((~mask[r, c]).unsqueeze(1), _REV_SHIFTS)
    i, j = (shifted < 0).nonzero().unbind(1)
    # index_select, not tensor[idx]: advanced indexing goes multi-threaded from ~3k elements.
    flat = r.index_select(0, i) * x_bits.shape[1] + c.index_select(0, i) * 32 + j
    x_bits.view(-1).index_fill_(0, flat, neg_inf)


def _apply_few_allowed(x_bits: torch.Tensor, mask: torch.Tensor, rows: list[int], neg_inf: int) -> None:
    """Rows that allow few tokens (a grammar at a key, a number, punctuation): save the
    allowed logits, set the whole rows to -inf (a memset-speed fill), put them back. Costs
    the allowed tokens plus one write per logit, instead of a 4-op sweep per logit. Every
    op stays within a tile's elements: a bigger index_select or nonzero wakes torch's
    thread pool (measured: ~10-20 ms each with the other core busy; see above)."""
    vocab, words = x_bits.shape[1], mask.shape[1]
    flat_x = x_bits.view(-1)
    step = max(1, _TILE_TOKENS // words)  # rows per piece
    for k in range(0, len(rows), step):
        piece = rows[k:k + step]
        idx = torch.tensor(piece, dtype=torch.int64)
        m = mask.index_select(0, idx)
        r, c = m.nonzero().unbind(1)  # words with some allowed token
        # Bit j to the sign bit, as in _set_neg_inf: negative = allowed.
        shifted = torch.bitwise_left_shift(m[r, c].unsqueeze(1), _REV_SHIFTS)
        i, j = (shifted < 0).nonzero().unbind(1)
        token = c.index_select(0, i) * 32 + j
        flat = idx.index_select(0, r.index_select(0, i)) * vocab + token
        if vocab % 32:  # bits past the vocabulary stand for no logit
            flat = flat[token < vocab]
        saved = flat_x.index_select(0, flat)
        for row in piece:
            for part in x_bits[row].split(_TILE_TOKENS):
                part.fill_(neg_inf)
        flat_x.index_copy_(0, flat, saved)


def _chunks(parts: list[torch.Tensor], size: int):
    """The rows of ``parts`` regrouped into tensors of at most ``size`` rows (one big
    torch.cat would be multi-threaded, and so would the sparse ops on it)."""
    group, count = [], 0
    for piece in (p for part in parts for p in part.split(size)):
        if count + len(piece) > size:
            yield torch.cat(group)
            group, count = [], 0
        group.append(piece)
        count += len(piece)
    if group:
        yield torch.cat(group)


def _set_neg_inf(x: torch.Tensor, not_m: torch.Tensor, words: torch.Tensor, words_x: torch.Tensor,
                 narrow_x: torch.Tensor | None, neg_inf: int) -> None:
    """x [R, T] (integer view of logits) for the mask words not_m [R, C] (~mask), with
    scratch ``words`` int32 [R, C, 32] and its [R, T] part (T <= 32 * C); for 16-bit logits
    also narrow_x int16 [R, T]. int32 throughout: AVX2 has no variable 16-bit shifts."""
    # Move bit j to the sign bit, then smear it: -1 where disallowed, else 0.
    torch.bitwise_left_shift(not_m.unsqueeze(-1), _REV_SHIFTS, out=words)
    words.bitwise_right_shift_(31)
    if narrow_x is not None:
        words_x = narrow_x.copy_(words_x)
    x.bitwise_or_(words_x)  # disallowed -> -1 (all bits set), allowed unchanged
    x.add_(words_x, alpha=-1 - neg_inf)  # -1 -> -inf bits, allowed + 0


def _cached(key: tuple, make):
    """Per-thread cache of workspaces and views into them: a server sees few shapes, fresh
    buffers would page-fault, and even making views costs microseconds per tile."""
    cache = _local.__dict__.setdefault("cache", {})
    if key not in cache:
        if len(cache) > 64:  # many batch sizes / vocabularies: start over
            cache.clear()
        # Normal tensors even when first called under inference_mode (the scheduler's
        # forward): an inference tensor could not be updated in place outside it later.
        with torch.inference_mode(False):
            cache[key] = make()
    return cache[key]


def _tile_views(int_dtype: torch.dtype, shape: torch.Size, tokens: int) -> tuple:
    """Scratch for an [R, C] tile of mask words covering ``tokens`` logits per row, in this
    thread's tile-sized workspaces: int32 [R, C, 32], its [R, tokens] part, and an int16
    [R, tokens] for 16-bit logits (else None)."""
    def make():
        work = _cached(("tile", torch.int32), lambda: torch.empty(_TILE_TOKENS, dtype=torch.int32))
        d = work[:shape[0] * shape[1] * 32].view(*shape, 32)
        narrow = None
        if int_dtype == torch.int16:
            w16 = _cached(("tile", torch.int16), lambda: torch.empty(_TILE_TOKENS, dtype=torch.int16))
            narrow = w16[:shape[0] * tokens].view(shape[0], tokens)
        return d, d.view(shape[0], -1)[:, :tokens], narrow
    return _cached(("tile", int_dtype, shape, tokens), make)
