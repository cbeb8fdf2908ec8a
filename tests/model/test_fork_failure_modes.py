"""Linear-attention failure modes reported in 2026 (fla issues and PRs, and other RL trainers' Qwen3.5/Nemotron
bug reports), as regression tests of HARTS's compact execution of the whole model.

- The short causal conv across forks: segments of 1 and 2 tokens after a fork (shorter than the conv's W − 1 = 3
  predecessors, which then come from the parent and grandparent segments), forks in a row, a fork after a path's
  first token and forks at a chunk boundary. fla's conv state gradients were wrong for segments shorter than
  W − 1 (fixed in 0.6.0); HARTS's conv runs its own gather/shift kernels, checked here end to end.
- Sibling branches packed in one call: a branch never sees a sibling's state. Changing one branch's tokens leaves
  every other trajectory's log-probs where they were (to rounding: the MoE's per-expert row counts change); a
  leak moves them by O(1e-2).

Each tree runs both executions on the tiny and gdn-tiny models (fp32, CPU: PyTorch KDA and conv; on CUDA,
`-m gpu`: fla's KDA, the fused Triton conv and the varlen attention, in bf16) and must agree as
tests/model/test_equivalence.py requires: log-probs, loss and every parameter gradient.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import StepConfig, run_step
from harts.objective.verify import compare_executions
from harts.trees.trie import PrefixIndex
from tests.trees.helpers import make_step

VOCAB = 256
SHAPES = {
    # name: (parent of each node, tokens of each node); a trajectory ends at every leaf.
    "one-token-forks": ([-1, 0, 0, 1, 1, 3, 3, 5, 5], [10, 1, 1, 1, 1, 1, 1, 1, 4]),
    "two-token-forks": ([-1, 0, 0, 1, 1, 3, 3, 5, 5], [10, 2, 2, 2, 2, 2, 2, 2, 4]),
    "fork-after-first-token": ([-1, 0, 0, 0, 3, 3], [1, 1, 2, 20, 1, 2]),
    "one-token-chain-of-forks": ([-1, 0, 0, 1, 1, 3, 3, 4], [1, 1, 1, 1, 1, 1, 5, 3]),
    "forks-at-the-chunk-edge": ([-1, 0, 0, 0, 1, 2, 3], [16, 1, 2, 17, 1, 15, 1]),
}


def tree_sequences(rng: np.random.Generator, parent: list[int], lengths: list[int]) -> list[list[int]]:
    """Random tokens per node, siblings starting with different tokens (so that the trie keeps them apart);
    one trajectory per leaf (root-to-leaf tokens)."""
    tokens: list[list[int]] = []
    first_of_children: dict[int, set[int]] = {}
    for v, n in enumerate(lengths):
        used = first_of_children.setdefault(parent[v], set())
        first = int(rng.choice(sorted(set(range(VOCAB)) - used)))
        used.add(first)
        tokens.append([first, *rng.integers(0, VOCAB, n - 1).tolist()])
    leaves = sorted(set(range(len(parent))) - set(parent))
    sequences = []
    for leaf in leaves:
        path, u = [], leaf
        while u >= 0:
            path = tokens[u] + path
            u = parent[u]
        sequences.append(path)
    return sequences


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def rl_step(sequences: list[list[int]], rng: np.random.Generator):
    step = make_step(sequences)
    return replace(step, advantage_per_trajectory=rng.standard_normal(step.num_trajectories).astype(np.float32))


@pytest.fixture(scope="module", params=["tiny", "gdn-tiny"])
def model(request):
    model = HybridModel(load_model_config(request.param))
    model.init_weights(seed=42)
    return model


@pytest.mark.parametrize("shape", SHAPES)
def test_compact_equals_per_trajectory_on_short_segments_after_forks(model, shape):
    rng = np.random.default_rng(7)
    step = rl_step(tree_sequences(rng, *SHAPES[shape]), rng)
    index = PrefixIndex.from_step(step)
    assert index.segment_tree().num_compact_tokens < step.num_semantic_tokens
    report = compare_executions(model, step, [np.arange(step.num_trajectories)], StepConfig(execution="baseline"),
                                StepConfig(execution="compact"), index=index)
    assert report["max_abs_logprob_diff"] <= 1e-5, report
    assert report["loss_rel_diff"] <= 1e-6, report
    assert report["grad_rel_diff"] <= 1e-4, report


def _logprobs(model, step, config):
    return run_step(model, step, [np.arange(step.num_trajectories)], config, backward=False,
                    collect_logprobs=True).logprobs


@pytest.mark.parametrize("shape", ["one-token-forks", "fork-after-first-token", "forks-at-the-chunk-edge"])
def test_a_branch_never_sees_its_siblings(model, shape):
    """New tokens on the last trajectory's own segment: the other trajectories' log-probs stay put (the changed
    trajectory's own move: the change is seen where it should be)."""
    rng = np.random.default_rng(11)
    sequences = tree_sequences(rng, *SHAPES[shape])
    step = rl_step(sequences, rng)
    changed = [list(s) for s in sequences]
    shared = max(common_prefix(changed[-1], s) for s in changed[:-1])
    assert shared + 1 < len(changed[-1])  # the last trajectory has tokens of its own after its first one
    changed[-1][shared + 1:] = ((np.asarray(changed[-1][shared + 1:]) + 101) % VOCAB).tolist()
    changed_step = replace(step, tokens=np.concatenate([np.asarray(s, dtype=step.tokens.dtype) for s in changed]))
    config = StepConfig(execution="compact")
    before, after = _logprobs(model, step, config), _logprobs(model, changed_step, config)
    others = slice(0, int(step.offsets[-2]))
    assert float((after[others] - before[others]).abs().max()) <= 1e-6
    own = slice(int(step.offsets[-2]) + shared, int(step.offsets[-1]))
    assert float((after[own] - before[own]).abs().max()) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["tiny", "gdn-tiny"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_compact_equals_per_trajectory_on_short_segments_after_forks(shape, name):
    """The same trees on fla's KDA (chunks of 64: the chunk-edge tree's 16 becomes 64), the fused conv and the
    varlen attention, bf16 autocast: the two executions within bf16 rounding of each other."""
    parent, lengths = SHAPES[shape]
    lengths = [64 if n == 16 else 65 if n == 17 else 63 if n == 15 else n for n in lengths]
    config = load_model_config(name)
    config = replace(config, **{config.linear_kind: replace(config.linear_attention, chunk_size=64)})
    model = HybridModel(config).cuda()
    model.init_weights(seed=42)
    rng = np.random.default_rng(7)
    step = rl_step(tree_sequences(rng, parent, lengths), rng)
    settings = dict(attention_backend="varlen", kda_backend="fla", dtype="bf16")
    baseline, compact = StepConfig(execution="baseline", **settings), StepConfig(execution="compact", **settings)
    report = compare_executions(model, step, [np.arange(step.num_trajectories)], baseline, compact)
    print(shape, {k: report[k] for k in ("max_abs_logprob_diff", "loss_rel_diff", "grad_rel_diff")})
    assert report["max_abs_logprob_diff"] <= 5e-2, report
    assert report["grad_rel_diff"] <= 5e-2, report
