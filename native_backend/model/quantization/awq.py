"""Activation-aware weight quantization (Lin et al., 2023), the way AutoAWQ runs it, on our float
model in place; the int4 rounding itself comes after (rtn.py, checkpoint.py).

Layer by layer, with the float outputs of the layer before as inputs (calibration.py's text):

  1. capture the inputs of each linear group from one float forward of the layer:
         input norm  -> q, k, v      (judged on the attention block's output)
         v           -> o            (only when v's output width is o's input width: not under GQA)
         post norm   -> gate, up     (judged on the MLP's output)
         up          -> down         (judged on down's output)
  2. per group, a grid of 20 exponents a: per input channel
         s = mean|x|^a / mean(|w| / max|w| of its group)^(1 - a),   s /= sqrt(max(s) min(s))
     and the s whose fake-quantized weights Q(w s) / s change the judged output least (judged on
     LOSS_TOKENS of the calibration tokens; mean|x| over all of them);
  3. fold each s into the op before the group (the norm's weight, or the rows of v / up), the
     group's weights times s, their captured inputs divided by it;
  4. per output row and group of every linear but q and k, the clip of max|w| (down to half) whose
     fake-quantized weights change that linear's output on the captured inputs least.

The float outputs of each layer (before any change) feed the next, as in AutoAWQ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from native_backend.model.layers.rotary import apply_rope
from native_backend.model.quantization.rtn import fake_quantize_, fake_quantize_groups

N_GRID = 20  # scale exponents 0, 0.05, .. 0.95 (AutoAWQ's n_grid)
CLIP_STEPS = 10  # clip max|w| to 1, 0.95, .. 0.55 of itself (max_shrink 0.5 over n_grid 20)
CLIP_ROWS = 1024  # output rows per clip batch (memory: a few rows x in floats)
# Tokens (whole sequences) whose output the scale grid's loss compares: 21 forward passes of each
# linear group per layer over every calibration token cost most of the search on a CPU (AutoAWQ,
# on a GPU, judges on all of them); the statistics mean|x| still use every token.
LOSS_TOKENS = 512


# ------------------------------------------------------------------------------ the layer in float


@dataclass
class Rope:
    cos: torch.Tensor  # (T, 1, head_dim), as RotaryEmbedding returns them
    sin: torch.Tensor


def attention_heads(attn, x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """(B, T, hidden) normed input -> (B, T, heads * head_dim): attention before o_proj, causal."""
    b, t, _ = x.shape
    hd = attn.head_dim
    q = attn.q_proj(x).view(b, t, attn.num_heads, hd)
    k = attn.k_proj(x).view(b, t, attn.num_kv_heads, hd)
    v = attn.v_proj(x).view(b, t, attn.num_kv_heads, hd)
    q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True)  # (B, heads, T, head_dim)
    return o.transpose(1, 2).reshape(b, t, attn.num_heads * hd)


def mlp_act(mlp, x: torch.Tensor) -> torch.Tensor:
    return F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)


@dataclass
class LayerInputs:
    """What each linear group of one layer saw in the float forward."""

    attn: torch.Tensor  # (B, T, hidden): input of q, k, v
    heads: torch.Tensor  # (B, T, heads * head_dim): input of o
    mlp: torch.Tensor  # (B, T, hidden): input of gate, up
    act: torch.Tensor  # (B, T, intermediate): input of down


def layer_forward(layer, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, LayerInputs]:
    """(B, T, hidden) -> the layer's output and the inputs its linears saw."""
    attn_in = layer.input_layernorm(h)
    heads = attention_heads(layer.self_attn, attn_in, rope)
    h = h + layer.self_attn.o_proj(heads)
    mlp_in = layer.post_attention_layernorm(h)
    act = mlp_act(layer.mlp, mlp_in)
    return h + layer.mlp.down_proj(act), LayerInputs(attn_in, heads, mlp_in, act)


# ------------------------------------------------------------------------------ scales


@dataclass
class ScaleGroup:
    prev: torch.nn.Module  # an RMSNorm, or the linear whose output rows feed the group
    linears: list
    inputs: str  # the LayerInputs field
    judge: Callable[[torch.Tensor], torch.Tensor]  # the group's input -> the output the loss compares


def scale_groups(layer, rope: Rope) -> list[ScaleGroup]:
    attn, mlp = layer.self_attn, layer.mlp
    groups = [ScaleGroup(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "attn",
                         lambda x: attn.o_proj(attention_heads(attn, x, rope)))]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # no GQA: v's rows are o's columns
        groups.append(ScaleGroup(attn.v_proj, [attn.o_proj], "heads", attn.o_proj))
    groups += [ScaleGroup(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp",
                          lambda x: mlp.down_proj(mlp_act(mlp, x))),
               ScaleGroup(mlp.up_proj, [mlp.down_proj], "act", mlp.down_proj)]
    return groups


def search_scale(group: ScaleGroup, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(in,) the per-channel scale of least output error; the group's weights are left as found."""
    x_mean = x.reshape(-1, x.shape[-1]).abs().mean(0)
    w = torch.cat([lin.weight for lin in group.linears])  # (sum of outs, in)
    wg = w.abs().reshape(-1, group_size)
    w_mean = (wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)
    # every calibration token counts for the statistics; the loss is judged on whole sequences
    # (attention is causal) spread over the calibration set
    n = max(1, LOSS_TOKENS // x.shape[1])
    x = x[:: max(1, x.shape[0] // n)][:n]  # (n, T, in)
    reference = group.judge(x)
    originals = [lin.weight.clone() for lin in group.linears]
    best, best_loss = None, float("inf")
    for i in range(N_GRID):
        ratio = i / N_GRID
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        # The group's weights become Q(w s) in place and its input x / s: the output is
        # x Q(w s)^T / s as the folded model's, without two more passes over every weight.
        for lin, w0 in zip(group.linears, originals):
            fake_quantize_(torch.mul(w0, s, out=lin.weight), group_size)
        loss = float((group.judge(x / s) - reference).pow(2).mean())
        if loss < best_loss:
            best, best_loss = s, loss
    for lin, w0 in zip(group.linears, originals):
        lin.weight.copy_(w0)
    return best


def fold_scale(group: ScaleGroup, s: torch.Tensor) -> None:
    """The op before divides by s, the group's weights multiply by it: the float output is unchanged."""
    prev = group.prev
    if prev.weight.dim() == 1:  # RMSNorm: y = norm(x) * weight
        prev.weight.div_(s)
    else:  # a linear: its last len(s) output rows
        prev.weight[-len(s):].div_(s[:, None])
        if prev.bias is not None:
            prev.bias[-len(s):].div_(s)
    for lin in group.linears:
        lin.weight.mul_(s)


# ------------------------------------------------------------------------------ clipping


def group_gram(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(tokens.., in) -> (in/g, g, g): per input group, the mean of x_i x_j over every token."""
    x = x.reshape(-1, x.shape[-1])
    xg = x.reshape(x.shape[0], -1, group_size).transpose(0, 1)  # (groups, tokens, g)
    return torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]


def search_clip(w: torch.Tensor, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in/g, 1) the max|w| per output row and group whose fake-quantized rows, clipped to it,
    change the output on x (tokens.., in) least.

    A row's output error from one group is x_g . d over the tokens (d: the group's rounded minus
    its float weights), and its mean square is d^T G d with G the group's mean x x^T: exact, and
    costs g^2 a weight instead of a dot product per token, so every token counts (AutoAWQ
    samples 512 and multiplies them out)."""
    gram = group_gram(x, group_size)  # (groups, g, g)
    n_groups = w.shape[1] // group_size
    best_all = []
    for r0 in range(0, w.shape[0], CLIP_ROWS):
        wg = w[r0:r0 + CLIP_ROWS].reshape(-1, n_groups, group_size)  # (rows, groups, g)
        hi, lo = wg.amax(dim=-1), wg.amin(dim=-1)
        org_max = torch.maximum(hi, -lo)
        best, min_err = org_max.clone(), torch.full_like(org_max, float("inf"))
        for i in range(CLIP_STEPS):
            max_val = org_max * (1 - i / N_GRID)
            clipped = torch.clamp(wg, -max_val[..., None], max_val[..., None])
            # the clipped group's max and min, without a pass over it
            d = fake_quantize_groups(clipped, hi.clamp(-max_val, max_val), lo.clamp(-max_val, max_val)).sub_(wg)
            dg = d.transpose(0, 1)  # (groups, rows, g)
            err = (torch.bmm(dg, gram) * dg).sum(-1).t()  # (rows, groups)
            better = err < min_err
            min_err[better], best[better] = err[better], max_val[better]
        best_all.append(best[..., None])
    return torch.cat(best_all)


def clip_weight(lin, max_val: torch.Tensor, group_size: int) -> None:
    w = lin.weight
    wg = w.reshape(w.shape[0], -1, group_size)
    w.copy_(torch.clamp(wg, -max_val, max_val).reshape(w.shape))


# ------------------------------------------------------------------------------ the model


@torch.no_grad()
def awq_layer(layer, inputs: LayerInputs, rope: Rope, group_size: int) -> None:
    """Scales searched on the layer as found, then folded; then clips on the scaled layer."""
    groups = scale_groups(layer, rope)
    scales = [search_scale(g, getattr(inputs, g.inputs), group_size) for g in groups]
    for g, s in zip(groups, scales):
        fold_scale(g, s)
        setattr(inputs, g.inputs, getattr(inputs, g.inputs) / s)
    attn, mlp = layer.self_attn, layer.mlp
    for lin, x in ((attn.v_proj, inputs.attn), (attn.o_proj, inputs.heads), (mlp.gate_proj, inputs.mlp),
                   (mlp.up_proj, inputs.mlp), (mlp.down_proj, inputs.act)):  # q and k are not clipped
        clip_weight(lin, search_clip(lin.weight, x, group_size), group_size)


@torch.no_grad()
def awq_search(model, tokens: torch.Tensor, group_size: int,
               progress: Callable[[int, int], None] = lambda *_: None) -> None:
    """Rewrite `model` (float32, dense torch linears) in place so that its int4 rounding loses least
    on `tokens` (samples, seq_len)."""
    n, t = tokens.shape
    rope = Rope(*model.model.rotary_emb(torch.arange(t)))
    h = model.model.embed_tokens(tokens.reshape(-1)).reshape(n, t, -1)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        h_next, inputs = layer_forward(layer, h, rope)
        awq_layer(layer, inputs, rope, group_size)
        h = h_next
        progress(i + 1, len(layers))
