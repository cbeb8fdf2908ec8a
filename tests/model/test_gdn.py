"""The Gated DeltaNet family's layers (harts.model.gdn) against plain references, and the compact execution of
gdn-tiny on a tree that has every fork the GDN hand-off must get right.

- `GDNLayer` on a baseline layout against its function written out: a depthwise `F.conv1d` over each sequence,
  SiLU, L2-normalised q/k, the paper's recurrence `naive_recurrent_gdn`, RMSNorm(o)·w·silu(z), the output
  projection (fp64 rows: forward and the gradients of the rows and of every parameter).
- `GatedAttentionLayer` against dense causal attention per sequence (fp64 rows, forward and gradients).
  The layers' norms, gates and decays compute in fp32 whatever the rows (as the KDA layer's), so the bound is
  fp32 rounding: 1e-5 of each tensor's largest entry (measured up to 3e-7); a wrong head, split or gate is O(1).
- gdn-tiny compact = per-trajectory (fp32: log-probs, loss, every gradient; with recomputation too) on a tree
  whose schedule is checked to hold a fork inside a chunk, a fork on a chunk multiple, 1-token segments and
  siblings in one packed call.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.model.config import load_model_config
from harts.model.gdn import GatedAttentionLayer, GDNLayer
from harts.model.layers import apply_rope
from harts.model.model import HybridModel
from harts.objective.step import StepConfig
from harts.objective.verify import compare_executions
from harts.ops.gdn.naive import naive_recurrent_gdn
from harts.runtime.layout import baseline_layout, compact_layout
from harts.trees.trie import PrefixIndex
from tests.model.test_fork_failure_modes import rl_step, tree_sequences
from tests.trees.helpers import make_step

LENGTHS = (21, 1, 9)


def _rows(seed: int, hidden: int, num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _random_parameters(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name == "A_log":
                parameter.copy_(torch.rand(parameter.shape, generator=generator, dtype=torch.float64) * 1.5)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                                / math.sqrt(parameter.shape[-1] if parameter.dim() > 1 else 4) + (parameter.dim() == 1))


def _layout(chunk_size: int, conv_size: int):
    step = make_step([list(range(1, n + 1)) for n in LENGTHS])
    return baseline_layout(step, np.arange(len(LENGTHS)), conv_size=conv_size, chunk_size=chunk_size)


def _gdn_reference(layer: GDNLayer, x_RD: torch.Tensor) -> torch.Tensor:
    c = layer.config
    outputs, start = [], 0
    for n in LENGTHS:
        x = x_RD[start:start + n]
        start += n
        projected = x @ layer.in_proj.weight.T
        mixed = projected[:, :layer.conv_width]
        conv = F.conv1d(mixed.T[None], layer.conv[:, None, :], padding=c.conv_size - 1,
                        groups=layer.conv_width)[0, :, :n].T
        q, k, v = F.silu(conv).split([layer.key_width, layer.key_width, layer.value_width], dim=-1)
        z, b, a = projected[:, layer.conv_width:].split([layer.value_width, c.num_value_heads, c.num_value_heads], -1)
        q, k = (t.reshape(n, c.num_key_heads, c.key_head_dim) for t in (q, k))
        q, k = (t / (t.square().sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k))
        g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
        o, _ = naive_recurrent_gdn(q[None], k[None], v.reshape(1, n, c.num_value_heads, c.value_head_dim), g[None],
                                   torch.sigmoid(b)[None])
        o = o[0] / (o[0].square().mean(-1, keepdim=True) + layer.o_norm.eps).sqrt() * layer.o_norm.weight
        o = o * F.silu(z.reshape(n, c.num_value_heads, c.value_head_dim))
        outputs.append(o.reshape(n, -1) @ layer.o_proj.weight.T)
    return torch.cat(outputs)


def _attention_reference(layer: GatedAttentionLayer, x_RD: torch.Tensor) -> torch.Tensor:
    c = layer.config
    outputs, start = [], 0
    for n in LENGTHS:
        x = x_RD[start:start + n]
        start += n
        q, gate = (x @ layer.q_proj.weight.T).view(n, c.num_heads, 2, c.head_dim).unbind(2)
        k = (x @ layer.k_proj.weight.T).view(n, c.num_kv_heads, c.head_dim)
        v = (x @ layer.v_proj.weight.T).view(n, c.num_kv_heads, c.head_dim)

        def norm(t, weight):
            return t / (t.square().mean(-1, keepdim=True) + layer.q_norm.eps).sqrt() * (1 + weight)

        positions = torch.arange(n)
        q, k = norm(q, layer.q_norm.weight), norm(k, layer.k_norm.weight)
        rot = c.rotary_dim
        q = torch.cat([apply_rope(q[..., :rot], positions, c.rope_theta), q[..., rot:]], -1)
        k = torch.cat([apply_rope(k[..., :rot], positions, c.rope_theta), k[..., rot:]], -1)
        group = c.num_heads // c.num_kv_heads
        k, v = k[:, torch.arange(c.num_heads) // group], v[:, torch.arange(c.num_heads) // group]
        scores = torch.einsum("qhe,khe->hqk", q, k) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hqk,khe->qhe", scores.softmax(-1), v).reshape(n, -1)
        outputs.append((o * torch.sigmoid(gate.reshape(n, -1))) @ layer.o_proj.weight.T)
    return torch.cat(outputs)


@pytest.mark.parametrize("kind", ["gdn", "gqa"])
def test_layer_matches_its_written_out_function(kind):
    config = load_model_config("gdn-tiny")
    if kind == "gdn":
        layer, reference = GDNLayer(config.hidden_size, config.gdn, config.norm_eps).double(), _gdn_reference
    else:
        layer = GatedAttentionLayer(config.hidden_size, config.gated_attention, config.norm_eps,
                                    zero_centered=True).double()
        reference = _attention_reference
    _random_parameters(layer, seed=1)
    layout = _layout(config.gdn.chunk_size, config.gdn.conv_size)
    x = _rows(2, config.hidden_size, sum(LENGTHS))
    upstream = _rows(3, config.hidden_size, sum(LENGTHS))
    results = []
    for run in (lambda x: layer(x, layout), lambda x: reference(layer, x)):
        leaf = x.clone().requires_grad_()
        out = run(leaf)
        grads = torch.autograd.grad((out * upstream).sum(), [leaf, *layer.parameters()])
        results.append([out, *grads])
    names = ["out", "dx"] + [name for name, _ in layer.named_parameters()]
    assert float(results[0][0].detach().std()) > 0.1
    for name, actual, expected in zip(names, *results):
        assert float((actual - expected).abs().max()) <= 1e-5 * float(expected.abs().max()), name


FORKS = ([-1, 0, 0, 0, 3, 3], [20, 1, 1, 12, 5, 1])
"""Root of 20 tokens (its children fork mid-chunk at 20), two 1-token siblings, a third child ending at 32 (a
chunk multiple of gdn-tiny's 16) whose children fork there, one of them a single token."""


def test_compact_equals_per_trajectory_on_every_kind_of_fork():
    config = load_model_config("gdn-tiny")
    chunk = config.gdn.chunk_size
    model = HybridModel(config)
    model.init_weights(seed=42)
    rng = np.random.default_rng(5)
    step = rl_step(tree_sequences(rng, *FORKS), rng)
    index = PrefixIndex.from_step(step)
    members = np.arange(step.num_trajectories)
    tree = index.segment_tree(members)
    layout = compact_layout(step, index, members, conv_size=config.gdn.conv_size, chunk_size=chunk)
    forks = tree.start[tree.parent >= 0]
    assert (forks % chunk != 0).any() and ((forks % chunk == 0) & (forks > 0)).any()
    assert (tree.segment_lengths == 1).sum() >= 2
    assert layout.kda_schedule.replay_tokens > 0
    assert any(call.num_sequences >= 2 for call in layout.kda_schedule.calls), "siblings share a packed call"
    for recompute in (False, True):
        report = compare_executions(model, step, [members], StepConfig(execution="baseline", recompute=recompute),
                                    StepConfig(execution="compact", recompute=recompute), index=index)
        assert report["candidate_rows"] < report["reference_rows"]
        assert report["max_abs_logprob_diff"] <= 1e-5, report
        assert report["loss_rel_diff"] <= 1e-6, report
        assert report["grad_rel_diff"] <= 1e-4, report
