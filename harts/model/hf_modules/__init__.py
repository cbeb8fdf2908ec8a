"""A live transformers model's parameters run by HARTS's `HybridModel`, in place: `KimiLinearForCausalLM`,
`BailingHybridForCausalLM` (Ling-3), `Qwen3NextForCausalLM` and `Qwen3_5MoeForCausalLM`.

`HFParameterView(hf_model)` builds a `HybridModel` of the same configuration (`hf_model_config`) on the meta device,
holding nothing; `with view.bound() as model:` gives that model the Hugging Face model's own tensors for the duration
of the block, so that HARTS's compact execution (`harts.api`) runs on exactly the weights a trainer (TRL, ...) holds,
updates and generates with, and back-propagates into them: gradients land in the Hugging Face parameters' `.grad`.
Nothing is copied where the layouts agree up to a view (projections, norms, the stacked experts transposed, the
stacked KDA convs split, A_log reshaped, the router and its bias); where HARTS fuses what transformers keeps apart,
the pieces are concatenated at binding time, a differentiable copy (the dense layers' gate and up projections, the
shared expert's, the GDN input projections regrouped into one). Binding again after an optimizer step sees the new
values; outside the block the model holds meta tensors again (no stale copy, no graph kept).

One module per architecture (`ARCHITECTURES`, by the transformers config's model_type) holds the mapping from
transformers' in-memory module tree (5.25), which differs from the checkpoint layouts of harts.model.hf since
transformers converts on loading and saving: `MODEL_TYPE`, `CLASS`, `model_config(hf_dict, where)` (the decoder's
`ModelConfig`: transformers' models hold no MTP layers, so the view binds the decoder, harts.model.hf_modules.bailing
says why) and `sources(config)` (harts.model.hf_modules.sources: how each HybridModel tensor is made). Every
HybridModel tensor must be made, in its shape, and every Hugging Face parameter and persistent buffer read; a
missing, extra or mis-shaped tensor, another model type or a HARTS config of another layout (or with MTP layers) is
a ValueError naming it. Non-persistent buffers (the rotary tables) are derived from the config, not weights.

Tested (tests/model/test_hf_modules.py, each architecture on a tiny transformers-built config) against
transformers' own forward (logits within fp32 rounding), against `load_hf_checkpoint` of the model's
`save_pretrained` (every bound tensor bitwise equal), with gradients reaching the Hugging Face parameters equal to
those of the loaded model's and of transformers' own backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
from torch import nn

from harts.model.config import HF_LAYOUTS, ModelConfig
from harts.model.hf_modules import bailing, kimi, qwen3_5_moe, qwen3_next
from harts.model.hf_modules.sources import Source
from harts.model.model import HybridModel

ARCHITECTURES: dict[str, ModuleType] = {module.MODEL_TYPE: module for module in (kimi, bailing, qwen3_next,
                                                                                 qwen3_5_moe)}
"""A transformers config's model_type -> the module of its in-memory layout."""
assert set(ARCHITECTURES) == set(HF_LAYOUTS), (set(ARCHITECTURES), HF_LAYOUTS)


def architecture_of(hf_model: nn.Module) -> ModuleType:
    """The module of `hf_model`'s in-memory layout, by its config's model_type."""
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        supported = ", ".join(f"{module.CLASS} ({name})" for name, module in ARCHITECTURES.items())
        raise ValueError(f"{type(hf_model).__name__}: model_type {model_type!r} has no HARTS module layout "
                         f"(supported: {supported})")
    return ARCHITECTURES[model_type]


def hf_model_config(hf_model: nn.Module) -> ModelConfig:
    """The `ModelConfig` of the HybridModel that runs `hf_model`'s tensors: its config read by its architecture's
    reader (the decoder: no MTP layers, which transformers' models do not hold)."""
    return architecture_of(hf_model).model_config(hf_model.config.to_dict(), f"{type(hf_model).__name__} config")


def hf_module_sources(config: ModelConfig) -> dict[str, Source]:
    """Every parameter and buffer of `HybridModel(config)` by name: how to make it from the tensors of the
    transformers model of `config.hf_layout`'s architecture (module docstring)."""
    return ARCHITECTURES[config.hf_layout].sources(config)


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
    """A HybridModel over a transformers model's tensors (module docstring)."""

    def __init__(self, hf_model: nn.Module, *, config: ModelConfig | None = None) -> None:
        """`config`: the HybridModel's configuration (default: `hf_model_config`); it may differ from it only in
        fields the weights do not depend on (MoE loss coefficients, chunk sizes, backends)."""
        architecture = architecture_of(hf_model)
        name = type(hf_model).__name__
        self.config = config or hf_model_config(hf_model)
        if self.config.hf_layout != architecture.MODEL_TYPE:
            raise ValueError(f"{name}: HARTS's model config {self.config.name!r} is of the "
                             f"{self.config.hf_layout} layout, the model of {architecture.MODEL_TYPE}")
        if self.config.mtp is not None:
            raise ValueError(f"{name}: HARTS's model config {self.config.name!r} has {self.config.mtp.num_layers} "
                             f"MTP layers, which transformers' {architecture.CLASS} does not hold: bind the decoder "
                             "(a config without mtp, as hf_model_config reads)")
        with torch.device("meta"):
            self.model = HybridModel(self.config)
        self.hf_model = hf_model
        self._class = architecture.CLASS
        self._sources = architecture.sources(self.config)
        self._slots = list(_slots(self.model))
        names = {name for name, *_ in self._slots}
        assert names == set(self._sources), sorted(names ^ set(self._sources))
        self._check()

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The Hugging Face model's parameters (a tied one under each of its names) and persistent buffers."""
        return self.hf_model.state_dict(keep_vars=True)

    def _check(self) -> None:
        """Every Hugging Face tensor is read, and each HybridModel tensor comes out in its shape."""
        tensors = self._tensors()
        name = type(self.hf_model).__name__
        read: set[str] = set()

        def get(tensor_name: str) -> torch.Tensor:
            if tensor_name not in tensors:
                raise ValueError(f"{name}: no tensor '{tensor_name}' (expected transformers' {self._class} module "
                                 "layout)")
            read.add(tensor_name)
            return tensors[tensor_name]

        with torch.no_grad():
            for slot_name, module, attribute, _ in self._slots:
                tensor = self._sources[slot_name](get)
                expected = getattr(module, attribute).shape
                if tensor.shape != expected:
                    raise ValueError(f"{name}: '{slot_name}' made from its tensors has shape {tuple(tensor.shape)}, "
                                     f"HARTS's config gives {tuple(expected)}")
        unread = sorted(set(tensors) - read)
        if unread:
            raise ValueError(f"{name}: tensor '{unread[0]}' has no place in HARTS's model ({len(unread)} unread)")

    @contextmanager
    def bound(self) -> Iterator[HybridModel]:
        """The HybridModel holding the Hugging Face model's current tensors (views, or differentiable copies where
        HARTS fuses several), for the duration of the block."""
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
