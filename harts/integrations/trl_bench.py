"""`harts bench trl`: the time of a GRPO update through TRL's `GRPOTrainer`, stock and with HARTS
(`HARTSGRPOTrainer`), on the same batch of GRPO groups with long shared prompts.

The model is a shipped model config (or a YAML path) in the form its Hugging Face layout holds (`trl_form`: for the
Kimi-Linear layout the KDA output gate and the NoPE MLA of Kimi-Linear; no MTP layers, which transformers' models do
not hold; chunks of 64 as fla's `chunk_kda` and `chunk_gated_delta_rule`), initialised from `--seed` and saved as a
Hugging Face checkpoint that transformers loads as the class of its layout (`KimiLinearForCausalLM`,
`BailingHybridForCausalLM`, `Qwen3NextForCausalLM` or `Qwen3_5MoeForCausalLM`), which both trainers run. A
config its layout cannot express is refused by name (`harts.model.hf.check_exportable`). Both trainers add TRL's
router auxiliary loss at the model config's own `router_aux_loss_coef`, as TRL does by default (Qwen3-Next's and
Qwen3.5's 0.001; Kimi-Linear's and BailingHybrid's configs declare none: 0), or at `--router-aux-loss-coef`
(0 turns it off); the record holds the coefficient both ran with (checked against each trainer's), and a non-zero
one for a model of sigmoid routing is refused, as HARTSGRPOTrainer refuses it. The batch
(`grpo_batch`) is `--prompts` random prompts of `--prompt-length` tokens, each with `--generations` random
completions of `--completion-length` tokens at most (lengths uniform in [half, all]; right-padded) and advantages
normalised within each group as TRL's `scale_rewards="group"`: it is what TRL's generation and rewards would hand
the update, so generation and rewards are not run (`_generate_and_score_completions` returns the batch).

Each trainer runs `trainer.train()` for `--warmup` + `--repeats` steps of one micro-batch (the whole batch, TRL's
dapo loss, on-policy); a callback times each step from `on_step_begin` to `on_step_end` (log-probs, loss, backward,
gradient clipping at TRL's max_grad_norm, optimizer step; `torch.cuda.synchronize` at both ends on CUDA) and the
median of the steps after the warm-up is the figure. The trainers run one after the other, each on a fresh copy of
the checkpoint. The parameters stay fp32; both compute under bf16 autocast (TRL's `bf16=True`, HARTS's dtype bf16)
or in fp32, `--dtype`: bf16 on CUDA by default (HARTS's grouped experts take bf16 only), fp32 on the CPU. bf16
runs on the CPU too: HARTS's CPU paths (sdpa attention, the PyTorch KDA and GDN, the loop experts) and
transformers' models all take CPU autocast.

Fidelity (`fidelity`), HARTS against stock TRL from the same weights: the per-token log-probs and entropies of the
batch's completions (`_get_per_token_logps_and_entropies`, before training), the first step's loss (on-policy dapo:
the ratio is 1, so the loss hardly depends on the log-probs; the gradients do), the first step's gradients after
clipping (relative difference of the whole gradient vector) and the parameters after it (largest difference, beside
the largest change the step made). Two bf16 executions of different kernels differ by their rounding, so in bf16
a third, untimed run follows the timed ones (`--no-fp32-reference` skips it): stock TRL in IEEE fp32 (`bf16=False`,
no autocast) for one step, under `ieee_fp32`: torch's fp32 matmuls, convolutions and RNNs without TF32 or bf16
passes (cuBLAS, cuDNN, oneDNN), and Triton's fp32 dots in IEEE (TRITON_F32_DEFAULT, for fla's kernels that
transformers' models call on CUDA; a kernel compiled earlier in the process for the same argument types keeps its
precision), restored after; the record holds these settings and the timed runs' own (`fp32_precision`). It records
what the fidelity reads as the timed runs do, and `fidelity` gives each bf16 trainer's distance to it
(`fidelity_vs_fp32`): the rounding noise that the HARTS-against-TRL figures are read against. One record per run
(`harts.tracking.records`), written after each run; a run that fails leaves an `error` in its entry and the command
exits 1.

This lives beside the TRL integration rather than in harts.bench: the benchmarks must not import the
integrations (tests/test_imports.py). Tested on the CPU in tests/integrations/test_trl_bench.py, in fp32 and, with
the fp32 reference, in bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from harts.args import non_negative_float, non_negative_int, positive_float, positive_int, records_file

logger = logging.getLogger(__name__)

PAD, EOS, UNK = 0, 1, 2
FIRST_TOKEN = 3
"""The batch's tokens are drawn from [FIRST_TOKEN, vocabulary): never the tokenizer's pad, eos or unknown ids."""
TRAINERS = ("trl", "harts")
REFERENCE = "fp32_reference"
"""The results entry of the untimed fp32 run of stock TRL (module docstring)."""
DTYPES = ("fp32", "bf16")
PRECISION_BACKENDS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
"""torch.backends' fp32 math settings (`fp32_precision`: ieee, tf32 or bf16 passes, none: the parent's) that the
reference sets; the legacy settings (`allow_tf32`, `set_float32_matmul_precision`) read through them."""
TRITON_F32_DEFAULT = "TRITON_F32_DEFAULT"
"""Triton's default precision of fp32 dots (tf32 on NVIDIA GPUs when unset): fla's kernels, which transformers'
models call on CUDA, take it."""
LABELS = {"trl": "TRL", "harts": "HARTS"}
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "sgd")
"""TRL's optimizer names the command takes (the first is TRL's default)."""


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("trl", help="time a GRPO update through TRL's GRPOTrainer, stock and with HARTS")
    parser.add_argument("--model", default="h200", help="configs/models NAME or a YAML path (run in the form "
                        "its Hugging Face layout holds)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--prompts", type=positive_int, default=4, help="GRPO groups (distinct prompts)")
    parser.add_argument("--generations", type=positive_int, default=8, help="completions per prompt (G)")
    parser.add_argument("--prompt-length", type=positive_int, default=2048, help="tokens of every prompt")
    parser.add_argument("--completion-length", type=positive_int, default=256,
                        help="longest completion (each is uniform in [half, all] tokens)")
    parser.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first (the first one is "
                        "the fidelity step)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed steps")
    parser.add_argument("--optim", choices=OPTIMIZERS, default=OPTIMIZERS[0], help="TRL's optimizer (default: TRL's)")
    parser.add_argument("--lr", type=positive_float, default=1e-6, help="learning rate (TRL's default)")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="TRL's gradient_checkpointing (default on, as TRL's), HARTS's recompute")
    parser.add_argument("--router-aux-loss-coef", type=non_negative_float, default=None,
                        help="TRL's router_aux_loss_coef in both trainers (default: the model config's, as TRL's; 0 "
                        "turns the load-balancing loss off)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="the trainers' compute: bf16 autocast (TRL's "
                        "bf16, HARTS's dtype) or fp32; the parameters stay fp32 (default: bf16 on CUDA, fp32 on the "
                        "CPU)")
    parser.add_argument("--fp32-reference", action=argparse.BooleanOptionalAction, default=None,
                        help="a third, untimed run of stock TRL in IEEE fp32 (no autocast, no TF32) from the same "
                        "weights and batch, and each trainer's fidelity figures against it (default: on with bf16; "
                        "needs --dtype bf16)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="model weights and batch")
    parser.add_argument("--out", type=records_file, default=None,
                        help="JSON records (default reports/raw/trl/MODEL-DEVICE.json)")
    parser.set_defaults(run=run, files=lambda a: ([output_path(a)], []))


def output_path(args: argparse.Namespace) -> str:
    """`--out`, else reports/raw/trl/MODEL-DEVICE.json (MODEL-DEVICE-DTYPE.json for a dtype not the device's
    default)."""
    dtype = "" if args.dtype in (None, default_dtype(args.device)) else f"-{args.dtype}"
    return args.out or f"reports/raw/trl/{Path(args.model).stem}-{args.device}{dtype}.json"


def default_dtype(device: str) -> str:
    return "bf16" if device == "cuda" else "fp32"


def resolved_precision(args: argparse.Namespace) -> tuple[str, bool]:
    """(the trainers' dtype, whether the fp32 reference runs) of `args`; ValueError for a reference asked of fp32
    trainers (stock TRL's own run is then the fp32 run)."""
    dtype = args.dtype or default_dtype(args.device)
    if args.fp32_reference and dtype == "fp32":
        raise ValueError("--fp32-reference: the trainers run fp32 (--dtype fp32), so stock TRL's own run is the fp32 "
                         "run: use --dtype bf16")
    return dtype, dtype != "fp32" if args.fp32_reference is None else args.fp32_reference


def run(args: argparse.Namespace) -> int:
    """`harts bench trl`: 0 when both trainers were measured, 1 when one failed."""
    import torch

    from harts.config import config_to_dict
    from harts.extras import require
    from harts.model.config import load_model_config
    from harts.tracking.records import Terminated, error_message, make_record, sigterm_raises, write_records

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    trl = require("trl", "harts bench trl")
    import transformers  # a dependency of trl

    dtype, reference = resolved_precision(args)
    config = trl_form(load_model_config(args.model))
    if config.vocab_size <= FIRST_TOKEN:
        raise ValueError(f"--model {args.model}: vocab_size {config.vocab_size} leaves no token besides the "
                         f"tokenizer's {FIRST_TOKEN} special ones")
    coefficient = router_aux_loss_coef(config, args.router_aux_loss_coef)
    if coefficient and config.moe.score_function != "softmax":
        raise ValueError(f"--router-aux-loss-coef {coefficient}: {config.name} routes with {config.moe.score_function}"
                         " (HARTSGRPOTrainer reads transformers' softmax load-balancing loss): set 0")
    out = Path(output_path(args))
    record_config = {
        "model": config.name, "model_config": config_to_dict(config), "device": args.device, "dtype": dtype,
        "fp32_reference": reference, "params": "fp32", "prompts": args.prompts, "generations": args.generations,
        "prompt_length": args.prompt_length, "completion_length": args.completion_length, "warmup": args.warmup,
        "repeats": args.repeats, "optim": args.optim, "lr": args.lr, "gradient_checkpointing":
        args.gradient_checkpointing, "loss_type": "dapo", "router_aux_loss_coef": coefficient,
        "router_aux_loss_coef_from": "model config" if args.router_aux_loss_coef is None else "--router-aux-loss-coef",
        "seed": args.seed,
        "hf_class": hf_class(config), "trl": trl.__version__,
        "transformers": transformers.__version__,
    }
    with sigterm_raises():
        try:
            results = measure(args, config, dtype, reference, coefficient, lambda partial: write_records(
                [make_record("trl", record_config, partial)], out))
            record = make_record("trl", record_config, results)
        except Terminated as error:
            record = make_record("trl", record_config, error=error_message(error))
        write_records([record], out)
    logger.info(f"wrote {out}")
    runs = TRAINERS + ((REFERENCE,) if reference else ())
    return 0 if "results" in record and all("error" not in record["results"][name] for name in runs) else 1


def trl_form(config):
    """`config` as the transformers model of its Hugging Face layout holds it (`harts.model.hf.check_exportable`):
    for the Kimi-Linear layout the KDA output gate of rank head_dim without bias, the NoPE MLA and the latent norm's
    eps; no MTP layers (transformers' models hold none, and TRL's loss has no MTP term); chunks of 64 as fla's
    `chunk_kda` and `chunk_gated_delta_rule` (which transformers' models call on CUDA; HARTS's fla kernels take 32 or
    64). ValueError naming what the layout cannot express."""
    from dataclasses import replace

    from harts.model.hf import check_exportable, kimi

    form = replace(config, mtp=None)
    if config.hf_layout == kimi.MODEL_TYPE:
        form = replace(form, kda=replace(config.kda, gate_rank=config.kda.head_dim, output_gate_bias=False),
                       mla=replace(config.mla, use_rope=False, latent_norm_eps=kimi.LATENT_NORM_EPS))
    if form.kda is not None:
        form = replace(form, kda=replace(form.kda, chunk_size=64))
    if form.gdn is not None:
        form = replace(form, gdn=replace(form.gdn, chunk_size=64))
    check_exportable(form)
    return form


def router_aux_loss_coef(config, given: float | None) -> float:
    """The router_aux_loss_coef TRL 1.16 runs a transformers model of `config`'s layout with: `given`, or when None the
    coefficient its transformers config declares (0 where it declares none)."""
    import transformers

    from harts.model.hf import hf_config_from_model

    if given is not None:
        return given
    hf_config = transformers.AutoConfig.for_model(**hf_config_from_model(config)).get_text_config()
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0))


def hf_class(config) -> str:
    """The transformers class that loads a checkpoint of `config`'s Hugging Face layout."""
    from harts.model.hf_modules import ARCHITECTURES

    return ARCHITECTURES[config.hf_layout].CLASS


def grpo_batch(*, num_prompts: int, num_generations: int, prompt_length: int, completion_length: int,
               vocab_size: int, seed: int) -> dict:
    """TRL's generation batch (what `_generate_and_score_completions` returns) of random GRPO groups: each prompt
    repeated for its `num_generations` completions (rows of a group adjacent), prompts unpadded, completions
    right-padded with PAD, advantages (r - mean) / (std + 1e-4) of uniform rewards within each group."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    num_rows = num_prompts * num_generations
    prompts = np.repeat(rng.integers(FIRST_TOKEN, vocab_size, (num_prompts, prompt_length)), num_generations, axis=0)
    lengths = rng.integers((completion_length + 1) // 2, completion_length + 1, num_rows)
    completion_mask = np.arange(completion_length)[None, :] < lengths[:, None]
    completions = np.where(completion_mask, rng.integers(FIRST_TOKEN, vocab_size, (num_rows, completion_length)), PAD)
    rewards = torch.from_numpy(rng.random((num_prompts, num_generations)))
    # torch's std is TRL's (unbiased); a group of one has none.
    std = rewards.std(dim=1, keepdim=True) if num_generations > 1 else torch.zeros(num_prompts, 1)
    advantages = ((rewards - rewards.mean(dim=1, keepdim=True)) / (std + 1e-4)).flatten().float()
    completion_mask_t = torch.from_numpy(completion_mask).long()
    return {
        "prompt_ids": torch.from_numpy(prompts),
        "prompt_mask": torch.ones(num_rows, prompt_length, dtype=torch.long),
        "completion_ids": torch.from_numpy(completions),
        "completion_mask": completion_mask_t,
        "advantages": advantages,
        "num_items_in_batch": completion_mask_t.sum(),
    }


class FixedBatch:
    """Mixed into a GRPOTrainer: every generation returns `bench_batch` (no generation, no reward)."""

    bench_batch: dict

    def _generate_and_score_completions(self, inputs):
        return dict(self.bench_batch)


class StepTimes:
    """Mixed into a transformers `TrainerCallback`: each optimizer step's seconds (`on_step_begin` to `on_step_end`,
    synchronised on CUDA), and the first step's gradients and parameters copied to the CPU outside the timing."""

    def __init__(self, total_steps: int, label: str) -> None:
        self.total_steps, self.label = total_steps, label
        self.seconds: list[float] = []
        self.first_gradients: dict | None = None
        self.first_parameters: dict | None = None
        self._start = 0.0

    @staticmethod
    def _synchronize() -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._synchronize()
        self._start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.first_gradients = {n: _cpu_copy(p.grad) for n, p in model.named_parameters() if p.grad is not None}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._synchronize()
        self.seconds.append(time.perf_counter() - self._start)
        if state.global_step == 1:
            self.first_parameters = {n: _cpu_copy(p) for n, p in model.named_parameters()}
        logger.info(f"{self.label}: step {state.global_step}/{self.total_steps} {self.seconds[-1]:.3f} s")


def _cpu_copy(tensor):
    """An fp32 copy on the CPU (never a view of a CPU tensor that later steps update in place)."""
    import torch

    return tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)


def measure(args: argparse.Namespace, config, dtype: str, reference: bool, coefficient: float, progress) -> dict:
    """Both trainers on the batch (module docstring) in `dtype` with router_aux_loss_coef `coefficient` (`args`' or
    the model config's), then with `reference` the untimed fp32 run of stock TRL: {"rows", "trl", "harts",
    "fp32_precision", "speedup", "fidelity"} and with `reference` {"fp32_reference", "fidelity_vs_fp32"}, a run that
    failed holding {"error"}; `progress(results)` is called with the results so far after each run."""
    import tempfile

    from harts.model.hf import save_hf_checkpoint
    from harts.model.model import HybridModel

    batch = grpo_batch(num_prompts=args.prompts, num_generations=args.generations, prompt_length=args.prompt_length,
                       completion_length=args.completion_length, vocab_size=config.vocab_size, seed=args.seed)
    completion_mask = batch["completion_mask"].bool()
    num_rows = batch["prompt_ids"].size(0)
    rows = {"padded": num_rows * (args.prompt_length + args.completion_length),
            "tokens": num_rows * args.prompt_length + int(batch["num_items_in_batch"])}
    results: dict[str, Any] = {"rows": rows, "fp32_precision": fp32_precision()}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="harts-bench-trl-") as root:
        logger.info(f"trl bench: {config.name} ({hf_class(config)}): initialising and saving a Hugging Face "
                    "checkpoint")
        model = HybridModel(config)
        model.init_weights(args.seed)
        checkpoint = Path(root) / "model"
        save_hf_checkpoint(model, checkpoint)
        del model
        for name in TRAINERS:
            run = _guarded(name, results, lambda: _train(name, args, dtype, coefficient, checkpoint, batch,
                                                         Path(root) / name))
            if run is not None:
                runs[name] = run
                results[name] = _summary(run, args.warmup)
            progress(dict(results))
        if reference:  # after the timed runs, which it must not disturb (compiled kernels, the allocator)
            run = _guarded(REFERENCE, results, lambda: _fp32_reference(args, coefficient, checkpoint, batch,
                                                                        Path(root) / REFERENCE))
            if run is not None:
                runs[REFERENCE] = run
                results[REFERENCE] = {"first_loss": run["losses"][0], "peak_memory_gib": run["peak_memory_gib"],
                                      "ran": run["ran"], "fp32_precision": run["fp32_precision"]}
                results["fidelity_vs_fp32"] = {name: fidelity(run, runs[name], completion_mask)
                                               for name in TRAINERS if name in runs}
            progress(dict(results))
    if all(name in runs for name in TRAINERS):
        rows["compact"] = runs["harts"]["rows_per_step"]
        results["speedup"] = results["trl"]["step_seconds"] / results["harts"]["step_seconds"]
        results["fidelity"] = fidelity(runs["trl"], runs["harts"], completion_mask)
        logger.info(f"trl bench: TRL {results['trl']['step_seconds']:.4f} s, HARTS "
                    f"{results['harts']['step_seconds']:.4f} s per step: {results['speedup']:.2f}x; rows padded "
                    f"{rows['padded']:,}, tokens {rows['tokens']:,}, compact {rows['compact']:,}; "
                    + ", ".join(f"{key} {value:.2e}" for key, value in results["fidelity"].items()))
    against = results.get("fidelity_vs_fp32", {})
    if against:
        names = [name for name in TRAINERS if name in against]
        logger.info(f"trl bench: against fp32, {' / '.join(LABELS[name] for name in names)} {dtype}: "
                    + ", ".join(f"{key} " + " / ".join(f"{against[name][key]:.2e}" for name in names)
                                for key in against[names[0]]))
    return results


def _guarded(name: str, results: dict, compute) -> dict | None:
    """`compute()`, or None with {"error"} as `results[name]` when it raises (the other runs still run); the
    memory it held is freed either way."""
    import gc
    import traceback

    import torch

    from harts.tracking.records import error_message

    try:
        return compute()
    except Exception as error:  # noqa: BLE001 - a failing run is an error entry, the others still run
        logger.info(f"trl bench: {name} failed:\n{traceback.format_exc().rstrip()}")
        results[name] = {"error": error_message(error)}
        return None
    finally:
        gc.collect()  # a failed trainer's frames and the trainer's reference cycles hold the GPU memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _fp32_reference(args: argparse.Namespace, coefficient: float, checkpoint: Path, batch: dict,
                    output_dir: Path) -> dict:
    """Stock TRL's run in IEEE fp32 (`ieee_fp32`), with the settings it ran under."""
    with ieee_fp32():
        run = _train("trl", args, "fp32", coefficient, checkpoint, batch, output_dir, reference=True)
        run["fp32_precision"] = fp32_precision()
    return run


def _precision_backend(name: str):
    import torch

    backend = torch.backends
    for part in name.split("."):
        backend = getattr(backend, part)
    return backend


def fp32_precision() -> dict:
    """The fp32 math settings in force: torch.backends' `fp32_precision` (the parent of all, "backends") and each
    of PRECISION_BACKENDS' (none: the parent's; cuDNN's default to tf32), and Triton's TRITON_F32_DEFAULT (None:
    unset, tf32 on NVIDIA GPUs)."""
    import os

    import torch

    return {"backends": torch.backends.fp32_precision,
            **{name: _precision_backend(name).fp32_precision for name in PRECISION_BACKENDS},
            "triton_f32_default": os.environ.get(TRITON_F32_DEFAULT)}


@contextlib.contextmanager
def ieee_fp32():
    """IEEE fp32 inside: every one of PRECISION_BACKENDS (cuBLAS's matmuls, cuDNN's and oneDNN's convolutions and
    RNNs: no TF32 or bf16 passes) and Triton's fp32 dots of kernels compiled inside (fla's); restored after. A
    Triton kernel compiled earlier in the process for the same argument types keeps its precision."""
    import os

    saved = {name: _precision_backend(name).fp32_precision for name in PRECISION_BACKENDS}
    saved_triton = os.environ.get(TRITON_F32_DEFAULT)
    try:
        for name in PRECISION_BACKENDS:
            _precision_backend(name).fp32_precision = "ieee"
        os.environ[TRITON_F32_DEFAULT] = "ieee"
        yield
    finally:
        for name, value in saved.items():
            _precision_backend(name).fp32_precision = value
        if saved_triton is None:
            os.environ.pop(TRITON_F32_DEFAULT, None)
        else:
            os.environ[TRITON_F32_DEFAULT] = saved_triton


def _tokenizer():
    """A word-level tokenizer of the special tokens and one word (TRL's trainer needs a processing class; nothing
    is tokenized or decoded, since generation is not run)."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK, "a": FIRST_TOKEN}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                                pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _train(name: str, args: argparse.Namespace, dtype: str, coefficient: float, checkpoint: Path, batch: dict,
           output_dir: Path, *, reference: bool = False) -> dict:
    """One trainer's run: its step seconds and losses, first gradients and parameters (and the initial ones for
    TRL), log-probs and entropies of the batch, what it ran, HARTS's rows per step, peak memory on CUDA; with
    `reference` (stock TRL in fp32), one step only, which is all the fidelity reads. The trainer resolves
    router_aux_loss_coef itself from `args` (None: the model config's) and must find `coefficient`."""
    import dataclasses
    import importlib.util

    import datasets
    import torch
    import transformers

    import trl
    from harts.integrations.trl import HARTSGRPOTrainer

    base = HARTSGRPOTrainer if name == "harts" else trl.GRPOTrainer
    assert not reference or (name, dtype) == ("trl", "fp32"), "the reference is stock TRL in fp32"
    label = "HARTS GRPOTrainer" if name == "harts" else "TRL GRPOTrainer, fp32 reference" if reference else (
        "TRL GRPOTrainer")
    total_steps = 1 if reference else args.warmup + args.repeats
    logger.info(f"trl bench: {label}: loading the checkpoint")
    device = torch.device(args.device)
    # use_kernels=False: with the `kernels` package installed, transformers >= 5.2x fetches its linear-attention
    # kernels from the Hub by default (none offline, and not the ones HARTS runs); off, it calls the installed fla.
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                              use_kernels=False).to(device)
    initial = {n: _cpu_copy(p) for n, p in model.named_parameters()} if name == "trl" else None
    # transformers >= 5.25 names TRL's gradient_checkpointing activation_checkpointing (the old name warns).
    fields = {field.name for field in dataclasses.fields(trl.GRPOConfig)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    grpo_args = trl.GRPOConfig(
        output_dir=str(output_dir), num_generations=args.generations,
        per_device_train_batch_size=batch["prompt_ids"].size(0), max_completion_length=args.completion_length,
        max_steps=total_steps, learning_rate=args.lr, optim=args.optim, lr_scheduler_type="constant",
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=args.seed,
        use_cpu=device.type == "cpu", bf16=dtype == "bf16", router_aux_loss_coef=args.router_aux_loss_coef,
        **{checkpointing: args.gradient_checkpointing},
    )
    timer = type("StepTimer", (StepTimes, transformers.TrainerCallback), {})(total_steps, label)
    trainer = type(f"Bench{base.__name__}", (FixedBatch, base), {})(
        model=model, reward_funcs=_no_reward, args=grpo_args, processing_class=_tokenizer(),
        train_dataset=datasets.Dataset.from_dict({"prompt": ["a"] * args.prompts}), callbacks=[timer],
    )
    trainer.remove_callback(transformers.PrinterCallback)
    assert trainer.router_aux_loss_coef == coefficient, (trainer.router_aux_loss_coef, coefficient)
    trainer.bench_batch = {key: value.to(device) for key, value in batch.items()}
    logger.info(f"trl bench: {label}: log-probs of the batch")
    input_ids = torch.cat([trainer.bench_batch["prompt_ids"], trainer.bench_batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([trainer.bench_batch["prompt_mask"], trainer.bench_batch["completion_mask"]], dim=1)
    with torch.no_grad():
        log_probs, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, args.completion_length, compute_entropy=True)
    rows_before = trainer.harts_counts["rows"] if name == "harts" else 0
    logger.info(f"trl bench: {label}: {total_steps} steps ({0 if reference else args.warmup} warm-up)")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(timer.seconds) == total_steps == len(losses), (len(timer.seconds), len(losses), total_steps)
    if name == "harts":
        knobs = ("execution", "dtype", "recompute", "attention_backend", "kda_backend", "experts_backend")
        ran = {knob: getattr(trainer.harts_config, knob) for knob in knobs}
    else:  # what transformers' model runs: its KDA and conv fall back to PyTorch without these packages on CUDA
        ran = {"bf16": trainer.args.bf16, "attn_implementation": getattr(model.config, "_attn_implementation", None),
               "experts_implementation": getattr(model.config, "_experts_implementation", None),
               **{f"{package}_installed": importlib.util.find_spec(package) is not None
                  for package in ("fla", "causal_conv1d")}}
    run = {
        "seconds": timer.seconds, "losses": losses, "gradients": timer.first_gradients,
        "parameters": timer.first_parameters, "initial": initial, "log_probs": log_probs.float().cpu(),
        "entropy": entropy.float().cpu(), "ran": ran,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    if name == "harts":
        rows, remainder = divmod(trainer.harts_counts["rows"] - rows_before, total_steps)
        assert remainder == 0, "every step computes the same batch"
        run["rows_per_step"] = rows
    return run


def _no_reward(completions, **kwargs):
    raise AssertionError("harts bench trl: the reward is never computed (the batch carries its advantages)")


def _summary(run: dict, warmup: int) -> dict:
    import statistics

    timed = run["seconds"][warmup:]
    summary = {"step_seconds": statistics.median(timed), "step_seconds_min": min(timed),
               "step_seconds_max": max(timed), "step_seconds_all": run["seconds"], "first_loss": run["losses"][0],
               "losses": run["losses"], "peak_memory_gib": run["peak_memory_gib"], "ran": run["ran"]}
    if "rows_per_step" in run:
        summary["rows_per_step"] = run["rows_per_step"]
    return summary


def fidelity(reference: dict, run: dict, completion_mask) -> dict:
    """`run` against `reference` from the same weights and batch (HARTS against TRL; each trainer against the fp32
    run): log-prob and entropy (completion tokens), first loss, first gradients (relative to the reference's), and
    parameters after the first step, beside the largest change the reference's step made."""
    import torch

    def masked_max(a, b) -> float:
        return float(torch.where(completion_mask, (a - b).abs(), 0.0).max())

    assert set(run["gradients"]) == set(reference["gradients"]), "the trainers' models differ"
    gradient_error = sum(float((run["gradients"][n] - g).square().sum()) for n, g in reference["gradients"].items())
    gradient_norm = sum(float(g.square().sum()) for g in reference["gradients"].values())
    return {
        "log_prob_max_abs_difference": masked_max(run["log_probs"], reference["log_probs"]),
        "entropy_max_abs_difference": masked_max(run["entropy"], reference["entropy"]),
        "first_loss_abs_difference": abs(run["losses"][0] - reference["losses"][0]),
        "gradient_relative_difference": (gradient_error / gradient_norm) ** 0.5 if gradient_norm else gradient_error,
        "parameter_max_abs_difference": max(float((run["parameters"][n] - p).abs().max())
                                            for n, p in reference["parameters"].items()),
        "parameter_max_change": max(float((reference["parameters"][n] - p).abs().max())
                                    for n, p in reference["initial"].items()),
    }
