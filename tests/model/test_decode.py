"""Incremental decoding (harts.model.decode) against the full forward of the baseline layout.

fp32 on the CPU: three rollouts decoded together (a batch row each), the logits of every position fed
token by token equal each rollout's own full forward (max
|Δ| <= 1e-5; the training path's KDA is chunked, decoding runs the token recurrence, so equality
is up to rounding), over lengths that cross the tiny model's KDA chunk boundaries (B = 16), for
models with and without the MLA rope part and with NoPE, bailing-tiny (BailingHybrid's bounded gate, full-rank
KDA gates, gated MLA with interleaved RoPE, group-limited routing, clipped SwiGLU) and gdn-tiny (GDN with grouped
values, gated GQA with partial rotary); a fork continues two rollouts from one prefix, each equal to its own full
forward; a dropped row leaves the others intact.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.model.config import load_model_config
from harts.model.decode import decode_step, empty_cache
from harts.model.model import HybridModel
from harts.runtime.layout import baseline_layout
from harts.trees.step import TOKEN_DTYPE, Step
from tests.fixtures import one_thread  # noqa: F401

TOLERANCE = 1e-5


VARIANTS = ("rope", "nope", "no-rope-dim", "bailing", "gdn")
SHIPPED = {"bailing": "bailing-tiny", "gdn": "gdn-tiny"}
"""The variants that are a shipped model config; the others vary tiny."""


def _model(variant: str) -> HybridModel:
    config = load_model_config(SHIPPED.get(variant, "tiny"))
    if variant == "nope":
        config = replace(config, mla=replace(config.mla, use_rope=False))
    elif variant == "no-rope-dim":
        config = replace(config, mla=replace(config.mla, qk_rope_head_dim=0))
    model = HybridModel(config)
    model.init_weights(seed=7)
    # Twice the initialisation's 0.02, so that the logits reach O(1) and every layer moves them.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(2.0)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    return {variant: _model(variant) for variant in VARIANTS}


def full_logits(model: HybridModel, tokens: list[int]) -> torch.Tensor:
    """[L, V] logits of every position of one trajectory: the baseline layout's full forward."""
    step = Step(
        ids=("x",), trees=("x",), offsets=np.array([0, len(tokens)], dtype=np.int64),
        tokens=np.asarray(tokens, dtype=TOKEN_DTYPE), loss_mask=np.zeros(len(tokens), dtype=np.uint8),
        rewards=np.zeros(1, dtype=np.float32), advantage_per_trajectory=np.zeros(1, dtype=np.float32),
    )
    linear = model.config.linear_attention
    layout = baseline_layout(step, np.array([0]), conv_size=linear.conv_size, chunk_size=linear.chunk_size)
    with torch.no_grad():
        hidden, _ = model(layout.input_ids, layout)
    return (hidden @ model.lm_head.weight.T).detach()


def feed(model, cache, columns: list[list[int]]) -> list[torch.Tensor]:
    """Feed column t of tokens (one per row) at step t; the logits [B, V] of every step."""
    return [decode_step(model, cache, torch.tensor(column)) for column in columns]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("length", [1, 5, 37])
def test_token_by_token_equals_full_forward(models, variant, length):
    """Three rollouts decoded together, one token each per step, each against its own full forward."""
    model = models[variant]
    generator = torch.Generator().manual_seed(length)
    sequences = torch.randint(0, model.config.vocab_size, (3, length), generator=generator).tolist()
    cache = empty_cache(model, batch_size=3, capacity=64)
    decoded = torch.stack(feed(model, cache, [list(column) for column in zip(*sequences)]), dim=1)  # [3, L, V]
    for row, tokens in enumerate(sequences):
        reference = full_logits(model, tokens)
        assert reference.abs().max() > 0.5, "logits too small to test anything"
        assert (decoded[row] - reference).abs().max() <= TOLERANCE
    assert cache.lengths.tolist() == [length] * 3


@pytest.mark.parametrize("variant", ["rope", "gdn"])
@pytest.mark.parametrize("fork_at", [3, 21])
def test_fork_continues_each_branch_as_its_own_forward(models, fork_at, variant):
    model = models[variant]
    rng = np.random.default_rng(fork_at)
    prefix = rng.integers(0, 256, fork_at).tolist()
    branches = [rng.integers(0, 256, 14).tolist() for _ in range(2)]
    cache = empty_cache(model, batch_size=1, capacity=48)
    prefix_logits = torch.cat(feed(model, cache, [[t] for t in prefix]))
    forked = cache.select(torch.tensor([0, 0]))
    steps = torch.stack(feed(model, forked, [list(column) for column in zip(*branches)]), dim=1)  # [2, 14, V]
    for b, branch in enumerate(branches):
        reference = full_logits(model, prefix + branch)
        assert (prefix_logits - reference[:fork_at]).abs().max() <= TOLERANCE
        assert (steps[b] - reference[fork_at:]).abs().max() <= TOLERANCE
    # The parent's cache is untouched by its forks: it still continues as the prefix's forward.
    more = rng.integers(0, 256, 4).tolist()
    parent = torch.cat(feed(model, cache, [[t] for t in more]))
    assert (parent - full_logits(model, prefix + more)[fork_at:]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("variant", ["rope", "gdn"])
def test_dropping_a_row_keeps_the_others(models, variant):
    model = models[variant]
    rng = np.random.default_rng(3)
    sequences = rng.integers(0, 256, (3, 12)).tolist()
    cache = empty_cache(model, batch_size=3, capacity=32)
    feed(model, cache, [list(column) for column in zip(*[s[:6] for s in sequences])])
    kept = cache.select(torch.tensor([2, 0]))
    tail = torch.stack(feed(model, kept, [list(column) for column in zip(*[sequences[2][6:], sequences[0][6:]])]), dim=1)
    for row, source in enumerate([2, 0]):
        assert (tail[row] - full_logits(model, sequences[source])[6:]).abs().max() <= TOLERANCE


def test_capacity_is_enforced(models):
    model = models["rope"]
    cache = empty_cache(model, batch_size=2, capacity=2)
    feed(model, cache, [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="capacity of 2 positions"):
        decode_step(model, cache, torch.tensor([5, 6]))
