"""Parallel configuration (configs/parallel/NAME.yaml): degrees of DP, TP, SP, PP and EP.

`ParallelConfig` holds the degrees; `world_size = dp · tp · pp` ranks. Expert parallelism does
not add ranks: as in megatron-core, the `ep` expert shards are folded onto the dp · tp ranks of a
pipeline stage (so `ep` must divide dp · tp). Those ranks must hold different rows for each
compact token to be dispatched once: different microbatches (the DP replicas) or different row
shards of one microbatch (sequence parallelism over the TP group) — hence ep > 1 with tp > 1
needs `sequence_parallel`, megatron-core's rule. With ep = 1 the routed experts are split by
columns across the TP group (megatron's expert-tensor-parallel size = tp); with ep > 1 every
expert is whole on its owner (expert-tensor-parallel size 1).

`check_model(model_config)` rejects degrees the model cannot be split by (heads, hidden sizes,
experts, layers), one line per problem. `load_parallel_config(name_or_path)` reads a shipped
config by name or a YAML path strictly (harts.config.load_config).
"""

from __future__ import annotations

from dataclasses import dataclass

from harts.config import load_config, shipped_config_path

BACKENDS = ("auto", "gloo", "nccl")


# The lean experts gather each row's k routed copies inside their own node and combine them there; expert
# parallelism instead sends the routed rows to the experts' owners and back, so its ranks run the grouped experts
# on what they receive, and a "lean" configuration would not be what ran.
LEAN_UNDER_EP = ("moe.experts_backend 'lean' fuses the dispatch and combine that expert parallelism (ep = {ep}) "
                 "replaces by its all-to-all exchange: use 'grouped' (or 'auto')")


@dataclass(kw_only=True)
class ParallelConfig:
    """Degrees of parallelism of one run."""

    name: str
    dp: int = 1
    """Data-parallel replicas: replica r runs microbatch r of every slot of the plan."""
    tp: int = 1
    """Tensor-parallel ranks: KDA/MLA heads and MLP/expert columns split across them."""
    pp: int = 1
    """Pipeline stages: contiguous blocks; embedding on the first, final norm + LM head on the last."""
    ep: int = 1
    """Expert-parallel ranks: routed experts split E/ep per rank, folded onto the dp · tp ranks."""
    sequence_parallel: bool = False
    """Shard rows across the TP group outside attention/KDA (needs tp > 1)."""
    backend: str = "auto"
    """"gloo", "nccl", or "auto" (nccl on CUDA, gloo on CPU)."""
    timeout_s: float = 300.0
    """Timeout of every collective: a rank that died or diverged fails the run instead of hanging."""

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "ep"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel config {self.name!r}: {key} must be >= 1, got {getattr(self, key)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"parallel config {self.name!r}: backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"parallel config {self.name!r}: timeout_s must be > 0")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(f"parallel config {self.name!r}: sequence_parallel needs tp > 1")
        if (self.dp * self.tp) % self.ep:
            raise ValueError(
                f"parallel config {self.name!r}: ep ({self.ep}) must divide dp·tp ({self.dp * self.tp}): experts "
                f"are folded onto the data- and tensor-parallel ranks of a stage"
            )
        if self.ep > 1 and self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"parallel config {self.name!r}: ep > 1 with tp > 1 needs sequence_parallel (TP ranks must hold "
                f"different rows so that each row is dispatched once; megatron-core's rule)"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def expert_tp(self) -> int:
        """Ranks splitting each routed expert by columns: tp when ep = 1, else 1."""
        return self.tp if self.ep == 1 else 1

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert shard within a stage (their expert gradients are summed)."""
        return self.dp * self.tp // (self.ep * self.expert_tp)

    def check_model(self, model) -> None:
        """ValueError if `model` (a ModelConfig) cannot be split by these degrees."""
        where = f"parallel config {self.name!r} on model {model.name!r}"
        tp, moe = self.tp, model.moe
        heads = {}  # every head count the tensor-parallel cuts divide, by its config field
        if model.kda is not None:
            heads["kda.num_heads"] = model.kda.num_heads
        if model.gdn is not None:
            heads.update({"gdn.num_key_heads": model.gdn.num_key_heads,
                          "gdn.num_value_heads": model.gdn.num_value_heads})
        if model.mla is not None:
            heads["mla.num_heads"] = model.mla.num_heads
        if model.gated_attention is not None:
            heads["gated_attention.num_kv_heads"] = model.gated_attention.num_kv_heads
        checks = [
            *((count % tp == 0, f"{field} ({count}) not divisible by tp ({tp})") for field, count in heads.items()),
            (not model.num_dense_layers or model.dense_hidden_size % tp == 0,
             f"dense_hidden_size ({model.dense_hidden_size}) not divisible by tp ({tp})"),
            (moe.num_experts % self.ep == 0, f"moe.num_experts ({moe.num_experts}) not divisible by ep ({self.ep})"),
            (moe.expert_hidden_size % self.expert_tp == 0,
             f"moe.expert_hidden_size ({moe.expert_hidden_size}) not divisible by tp ({self.expert_tp})"),
            (self.ep > 1 or moe.shared_expert_hidden_size % tp == 0,
             f"moe.shared_expert_hidden_size ({moe.shared_expert_hidden_size}) not divisible by tp ({tp})"),
            (model.num_layers >= self.pp, f"num_layers ({model.num_layers}) < pp ({self.pp})"),
            (self.ep == 1 or moe.experts_backend != "lean", LEAN_UNDER_EP.format(ep=self.ep)),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{where}: {message}")
        if model.mtp is not None:
            raise ValueError(f"{where}: MTP layers (the model config's mtp) run in one process only "
                             "(harts.objective.step.run_step); the parallel step does not split or run them")
        if model.tie_embeddings and self.pp > 1:
            raise NotImplementedError(
                f"{where}: tie_embeddings with pp > 1 needs an embedding-gradient exchange between the first and "
                f"last stages, which is not implemented"
            )


def load_parallel_config(name_or_path: str) -> ParallelConfig:
    """A shipped config by name (`single`, `dp2`, `tp2`, `tp2-sp`, `pp2`, `ep2`, `dp2-ep2`, ...) or a YAML path."""
    return load_config(shipped_config_path(name_or_path, "parallel"), ParallelConfig)
