"""harts.integrations.trl_metrics: `HARTSGRPOTrainer` logs the metrics stock TRL 1.16 logs from `_compute_loss`.

TRL's own `GRPOTrainer._compute_loss` runs on a stand-in trainer whose `_get_per_token_logps_and_entropies` returns
the test's log-probs and entropies; `HARTSGRPOTrainer._log_loss_metrics` runs on a stand-in with the same log-probs
and entropies and HARTS's policy loss of them (`grpo_loss` of TRL's reading, with the trainer's normalisers). Both
`_metrics` dicts must have the same keys and values within 1e-6 + 1e-6 relative: the inputs are the same fp32
tensors and the two sum in other orders (fp32 rounding, ~1e-7 relative; a clip fraction off by one token of the
batch's ~60 is 1.6e-2). The batch is far off-policy (log-ratios ~ N(0, 0.6): tokens clip low and high), B = 6 rows
of T = 9 completion tokens with one row without masked tokens (NaN in TRL's per-sequence means, left out of its min
and max), one of a single token and one of zero advantage. Processes are threads here, whose collectives exchange
tensors as accelerate's `gather` and `reduce` do; with two, process 1 has other log-probs and advantages, and in
"empty-process" no masked token (its NaN minimum must not win).
"""

from __future__ import annotations

import threading
import types
from collections import defaultdict

import pytest
import torch

from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)

trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'harts[trl]')")

from harts.integrations.trl import HARTSGRPOTrainer, grpo_config_from_trl  # noqa: E402
from harts.integrations.trl_metrics import nan_extreme  # noqa: E402
from harts.objective.losses import grpo_loss  # noqa: E402

B, T, PROMPT = 6, 9, 3
LENGTHS = (9, 4, 7, 0, 1, 6)
"""Masked completion tokens of each row (a prefix)."""

CASES = {
    # name: (trl.GRPOConfig settings, {stand-in options}); every case is off-policy with the KL term and the
    # entropy bonus unless it says otherwise.
    **{loss_type: (dict(loss_type=loss_type), {}) for loss_type in
       ("dapo", "grpo", "dr_grpo", "bnpo", "sapo", "luspo", "vespo")},
    "cispo": (dict(loss_type="cispo", epsilon_high=5.0), {}),  # TRL's recommended cap (HARTS refuses one < 1)
    "cispo-epsilon-high": (dict(loss_type="cispo", epsilon_high=1.3), {}),
    "gspo": (dict(importance_sampling_level="sequence", epsilon=0.05), {}),
    "luspo-sequence": (dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.05), {}),
    "cispo-sequence": (dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.05), {}),
    "delta": (dict(delta=1.3, epsilon_high=0.1), {}),
    "epsilon-high": (dict(epsilon=0.1, epsilon_high=0.4), {}),
    "no-bias-correction": (dict(use_bias_correction_kl=False), {}),
    "no-kl-no-entropy": (dict(beta=0.0, entropy_coef=0.0), {}),
    "on-policy": (dict(), dict(on_policy=True)),
    "grpo-accumulate": (dict(loss_type="grpo", gradient_accumulation_steps=2), dict(accumulation=2)),
    "dapo-accumulate": (dict(gradient_accumulation_steps=2), dict(accumulation=2)),
    "bnpo-eval": (dict(loss_type="bnpo", gradient_accumulation_steps=2), dict(accumulation=2, eval=True)),
    "tool-mask": (dict(), dict(tool_mask=True)),
    "per-token-advantages": (dict(), dict(per_token_advantages=True)),
    "not-syncing": (dict(gradient_accumulation_steps=2), dict(accumulation=2, sync_gradients=False)),
    "empty-process": (dict(), dict(empty_process=True)),
    "negative-advantages": (dict(), dict(negative=True)),
    "delta-below-clip": (dict(delta=1.1), {}),
}
DEFAULTS = dict(beta=0.04, entropy_coef=0.01)


class Processes:
    """accelerate's `gather` and `reduce` among `num` threads, thread r as process r."""

    def __init__(self, num: int) -> None:
        self.barrier = threading.Barrier(num, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * num

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()  # no slot written again before every thread has read them all
        return every

    def accelerator(self, rank: int, num_processes: int, sync_gradients: bool) -> types.SimpleNamespace:
        def gather(tensor):
            return torch.cat([torch.atleast_1d(t) for t in self.exchange(rank, tensor)])

        def reduce(tensor, reduction="sum"):
            total = torch.stack(self.exchange(rank, tensor)).sum(0)
            return total if reduction == "sum" else total / num_processes

        return types.SimpleNamespace(num_processes=num_processes, sync_gradients=sync_gradients, gather=gather,
                                     gather_for_metrics=gather, reduce=reduce)


def make_inputs(rank: int, options: dict, empty: bool) -> dict:
    """Process `rank`'s micro-batch: TRL's inputs, plus its log-probs and entropies under "log_probs", "entropy"."""
    generator = torch.Generator().manual_seed(17 + rank)
    lengths = torch.tensor((0,) * B if empty else LENGTHS)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.int64)
    log_probs = -3 * torch.rand(B, PROMPT + T, generator=generator)
    old = log_probs[:, PROMPT:] + 0.6 * torch.randn(B, T, generator=generator)
    advantages = torch.tensor([1.0, -1.0, 0.0, -0.5, -2.0, 2.0]) * (1 if rank == 0 else -1)
    if options.get("negative"):  # every row's ratio low, clipped where A < 0: TRL's low_min above 0
        old, advantages = old + 0.6, -advantages.abs() - 0.5
    if options.get("per_token_advantages"):
        advantages = advantages[:, None] * torch.randn(B, T, generator=generator)
    inputs = {
        "prompt_ids": torch.zeros(B, PROMPT, dtype=torch.int64),
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.int64), "completion_ids": torch.zeros(B, T, dtype=torch.int64),
        "completion_mask": mask, "advantages": advantages,
        "ref_per_token_logps": log_probs[:, PROMPT:] + torch.randn(B, T, generator=generator),
        "num_items_in_batch": torch.tensor(float(sum(LENGTHS) * 2 * options.get("accumulation", 1))),
        "log_probs": log_probs, "entropy": 5 * torch.rand(B, PROMPT + T, generator=generator),
    }
    if not options.get("on_policy"):
        inputs["old_per_token_logps"] = old
    if options.get("tool_mask"):
        inputs["tool_mask"] = (torch.rand(B, T, generator=generator) > 0.3).to(torch.int64)
    return inputs


def stand_in(args, accelerator, options: dict) -> types.SimpleNamespace:
    """What TRL's `_compute_loss` and HARTS's `_normalizers` and `_log_loss_metrics` read of a trainer."""
    return types.SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        max_completion_length=args.max_completion_length, model=types.SimpleNamespace(training=not options.get("eval")),
        current_gradient_accumulation_steps=options.get("accumulation", 1), accelerator=accelerator,
        _entropy_bonus_enabled=args.entropy_coef != 0.0, entropy_coef=args.entropy_coef, use_adaptive_entropy=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=trl.GRPOTrainer.get_gamma_weights, harts_config=types.SimpleNamespace(
            grpo=grpo_config_from_trl(args)),
    )


def trl_metrics(args, accelerator, options: dict, inputs: dict) -> dict:
    """TRL's `_compute_loss` metrics of the micro-batch."""
    trainer = stand_in(args, accelerator, options)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        inputs["log_probs"][:, PROMPT:], inputs["entropy"][:, PROMPT:], None)
    trl.GRPOTrainer._compute_loss(trainer, None, {k: v for k, v in inputs.items() if k not in ("log_probs",
                                                                                              "entropy")})
    return trainer._metrics


def harts_metrics(args, accelerator, options: dict, inputs: dict) -> dict:
    """HARTSGRPOTrainer's metrics of the micro-batch, with HARTS's policy loss of the same log-probs."""
    trainer = stand_in(args, accelerator, options)
    mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
    accumulation = float(options.get("accumulation", 1)) if not options.get("eval") else 1.0
    normalizer, entropy_normalizer = HARTSGRPOTrainer._normalizers(trainer, inputs, mask, accumulation)
    advantages = inputs["advantages"]
    advantages = advantages[:, None].expand(B, T) if advantages.dim() == 1 else advantages
    old = inputs.get("old_per_token_logps")
    policy = grpo_loss(
        inputs["log_probs"][:, PROMPT:].reshape(-1), advantages_S=advantages.reshape(-1), loss_mask_S=mask.reshape(-1),
        config=trainer.harts_config.grpo, old_logprobs_S=None if old is None else old.reshape(-1),
        ref_logprobs_S=inputs["ref_per_token_logps"].reshape(-1) if args.beta else None,
        trajectory_index_S=torch.arange(B).repeat_interleave(T), normalizer=normalizer,
        entropy_S=inputs["entropy"][:, PROMPT:].reshape(-1) if args.entropy_coef else None,
        entropy_normalizer=entropy_normalizer,
    )
    result = types.SimpleNamespace(log_probs=inputs["log_probs"], entropy=inputs["entropy"], policy_loss=policy.loss)
    mode = "eval" if options.get("eval") else "train"
    HARTSGRPOTrainer._log_loss_metrics(trainer, mode, result, inputs, mask, accumulation, entropy_normalizer)
    return trainer._metrics


def run(case: str, num_processes: int) -> list[tuple[dict, dict]]:
    """(TRL's metrics, HARTS's metrics) of each process of `case`, the processes run as threads."""
    settings, options = CASES[case]
    args = trl.GRPOConfig(output_dir="/tmp/harts-trl-unused", max_completion_length=16, report_to="none",
                          use_cpu=True, bf16=False, **{**DEFAULTS, **settings})
    processes = Processes(num_processes)
    results: list = [None] * num_processes
    errors = []

    def process(rank):
        try:
            accelerator = processes.accelerator(rank, num_processes, options.get("sync_gradients", True))
            inputs = make_inputs(rank, options, empty=options.get("empty_process", False) and rank == 1)
            results[rank] = (trl_metrics(args, accelerator, options, inputs),
                             harts_metrics(args, accelerator, options, inputs))
        except BaseException as error:  # noqa: BLE001 (re-raised below)
            errors.append(error)
            processes.barrier.abort()

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(num_processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def same(got: float, want: float) -> bool:
    return (got != got and want != want) or abs(got - want) <= 1e-6 + 1e-6 * abs(want)


def assert_same_metrics(stock: dict, harts: dict) -> None:
    """The same modes, keys and values (NaN where TRL's is NaN)."""
    assert set(harts) == set(stock)
    for mode in stock:
        assert set(harts[mode]) == set(stock[mode]), (mode, sorted(harts[mode]), sorted(stock[mode]))
        for name, want in stock[mode].items():
            got = harts[mode][name]
            assert len(got) == len(want) and all(map(same, got, want)), (mode, name, got, want)


@pytest.mark.parametrize(("case", "num_processes"), [
    pytest.param(case, num, id=f"{case}-{['one-process', 'two-processes'][num - 1]}")
    for case, (_, options) in CASES.items() for num in (1, 2) if num == 2 or not options.get("empty_process")])
def test_harts_logs_trls_loss_metrics(case, num_processes):
    settings, options = CASES[case]
    for stock, harts in run(case, num_processes):
        assert_same_metrics(stock, harts)
        metrics = {name: values[0] for name, values in stock["eval" if options.get("eval") else "train"].items()}
        loss_type = {**DEFAULTS, **settings}.get("loss_type", "dapo")
        # The batch exercises each metric: clipping on both sides, a cap, weights other than 1, NaN rows.
        if case == "negative-advantages":
            assert 0 < metrics["clip_ratio/low_min"] < 1 and metrics["clip_ratio/high_max"] == 0, metrics
        elif case == "delta-below-clip":  # the ratio capped at 1.1 never exceeds 1 + 0.2
            assert metrics["clip_ratio/high_max"] == 0 < metrics["clip_ratio/low_mean"], metrics
        elif loss_type not in ("cispo", "sapo", "vespo") and not options.get("on_policy"):
            assert 0 < metrics["clip_ratio/low_mean"] < metrics["clip_ratio/region_mean"] < 1, metrics
            assert 0 < metrics["clip_ratio/high_mean"] < metrics["clip_ratio/region_mean"], metrics
            assert metrics["clip_ratio/low_min"] == 0 and metrics["clip_ratio/high_max"] > 0, metrics
        if case in ("cispo-epsilon-high", "cispo-sequence"):
            assert metrics["cispo_clip_ratio"] > 0, metrics
        if loss_type == "vespo":
            assert 0 < metrics["vespo/phi_seq_mean"] != 1, metrics
        assert ("policy_loss" in metrics) is ({**DEFAULTS, **settings}["entropy_coef"] != 0), metrics


def test_nan_extreme_leaves_nan_out():
    values = torch.tensor([float("nan"), 0.25, 0.5, float("nan")])
    assert nan_extreme(values, largest=False) == 0.25 and nan_extreme(values, largest=True) == 0.5
    assert nan_extreme(torch.full((3,), float("nan")), largest=True).isnan()
