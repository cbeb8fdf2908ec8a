"""The loss options of `harts train-step` and `harts verify` (harts/cli/train.py): the flags and the
strict `--loss-config` YAML reach the step's GRPOConfig/PPOConfig, flags override the file, a loss
option of the other loss is refused, and the resolved config is printed with the results."""

import json

import pytest

from harts.cli import train
from harts.cli.main import build_parser, main
from harts.objective.losses import AGGREGATIONS, GRPOConfig, PPOConfig
from tests.trees.helpers import cli_error

STEP = "data/samples/tiny-step.jsonl.gz"
COMMANDS = {"train-step": ["train-step", "--execution", "compact"], "verify": ["verify"]}


def step_config(argv):
    args = build_parser().parse_args([*argv, "--model", "tiny", "--trees", STEP])
    return train._step_config(args, "compact")


def test_parser_aggregations_are_the_losses():
    assert train.AGGREGATIONS == AGGREGATIONS


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
                         "clip_ratio_high, clip_ratio_low, kl_coef)"),
    "yaml-ppo-key-under-grpo": ("dual_clip_ratio: 3\n", [], "{path}: unknown key 'dual_clip_ratio'"),
    "yaml-wrong-type": ("kl_coef: a lot\n", [], "{path}: key 'kl_coef': expected a number, got str 'a lot'"),
    "yaml-out-of-range": ("clip_ratio_low: 1.5\n", [], "{path}: GRPOConfig: need 0 <= clip_ratio_low < 1"),
    "yaml-missing": (None, ["--loss-config", "{tmp}/nope.yaml"], "{tmp}/nope.yaml: no such config file"),
    "flag-out-of-range": (None, ["--clip-ratio-low", "1"], "loss options: GRPOConfig: need 0 <= clip_ratio_low < 1"),
    "dual-clip-under-grpo": (None, ["--dual-clip-ratio", "3"],
                             "--dual-clip-ratio applies to --loss ppo only (this is --loss grpo)"),
    "kl-under-ppo": (None, ["--loss", "ppo", "--kl-coef", "0.1"],
                     "--kl-coef applies to --loss grpo only (this is --loss ppo)"),
    "dual-clip-not-above-1": (None, ["--loss", "ppo", "--dual-clip-ratio", "0.5"],
                              "loss options: PPOConfig: dual_clip_ratio must be > 1, got 0.5"),
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
    assert line.startswith("harts: error: " + message.format(path=path, tmp=tmp_path))


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
        assert out["loss_config"] == {"loss": "grpo", **expected.__dict__}
    assert losses["kl"] > losses["default"]  # the k3 penalty is >= 0 and not 0 off-policy


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
    monkeypatch.setattr(MoE, "routed_experts", lambda self, x, routing: backends.append(
        self.config.experts_backend) or self.loop_experts(x, routing))
    argv = [*COMMANDS[command], "--model", "tiny", "--trees", STEP, "--capacity", "1024", "--experts-backend", "lean"]
    assert main(argv) == 0
    assert backends and set(backends) == {"lean"}
