"""harts.integrations.trl: `HARTSGRPOTrainer` trains exactly as `trl.GRPOTrainer` does, computing fewer rows.

End to end on the CPU: a kimi-tiny Kimi-Linear checkpoint (HARTS's init, exported) that transformers loads, a
character tokenizer, 8 prompts of 5-11 tokens, 4 completions each of at most 8 tokens, a toy reward (the share
of completion tokens below 128), SGD (Adam would turn fp32 noise in near-zero gradients into whole learning-rate
steps). Each case runs 3 GRPO steps of stock TRL and of the HARTS trainer from the same seed: the completions
(recorded by the reward function) must be identical, the logged losses equal to fp32 rounding (1e-6 + 1e-5
relative), every metric of every micro-batch too (the same names, `harts/` counts and wall time apart; NaN where
TRL's is), and every parameter equal within 1e-4 of the largest parameter change plus 1e-6 of its own size (a few
fp32 ulps of rounding per update); HARTS computes fewer rows than TRL's padded forwards (the group's prompt once).
The cases cover gradient accumulation with TRL's per-step normalisers, reused generations (old log-probs from
HARTS, off-policy ratios), the KL term (reference log-probs from HARTS on TRL's reference model), temperature, the
entropy bonus and every loss type, with TRL's default gradient checkpointing (HARTS's recomputation, whose backward
runs blocks again from the bound model) and without.
gdn-tiny (Qwen3-Next's layout) runs every case at TRL's default router_aux_loss_coef, its config's 0.001: TRL adds
transformers' load-balancing loss, HARTS its pooled reading, and the logged `aux_loss` of every step must agree
within 1e-6 relative (a shared prompt counted once per group instead of once per completion is off by ~2e-4).
The off-policy cases (every loss type, kimi-tiny) add noise to the old log-probs and a tool mask, so that TRL's
clip, CISPO and VESPO metrics are away from their on-policy values (tests/integrations/test_trl_metrics.py checks
the same metrics against TRL's `_compute_loss` on set log-probs, edge cases and reductions over processes included).

The HARTS reading of TRL's config (`grpo_config_from_trl`) equals the readings tests/objective/test_losses_readings
checks against TRL's own loss function. Without trl (pip install 'harts[trl]') the module is skipped.
"""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)

trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'harts[trl]')")
datasets = pytest.importorskip("datasets", reason="datasets (a dependency of trl) is not installed")

import transformers  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from harts.integrations.trl import HARTSGRPOTrainer, grpo_config_from_trl, unsupported_options  # noqa: E402
from harts.model.config import load_model_config  # noqa: E402
from harts.model.hf import save_hf_checkpoint  # noqa: E402
from harts.model.model import HybridModel  # noqa: E402
from tests.objective.test_losses_readings import MAX_COMPLETION_LENGTH, READINGS  # noqa: E402

NUM_PROMPTS, NUM_GENERATIONS, COMPLETION_TOKENS, STEPS = 4, 4, 8, 3
FIRST_CHARACTER = 0x4E00
"""Token t >= 3 is the character FIRST_CHARACTER + t - 3: one character, one token, all 256 ids decodable."""


MODELS = ("kimi-tiny", "bailing-tiny", "gdn-tiny")
"""Shipped model configs of each Hugging Face architecture the trainer runs: Kimi-Linear, BailingHybrid (Ling-3),
Qwen3-Next (the GDN family: Qwen3.5-MoE's module tree differs only in its GDN input projections,
tests/model/test_hf_modules.py)."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The checkpoint of a model of MODELS, made once."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = make_checkpoint(tmp_path_factory.mktemp("trl") / name, name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints("kimi-tiny")


AUX_LOSS_MODELS = ("gdn-tiny",)
"""Models whose Hugging Face config declares router_aux_loss_coef (Qwen3-Next's 0.001), which TRL adds by default as
transformers' load-balancing loss: every case of theirs runs with it, and both trainers log the same `aux_loss`."""


def make_checkpoint(path, name="kimi-tiny"):
    """The checkpoint of the shipped model config `name` (HARTS's init, exported in its Hugging Face layout) at
    `path` (a new directory) with a character tokenizer beside it."""
    model = HybridModel(load_model_config(name))
    model.init_weights(seed=3)
    save_hf_checkpoint(model, path)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {chr(FIRST_CHARACTER + i): 3 + i for i in range(253)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                         unk_token="<unk>").save_pretrained(path)
    return path


def prompts():
    rng = np.random.default_rng(0)
    return ["".join(chr(FIRST_CHARACTER + int(t)) for t in rng.integers(0, 253, int(rng.integers(5, 12))))
            for _ in range(NUM_PROMPTS)]


def train(trainer_class, checkpoint, output_dir, settings, steps=STEPS, old_noise=0.0):
    """(trainer, final parameters, completions seen by the reward, rows the log-prob computations ran); with
    `old_noise`, the old log-probs of each generation batch are off by seeded noise of that scale
    (`off_policy`). The trainer's `logged_metrics` holds what each `log` call averaged (`record_metrics`)."""
    seen, rows = [], []

    def reward(completions, completion_ids, **kwargs):
        seen.append([list(ids) for ids in completion_ids])
        return [sum(t < 128 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    reward.__name__ = "low_tokens"
    settings = {"per_device_train_batch_size": NUM_PROMPTS * NUM_GENERATIONS // settings.get(
        "gradient_accumulation_steps", 1), **settings}
    args = trl.GRPOConfig(
        output_dir=str(output_dir), num_generations=NUM_GENERATIONS, max_completion_length=COMPLETION_TOKENS,
        max_steps=steps, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
        report_to="none", seed=42, save_strategy="no", use_cpu=True, bf16=False, **settings,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    trainer = trainer_class(
        model=model, reward_funcs=reward, args=args, processing_class=transformers.AutoTokenizer.from_pretrained(
            checkpoint), train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}),
    )
    harts = issubclass(trainer_class, HARTSGRPOTrainer)
    record_metrics(trainer)
    if old_noise:
        off_policy(trainer, old_noise)
    if not harts:  # the rows TRL's padded forwards compute
        compute = trainer._get_per_token_logps_and_entropies

        def counted(model, input_ids, *args, **kwargs):
            rows.append(input_ids.numel())
            return compute(model, input_ids, *args, **kwargs)

        trainer._get_per_token_logps_and_entropies = counted
    torch.manual_seed(0)
    trainer.train()
    if harts:
        rows = [trainer.harts_counts["rows"]]
    return trainer, {n: p.detach().clone() for n, p in model.named_parameters()}, seen, sum(rows)


CASES = {
    # name: (GRPOConfig settings, steps); the loss types after the first four run a generation and its reuse.
    "dapo": ({}, STEPS),
    "dapo-no-checkpointing": (dict(gradient_checkpointing=False), STEPS),
    "dapo-accumulate-reuse-kl": (dict(gradient_accumulation_steps=2, num_iterations=2, beta=0.04, temperature=0.8),
                                 STEPS),
    "grpo-accumulate-entropy": (dict(loss_type="grpo", gradient_accumulation_steps=2, entropy_coef=0.01), STEPS),
    "bnpo-accumulate": (dict(loss_type="bnpo", gradient_accumulation_steps=2), STEPS),
    "dr_grpo": (dict(loss_type="dr_grpo", num_iterations=2), 2),
    "cispo": (dict(loss_type="cispo", epsilon_high=5.0, num_iterations=2), 2),
    "sapo": (dict(loss_type="sapo", num_iterations=2), 2),
    "luspo": (dict(loss_type="luspo", importance_sampling_level="sequence", num_iterations=2), 2),
    "vespo": (dict(loss_type="vespo", num_iterations=2), 2),
    "gspo-delta": (dict(importance_sampling_level="sequence", delta=1.5, epsilon_high=0.28, num_iterations=2), 2),
}


def record_metrics(trainer) -> None:
    """Has `trainer.logged_metrics` receive, at each `log` call, the metrics it averages: {name: the values of each
    micro-batch (or step)}."""
    trainer.logged_metrics = []
    log = trainer.log

    def recording(logs, *args, **kwargs):
        mode = "train" if trainer.model.training else "eval"
        trainer.logged_metrics.append({name: list(values) for name, values in trainer._metrics[mode].items()})
        return log(logs, *args, **kwargs)

    trainer.log = recording


def off_policy(trainer, scale: float) -> None:
    """Each generation batch off-policy, with tool tokens: seeded N(0, scale²) noise added to its old log-probs, so
    that the ratios clip on both sides from the first step, and a tool mask (TRL's, of multi-turn tool calls) that
    leaves a quarter of the tokens and every token of the first completion out of the loss (the toy model rarely
    ends a completion early, so the loss mask would be all ones). The n-th batch of a process is changed alike in
    every trainer."""
    generate = trainer._generate_and_score_completions
    batches = itertools.count()

    def changed(*args, **kwargs):
        output = generate(*args, **kwargs)
        old = output["old_per_token_logps"]
        generator = torch.Generator().manual_seed(1000 * trainer.accelerator.process_index + next(batches))
        output["old_per_token_logps"] = old + scale * torch.randn(old.shape, generator=generator).to(old)
        tool_mask = (torch.rand(old.shape, generator=generator) > 0.25).to(output["completion_mask"])
        tool_mask[0] = 0
        output["tool_mask"] = tool_mask if "tool_mask" not in output else tool_mask * output["tool_mask"]
        return output

    trainer._generate_and_score_completions = changed


UNCOMPARED = ("step_time",)
"""Logged metrics that differ between runs (wall time); HARTS's own `harts/` counts are left out too."""


def compared_metrics(trainer) -> list[dict]:
    """What each `log` call of the trainer averaged, but UNCOMPARED and `harts/` metrics."""
    return [{name: values for name, values in logged.items()
             if name not in UNCOMPARED and not name.startswith("harts/")} for logged in trainer.logged_metrics]


def assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    """The same metrics at every log call, each micro-batch's value within test_trl's tolerance (NaN where TRL's)."""
    assert len(got) == len(want)
    for step, (harts, stock) in enumerate(zip(got, want)):
        assert set(harts) == set(stock), (step, sorted(set(harts) ^ set(stock)))
        for name, values in stock.items():
            assert len(harts[name]) == len(values) and all(
                (g != g and w != w) or abs(g - w) <= 1e-6 + 1e-5 * abs(w) for g, w in zip(harts[name], values)), (
                step, name, harts[name], values)


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def aux_losses(trainer):
    """The logged router aux loss of each step (the mean over its micro-batches, before the coefficient)."""
    return [entry["aux_loss"] for entry in trainer.state.log_history if "aux_loss" in entry]


def run_case(checkpoint, output_dir, case):
    """Both trainers on one case: {trainer name: (trainer, parameters, completions, rows)}."""
    settings, steps = CASES[case]
    return {name: train(trainer_class, checkpoint, output_dir / name, settings, steps)
            for name, trainer_class in (("trl", trl.GRPOTrainer), ("harts", HARTSGRPOTrainer))}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", CASES)
def test_harts_trainer_trains_as_trl(checkpoints, tmp_path, case, model):
    checkpoint = checkpoints(model)
    runs = run_case(checkpoint, tmp_path, case)
    (stock, stock_parameters, stock_completions, stock_rows) = runs["trl"]
    (harts, harts_parameters, harts_completions, harts_rows) = runs["harts"]
    settings, steps = CASES[case]
    assert harts_completions == stock_completions
    assert len(stock_completions) == (steps + 1) // 2 if settings.get("num_iterations", 1) > 1 else steps
    assert len(losses(stock)) == steps
    for got, want in zip(losses(harts), losses(stock), strict=True):
        assert abs(got - want) <= 1e-6 + 1e-5 * abs(want), (losses(harts), losses(stock))
    assert_same_metrics(compared_metrics(harts), compared_metrics(stock))
    initial = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    change = max(float((stock_parameters[n] - p.detach()).abs().max()) for n, p in initial.named_parameters())
    assert change > 1e-3
    for name, want in stock_parameters.items():
        # The parameters differ by the gradients' fp32 rounding (a 1e-4 share of the step) and by the rounding
        # of each update onto parameters of size ~1-5 (a few ulps).
        assert torch.allclose(harts_parameters[name], want, rtol=1e-6, atol=1e-4 * change), name
    if model in AUX_LOSS_MODELS:
        assert stock.aux_loss_enabled and harts.aux_loss_enabled and stock.router_aux_loss_coef == 0.001
        stock_aux, harts_aux = aux_losses(stock), aux_losses(harts)
        assert len(stock_aux) == steps and all(x > 0 for x in stock_aux)
        for got, want in zip(harts_aux, stock_aux, strict=True):
            assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (harts_aux, stock_aux)
    assert harts.harts_counts["padded_rows"] == stock_rows
    assert harts_rows < 0.75 * harts.harts_counts["tokens"] < 0.75 * stock_rows, (harts.harts_counts, stock_rows)


OFF_POLICY_CASES = {
    # name: GRPOConfig settings, each with the KL term and the entropy bonus (TRL logs policy_loss, entropy_coef),
    # a reused generation, old log-probs off by N(0, OLD_NOISE²) and a tool mask (`off_policy`).
    "dapo-accumulate": dict(gradient_accumulation_steps=2),
    "grpo-accumulate": dict(loss_type="grpo", gradient_accumulation_steps=2),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.05),
    "vespo": dict(loss_type="vespo"),
    "gspo-delta": dict(importance_sampling_level="sequence", epsilon=0.05, delta=1.08),
}
OLD_NOISE = 0.5


@pytest.mark.parametrize("case", OFF_POLICY_CASES)
def test_harts_trainer_logs_trls_metrics_off_policy(checkpoint, tmp_path, case):
    """Every metric both trainers log at each micro-batch (TRL's `_compute_loss` ones: entropy, kl, policy_loss,
    entropy_coef and each loss type's own) agrees within the losses' tolerance, with ratios that clip on both
    sides: the clip fractions are exact counts unless a ratio lies within fp32 rounding of a clip bound (then off
    by a token of the batch, > 1e-3), the other metrics fp32 sums of the log-probs' functions."""
    settings = dict(num_iterations=2, beta=0.04, entropy_coef=0.01, **OFF_POLICY_CASES[case])
    runs = {name: train(trainer_class, checkpoint, tmp_path / name, settings, 2, old_noise=OLD_NOISE)
            for name, trainer_class in (("trl", trl.GRPOTrainer), ("harts", HARTSGRPOTrainer))}
    stock, harts = runs["trl"][0], runs["harts"][0]
    assert runs["harts"][2] == runs["trl"][2]
    want = compared_metrics(stock)
    assert_same_metrics(compared_metrics(harts), want)
    values = {name: [v for logged in want for v in logged.get(name, [])] for name in set().union(*want)}
    assert {"kl", "entropy", "policy_loss", "entropy_coef"} <= set(values)
    loss_type = settings.get("loss_type", "dapo")
    if loss_type in ("dapo", "grpo", "dr_grpo", "bnpo", "luspo"):
        assert max(values["clip_ratio/low_mean"]) > 0 and max(values["clip_ratio/high_mean"]) > 0, values
        assert max(values["clip_ratio/high_max"]) > 0
    if loss_type == "cispo":
        assert max(values["cispo_clip_ratio"]) > 0, values
    if loss_type == "vespo":
        assert all(0 < v < 1 for v in values["vespo/phi_seq_mean"]), values


@pytest.mark.parametrize("name", [name for name, reading in READINGS.items() if reading.library == "trl"])
def test_config_reading_is_the_losses_reading(name):
    """`grpo_config_from_trl` gives, for each TRL setting, the GRPOConfig that the loss readings check against
    TRL's own `_compute_loss`."""
    reading = READINGS[name]
    settings = {k: v for k, v in reading.settings.items() if k != "num_items_in_batch"}
    args = trl.GRPOConfig(output_dir="/tmp/harts-trl-unused", max_completion_length=MAX_COMPLETION_LENGTH,
                          report_to="none", use_cpu=True, bf16=False, **settings)
    assert grpo_config_from_trl(args) == reading.harts


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_gradient_checkpointing_is_harts_recompute(checkpoint, tmp_path, checkpointing):
    args = trl.GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=checkpointing, report_to="none",
                          use_cpu=True, bf16=False)
    trainer = HARTSGRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(checkpoint),
                               reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
                               processing_class=transformers.AutoTokenizer.from_pretrained(checkpoint),
                               train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}))
    assert trainer.harts_config.recompute is checkpointing


def test_the_pooled_balance_coefficient_is_trls(checkpoint, tmp_path):
    """TRL's router_aux_loss_coef adds the pooled load-balancing loss: a harts_config's pooled_balance_coeff (which
    `api.policy_loss` would add too) is replaced by 0, as its other loss fields are by TRL's reading."""
    from harts import api

    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    given = dataclasses.replace(api.device_config("cpu"), pooled_balance_coeff=0.5, recompute=True)
    trainer = HARTSGRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(checkpoint),
                               reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
                               processing_class=transformers.AutoTokenizer.from_pretrained(checkpoint),
                               train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}), harts_config=given)
    assert trainer.harts_config.pooled_balance_coeff == 0.0 and trainer.harts_config.recompute


def test_unsupported_settings_are_refused(checkpoint, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), top_entropy_quantile=0.2, off_policy_mask_threshold=0.5,
                          use_adaptive_entropy=True, report_to="none", use_cpu=True, bf16=False)
    assert len(unsupported_options(args)) == 3
    with pytest.raises(ValueError, match=r"HARTSGRPOTrainer: TRL settings without a HARTS reading: "
                                         r"top_entropy_quantile=0.2 \(set 1.0\); off_policy_mask_threshold=0.5"):
        HARTSGRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(checkpoint),
                         reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
                         processing_class=transformers.AutoTokenizer.from_pretrained(checkpoint),
                         train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}))


def test_trl_aux_loss_is_read_from_the_model_config(checkpoints, tmp_path):
    """TRL takes Qwen3-Next's router_aux_loss_coef (0.001) from the model config unless the GRPOConfig sets one: the
    HARTS trainer then has its model report the load-balancing statistics; with 0.0 it does not."""
    checkpoint = checkpoints("gdn-tiny")
    for coefficient, enabled in ((None, True), (0.0, False)):
        args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                              router_aux_loss_coef=coefficient)
        trainer = HARTSGRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(checkpoint),
                                   reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
                                   processing_class=transformers.AutoTokenizer.from_pretrained(checkpoint),
                                   train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}))
        assert trainer.aux_loss_enabled is enabled
        assert trainer._view(trainer.model).config.moe.balance_statistics is enabled


def test_a_model_of_another_architecture_is_refused_at_construction(checkpoint, tmp_path):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="LlamaForCausalLM: model_type 'llama' has no HARTS module layout"):
        HARTSGRPOTrainer(model=transformers.LlamaForCausalLM(config),
                         reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
                         processing_class=transformers.AutoTokenizer.from_pretrained(checkpoint),
                         train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}))


def main() -> None:
    """Print each model's and case's losses, parameter differences and rows: python -m tests.integrations.test_trl."""
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="harts-trl-"))
    torch.set_num_threads(1)
    print("| model | case | steps | losses TRL | losses HARTS | max abs param diff | max param change | rows TRL "
          "(padded) | real tokens | rows HARTS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        path = make_checkpoint(root / model, model)
        for case in CASES:
            runs = run_case(path, root / model / case, case)
            (stock, stock_parameters, stock_completions, stock_rows) = runs["trl"]
            (harts, harts_parameters, harts_completions, harts_rows) = runs["harts"]
            assert harts_completions == stock_completions
            initial = dict(transformers.AutoModelForCausalLM.from_pretrained(path).named_parameters())
            change = max(float((stock_parameters[n] - p.detach()).abs().max()) for n, p in initial.items())
            difference = max(float((harts_parameters[n] - p).abs().max()) for n, p in stock_parameters.items())
            print(f"| {model} | {case} | {CASES[case][1]} | {', '.join(f'{x:.6f}' for x in losses(stock))} | "
                  f"{', '.join(f'{x:.6f}' for x in losses(harts))} | {difference:.1e} | {change:.1e} | "
                  f"{stock_rows} | {harts.harts_counts['tokens']} | {harts_rows} |", flush=True)


if __name__ == "__main__":
    main()
