"""The loss options of `harts train-step` and `harts verify` (harts/cli/train.py): the flags and the
strict `--loss-config` YAML reach the step's GRPOConfig/PPOConfig, flags override the file, a loss
option of the other loss is refused, and the resolved config is printed with the results;
`--pooled-balance-coeff` reaches the StepConfig and the step's loss, a bad value or a model that cannot give the
loss is refused in one line."""

import dataclasses
import json

import pytest

from harts import args as cli_args
from harts.cli import train
from harts.cli.main import build_parser, main
from harts.objective import losses
from harts.config.execution import ExecutionConfig
from harts.objective.losses import AGGREGATIONS, GRPOConfig, PPOConfig
from harts.objective.step import StepConfig
from harts.objective.step import step_config as objective_step_config
from tests.trees.helpers import cli_error

STEP = "data/samples/tiny-step.jsonl.gz"
COMMANDS = {"train-step": ["train-step", "--execution", "compact"], "verify": ["verify"]}


def step_config(argv):
    args = build_parser().parse_args([*argv, "--model", "tiny", "--trees", STEP])
    return train._step_config(args, "compact")


def test_parser_aggregations_are_the_losses():
    assert train.AGGREGATIONS == AGGREGATIONS


def test_loss_options_are_the_configs_fields():
    """One flag per field of each loss config, for exactly the losses that have it, with the losses' choices."""
    for loss, cls in (("grpo", GRPOConfig), ("ppo", PPOConfig)):
        options = {field for field, losses_of, _ in cli_args.LOSS_OPTIONS if loss in losses_of}
        assert options == {f.name for f in dataclasses.fields(cls)}, loss
    assert (cli_args.LOSS_AGGREGATIONS, cli_args.LOSS_SURROGATES, cli_args.LOSS_IMPORTANCE_SAMPLING_LEVELS,
            cli_args.LOSS_KL_ESTIMATORS) == (losses.AGGREGATIONS, losses.SURROGATES, losses.IMPORTANCE_SAMPLING_LEVELS,
                                             losses.KL_ESTIMATORS)


def test_loss_section_options_are_the_loss_configs_fields():
    """One flag per field of LossConfig besides name and its sections, and those are the StepConfig's loss fields
    (`name` is StepConfig's `loss`), so that step_config copies every one of them."""
    section = {f.name for f in dataclasses.fields(losses.LossConfig)} - {"name", "grpo", "ppo"}
    assert {field for field, _ in cli_args.LOSS_SECTION_OPTIONS} == section == {"pooled_balance_coeff"}
    knobs = {f.name for f in dataclasses.fields(ExecutionConfig)}
    assert {f.name for f in dataclasses.fields(StepConfig)} - knobs - {"replay"} == section | {"loss", "grpo", "ppo"}
    loss_config = losses.LossConfig(name="ppo", ppo=PPOConfig(entropy_coef=0.01), pooled_balance_coeff=0.25)
    config = objective_step_config(ExecutionConfig(), "cpu", loss_config=loss_config, execution="compact")
    assert (config.loss, config.ppo, config.pooled_balance_coeff) == ("ppo", loss_config.ppo, 0.25)


@pytest.mark.parametrize("command", COMMANDS)
def test_pooled_balance_coeff_reaches_the_step_config(command):
    assert step_config(COMMANDS[command]).pooled_balance_coeff == 0.0
    given = step_config([*COMMANDS[command], "--loss", "ppo", "--pooled-balance-coeff", "0.25"])
    assert (given.loss, given.pooled_balance_coeff) == ("ppo", 0.25)


# name: (extra argv, loss, the resolved config)
FLAGS = {
    "defaults-grpo": ([], "grpo", GRPOConfig()),
    "defaults-ppo": (["--loss", "ppo"], "ppo", PPOConfig()),
    "grpo-every-flag": (
        ["--clip-ratio-low", "0.1", "--clip-ratio-high", "0.28", "--kl-coef", "0.05", "--aggregation",
         "seq-mean-token-mean"],
        "grpo", GRPOConfig(clip_ratio_low=0.1, clip_ratio_high=0.28, kl_coef=0.05, aggregation="seq-mean-token-mean"),
    ),
    "ppo-every-flag": (
        ["--loss", "ppo", "--clip-ratio-low", "0", "--clip-ratio-high", "0.3", "--dual-clip-ratio", "3",
         "--aggregation", "seq-mean-token-mean"],
        "ppo", PPOConfig(clip_ratio_low=0.0, clip_ratio_high=0.3, dual_clip_ratio=3.0, aggregation="seq-mean-token-mean"),
    ),
    "grpo-verl-reading": (
        ["--dual-clip-ratio", "3", "--log-ratio-clamp", "20", "--kl-coef", "0.001", "--kl-estimator", "low_var_kl",
         "--entropy-coef", "0.01", "--aggregation", "seq-mean-token-sum-norm", "--loss-scale-factor", "4096"],
        "grpo", GRPOConfig(dual_clip_ratio=3.0, log_ratio_clamp=20.0, kl_coef=0.001, kl_estimator="low_var_kl",
                           entropy_coef=0.01, aggregation="seq-mean-token-sum-norm", loss_scale_factor=4096.0),
    ),
    "grpo-trl-readings": (
        ["--surrogate", "sapo", "--sapo-tau-pos", "0.9", "--sapo-tau-neg", "1.2", "--importance-sampling-level",
         "sequence", "--kl-coef", "0.04", "--kl-importance-weighted", "--entropy-aggregation", "token-mean",
         "--vespo-k-pos", "1", "--vespo-lambda-pos", "2", "--vespo-k-neg", "4", "--vespo-lambda-neg", "5"],
        "grpo", GRPOConfig(surrogate="sapo", sapo_tau_pos=0.9, sapo_tau_neg=1.2, importance_sampling_level="sequence",
                           kl_coef=0.04, kl_importance_weighted=True, entropy_aggregation="token-mean",
                           vespo_k_pos=1.0, vespo_lambda_pos=2.0, vespo_k_neg=4.0, vespo_lambda_neg=5.0),
    ),
    "grpo-ratio-cap": (["--ratio-cap", "1.5"], "grpo", GRPOConfig(ratio_cap=1.5)),
    "ppo-entropy": (
        ["--loss", "ppo", "--entropy-coef", "0.01", "--entropy-aggregation", "token-sum", "--log-ratio-clamp", "20"],
        "ppo", PPOConfig(entropy_coef=0.01, entropy_aggregation="token-sum", log_ratio_clamp=20.0),
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", FLAGS)
def test_flags_reach_the_step_config(command, case):
    argv, loss, expected = FLAGS[case]
    config = step_config([*COMMANDS[command], *argv])
    assert config.loss == loss
    assert getattr(config, loss) == expected


def test_flags_override_the_yaml(tmp_path):
    path = tmp_path / "loss.yaml"
    path.write_text("clip_ratio_high: 0.28\nkl_coef: 0.05\naggregation: seq-mean-token-mean\n")
    config = step_config(["verify", "--loss-config", str(path), "--kl-coef", "0.2"])
    assert config.grpo == GRPOConfig(clip_ratio_high=0.28, kl_coef=0.2, aggregation="seq-mean-token-mean")
    path.write_text("dual_clip_ratio: 4\nclip_ratio_low: 0.15\n")
    config = step_config(["train-step", "--execution", "compact", "--loss", "ppo", "--loss-config", str(path),
                          "--dual-clip-ratio", "2.5"])
    assert config.ppo == PPOConfig(clip_ratio_low=0.15, dual_clip_ratio=2.5)


# name: (YAML text or None, extra argv, the message after "harts: error: ")
BAD = {
    "yaml-unknown-key": ("clip_ratio: 0.2\n", [], "{path}: unknown key 'clip_ratio' (allowed: aggregation, "
                         "clip_ratio_high, clip_ratio_low, dual_clip_ratio, entropy_aggregation, entropy_coef, "
                         "importance_sampling_level, kl_coef, kl_estimator, kl_importance_weighted, log_ratio_clamp, "
                         "loss_scale_factor, ratio_cap, sapo_tau_neg, sapo_tau_pos, surrogate, vespo_k_neg, "
                         "vespo_k_pos, vespo_lambda_neg, vespo_lambda_pos)"),
    "yaml-grpo-key-under-ppo": ("kl_estimator: k3\n", ["--loss", "ppo"], "{path}: unknown key 'kl_estimator'"),
    "yaml-bad-surrogate": ("surrogate: ppo\n", [], "{path}: GRPOConfig: surrogate must be one of ('clip', 'cispo', "
                           "'sapo', 'vespo'), got 'ppo'"),
    "yaml-bad-kl-estimator": ("kl_estimator: full\n", [], "{path}: GRPOConfig: kl_estimator must be one of"),
    "yaml-norm-without-factor": ("aggregation: seq-mean-token-sum-norm\n", [], "{path}: GRPOConfig: aggregation "
                                 "'seq-mean-token-sum-norm' needs loss_scale_factor > 0"),
    "yaml-factor-without-norm": ("loss_scale_factor: 512\n", ["--loss", "ppo"], "{path}: PPOConfig: "
                                 "loss_scale_factor applies to aggregation 'seq-mean-token-sum-norm' only"),
    "yaml-vespo-lambda-zero": ("vespo_lambda_neg: 0\n", [], "{path}: GRPOConfig: vespo_k_* must be finite numbers >= 0 "
                               "and vespo_lambda_* >= 1e-4"),
    "yaml-importance-weighted-not-bool": ("kl_importance_weighted: 1\n", [], "{path}: key 'kl_importance_weighted': "
                                          "expected true or false"),
    "yaml-wrong-type": ("kl_coef: a lot\n", [], "{path}: key 'kl_coef': expected a number, got str 'a lot'"),
    "yaml-out-of-range": ("clip_ratio_low: 1.5\n", [], "{path}: GRPOConfig: need 0 <= clip_ratio_low < 1 (<= 1 with "
                          "surrogate 'cispo'), got clip_ratio_low 1.5"),
    "yaml-kl-negative": ("kl_coef: -0.5\n", [], "{path}: GRPOConfig: need kl_coef >= 0, got -0.5"),
    "yaml-ppo-clip-high-negative": ("clip_ratio_high: -0.2\n", ["--loss", "ppo"],
                                    "{path}: PPOConfig: need clip_ratio_high >= 0, got -0.2"),
    "yaml-missing": (None, ["--loss-config", "{tmp}/nope.yaml"], "{tmp}/nope.yaml: no such config file"),
    "flag-out-of-range": (None, ["--clip-ratio-low", "1"], "loss options: GRPOConfig: need 0 <= clip_ratio_low < 1"),
    "surrogate-under-ppo": (None, ["--loss", "ppo", "--surrogate", "cispo"],
                            "--surrogate applies to --loss grpo only (this is --loss ppo)"),
    "dual-clip-with-sapo": (None, ["--surrogate", "sapo", "--dual-clip-ratio", "3"],
                            "loss options: GRPOConfig: dual_clip_ratio applies to surrogate 'clip', not 'sapo'"),
    "clip-ratio-low-1-with-clip": (None, ["--clip-ratio-low", "1", "--surrogate", "clip"],
                                   "loss options: GRPOConfig: need 0 <= clip_ratio_low < 1"),
    "kl-under-ppo": (None, ["--loss", "ppo", "--kl-coef", "0.1"],
                     "--kl-coef applies to --loss grpo only (this is --loss ppo)"),
    "dual-clip-not-above-1": (None, ["--loss", "ppo", "--dual-clip-ratio", "0.5"],
                              "loss options: PPOConfig: dual_clip_ratio must be > 1, got 0.5"),
    "pooled-negative": (None, ["--pooled-balance-coeff", "-1"],
                        "{command}: argument --pooled-balance-coeff: expected a finite number >= 0, got '-1'"),
    "pooled-nan": (None, ["--pooled-balance-coeff", "nan"],
                   "{command}: argument --pooled-balance-coeff: expected a finite number >= 0, got 'nan'"),
    "pooled-sigmoid-model": (None, ["--pooled-balance-coeff", "0.5"],
                             "{command}: --pooled-balance-coeff 0.5 on model 'tiny': transformers' load-balancing "
                             "loss is the softmax one; the model routes with sigmoid scores"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", BAD)
def test_bad_loss_options_fail_in_one_line(command, case, tmp_path, capsys):
    text, argv, message = BAD[case]
    path = tmp_path / "loss.yaml"
    if text is not None:
        path.write_text(text)
        argv = [*argv, "--loss-config", str(path)]
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    line = cli_error([*COMMANDS[command], "--model", "tiny", "--trees", STEP, "--capacity", "1024", *argv], capsys)
    assert line.startswith("harts: error: " + message.format(path=path, tmp=tmp_path, command=command))


def test_train_step_uses_and_prints_the_loss_config(tmp_path, capsys):
    """The options change the loss of a real step (the sample step has old and reference log-probs)
    and the resolved config is in the JSON."""
    path = tmp_path / "loss.yaml"
    path.write_text("clip_ratio_high: 0.28\n")
    base = ["train-step", "--model", "tiny", "--trees", STEP, "--execution", "compact", "--capacity", "1024", "--json"]
    losses = {}
    for name, extra in {"default": [], "kl": ["--loss-config", str(path), "--kl-coef", "0.5"]}.items():
        assert main([*base, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        losses[name] = out["policy_loss"]
        expected = GRPOConfig(clip_ratio_high=0.28, kl_coef=0.5) if name == "kl" else GRPOConfig()
        assert out["loss_config"] == {"loss": "grpo", **expected.__dict__, "pooled_balance_coeff": 0.0}
    assert losses["kl"] > losses["default"]  # the k3 penalty is >= 0 and not 0 off-policy


def test_train_step_adds_the_pooled_balance_loss(capsys):
    """--pooled-balance-coeff c adds c × the pooled loss (the mean over the step's microbatches, printed) to the
    MoE loss and the loss of the same step; the policy loss is unchanged."""
    base = ["train-step", "--model", "gdn-tiny", "--trees", STEP, "--execution", "compact", "--capacity", "512",
            "--json"]
    out = {}
    for coeff in ("0", "0.5"):
        assert main([*base, "--pooled-balance-coeff", coeff]) == 0
        out[coeff] = json.loads(capsys.readouterr().out)
    without, with_ = out["0"], out["0.5"]
    assert "pooled_balance_loss" not in without and with_["microbatches"] == without["microbatches"] > 1
    assert with_["loss_config"]["pooled_balance_coeff"] == 0.5 and with_["pooled_balance_loss"] > 2.0  # top-2: 2
    assert with_["policy_loss"] == pytest.approx(without["policy_loss"], rel=1e-6)
    assert with_["moe_loss"] == pytest.approx(without["moe_loss"] + 0.5 * with_["pooled_balance_loss"], rel=1e-6)
    assert with_["loss"] == pytest.approx(without["loss"] + 0.5 * with_["pooled_balance_loss"], rel=1e-6)


@pytest.mark.parametrize("command", COMMANDS)
def test_execution_flags_reach_the_step_config(command):
    config = step_config([*COMMANDS[command], "--recompute", "--recompute-blocks", "2",
                          "--logprob-grad-precision", "input", "--keep-attention", "--recompute-by-rows"])
    assert (config.recompute, config.recompute_blocks, config.logprob_grad_precision, config.keep_attention,
            config.recompute_by_rows) == (True, 2, "input", True, True)
    default = step_config(COMMANDS[command])
    assert default.keep_attention is False and default.recompute_by_rows is False


@pytest.mark.parametrize("command", COMMANDS)
def test_experts_backend_reaches_the_model(command, monkeypatch):
    """--experts-backend replaces the model config's MoE experts backend in the model the command builds."""
    from harts.model.moe import MoE

    backends = []
    monkeypatch.setattr(MoE, "routed_experts", lambda self, x, routing, *rest: backends.append(
        self.config.experts_backend) or self.loop_experts(x, routing).to(x.dtype))
    argv = [*COMMANDS[command], "--model", "tiny", "--trees", STEP, "--capacity", "1024", "--experts-backend", "lean"]
    assert main(argv) == 0
    assert backends and set(backends) == {"lean"}
