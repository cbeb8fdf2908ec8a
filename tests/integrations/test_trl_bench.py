"""`harts bench trl` (harts.integrations.trl_bench): end to end on the CPU (a tiny model of each Hugging Face
architecture in the form its layout holds: tiny as Kimi-Linear, bailing-tiny as BailingHybrid, gdn-tiny as
Qwen3-Next; 2 prompts of 40 tokens x 4 completions of at most 12, SGD so that the parameters compare as in
test_trl), the record holds both trainers' times, the rows and the fidelity figures, and HARTS's losses, log-probs,
gradients and parameters agree with stock TRL's within tests/integrations/test_trl.py's tolerances; the batch is
GRPO groups sharing their prompt; the form of every shipped model exports and changes only what its layout fixes,
and a config its layout cannot express is refused by name; `fidelity` measures what it names. In bf16 on the CPU
(`tiny`, SGD) the untimed fp32 run of stock TRL runs third, with TF32 off and the settings restored after, and the
record holds each trainer's distance to it, through the same `fidelity`: non-zero and within bounds that HARTS
with wrong advantages, a dropped token or a temperature 2% off exceeds while TRL stays inside;
`--no-fp32-reference` and fp32 runs have no third run, and a reference of fp32 trainers is refused. On CUDA
(`-m gpu`) the same run in bf16 completes, with its fp32 run.
"""

import dataclasses
import json
import statistics

import numpy as np
import pytest
import torch

from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("trl", reason="trl is not installed (pip install 'harts[trl]')")
pytest.importorskip("datasets", reason="datasets (a dependency of trl) is not installed")

from harts.cli.main import main  # noqa: E402
from harts.config import shipped_config_path  # noqa: E402
from harts.integrations import trl_bench  # noqa: E402
from harts.integrations.trl_bench import FIRST_TOKEN, PAD, fidelity, grpo_batch, trl_form  # noqa: E402
from harts.model.config import MTPConfig, load_model_config  # noqa: E402
from harts.model.hf import hf_config_from_model  # noqa: E402

PROMPTS, GENERATIONS, PROMPT_LENGTH, COMPLETION_LENGTH, WARMUP, REPEATS = 2, 4, 40, 12, 1, 2


def bench(tmp_path, device: str, *extra: str, model: str = "tiny", repeats: int = REPEATS) -> tuple[int, dict]:
    out = tmp_path / "trl.json"
    status = main(["bench", "trl", "--model", model, "--device", device, "--prompts", str(PROMPTS),
                   "--generations", str(GENERATIONS), "--prompt-length", str(PROMPT_LENGTH), "--completion-length",
                   str(COMPLETION_LENGTH), "--warmup", str(WARMUP), "--repeats", str(repeats), "--out", str(out),
                   *extra])
    (record,) = json.loads(out.read_text())
    return status, record


CPU_MODELS = {"tiny": "KimiLinearForCausalLM", "bailing-tiny": "BailingHybridForCausalLM",
              "gdn-tiny": "Qwen3NextForCausalLM"}
AUX_LOSS = {"tiny": (("--router-aux-loss-coef", "0"), 0.0, "--router-aux-loss-coef"),
            "bailing-tiny": ((), 0.0, "model config"), "gdn-tiny": ((), 0.001, "model config")}
"""Per model: the flags, the router_aux_loss_coef both trainers run with and where it comes from (Qwen3-Next's config
declares 0.001, TRL's default; BailingHybrid's none)."""


@pytest.mark.parametrize("model", CPU_MODELS)
def test_cpu_run_records_both_trainers_and_they_agree(tmp_path, capsys, model):
    flags, coefficient, source = AUX_LOSS[model]
    status, record = bench(tmp_path, "cpu", "--optim", "sgd", "--lr", "0.05", *flags, model=model)
    assert status == 0, record
    assert record["benchmark"] == "trl"
    config, results = record["config"], record["results"]
    assert {k: config[k] for k in ("model", "device", "dtype", "prompts", "generations", "prompt_length",
                                   "completion_length", "warmup", "repeats", "optim", "gradient_checkpointing",
                                   "hf_class", "router_aux_loss_coef")} == {
        "model": model, "device": "cpu", "dtype": "fp32", "prompts": PROMPTS, "generations": GENERATIONS,
        "prompt_length": PROMPT_LENGTH, "completion_length": COMPLETION_LENGTH, "warmup": WARMUP,
        "repeats": REPEATS, "optim": "sgd", "gradient_checkpointing": True, "hf_class": CPU_MODELS[model],
        "router_aux_loss_coef": coefficient}
    assert config["router_aux_loss_coef_from"] == source
    assert config["fp32_reference"] is False and "fp32_reference" not in results  # fp32 trainers: no third run
    assert "fidelity_vs_fp32" not in results and results["trl"]["ran"]["bf16"] is False
    linear = config["model_config"]["kda"] or config["model_config"]["gdn"]
    assert linear["chunk_size"] == 64
    if model == "tiny":
        assert not config["model_config"]["mla"]["use_rope"]
    assert {"git", "hardware", "versions", "env"} <= set(record["environment"])

    batch = grpo_batch(num_prompts=PROMPTS, num_generations=GENERATIONS, prompt_length=PROMPT_LENGTH,
                       completion_length=COMPLETION_LENGTH, vocab_size=256, seed=0)
    rows = results["rows"]
    num_rows = PROMPTS * GENERATIONS
    completion_tokens = int(batch["completion_mask"].sum())
    assert rows["padded"] == num_rows * (PROMPT_LENGTH + COMPLETION_LENGTH)
    assert rows["tokens"] == num_rows * PROMPT_LENGTH + completion_tokens < rows["padded"]
    # Each prompt once; completions share at most a first token by chance.
    assert PROMPTS * PROMPT_LENGTH + completion_tokens - num_rows <= rows["compact"] <= (
        PROMPTS * PROMPT_LENGTH + completion_tokens)
    assert results["harts"]["rows_per_step"] == rows["compact"]
    assert results["harts"]["ran"]["recompute"] and results["harts"]["ran"]["execution"] == "compact"

    for name in ("trl", "harts"):
        run = results[name]
        assert len(run["step_seconds_all"]) == len(run["losses"]) == WARMUP + REPEATS
        assert run["step_seconds"] == statistics.median(run["step_seconds_all"][WARMUP:]) > 0
        assert run["peak_memory_gib"] is None
    assert results["speedup"] == pytest.approx(results["trl"]["step_seconds"] / results["harts"]["step_seconds"])
    for got, want in zip(results["harts"]["losses"], results["trl"]["losses"], strict=True):
        assert abs(got - want) <= 1e-6 + 1e-5 * abs(want)
    figures = results["fidelity"]
    assert figures["first_loss_abs_difference"] == abs(results["harts"]["first_loss"] - results["trl"]["first_loss"])
    assert figures["log_prob_max_abs_difference"] <= 1e-5 and figures["entropy_max_abs_difference"] <= 1e-5
    assert figures["gradient_relative_difference"] <= 1e-4
    # test_trl's bound: 1e-4 of the largest change plus 1e-6 of a parameter's size (the tiny model's are O(1)).
    assert figures["parameter_max_change"] > 1e-3
    assert figures["parameter_max_abs_difference"] <= 1e-4 * figures["parameter_max_change"] + 1e-6
    progress = capsys.readouterr().err
    for line in (f"({CPU_MODELS[model]}): initialising and saving", "TRL GRPOTrainer: 3 steps (1 warm-up)",
                 "HARTS GRPOTrainer: step 3/3",
                 "per step:", "wrote"):
        assert line in progress


@pytest.fixture
def loaded_models(monkeypatch) -> list:
    """Every transformers model the bench loads (one per run)."""
    import transformers

    loaded, load = [], transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        model = load(*args, **kwargs)
        loaded.append(model)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    return loaded


def test_both_trainers_run_the_installed_kernels_not_the_hubs(tmp_path, loaded_models):
    """transformers >= 5.2x kernelizes a model from the Hub by default where the `kernels` package is installed
    (offline on the GPU machine: an error); the bench loads both trainers' models with Hub kernels off (and, in fp32
    on the CPU by default, no third)."""
    status, record = bench(tmp_path, "cpu", "--optim", "sgd", "--router-aux-loss-coef", "0")
    assert status == 0, record
    assert len(loaded_models) == 2 and not any(model.use_kernels for model in loaded_models)


BF16_FLAGS = ("--dtype", "bf16", "--optim", "sgd", "--lr", "0.05", "--router-aux-loss-coef", "0")
NOISE_BOUNDS = {"log_prob_max_abs_difference": 0.05, "entropy_max_abs_difference": 5e-4,
                "first_loss_abs_difference": 1e-6, "gradient_relative_difference": 0.1}
"""A bf16 trainer's largest distances to the fp32 run on `tiny` (SGD at 0.05, 2 x 4 completions of 40 + 12 tokens);
measured on three seeds of the three CPU models: at most 1.8e-2, 1.7e-4, 1.5e-8 and 5.7e-2, the parameters at most
0.055 of the step's change (bounded at 0.1 below), HARTS's log-probs, entropies and gradients at most 1.7x TRL's
(bounded at 3x). A bug in HARTS's loss or log-probs lands outside: rolled advantages give a gradient 1.29 away,
one dropped token a log-prob 5.7 and a first loss 9.6e-3 away, a temperature 2% off entropies 6x TRL's distance."""
RATIO_BOUNDED = ("log_prob_max_abs_difference", "entropy_max_abs_difference", "gradient_relative_difference")


def noise_violations(figures: dict, trl_figures: dict | None = None) -> list[str]:
    """The figures of a trainer's distance to the fp32 run beyond NOISE_BOUNDS (the parameters: 0.1 of the step's
    change), and with `trl_figures` those of RATIO_BOUNDED beyond 3 x stock TRL's distance."""
    beyond = [key for key, bound in NOISE_BOUNDS.items() if not figures[key] <= bound]
    if not figures["parameter_max_abs_difference"] <= 0.1 * figures["parameter_max_change"]:
        beyond.append("parameter_max_abs_difference")
    if trl_figures is not None:
        beyond += [f"{key} (ratio)" for key in RATIO_BOUNDED if not figures[key] <= 3 * trl_figures[key]]
    return beyond


def test_cpu_bf16_run_measures_both_trainers_against_the_fp32_reference(tmp_path, capsys, monkeypatch,
                                                                          loaded_models):
    calls = []

    def spy(reference, run, completion_mask):
        figures = fidelity(reference, run, completion_mask)
        calls.append((reference["ran"], run["ran"], figures))
        return figures

    monkeypatch.setattr(trl_bench, "fidelity", spy)
    before = trl_bench.fp32_precision()
    status, record = bench(tmp_path, "cpu", *BF16_FLAGS)
    assert status == 0, record
    assert trl_bench.fp32_precision() == before  # restored after the reference
    config, results = record["config"], record["results"]
    assert (config["dtype"], config["fp32_reference"]) == ("bf16", True)
    assert len(loaded_models) == 3 and not any(model.use_kernels for model in loaded_models)
    trl_ran, harts_ran, reference = results["trl"]["ran"], results["harts"]["ran"], results["fp32_reference"]
    assert trl_ran["bf16"] is True and harts_ran["dtype"] == "bf16" and reference["ran"]["bf16"] is False
    assert results["fp32_precision"] == before
    assert reference["fp32_precision"] == {"backends": before["backends"], "triton_f32_default": "ieee",
                                           **{name: "ieee" for name in trl_bench.PRECISION_BACKENDS}}
    assert reference["peak_memory_gib"] is None and np.isfinite(reference["first_loss"])
    assert [(reference_ran["bf16"], ran.get("bf16", ran.get("dtype"))) for reference_ran, ran, _ in calls] == [
        (False, True), (False, "bf16"), (True, "bf16")]  # each against the fp32 run, then HARTS against TRL
    against = results["fidelity_vs_fp32"]
    assert [figures for *_, figures in calls] == [against["trl"], against["harts"], results["fidelity"]]

    for name in ("trl", "harts"):
        figures = against[name]
        assert figures["parameter_max_change"] > 1e-3
        assert all(figures[key] > 0 for key in ("log_prob_max_abs_difference", "entropy_max_abs_difference",
                                                "gradient_relative_difference", "parameter_max_abs_difference"))
        assert noise_violations(figures, against["trl"] if name == "harts" else None) == [], (name, figures)
    assert "against fp32, TRL / HARTS bf16: log_prob_max_abs_difference" in capsys.readouterr().err


CAUGHT = {"rolled-advantages": {"gradient_relative_difference", "first_loss_abs_difference"},
          "dropped-token": {"log_prob_max_abs_difference", "first_loss_abs_difference"},
          "temperature": {"entropy_max_abs_difference (ratio)"}}
"""What each planted bug moves out of bounds (`noise_violations`), at least."""


@pytest.mark.parametrize("bug", CAUGHT)
def test_the_fp32_bounds_catch_a_planted_harts_bug(tmp_path, monkeypatch, bug):
    """HARTS's loss with each row's advantage moved to the next row, or one completion token's log-prob dropped
    (0, and out of the loss), or its log-probs and entropies at 1.02 x TRL's temperature: its distance to the fp32
    run leaves the bounds, TRL's stays inside."""
    import harts.integrations.trl as harts_trl

    policy_loss, logprobs = harts_trl.api.policy_loss, harts_trl.api.logprobs
    token = (0, PROMPT_LENGTH)  # row 0's first completion token

    def planted_loss(model, batch, **kwargs):
        batch = dict(batch)
        if bug == "rolled-advantages":
            batch["advantages"] = batch["advantages"].roll(1)
        else:
            batch["loss_mask"] = batch["loss_mask"].clone()
            batch["loss_mask"][0, 0] = 0
        return policy_loss(model, batch, **kwargs)

    def planted_logprobs(model, batch, **kwargs):
        if bug == "temperature":
            kwargs["temperature"] *= 1.02
        out = logprobs(model, batch, **kwargs)
        if bug == "dropped-token":
            log_probs = out.log_probs.clone()
            log_probs[token] = 0.0
            out = dataclasses.replace(out, log_probs=log_probs)
        return out

    monkeypatch.setattr(harts_trl.api, "policy_loss", planted_loss)
    monkeypatch.setattr(harts_trl.api, "logprobs", planted_logprobs)
    status, record = bench(tmp_path, "cpu", *BF16_FLAGS, repeats=1)
    assert status == 0, record
    against = record["results"]["fidelity_vs_fp32"]
    assert noise_violations(against["trl"]) == []
    caught = noise_violations(against["harts"], against["trl"])
    assert set(caught) >= CAUGHT[bug], caught


def test_no_fp32_reference_leaves_it_out(tmp_path, loaded_models):
    status, record = bench(tmp_path, "cpu", *BF16_FLAGS, "--no-fp32-reference", repeats=1)
    assert status == 0, record
    assert (record["config"]["dtype"], record["config"]["fp32_reference"]) == ("bf16", False)
    assert not {"fp32_reference", "fidelity_vs_fp32"} & set(record["results"]) and len(loaded_models) == 2
    assert record["results"]["fidelity"]["log_prob_max_abs_difference"] > 0  # bf16 kernels differ


@pytest.mark.parametrize("flags", [("--fp32-reference",), ("--dtype", "fp32", "--fp32-reference")],
                         ids=["cpu-default", "fp32"])
def test_an_fp32_reference_of_fp32_trainers_is_refused(tmp_path, capsys, flags):
    out = tmp_path / "t.json"
    small = ("--prompts", "1", "--generations", "2", "--prompt-length", "8", "--completion-length", "4")
    assert main(["bench", "trl", "--model", "tiny", "--device", "cpu", *small, *flags, "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        "harts: error: --fp32-reference: the trainers run fp32 (--dtype fp32), so stock TRL's own run is the fp32 "
        "run: use --dtype bf16")
    assert not out.exists()


@pytest.mark.parametrize("dtype, path", [(None, "tiny-cpu.json"), ("fp32", "tiny-cpu.json"),
                                         ("bf16", "tiny-cpu-bf16.json")], ids=["default", "fp32", "bf16"])
def test_the_default_output_names_a_dtype_not_the_devices(dtype, path):
    import argparse

    args = argparse.Namespace(out=None, model="tiny", device="cpu", dtype=dtype)
    assert trl_bench.output_path(args) == f"reports/raw/trl/{path}"


@pytest.mark.parametrize("triton", [None, "tf32"], ids=["triton-unset", "triton-tf32"])
def test_ieee_fp32_sets_every_fp32_precision_and_restores_it(monkeypatch, triton):
    if triton is None:
        monkeypatch.delenv(trl_bench.TRITON_F32_DEFAULT, raising=False)
    else:
        monkeypatch.setenv(trl_bench.TRITON_F32_DEFAULT, triton)
    matmul = torch.backends.mkldnn.matmul
    own = matmul.fp32_precision  # a property of the class: monkeypatch cannot restore it
    matmul.fp32_precision = "bf16"
    try:
        before = trl_bench.fp32_precision()
        assert before["mkldnn.matmul"] == "bf16" and before["triton_f32_default"] == triton
        with trl_bench.ieee_fp32():
            inside = trl_bench.fp32_precision()
        after = trl_bench.fp32_precision()
    finally:
        matmul.fp32_precision = own
    assert inside == {"backends": before["backends"], "triton_f32_default": "ieee",
                      **{name: "ieee" for name in trl_bench.PRECISION_BACKENDS}}
    assert after == before


def test_an_aux_loss_on_sigmoid_routing_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "trl", "--model", "tiny", "--device", "cpu", "--router-aux-loss-coef", "0.01", "--out",
                 str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        "harts: error: --router-aux-loss-coef 0.01: tiny routes with sigmoid (HARTSGRPOTrainer reads transformers' "
        "softmax load-balancing loss): set 0")
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_run(tmp_path):
    status, record = bench(tmp_path, "cuda")
    assert status == 0, record
    results = record["results"]
    assert record["config"]["dtype"] == "bf16"
    assert results["harts"]["ran"]["kda_backend"] == "fla" and results["harts"]["ran"]["dtype"] == "bf16"
    assert all(results[name]["peak_memory_gib"] > 0 for name in ("trl", "harts"))
    assert results["rows"]["compact"] < results["rows"]["tokens"]
    assert all(np.isfinite(value) for value in results["fidelity"].values())
    reference = results["fp32_reference"]
    assert record["config"]["fp32_reference"] and reference["ran"]["bf16"] is False
    assert reference["fp32_precision"]["cuda.matmul"] == reference["fp32_precision"]["cudnn.conv"] == "ieee"
    for name in ("trl", "harts"):
        assert all(np.isfinite(value) for value in results["fidelity_vs_fp32"][name].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU error")
def test_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "trl", "--model", "tiny", "--out", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.strip() == "harts: error: --device cuda: no CUDA device is available"
    assert not (tmp_path / "t.json").exists()


def test_grpo_batch_is_groups_sharing_their_prompt():
    batch = grpo_batch(num_prompts=3, num_generations=5, prompt_length=7, completion_length=9, vocab_size=50, seed=1)
    prompts, completions, mask = batch["prompt_ids"], batch["completion_ids"], batch["completion_mask"].bool()
    assert prompts.shape == (15, 7) and completions.shape == mask.shape == (15, 9)
    groups = prompts.view(3, 5, 7)
    assert (groups == groups[:, :1]).all() and len({tuple(g[0].tolist()) for g in groups}) == 3
    assert batch["prompt_mask"].eq(1).all()
    lengths = mask.sum(dim=1)
    assert (mask == (torch.arange(9) < lengths[:, None])).all()  # right-padded
    assert lengths.min() >= 5 and lengths.max() <= 9
    assert (completions[~mask] == PAD).all() and (completions[mask] >= FIRST_TOKEN).all()
    assert (prompts >= FIRST_TOKEN).all() and max(prompts.max(), completions.max()) < 50
    assert batch["num_items_in_batch"] == mask.sum()
    advantages = batch["advantages"].view(3, 5)
    assert advantages.dtype == torch.float32
    assert torch.allclose(advantages.mean(dim=1), torch.zeros(3), atol=1e-6)
    assert torch.allclose(advantages.std(dim=1), torch.ones(3), atol=1e-3)


SHIPPED_MODELS = sorted(p.stem for p in shipped_config_path("tiny", "models").parent.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_trl_form_exports_and_changes_only_what_its_layout_fixes(name):
    config = load_model_config(name)
    form = trl_form(config)
    hf_config_from_model(form)  # exportable
    linear = "kda" if config.kda is not None else "gdn"
    chunked = dataclasses.replace(getattr(config, linear), chunk_size=64)
    if config.hf_layout != "kimi_linear" or name == "kimi-tiny":  # the others export as they are
        assert form == dataclasses.replace(config, mtp=None, **{linear: chunked})
    assert dataclasses.replace(form, kda=config.kda, mla=config.mla, gdn=config.gdn, mtp=config.mtp) == config
    if config.hf_layout == "kimi_linear":
        assert (form.kda.num_heads, form.kda.head_dim, form.mla.kv_lora_rank, form.mla.q_lora_rank) == (
            config.kda.num_heads, config.kda.head_dim, config.mla.kv_lora_rank, config.mla.q_lora_rank)


def test_trl_form_drops_the_mtp_layers():
    config = load_model_config("bailing-tiny")
    with_mtp = dataclasses.replace(config, mtp=MTPConfig(num_layers=1))
    assert trl_form(with_mtp) == trl_form(config)


@pytest.mark.parametrize("name, change, message", [
    ("bailing-tiny", {"kda": {"full_rank_gates": False}}, "low-rank KDA gates .* no BailingHybrid equivalent"),
    ("gdn-tiny", {"norm_zero_centered": False}, r"RMSNorms scaling by w .* no qwen3_next equivalent"),
], ids=["bailing-low-rank-gates", "gdn-norms-not-centered"])
def test_trl_form_refuses_what_the_layout_cannot_express(name, change, message):
    config = load_model_config(name)
    fields = {key: dataclasses.replace(getattr(config, key), **value) if isinstance(value, dict) else value
              for key, value in change.items()}
    with pytest.raises(ValueError, match=f"model config '{name}': {message}"):
        trl_form(dataclasses.replace(config, **fields))


def test_fidelity_measures_what_it_names():
    mask = torch.tensor([[True, True, False]])
    zeros = {"a": torch.zeros(2, 2), "b": torch.zeros(3)}

    def run(log_probs, entropy, loss, gradients, parameters):
        return {"log_probs": torch.tensor([log_probs]), "entropy": torch.tensor([entropy]), "losses": [loss, 9.0],
                "gradients": gradients, "parameters": parameters, "initial": zeros}

    trl_run = run([-1.0, -2.0, -3.0], [0.5, 0.5, 0.5], 0.25,
                  {"a": torch.full((2, 2), 1.0), "b": torch.zeros(3)}, {"a": torch.full((2, 2), 0.1), "b": -zeros["b"]})
    harts_run = run([-1.0, -2.5, -9.0], [0.5, 0.75, 0.0], 0.5,
                    {"a": torch.full((2, 2), 1.0), "b": torch.tensor([0.0, 0.0, 1.0])},
                    {"a": torch.full((2, 2), 0.1), "b": torch.tensor([0.0, 0.0, 0.03])})
    assert fidelity(trl_run, harts_run, mask) == pytest.approx({
        "log_prob_max_abs_difference": 0.5, "entropy_max_abs_difference": 0.25, "first_loss_abs_difference": 0.25,
        "gradient_relative_difference": 0.5, "parameter_max_abs_difference": 0.03, "parameter_max_change": 0.1})
