"""harts.integrations.trl on two processes: `HARTSGRPOTrainer` under accelerate's DistributedDataParallel trains
exactly as `trl.GRPOTrainer` does, computing fewer rows.

torchrun (`python -m torch.distributed.run --standalone --nproc-per-node 2`, what `accelerate launch` runs) starts
two CPU processes; accelerate reads torchrun's RANK, WORLD_SIZE and LOCAL_RANK, joins a gloo group and wraps each
trainer's model in DDP. Each rank runs this module's `main`: test_trl's checkpoint, prompts, toy reward and SGD, N
GRPO steps of stock TRL and of the HARTS trainer from the same seed, and saves what it saw. Checked here, on both
ranks: the same completions; the same logged losses, and every metric of every micro-batch as stock TRL logs it
(test_trl's `assert_same_metrics`), reduced over the processes as TRL's (sums of values and counts, the min and
max of per-sequence means over both ranks' sequences, a mean of the ranks' policy losses), within test_trl's
tolerances; every parameter within test_trl's tolerance of stock TRL's, and the two ranks' parameters bitwise equal
(DDP keeps whole replicas); fewer rows than TRL's padded forwards.
Cases: (default, ~30 s) kimi-tiny, dapo with 2 accumulation steps, reused generations (old log-probs, off-policy
and with a tool mask: both ranks' ratios clip on both sides), the KL term and the entropy bonus:
`num_items_in_batch` / the processes, `no_sync` on each step's first micro-batch (a comm hook that reduces as
DDP's default counts each bucket's reductions, which must be stock TRL's: one per optimizer step), no gradient
clipping (which would hide a gradient scaled by the processes); slow: grpo with the entropy bonus and without
gradient checkpointing (the Trainer's `find_unused_parameters=True`: DDP searches the graph of HARTS's loss; DDP's
own reducer path), luspo with a sequence-level ratio off-policy (clip metrics of one value per sequence), and
gdn-tiny (Qwen3-Next) at its router_aux_loss_coef.

In this process: torch's reducer on a one-rank gloo world (nothing reduced without the wrapper's forward, once per
backward through `forward_through`, nothing under no_sync), the refusals of what is not DDP, by name.
"""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'harts[trl]')")
pytest.importorskip("datasets", reason="datasets (a dependency of trl) is not installed")

from harts.integrations.trl import (  # noqa: E402
    HARTSGRPOTrainer, data_parallel_wrapper, forward_through, parallelism_problems,
)
from tests.integrations.test_trl import (  # noqa: E402
    OLD_NOISE, assert_same_metrics, compared_metrics, losses, make_checkpoint, train,
)

REPO = Path(__file__).resolve().parents[2]
NUM_PROCESSES = 2
TIMEOUT_S = 300
CASES = {
    # name: (model, GRPOConfig settings, steps, count the reductions, off-policy). Each rank's micro-batch is
    # per_device_train_batch_size completions; a generation batch is that × 2 processes × accumulation steps.
    # Off-policy: test_trl's `off_policy` (old log-probs off by noise, a tool mask) on each rank's generations.
    "dapo-accumulate-reuse-kl-off-policy": ("kimi-tiny", dict(
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_iterations=2, beta=0.04, entropy_coef=0.01,
        max_grad_norm=0.0), 3, True, True),
    "grpo-entropy-no-checkpointing": ("kimi-tiny", dict(per_device_train_batch_size=8, loss_type="grpo",
                                                        entropy_coef=0.01, gradient_checkpointing=False), 2, False,
                                      False),
    "luspo-sequence-off-policy": ("kimi-tiny", dict(per_device_train_batch_size=8, loss_type="luspo",
                                                    importance_sampling_level="sequence", epsilon=0.05,
                                                    num_iterations=2), 2, False, True),
    "gdn-aux-dapo": ("gdn-tiny", dict(per_device_train_batch_size=8), 2, False, False),
}
SLOW_CASES = ("grpo-entropy-no-checkpointing", "luspo-sequence-off-policy", "gdn-aux-dapo")
CLIP_METRICS = {"clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                "clip_ratio/region_mean"}


def count_and_average(reductions: list, bucket):
    """A DDP comm hook: DDP's default reduction (divide by the processes, all-reduce the sum), recording the bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    reductions.append(bucket.index())
    return allreduce_hook(None, bucket)


def counting(trainer_class):
    """`trainer_class` whose DDP wrapper reduces through `count_and_average` (into the trainer's `reductions`)."""

    class Counting(trainer_class):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if not hasattr(self, "reductions"):  # the first step, before DDP's first forward
                self.reductions = []
                data_parallel_wrapper(model).register_comm_hook(self.reductions, count_and_average)
            return super().training_step(model, inputs, num_items_in_batch)

    return Counting


def main() -> None:
    """One rank: both trainers on a case, what each saw saved as OUT/rankR.pt."""
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("case", choices=CASES)
    parser.add_argument("out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, settings, steps, count, changed = CASES[args.case]
    rank = int(os.environ["RANK"])
    saved = {}
    for name, trainer_class in (("trl", trl.GRPOTrainer), ("harts", HARTSGRPOTrainer)):
        trainer_class = counting(trainer_class) if count else trainer_class
        trainer, parameters, completions, rows = train(trainer_class, args.checkpoint, Path(args.out) / name,
                                                       settings, steps, old_noise=OLD_NOISE if changed else 0.0)
        saved[name] = {
            "num_processes": trainer.accelerator.num_processes, "wrapper": type(trainer.model_wrapped).__name__,
            "losses": losses(trainer), "metrics": compared_metrics(trainer),
            "parameters": parameters, "completions": completions, "rows": rows,
            "counts": getattr(trainer, "harts_counts", None), "reductions": getattr(trainer, "reductions", None),
        }
    torch.save(saved, Path(args.out) / f"rank{rank}.pt")


def run_ranks(checkpoint: Path, case: str, out: Path) -> list[dict]:
    """Both ranks of `case` under torchrun: each rank's saved runs."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NUM_PROCESSES),
               "-m", "tests.integrations.test_trl_processes", str(checkpoint), case, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    # A session of its own, so that a timeout also stops torchrun's workers.
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, output[-6000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(NUM_PROCESSES)]


def close(got: list[float], want: list[float]) -> bool:
    """test_trl's loss tolerance: 1e-6 + 1e-5 relative."""
    return len(got) == len(want) and all(abs(g - w) <= 1e-6 + 1e-5 * abs(w) for g, w in zip(got, want))


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case
                                  for case in CASES])
def test_harts_trainer_trains_as_trl_on_two_processes(tmp_path, case):
    model, settings, steps, count, changed = CASES[case]
    checkpoint = make_checkpoint(tmp_path / "checkpoint", model)
    ranks = run_ranks(checkpoint, case, tmp_path / "runs")
    initial = dict(transformers.AutoModelForCausalLM.from_pretrained(checkpoint).named_parameters())
    for rank, runs in enumerate(ranks):
        stock, harts = runs["trl"], runs["harts"]
        for run in (stock, harts):
            assert (run["num_processes"], run["wrapper"]) == (NUM_PROCESSES, "DistributedDataParallel"), run
        assert harts["completions"] == stock["completions"] and stock["completions"], rank
        assert len(stock["losses"]) == steps
        assert close(harts["losses"], stock["losses"]), (rank, harts["losses"], stock["losses"])
        # Every metric of every micro-batch as stock TRL logs it, reduced over the processes.
        assert_same_metrics(harts["metrics"], stock["metrics"])
        names = set().union(*stock["metrics"])
        assert CLIP_METRICS | {"entropy"} <= names
        assert ("kl" in names, "aux_loss" in names, "policy_loss" in names) == (
            bool(settings.get("beta")), model == "gdn-tiny", bool(settings.get("entropy_coef")))
        if changed:  # the ratios clip on both sides
            values = {name: [v for logged in stock["metrics"] for v in logged.get(name, [])] for name in names}
            assert max(values["clip_ratio/low_mean"]) > 0 and max(values["clip_ratio/high_max"]) > 0, values
        change = max(float((stock["parameters"][n] - p.detach()).abs().max()) for n, p in initial.items())
        assert change > 1e-3
        for name, want in stock["parameters"].items():
            assert torch.allclose(harts["parameters"][name], want, rtol=1e-6, atol=1e-4 * change), (rank, name)
        if count:
            # One reduction of every bucket per optimizer step, as stock TRL (none inside no_sync).
            assert harts["reductions"] == stock["reductions"], (harts["reductions"], stock["reductions"])
            assert stock["reductions"].count(0) == steps
        assert harts["counts"]["padded_rows"] == stock["rows"]
        assert harts["rows"] < harts["counts"]["tokens"] < stock["rows"], (harts["counts"], stock["rows"])
    for name in ("trl", "harts"):
        first, second = (runs[name]["parameters"] for runs in ranks)
        assert all(torch.equal(first[n], second[n]) for n in first), name
    assert ranks[0]["trl"]["completions"] != ranks[1]["trl"]["completions"]  # each rank its share of the batch


@pytest.fixture
def one_rank():
    """A one-rank gloo world in this process (DDP's reducer runs, its all-reduce over one rank)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_reduces_what_runs_through_its_forward_once_per_backward(one_rank):
    """torch's reducer hooks every parameter's gradient accumulator but acts only after the wrapper's forward
    (`prepare_for_backward`): a backward of the parameters without it is never reduced; `forward_through` is reduced
    once per backward, not under no_sync, and leaves the module's own forward (accelerate's wrapper) in place."""
    linear = torch.nn.Linear(3, 2)
    wrapper = DistributedDataParallel(linear)
    reductions = []
    wrapper.register_comm_hook(reductions, count_and_average)

    def loss() -> torch.Tensor:  # the parameters without the module's forward, as HARTS runs them
        return torch.nn.functional.linear(torch.ones(4, 3), linear.weight, linear.bias).square().sum()

    loss().backward()
    assert reductions == []
    forward_through(wrapper, loss).backward()
    assert reductions == [0]
    with wrapper.no_sync():
        forward_through(wrapper, loss).backward()
    assert reductions == [0]
    forward_through(wrapper, loss).backward()
    loss().backward()
    assert reductions == [0, 0] and "forward" not in vars(linear)
    accelerate_forward = linear.forward = lambda x: x
    forward_through(wrapper, loss).backward()
    assert reductions == [0, 0, 0] and linear.forward is accelerate_forward
    assert data_parallel_wrapper(SimpleNamespace(_orig_mod=wrapper)) is wrapper  # under torch.compile
    assert data_parallel_wrapper(linear) is None


def stand_in(distributed_type="MULTI_GPU", deepspeed_stage=None, fsdp=False, **parallelism):
    """What `parallelism_problems` reads of a trainer."""
    from accelerate.utils import DistributedType

    config = SimpleNamespace(**{f"{d}_size": parallelism.get(d, 1) for d in ("dp_replicate", "dp_shard", "tp", "cp",
                                                                               "sp")})
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=deepspeed_stage))
    accelerator = SimpleNamespace(distributed_type=DistributedType(distributed_type), state=state,
                                  parallelism_config=config if parallelism else None)
    return SimpleNamespace(accelerator=accelerator, is_deepspeed_enabled=deepspeed_stage is not None,
                           is_fsdp_enabled=fsdp)


@pytest.mark.parametrize(("trainer", "problems"), [
    (stand_in("NO"), []),
    (stand_in("MULTI_CPU"), []),
    (stand_in("MULTI_GPU", dp_replicate=2), []),
    (stand_in("DEEPSPEED", deepspeed_stage=3), ["DeepSpeed (ZeRO stage 3) (launch without DeepSpeed: "
                                                "accelerate's DDP)"]),
    (stand_in("DEEPSPEED", deepspeed_stage=1), ["DeepSpeed (ZeRO stage 1) (launch without DeepSpeed: "
                                                "accelerate's DDP)"]),
    (stand_in("FSDP", fsdp=True), ["FSDP (launch without FSDP: accelerate's DDP)"]),
    (stand_in("XLA"), ["accelerate's XLA (launch DDP or one process)"]),
    (stand_in("MEGATRON_LM"), ["accelerate's MEGATRON_LM (launch DDP or one process)"]),
    (stand_in("MULTI_GPU", tp=2, cp=2), ["parallelism_config tp_size=2 (set 1: DDP's replicas only)",
                                         "parallelism_config cp_size=2 (set 1: DDP's replicas only)"]),
], ids=["one-process", "ddp-cpu", "ddp-gpu", "zero3", "zero1", "fsdp", "xla", "megatron", "tp-cp"])
def test_only_ddp_replicas_are_accepted(trainer, problems):
    assert parallelism_problems(trainer) == problems


def test_a_step_of_several_processes_without_ddp_is_refused():
    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=2))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="HARTSGRPOTrainer: 2 processes train a Linear that no DistributedDataParallel "
                                         "wraps: its gradients would not be averaged"):
        HARTSGRPOTrainer._reduced(trainer, model, lambda: model.weight.sum())
    with torch.no_grad():  # evaluation: nothing to reduce
        assert HARTSGRPOTrainer._reduced(trainer, model, lambda: model.weight.sum()) == model.weight.sum()


if __name__ == "__main__":
    main()
