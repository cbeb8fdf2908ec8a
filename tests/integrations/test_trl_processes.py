"""harts.integrations.trl on two processes: `HARTSGRPOTrainer` under accelerate's DistributedDataParallel trains
exactly as `trl.GRPOTrainer` does, computing fewer rows.

torchrun (`python -m torch.distributed.run --standalone --nproc-per-node 2`, what `accelerate launch` runs) starts
two CPU processes; accelerate reads torchrun's RANK, WORLD_SIZE and LOCAL_RANK, joins a gloo group and wraps each
trainer's model in DDP. Each rank runs this module's `main`: test_trl's kimi-tiny checkpoint, prompts, toy reward and
SGD, N GRPO steps of stock TRL and of the HARTS trainer from the same seed, and saves what it saw. Checked here, on
both ranks: the same completions; the same logged losses and the metrics TRL reduces over the processes (entropy,
KL, clip ratio, aux loss) within test_trl's tolerances; every parameter within test_trl's tolerance of stock TRL's,
and the two ranks' parameters bitwise equal (DDP keeps whole replicas); fewer rows than TRL's padded forwards.
Cases: dapo with 2 accumulation steps, reused generations (old log-probs) and the KL term (`num_items_in_batch` /
the processes; `no_sync` on the first micro-batch of each step: a comm hook that averages as DDP's default counts
each bucket's reductions, which must be stock TRL's, one per optimizer step); slow: grpo with the entropy bonus and
without gradient checkpointing (the Trainer's `find_unused_parameters=True`: DDP searches the graph of HARTS's loss,
default reducer path), and gdn-tiny (Qwen3-Next) at its router_aux_loss_coef.
"""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'harts[trl]')")
pytest.importorskip("datasets", reason="datasets (a dependency of trl) is not installed")

from harts.integrations.trl import HARTSGRPOTrainer, data_parallel_wrapper  # noqa: E402
from tests.integrations.test_trl import logged, losses, make_checkpoint, train  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NUM_PROCESSES = 2
TIMEOUT_S = 300
METRICS = ("entropy", "kl", "clip_ratio/region_mean", "aux_loss")
"""Metrics both trainers log, each reduced over the processes by TRL."""

CASES = {
    # name: (model, GRPOConfig settings, steps, count the reductions). Each rank's micro-batch is
    # per_device_train_batch_size completions; a generation batch is that × 2 processes × accumulation steps.
    "dapo-accumulate-reuse-kl": ("kimi-tiny", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                                   num_iterations=2, beta=0.04), 3, True),
    "grpo-entropy-no-checkpointing": ("kimi-tiny", dict(per_device_train_batch_size=8, loss_type="grpo",
                                                        entropy_coef=0.01, gradient_checkpointing=False), 2, False),
    "gdn-aux-dapo": ("gdn-tiny", dict(per_device_train_batch_size=8), 2, False),
}
SLOW_CASES = ("grpo-entropy-no-checkpointing", "gdn-aux-dapo")


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
    _, settings, steps, count = CASES[args.case]
    rank = int(os.environ["RANK"])
    saved = {}
    for name, trainer_class in (("trl", trl.GRPOTrainer), ("harts", HARTSGRPOTrainer)):
        trainer_class = counting(trainer_class) if count else trainer_class
        trainer, parameters, completions, rows = train(trainer_class, args.checkpoint, Path(args.out) / name,
                                                       settings, steps)
        saved[name] = {
            "num_processes": trainer.accelerator.num_processes, "wrapper": type(trainer.model_wrapped).__name__,
            "losses": losses(trainer), "metrics": {metric: logged(trainer, metric) for metric in METRICS},
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
    model, settings, steps, count = CASES[case]
    checkpoint = make_checkpoint(tmp_path / "checkpoint", model)
    ranks = run_ranks(checkpoint, case, tmp_path / "runs")
    initial = {n: p.detach() for n, p in transformers.AutoModelForCausalLM.from_pretrained(checkpoint).named_parameters()}
    for rank, runs in enumerate(ranks):
        stock, harts = runs["trl"], runs["harts"]
        for run in (stock, harts):
            assert (run["num_processes"], run["wrapper"]) == (NUM_PROCESSES, "DistributedDataParallel"), run
        assert harts["completions"] == stock["completions"] and stock["completions"], rank
        assert len(stock["losses"]) == steps
        assert close(harts["losses"], stock["losses"]), (rank, harts["losses"], stock["losses"])
        for metric in METRICS:  # each as stock TRL logs it (kl with beta, aux_loss at gdn-tiny's coefficient)
            assert close(harts["metrics"][metric], stock["metrics"][metric]), (
                rank, metric, harts["metrics"][metric], stock["metrics"][metric])
        assert {m for m in METRICS if stock["metrics"][m]} == (
            {"entropy", "clip_ratio/region_mean"} | ({"kl"} if settings.get("beta") else set())
            | ({"aux_loss"} if model == "gdn-tiny" else set()))
        change = max(float((stock["parameters"][n] - p).abs().max()) for n, p in initial.items())
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


if __name__ == "__main__":
    main()
