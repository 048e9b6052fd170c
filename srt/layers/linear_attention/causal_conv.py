"""Causal depthwise conv1d over time, the short conv in front of Gated DeltaNet's q/k/v.

One function serves prefill, chunked prefill and decode: the conv state is the last K-1 inputs
the sequence has seen, prepended to this call's inputs, so a sequence fed in any number of pieces
gives the same outputs as fed at once (prefill with no state == zero left padding).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}


def causal_conv1d(x, weight, bias=None, conv_state=None, activation=None, all_states=False):
    """y[t, c] = act(bias[c] + sum_j weight[c, j] * xs[t + j, c]), xs = [conv_state, x] over time.

    x: [B, T, C]; weight: [C, K] (nn.Conv1d's [C, 1, K] squeezed); bias: [C] or None;
    conv_state: [B, C, K-1] (the previous K-1 inputs, oldest first) or None for zeros;
    activation: None or "silu". Returns ``(y [B, T, C] in x's dtype, new_conv_state [B, C, K-1])``:
    the last K-1 columns of xs, in the weight's dtype. ``conv_state`` is not modified, so a
    snapshot of it stays valid (speculative decoding restores from one). ``all_states``: also
    the state after each input, ``[B, T, C, K-1]`` (the window ending at it).
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}")
    b, t, c = x.shape
    k = weight.shape[-1]
    # Math in the weight's dtype, as transformers' conv path does.
    xt = x.transpose(1, 2).to(weight.dtype)                                # [B, C, T]
    if conv_state is None:
        conv_state = xt.new_zeros(b, c, k - 1)
    elif conv_state.shape != (b, c, k - 1):
        raise ValueError(f"conv_state shape {tuple(conv_state.shape)} != {(b, c, k - 1)}")
    xs = torch.cat([conv_state.to(weight.dtype), xt], dim=-1)              # [B, C, K-1+T]
    # The K taps as K multiply-adds in fp32: a depthwise F.conv1d runs per channel on CPU
    # (thnn's slow path, or oneDNN's at ~2x this), and K is 4.
    w = weight.float()
    acc = xs[:, :, 0:t].float() * w[:, 0:1]
    for j in range(1, k):
        acc.addcmul_(xs[:, :, j:j + t], w[:, j:j + 1])
    if bias is not None:
        acc += bias.float()[:, None]
    y = acc.to(weight.dtype)                                               # [B, C, T]
    act = _ACTIVATIONS[activation]
    if act is not None:
        y = act(y)
    last = xs[:, :, xs.shape[-1] - (k - 1):].clone()
    if all_states:  # window t = xs[t+1 : t+K], the K-1 inputs up to and including input t
        return y.transpose(1, 2).to(x.dtype), last, xs.unfold(-1, k - 1, 1)[:, :, 1:].transpose(1, 2).clone()
    return y.transpose(1, 2).to(x.dtype), last
