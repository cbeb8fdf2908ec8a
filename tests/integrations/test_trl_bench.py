"""`harts bench trl` (harts.integrations.trl_bench): end to end on the CPU (a tiny model of each Hugging Face
architecture in the form its layout holds: tiny as Kimi-Linear, bailing-tiny as BailingHybrid, gdn-tiny as
Qwen3-Next; 2 prompts of 40 tokens x 4 completions of at most 12, SGD so that the parameters compare as in
test_trl), the record holds both trainers' times, the rows and the fidelity figures, and HARTS's losses, log-probs,
gradients and parameters agree with stock TRL's within tests/integrations/test_trl.py's tolerances; the batch is
GRPO groups sharing their prompt; the form of every shipped model exports and changes only what its layout fixes,
and a config its layout cannot express is refused by name; `fidelity` measures what it names. On CUDA (`-m gpu`)
the same run in bf16 completes.
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
from harts.integrations.trl_bench import FIRST_TOKEN, PAD, fidelity, grpo_batch, trl_form  # noqa: E402
from harts.model.config import MTPConfig, load_model_config  # noqa: E402
from harts.model.hf import hf_config_from_model  # noqa: E402

PROMPTS, GENERATIONS, PROMPT_LENGTH, COMPLETION_LENGTH, WARMUP, REPEATS = 2, 4, 40, 12, 1, 2


def bench(tmp_path, device: str, *extra: str, model: str = "tiny") -> tuple[int, dict]:
    out = tmp_path / "trl.json"
    status = main(["bench", "trl", "--model", model, "--device", device, "--prompts", str(PROMPTS),
                   "--generations", str(GENERATIONS), "--prompt-length", str(PROMPT_LENGTH), "--completion-length",
                   str(COMPLETION_LENGTH), "--warmup", str(WARMUP), "--repeats", str(REPEATS), "--out", str(out),
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


def test_both_trainers_run_the_installed_kernels_not_the_hubs(tmp_path, monkeypatch):
    """transformers >= 5.2x kernelizes a model from the Hub by default where the `kernels` package is installed
    (offline on the GPU machine: an error); the bench loads both trainers' models with Hub kernels off."""
    import transformers

    loaded, load = [], transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        model = load(*args, **kwargs)
        loaded.append(model)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    status, record = bench(tmp_path, "cpu", "--optim", "sgd", "--router-aux-loss-coef", "0")
    assert status == 0, record
    assert len(loaded) == 2 and not any(model.use_kernels for model in loaded)


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
