"""A live transformers `KimiLinearForCausalLM`'s parameters run by HARTS's `HybridModel`, in place.

`HFParameterView(hf_model)` builds a `HybridModel` of the same configuration (`model_config_from_hf` of its
config) on the meta device, holding nothing; `with view.bound() as model:` gives that model the Hugging Face
model's own tensors for the duration of the block, so that HARTS's compact execution (`harts.api`) runs on
exactly the weights a trainer (TRL, ...) holds, updates and generates with, and back-propagates into them:
gradients land in the Hugging Face parameters' `.grad`. Nothing is copied where the layouts agree up to a view
(every projection, norm, the stacked experts transposed, the fused q/k/v conv split, A_log reshaped, the router
and its bias); two pairs of matrices HARTS keeps fused are concatenated at binding time, a differentiable copy
(the dense layers' gate and up projections, the shared expert's). Binding again after an optimizer step sees the
new values; outside the block the model holds meta tensors again (no stale copy, no graph kept).

The mapping reads transformers' in-memory module tree of `KimiLinearForCausalLM` (5.25: `self_attn.conv1d` is
q, k and v's convs stacked [3C, 1, W], `forget_gate.{A_log,dt_bias,f_a_proj,f_b_proj}`, `mlp.experts.gate_up_proj`
[E, 2F, D] gate first and `down_proj` [E, D, F], `mlp.gate` and its `e_score_correction_bias`, the dense layers'
`mlp.{gate,up,down}_proj`), which differs from the checkpoint layout of harts.model.hf (transformers converts on
loading and saving). A missing, extra or mis-shaped tensor is a ValueError naming it.

Tested (tests/model/test_hf_modules.py) against transformers' own forward (logits within fp32 rounding) and
against `load_hf_checkpoint` of the model's `save_pretrained` (every bound tensor bitwise equal), with gradients
reaching the Hugging Face parameters equal to those of the loaded model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from harts.model.config import ModelConfig
from harts.model.hf import model_config_from_hf
from harts.model.model import HybridModel

Source = Callable[[Callable[[str], torch.Tensor]], torch.Tensor]
"""How one HybridModel tensor is made from the Hugging Face model's tensors (given a lookup by name)."""


def _named(name: str) -> Source:
    return lambda get: get(name)


def _kda_sources(config: ModelConfig, hf: str, mixer: str) -> dict[str, Source]:
    channels = config.kda.num_heads * config.kda.head_dim
    attn = hf + "self_attn."
    sources = {}
    for k, name in enumerate(("q", "k", "v")):
        sources[mixer + f"{name}_proj.weight"] = _named(attn + f"{name}_proj.weight")
        # conv1d stacks q, k, v's depthwise convs; HARTS's [C, W] has the same column order (the last tap
        # multiplies the row itself in both).
        sources[mixer + f"{name}_conv"] = (
            lambda get, lo=k * channels: get(attn + "conv1d.weight")[lo:lo + channels, 0]
        )
    sources[mixer + "A_log"] = lambda get: get(attn + "forget_gate.A_log").view(-1)
    sources[mixer + "dt_bias"] = _named(attn + "forget_gate.dt_bias")
    sources[mixer + "f_proj.0.weight"] = _named(attn + "forget_gate.f_a_proj.weight")
    sources[mixer + "f_proj.1.weight"] = _named(attn + "forget_gate.f_b_proj.weight")
    for ours, theirs in (("b_proj", "b_proj"), ("g_proj.0", "g_a_proj"), ("g_proj.1", "g_b_proj"),
                         ("o_norm", "o_norm"), ("o_proj", "o_proj")):
        sources[mixer + ours + ".weight"] = _named(attn + theirs + ".weight")
    return sources


def _mla_sources(config: ModelConfig, hf: str, mixer: str) -> dict[str, Source]:
    attn = hf + "self_attn."
    pairs = [("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"),
             ("o_proj", "o_proj")]
    if config.mla.q_lora_rank:
        pairs += [("q_proj.0", "q_a_proj"), ("q_proj.1", "q_a_layernorm"), ("q_proj.2", "q_b_proj")]
    else:
        pairs.append(("q_proj", "q_proj"))
    return {mixer + ours + ".weight": _named(attn + theirs + ".weight") for ours, theirs in pairs}


def _mlp_sources(config: ModelConfig, index: int, hf: str, ours: str) -> dict[str, Source]:
    mlp = hf + "mlp."
    if index < config.num_dense_layers:
        return {
            ours + "gate_up.weight": lambda get: torch.cat(
                [get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
            ours + "down.weight": _named(mlp + "down_proj.weight"),
        }
    sources = {
        ours + "router_weight": _named(mlp + "gate.weight"),
        ours + "expert_bias": _named(mlp + "gate.e_score_correction_bias"),
        # [E, 2F, D] and [E, D, F] are HARTS's [E, D, 2F] (gate first) and [E, F, D] transposed: views.
        ours + "gate_up_proj": lambda get: get(mlp + "experts.gate_up_proj").transpose(1, 2),
        ours + "down_proj": lambda get: get(mlp + "experts.down_proj").transpose(1, 2),
    }
    if config.moe.shared_expert_hidden_size:
        shared = mlp + "shared_experts."
        sources[ours + "shared_gate_up_proj"] = lambda get: torch.cat(
            [get(shared + "gate_proj.weight").T, get(shared + "up_proj.weight").T], dim=1)
        sources[ours + "shared_down_proj"] = lambda get: get(shared + "down_proj.weight").T
    return sources


def hf_module_sources(config: ModelConfig) -> dict[str, Source]:
    """Every parameter and buffer of `HybridModel(config)` by name: how to make it from the tensors of a
    transformers `KimiLinearForCausalLM` of the same configuration (module docstring)."""
    sources: dict[str, Source] = {"embed.weight": _named("model.embed_tokens.weight")}
    for i, kind in enumerate(config.layer_kinds()):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        sources[ours + "mixer_norm.weight"] = _named(hf + "input_layernorm.weight")
        mixer = ours + "mixer."
        sources.update(_kda_sources(config, hf, mixer) if kind == "kda" else _mla_sources(config, hf, mixer))
        sources[ours + "mlp_norm.weight"] = _named(hf + "post_attention_layernorm.weight")
        sources.update(_mlp_sources(config, i, hf, ours + "mlp."))
    sources["final_norm.weight"] = _named("model.norm.weight")
    sources["lm_head.weight"] = _named("lm_head.weight")
    return sources


def _slots(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, bool]]:
    """(name, owning module, attribute, is a parameter) of every parameter and buffer of `model`."""
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        for attribute, tensor in module._parameters.items():
            if tensor is not None:
                yield prefix + attribute, module, attribute, True
        for attribute, tensor in module._buffers.items():
            if tensor is not None:
                yield prefix + attribute, module, attribute, False


class HFParameterView:
    """A HybridModel over a transformers KimiLinearForCausalLM's tensors (module docstring)."""

    def __init__(self, hf_model: nn.Module, *, config: ModelConfig | None = None) -> None:
        """`config`: the HybridModel's configuration (default: read off the Hugging Face config); it may differ
        from it only in fields the weights do not depend on (MoE loss coefficients, KDA chunk size, backends)."""
        where = f"{type(hf_model).__name__} config"
        self.config = config or model_config_from_hf(hf_model.config.to_dict(), where)
        with torch.device("meta"):
            self.model = HybridModel(self.config)
        self.hf_model = hf_model
        self._sources = hf_module_sources(self.config)
        self._slots = list(_slots(self.model))
        names = {name for name, *_ in self._slots}
        assert names == set(self._sources), sorted(names ^ set(self._sources))
        self._check(hf_model)

    def _tensors(self) -> dict[str, torch.Tensor]:
        hf = dict(self.hf_model.named_parameters())
        hf.update(self.hf_model.named_buffers())
        return hf

    def _check(self, hf_model: nn.Module) -> None:
        """Every Hugging Face tensor is read, and each HybridModel tensor comes out in its shape."""
        tensors = self._tensors()
        read: set[str] = set()

        def get(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"{type(hf_model).__name__}: no tensor '{name}' (expected transformers' "
                                 "KimiLinearForCausalLM module layout)")
            read.add(name)
            return tensors[name]

        with torch.no_grad():
            for name, module, attribute, _ in self._slots:
                tensor = self._sources[name](get)
                expected = getattr(module, attribute).shape
                if tensor.shape != expected:
                    raise ValueError(f"{type(hf_model).__name__}: '{name}' made from its tensors has shape "
                                     f"{tuple(tensor.shape)}, HARTS's config gives {tuple(expected)}")
        unread = sorted(set(tensors) - read)
        if unread:
            raise ValueError(f"{type(hf_model).__name__}: tensor '{unread[0]}' has no place in HARTS's model "
                             f"({len(unread)} unread)")

    @contextmanager
    def bound(self) -> Iterator[HybridModel]:
        """The HybridModel holding the Hugging Face model's current tensors (views, or differentiable copies where
        HARTS fuses two), for the duration of the block."""
        tensors = self._tensors()
        placeholders = []
        try:
            for name, module, attribute, is_parameter in self._slots:
                store = module._parameters if is_parameter else module._buffers
                placeholders.append((store, attribute, store[attribute]))
                # Plain tensors in the module's slots: nn.Module reads them as its parameters and buffers.
                store[attribute] = self._sources[name](tensors.__getitem__)
            yield self.model
        finally:
            for store, attribute, placeholder in placeholders:
                store[attribute] = placeholder


def without_moe_losses(config: ModelConfig) -> ModelConfig:
    """`config` with the MoE auxiliary loss coefficients set to 0 (a trainer that adds none of its own)."""
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, aux_loss_coeff=0.0, z_loss_coeff=0.0))
