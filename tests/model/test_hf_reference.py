"""harts.model.hf against an independent Kimi-Linear: transformers' `KimiLinearForCausalLM`.

The checkpoint is written here, in Moonshot's layout (modeling_kimi.py's names and shapes,
enumerated in this file, not by harts.model.hf), with random values, two shards and an index. The
reference reads it with `from_pretrained` (transformers' own conversion mapping of that layout,
checked strict: no missing, unexpected or mis-shaped key) and runs its own forward: PyTorch
KDA (`chunk_kimi_delta_attention`'s reference path, which transformers takes for CPU inputs
even with fla installed), its MLA, router, experts and norms. HARTS loads the same
files with `load_hf_checkpoint` and runs `HybridModel` on a baseline layout. Logits must agree to
fp32 rounding; `save_hf_checkpoint` of the loaded model must read back in transformers to the
same logits. A GPU variant runs transformers' path for CUDA inputs instead, fla's Triton `chunk_kda`
(the kernel Moonshot's modeling_kimi.py calls), against HARTS on fla's kernels. Only public APIs of
transformers are used (no private wrappers), so a new release cannot break the test unnoticed.

Tolerance: both sides compute in fp32 with different algorithms (transformers' chunked KDA with
chunk 64 and its conv1d, HARTS's chunked KDA and gather conv, different matmul shapes and
summation orders), so they differ by accumulated rounding: ~1e-6 relative per op over a few
layers. The logits are O(1)-O(10) here (unit-variance weights), measured max differences are ~1e-6;
we allow 1e-4 · max|logit|. A mapping error (a swapped projection, expert or norm) changes the
logits by O(1), as the planted swaps showed.

Checkpoints transformers writes itself: tiny `KimiLinearConfig`s built by transformers, models built from them
with random weights, saved with `save_pretrained` (one file or shards: its config keys, and its tensor names
with the dense MLP under block_sparse_moe.). HARTS loads them to transformers' logits within 1e-5 of the largest
(`TRANSFORMERS_TOLERANCE`: decays kept within fp32's normal range), for each sequence alone and for batches
padded on the left and on the right (transformers' KDA zeroes the padded rows, its MLA masks them); HARTS saves
them back and transformers reads its own logits bitwise. The other way, a HARTS model of the shipped kimi-tiny
config saved by HARTS gives transformers HARTS's logits within the same tolerance.
"""

import json
import math

import numpy as np
import pytest
import torch
import transformers

from harts.model.config import load_model_config
from harts.model.hf import load_hf_checkpoint, save_hf_checkpoint
from harts.model.model import HybridModel
from harts.config.execution import default_attention_backend, default_kda_backend
from harts.runtime.layout import baseline_layout
from tests.trees.helpers import make_step

LENGTHS = (70, 37)
"""Two sequences, one crossing the 64-row KDA chunk boundary of both implementations."""
TOLERANCE = 1e-4
LATENT_SCALE = 3e-3
"""The MLA latents (inputs of kv_a_layernorm and q_a_layernorm) get an RMS of ~3e-3, so that
their norm's eps (1e-6 in Kimi-Linear whatever rms_norm_eps) changes the logits."""


def kimi_config(**changes) -> dict:
    """A tiny config.json in the shape of Kimi-Linear-48B-A3B's (5 layers: KDA, KDA, KDA, MLA, MLA)."""
    config = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 97,
        "hidden_size": 48,
        "num_hidden_layers": 5,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "first_k_dense_replace": 1,
        "intermediate_size": 80,
        "linear_attn_config": {"num_heads": 3, "head_dim": 16, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4, 5]},
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8,
        "v_head_dim": 10,
        "mla_use_nope": True,
        "num_experts": 6,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 20,
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }
    config.update(changes)
    return config


def kimi_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors named and shaped as Moonshot's modeling_kimi.py stores them. Matrices have
    unit-variance outputs (the MLA latents: LATENT_SCALE), norms sit near 1, the decay and routing
    parameters are spread so that every path (decay, expert bias, shared expert) changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    linear = config["linear_attn_config"]
    heads, dim, width = linear["num_heads"], linear["head_dim"], linear["short_conv_kernel_size"]
    tensors = {}

    def matrix(name, rows, cols):
        tensors[name] = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm(name, size):
        tensors[name] = 1 + 0.3 * torch.randn(size, generator=gen)

    tensors["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        attn = layer + "self_attn."
        norm(layer + "input_layernorm.weight", hidden)
        norm(layer + "post_attention_layernorm.weight", hidden)
        if i + 1 in linear["full_attn_layers"]:
            mla_heads = config["num_attention_heads"]
            qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
            rank = config["kv_lora_rank"]
            if config["q_lora_rank"]:
                matrix(attn + "q_a_proj.weight", config["q_lora_rank"], hidden)
                tensors[attn + "q_a_proj.weight"] *= LATENT_SCALE
                norm(attn + "q_a_layernorm.weight", config["q_lora_rank"])
                matrix(attn + "q_b_proj.weight", mla_heads * qk, config["q_lora_rank"])
            else:
                matrix(attn + "q_proj.weight", mla_heads * qk, hidden)
            matrix(attn + "kv_a_proj_with_mqa.weight", rank + config["qk_rope_head_dim"], hidden)
            tensors[attn + "kv_a_proj_with_mqa.weight"][:rank] *= LATENT_SCALE
            norm(attn + "kv_a_layernorm.weight", rank)
            matrix(attn + "kv_b_proj.weight", mla_heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), rank)
            matrix(attn + "o_proj.weight", hidden, mla_heads * config["v_head_dim"])
        else:
            for name in ("q", "k", "v"):
                matrix(attn + f"{name}_proj.weight", heads * dim, hidden)
                tensors[attn + f"{name}_conv1d.weight"] = torch.rand(heads * dim, 1, width, generator=gen) - 0.5
            tensors[attn + "A_log"] = torch.empty(1, 1, heads, 1).uniform_(1, 16, generator=gen).log()
            tensors[attn + "dt_bias"] = torch.randn(heads * dim, generator=gen) - 2
            matrix(attn + "f_a_proj.weight", dim, hidden)
            matrix(attn + "f_b_proj.weight", heads * dim, dim)
            matrix(attn + "b_proj.weight", heads, hidden)
            matrix(attn + "g_a_proj.weight", dim, hidden)
            matrix(attn + "g_b_proj.weight", heads * dim, dim)
            norm(attn + "o_norm.weight", dim)
            matrix(attn + "o_proj.weight", hidden, heads * dim)
        if i < config["first_k_dense_replace"]:
            size = config["intermediate_size"]
            matrix(layer + "mlp.gate_proj.weight", size, hidden)
            matrix(layer + "mlp.up_proj.weight", size, hidden)
            matrix(layer + "mlp.down_proj.weight", hidden, size)
            continue
        moe, size = layer + "block_sparse_moe.", config["moe_intermediate_size"]
        matrix(moe + "gate.weight", config["num_experts"], hidden)
        tensors[moe + "gate.e_score_correction_bias"] = 0.2 * torch.randn(config["num_experts"], generator=gen)
        for e in range(config["num_experts"]):
            matrix(moe + f"experts.{e}.w1.weight", size, hidden)
            matrix(moe + f"experts.{e}.w2.weight", hidden, size)
            matrix(moe + f"experts.{e}.w3.weight", size, hidden)
        shared = size * config["num_shared_experts"]
        matrix(moe + "shared_experts.gate_proj.weight", shared, hidden)
        matrix(moe + "shared_experts.up_proj.weight", shared, hidden)
        matrix(moe + "shared_experts.down_proj.weight", hidden, shared)
    norm("model.norm.weight", hidden)
    matrix("lm_head.weight", vocab, hidden)
    return tensors


def write_kimi_checkpoint(root, config: dict, seed: int) -> None:
    """config.json, two shards (layers split in the middle, as HF shards are) and the index."""
    from safetensors.torch import save_file

    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    tensors = kimi_tensors(config, seed)
    names = list(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for k, part in enumerate(halves):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(root / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture
def offline(monkeypatch):
    """No hub lookups (transformers' kernel hub). On CPU inputs transformers runs its own PyTorch KDA:
    its wrapper dispatches to fla only for the devices fla's kernels run on (transformers >= 5.25)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def reference_logits(root, sequences, device="cpu") -> list[torch.Tensor]:
    model, info = transformers.KimiLinearForCausalLM.from_pretrained(
        root, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
    )
    problems = {key: value for key, value in info.items() if value}
    assert not problems, problems
    model.to(device).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s], device=device)).logits[0].cpu() for s in sequences]


def harts_logits(model, sequences) -> list[torch.Tensor]:
    step = make_step(sequences)
    config = model.config
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    linear = config.linear_attention
    layout = baseline_layout(step, np.arange(len(sequences)), conv_size=linear.conv_size,
                             chunk_size=linear.chunk_size, attention_backend=default_attention_backend("cuda" if cuda else "cpu"),
                             kda_backend=default_kda_backend("cuda" if cuda else "cpu"))
    with torch.no_grad():
        hidden, _ = model(layout.input_ids.to(device), layout.to(device))
        logits = model.lm_head(hidden).cpu()
    return list(logits.split(list(step.lengths)))


def max_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """max |Δ| over every logit, relative to the largest reference logit."""
    scale = max(float(e.abs().max()) for e in expected)
    return max(float((a - e).abs().max()) for a, e in zip(actual, expected)) / scale


CASES = {
    "q-full-rank": {},
    "q-low-rank": {"q_lora_rank": 16},
    "no-scaling-two-dense": {"routed_scaling_factor": 1.0, "first_k_dense_replace": 2},
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, offline, case):
    config = kimi_config(**CASES[case])
    root = tmp_path / "kimi"
    write_kimi_checkpoint(root, config, seed=42)
    rng = np.random.default_rng(42)
    sequences = [rng.integers(0, config["vocab_size"], n).tolist() for n in LENGTHS]
    expected = reference_logits(root, sequences)
    assert min(float(e.std()) for e in expected) > 0.5, "logits too flat to compare"

    model, _ = load_hf_checkpoint(root)
    assert max_error(harts_logits(model, sequences), expected) <= TOLERANCE

    saved = tmp_path / "saved"
    save_hf_checkpoint(model, saved, max_shard_bytes=40_000)
    assert max_error(reference_logits(saved, sequences), expected) <= TOLERANCE


def transformers_config(**changes) -> transformers.KimiLinearConfig:
    """A tiny config built by transformers' own `KimiLinearConfig` (its keys: layer_types, mlp_layer_types,
    linear_*), 5 layers: KDA, KDA, KDA, MLA, MLA, the first with a dense MLP."""
    settings = dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=20, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=2.446, linear_num_heads=3, linear_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"] * 2, mlp_layer_types=["dense"] + ["sparse"] * 4,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    settings.update(changes)
    return transformers.KimiLinearConfig(**settings)


def random_weights(tensors: dict[str, torch.Tensor], seed: int, fan_in) -> None:
    """Fill a model's tensors in place (by name; `fan_in(name, tensor)` of a matrix): unit-variance outputs, norms
    near 1, expert biases spread, convs in [-0.5, 0.5), decays exp(A_log) in [0.5, 4]; dt_bias keeps its
    initialisation (FLA's, in both models). With transformers' own decay range [1, 16] its fp32 chunked KDA loses
    more (decays below fp32's normal range): 5e-5 to 8e-5 from HARTS's float64 logits, against 2e-5 for HARTS's fp32."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name.endswith("A_log"):
                tensor.copy_(torch.empty(tensor.shape).uniform_(0.5, 4, generator=generator).log())
            elif name.endswith("dt_bias"):
                continue
            elif name.endswith(("e_score_correction_bias", "expert_bias")):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith(("conv1d.weight", "_conv")):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) - 0.5)
            elif tensor.dim() == 1:
                tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / math.sqrt(fan_in(name, tensor)))


def transformers_model(config: transformers.KimiLinearConfig, seed: int) -> transformers.KimiLinearForCausalLM:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    random_weights(model.state_dict(), seed, lambda name, tensor: tensor.shape[-1])
    return model.eval()


def harts_model(config, seed: int) -> HybridModel:
    """A HybridModel of `config` with `random_weights` (the MoE stacks are [.., in, out], the Linears [out, in])."""
    model = HybridModel(config)
    model.init_weights(seed)
    random_weights(model.state_dict(), seed,
                   lambda name, tensor: tensor.shape[-2] if name.endswith("_proj") else tensor.shape[-1])
    return model


def padded_logits(model, sequences, side: str | None) -> list[torch.Tensor]:
    """transformers' logits of `sequences` as one batch padded on `side` ("left" or "right"; the attention mask
    marks the padding, which its KDA layers zero and its MLA masks), or of each sequence alone (None)."""
    if side is None:
        return [padded_logits(model, [sequence], "right")[0] for sequence in sequences]
    width = max(map(len, sequences))
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    spans = [slice(width - len(s), width) if side == "left" else slice(0, len(s)) for s in sequences]
    for row, (sequence, span) in enumerate(zip(sequences, spans)):
        input_ids[row, span] = torch.tensor(sequence)
        mask[row, span] = 1
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    return [logits[row, span] for row, span in enumerate(spans)]


def load_strict(root) -> transformers.KimiLinearForCausalLM:
    """`from_pretrained`, refusing any missing, unexpected or mis-shaped key."""
    model, info = transformers.KimiLinearForCausalLM.from_pretrained(
        root, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
    )
    problems = {key: value for key, value in info.items() if value}
    assert not problems, problems
    return model.eval()


PADDINGS = (None, "left", "right")
TRANSFORMERS_TOLERANCE = 1e-5
"""max |Δlogit| / max |logit| between HARTS and transformers' KimiLinearForCausalLM, both fp32. Measured 2.7e-6
to 4.4e-6 on these checkpoints (logits up to 4.5); each side is about as far from HARTS's float64 logits (1.1e-5 to
1.7e-5 absolute), so that is fp32 rounding on both sides, not a difference in the function."""
TRANSFORMERS_CASES = {
    "one-file": {},
    "sharded-q-low-rank": {"config": {"q_lora_rank": 16}, "shard": "40KB"},
    "sharded-irregular-mla-two-dense": {
        "config": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                   "full_attention"],
                   "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse"]},
        "shard": "40KB"},
    "tied-one-file": {"config": {"tie_word_embeddings": True}},
}


@pytest.mark.parametrize("case", TRANSFORMERS_CASES)
def test_transformers_save_pretrained_both_ways(tmp_path, offline, case):
    """A checkpoint written by transformers' own `save_pretrained` (its config keys and tensor names) loads into
    HARTS with transformers' logits, for sequences alone and in batches padded on either side; HARTS saves it back
    (sharded or not) in the Hub layout, which transformers reads strictly to the same weights: logits bitwise."""
    settings = TRANSFORMERS_CASES[case]
    config = transformers_config(**settings.get("config", {}))
    model = transformers_model(config, seed=42)
    if config.tie_word_embeddings:
        # transformers' KimiLinear never ties the head: a tied checkpoint is one whose head is the embedding.
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    root = tmp_path / "transformers"
    model.save_pretrained(root, max_shard_size=settings.get("shard", "1GB"))
    assert (root / "model.safetensors.index.json").is_file() == ("shard" in settings)
    rng = np.random.default_rng(42)
    sequences = [rng.integers(0, config.vocab_size, n).tolist() for n in (*LENGTHS, 5)]
    expected = {side: padded_logits(model, sequences, side) for side in PADDINGS}
    assert min(float(e.std()) for e in expected[None]) > 0.5, "logits too flat to compare"

    loaded, loaded_config = load_hf_checkpoint(root)
    assert loaded_config.tie_embeddings == config.tie_word_embeddings
    actual = harts_logits(loaded, sequences)
    for side in PADDINGS:
        assert max_error(actual, expected[side]) <= TRANSFORMERS_TOLERANCE, side

    saved = tmp_path / "harts"
    files = save_hf_checkpoint(loaded, saved, max_shard_bytes=40_000 if "shard" in settings else 10**9)
    assert (len([f for f in files if f.suffix == ".safetensors"]) > 1) == ("shard" in settings)
    reloaded = load_strict(saved)
    for side in PADDINGS:
        assert all(torch.equal(a, e) for a, e in zip(padded_logits(reloaded, sequences, side), expected[side])), side


@pytest.mark.parametrize("max_shard_bytes", [10**9, 30_000], ids=["one-file", "sharded"])
def test_harts_model_runs_in_transformers(tmp_path, offline, max_shard_bytes):
    """A model of the shipped kimi-tiny config (HARTS's own chunk size, layer pattern and training fields) saved by
    HARTS loads strictly in transformers, whose logits are HARTS's, alone and in batches padded on either side."""
    model = harts_model(load_model_config("kimi-tiny"), seed=42)
    root = tmp_path / "harts"
    save_hf_checkpoint(model, root, max_shard_bytes=max_shard_bytes)
    reference = load_strict(root)
    rng = np.random.default_rng(42)
    sequences = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (*LENGTHS, 5)]
    actual = harts_logits(model, sequences)
    for side in PADDINGS:
        expected = padded_logits(reference, sequences, side)
        assert min(float(e.std()) for e in expected) > 0.5, "logits too flat to compare"
        assert max_error(actual, expected) <= TRANSFORMERS_TOLERANCE, side


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_logits_match_transformers_on_fla_kernels(tmp_path, offline):
    """On CUDA, transformers' default KDA path: fla's Triton `chunk_kda` (the kernel Moonshot's
    modeling_kimi.py calls), seen in the profiler's kernel names; HARTS on its GPU default (fla) too."""
    config = kimi_config()
    root = tmp_path / "kimi"
    write_kimi_checkpoint(root, config, seed=42)
    rng = np.random.default_rng(42)
    sequences = [rng.integers(0, config["vocab_size"], n).tolist() for n in LENGTHS]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        expected = reference_logits(root, sequences, device="cuda")
    kernels = {event.name for event in profile.events()}
    assert any("chunk_kda" in name for name in kernels), sorted(kernels)[:40]
    model, _ = load_hf_checkpoint(root)
    actual = harts_logits(model.cuda(), sequences)
    assert max_error(actual, expected) <= TOLERANCE
