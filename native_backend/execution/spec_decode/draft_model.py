"""The draft models: the target's own first layers (no extra weights), or another checkpoint.

    self-speculative (draft_num_layers n):   embed ─ layers[0..n) ─ final norm ─ head   (the target's
                                             modules themselves, and its KV layers 0..n: the target's
                                             KV of accepted tokens *is* the draft's)
    draft_model (another checkpoint):        built with the target's LayerContext; its own KV cache
                                             with the same blocks (one block id, both caches)
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from native_backend.model.kv_cache import KVCache


def early_exit_draft(target: nn.Module, num_layers: int) -> nn.Module:
    """A model whose forward runs the target's first num_layers layers, then its final norm and
    head. Shallow copies with their own module lists: the target is untouched."""
    total = target.config.num_layers
    if not 0 < num_layers < total:
        raise ValueError(f"speculative.draft_num_layers: {num_layers} is not in 1..{total - 1} "
                         f"(the target has {total} layers; a draft must be smaller)")
    draft = copy.copy(target)
    draft._modules = dict(target._modules)
    draft.model = copy.copy(target.model)
    draft.model._modules = dict(target.model._modules)
    draft.model.layers = target.model.layers[:num_layers]  # the same layer modules, fewer of them
    draft.config = dataclasses.replace(target.config, num_layers=num_layers)
    draft.layer_range = range(num_layers)
    draft.fused_decode = None  # built for the draft's own layers when its cache is bound
    return draft


def shared_kv_cache(cache: KVCache, num_layers: int) -> KVCache:
    """The target's cache seen by its first num_layers layers (the same KVLayer objects)."""
    view = copy.copy(cache)
    view.layers = cache.layers[:num_layers]
    return view


def check_draft_fits_target(draft_config, target_config, draft_params: int, target_params: int) -> None:
    """Refuse a draft the target cannot verify (another vocabulary) or one that would cost more
    than it saves (larger than the target)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative.draft_model: its vocabulary has {draft_config.vocab_size} tokens, the "
                         f"target's {target_config.vocab_size}: a draft must use the target's tokenizer")
    if draft_params > target_params:
        raise ValueError(f"speculative.draft_model: {draft_params / 1e6:.1f}M parameters, more than the target's "
                         f"{target_params / 1e6:.1f}M: a draft larger than the target only slows decoding")


def check_same_tokenizer(draft_vocab: dict[str, int], target_vocab: dict[str, int]) -> None:
    """Same size is not enough: every token must have the same id in both."""
    differ = sum(1 for token, i in draft_vocab.items() if target_vocab.get(token) != i)
    if differ or len(draft_vocab) != len(target_vocab):
        raise ValueError(f"speculative.draft_model: its tokenizer maps {differ} tokens differently from the "
                         "target's: a draft must use the target's tokenizer")


# ------------------------------------------------------------------------------ executor wiring


def load_separate_draft(config, target: nn.Module, ctx, target_tokenizer) -> nn.Module | None:
    """A separate draft checkpoint built with the target's LayerContext and checked against the
    target (`target_tokenizer`: a callable giving the target's tokenizer, loaded by the process
    once); None when speculation has no separate draft model."""
    spec = config.speculative
    if spec is None or spec.method != "draft" or spec.draft_model is None:
        return None
    from native_backend.model.loader import load_model
    from native_backend.text.tokenizer import Tokenizer

    draft = load_model(spec.draft_model, ctx)
    check_draft_fits_target(draft.config, target.config, _num_params(draft), _num_params(target))
    cache_dir = config.model.tokenizer_cache_dir
    try:
        draft_vocab = Tokenizer.from_pretrained(spec.draft_model, cache_dir=cache_dir).backend.get_vocab()
    except FileNotFoundError:
        raise ValueError(f"speculative.draft_model: {spec.draft_model} has no tokenizer to compare with the "
                         "target's") from None
    check_same_tokenizer(draft_vocab, target_tokenizer().backend.get_vocab())
    return draft


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def draft_kv_bytes_per_token(draft: nn.Module | None, dtype) -> int:
    """A separate draft's KV per token (in the model's dtype); 0 for none or a shared-KV draft."""
    if draft is None:
        return 0
    c = draft.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype.itemsize


def leave_room_for_draft(plan, draft_bytes_per_token: int):
    """The target's share of a KV plan when every block also holds the draft's KV: one block id
    names a block in both caches, so both are sized by the same block count."""
    if not draft_bytes_per_token:
        return plan
    num_blocks = plan.kv_cache_bytes // (plan.bytes_per_block + draft_bytes_per_token * plan.block_size)
    if num_blocks < 1:
        raise ValueError("the KV cache budget cannot hold one block of the target and the draft model together")
    return dataclasses.replace(plan, num_blocks=num_blocks, kv_cache_bytes=num_blocks * plan.bytes_per_block,
                               full_context_sequences=num_blocks // plan.blocks_per_full_sequence)


def make_draft_proposer(spec, target: nn.Module, target_cache: KVCache, draft: nn.Module | None, device, dtype):
    """The proposer for method 'draft': the target's first layers over the target's first KV
    layers (self-speculative), or the separate draft over a cache of its own with the same block count."""
    from native_backend.execution.model_runner import ModelRunner
    from native_backend.execution.spec_decode.drafter import DraftModelProposer

    if draft is None:
        n = spec.draft_num_layers
        runner = ModelRunner(early_exit_draft(target, n), shared_kv_cache(target_cache, n), device)
        return DraftModelProposer(runner, shares_target_kv=True)
    cache = KVCache.for_model(draft.config, num_blocks=target_cache.num_blocks, block_size=target_cache.block_size,
                              dtype=dtype, device=device)
    return DraftModelProposer(ModelRunner(draft, cache, device), shares_target_kv=False)
