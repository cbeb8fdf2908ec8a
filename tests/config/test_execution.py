"""The one execution config: its choices are the registries', its rules refuse bad knobs in one line naming the key,
`resolved` fills the device's and the execution's defaults, every field has a flag with help, every command offers
the knobs that apply to it, and every command refuses a bad knob before it builds a model, and the GDN kernel that
the installed fla refuses (faked on this CPU) before it builds a GDN model whose baseline would run it."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from harts.config import execution
from harts.config.execution import ExecutionConfig
from tests.test_docs import command_options

REPO = Path(__file__).resolve().parents[2]


def test_choice_lists_are_the_registries():
    from harts.objective.step import DTYPES
    from harts.ops.attention.groups import BACKENDS, KEEPABLE_BACKENDS

    assert tuple(BACKENDS) == execution.ATTENTION_BACKENDS
    assert set(KEEPABLE_BACKENDS) <= set(execution.ATTENTION_BACKENDS)
    assert tuple(DTYPES) == execution.DTYPES


@pytest.mark.parametrize("fields, message", [
    (dict(planner="best"), "execution.planner must be one of"),
    (dict(execution="replay"), "execution.execution must be one of"),
    (dict(dtype="fp16"), "execution.dtype must be one of"),
    (dict(attention_backend="bogus"), "execution.attention_backend must be one of"),
    (dict(kda_backend="triton"), "execution.kda_backend must be one of"),
    (dict(gdn_kernel="fla"), "execution.gdn_kernel must be one of"),
    (dict(gdn_kernel=None), "execution.gdn_kernel must be one of"),
    (dict(experts_backend="fast"), "execution.experts_backend must be one of"),
    (dict(logprob_grad_precision=None), "execution.logprob_grad_precision must be one of"),
    (dict(capacity=0), "execution.capacity must be an int >= 1"),
    (dict(capacity=True), "execution.capacity must be an int >= 1"),
    (dict(logprob_chunk_rows=2.5), "execution.logprob_chunk_rows must be an int >= 1"),
    (dict(recompute="yes"), "execution.recompute must be true or false"),
    (dict(recompute=True, recompute_blocks=-1), "execution.recompute_blocks must be an int >= 0 or 'auto'"),
    (dict(recompute=True, recompute_blocks="all"), "execution.recompute_blocks must be an int >= 0 or 'auto'"),
    (dict(memory_margin=1.0), "execution.memory_margin must be a number >= 0 and < 1"),
    (dict(memory_margin=-0.01), "execution.memory_margin must be a number >= 0 and < 1"),
    (dict(memory_margin=float("nan")), "execution.memory_margin must be a number >= 0 and < 1"),
    (dict(memory_margin=False), "execution.memory_margin must be a number >= 0 and < 1"),
    (dict(memory_margin="5%"), "execution.memory_margin must be a number >= 0 and < 1"),
    (dict(mtp_loss_scaling_factor=-0.1), "execution.mtp_loss_scaling_factor must be a finite number >= 0"),
    (dict(mtp_loss_scaling_factor=float("inf")), "execution.mtp_loss_scaling_factor must be a finite number >= 0"),
    (dict(mtp_loss_scaling_factor=True), "execution.mtp_loss_scaling_factor must be a finite number >= 0"),
    (dict(recompute_blocks="auto"), "execution.recompute_blocks needs execution.recompute"),
    (dict(recompute_blocks=2), "execution.recompute_blocks needs execution.recompute"),
    (dict(keep_attention=True), "execution.keep_attention needs execution.recompute"),
    (dict(keep_kda_intermediates=True), "execution.keep_kda_intermediates needs execution.recompute"),
    (dict(recompute=True, recompute_by_rows=True), "execution.recompute_by_rows scales the blocks"),
    (dict(recompute=True, keep_attention=True, attention_backend="flex"), "keep_attention needs an attention backend"),
    (dict(recompute=True, keep_kda_intermediates=True, kda_backend="torch"), "it needs execution.kda_backend 'fla'"),
], ids=["planner", "execution", "dtype", "attention-backend", "kda-backend", "gdn-kernel", "gdn-kernel-none",
        "experts-backend", "grad-precision",
        "capacity-zero", "capacity-bool", "chunk-rows-float", "recompute-not-bool", "blocks-negative", "blocks-word",
        "margin-one", "margin-negative", "margin-nan", "margin-bool", "margin-text", "mtp-factor-negative",
        "mtp-factor-inf", "mtp-factor-bool", "auto-alone", "blocks-alone",
        "keep-attention-alone", "keep-kda-alone", "by-rows-without-blocks", "keep-attention-flex", "keep-kda-torch"])
def test_check_refuses_a_bad_knob_in_one_line_naming_the_key(fields, message):
    config = ExecutionConfig(**fields)
    with pytest.raises(ValueError, match=message) as error:
        config.check("execution.")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError):
        config.resolved("cpu", "compact")


def test_every_knob_alone_passes_the_check():
    good = dict(planner="greedy-trie", execution="baseline", dtype="bf16", attention_backend="flex",
                kda_backend="fla", gdn_kernel="kda", experts_backend="lean", logprob_grad_precision="input", capacity=7,
                logprob_chunk_rows=3, recompute=True, memory_margin=0, mtp_loss_scaling_factor=0,
                kda_calls="linked")
    assert set(good) | {"recompute_blocks", "recompute_by_rows", "keep_attention", "keep_kda_intermediates"} == set(
        execution.FIELDS)
    ExecutionConfig(**good).check()
    ExecutionConfig(recompute=True, recompute_blocks=2, recompute_by_rows=True, keep_attention=True,
                    keep_kda_intermediates=True).check()
    ExecutionConfig(recompute=True, recompute_blocks="auto", recompute_by_rows=True, memory_margin=0.999).check()


def test_recompute_blocks_auto_resolves_only_where_it_can_search(monkeypatch):
    """auto probes for out-of-memory errors: resolved on CUDA, refused on the CPU naming the key (or the flag); a
    StepConfig takes a number."""
    from harts.objective.step import StepConfig

    auto = ExecutionConfig(recompute=True, recompute_blocks="auto")
    assert auto.resolved("cuda", "compact").recompute_blocks == "auto"
    with pytest.raises(ValueError, match="^execution.recompute_blocks auto searches a GPU's memory .* it needs device "
                                         "cuda, got 'cpu'$"):
        execution.resolved_for_run(None, auto, "cpu", "compact")
    with pytest.raises(ValueError, match="^--recompute-blocks auto searches"):
        auto.resolved("cpu", as_flags=True)
    monkeypatch.setattr(execution, "SEARCH_DEVICES", ("cpu", "cuda"))
    assert auto.resolved("cpu", "compact").recompute_blocks == "auto"
    with pytest.raises(ValueError, match="recompute_blocks: a StepConfig takes a number of blocks, got 'auto'"):
        StepConfig(recompute=True, recompute_blocks="auto")


@pytest.mark.parametrize("backend, runs", [("varlen", "torch's varlen flash-attention kernel"),
                                           ("cudnn", "cuDNN's attention kernels"),
                                           ("flash4", "FlashAttention-4's kernels"), ("triton_tree", "Triton kernels")])
def test_cuda_attention_backends_resolve_only_on_cuda(backend, runs):
    """The GPU backends' kernels run on CUDA: resolved for the CPU each is refused before any model is built, naming
    the key (or the flag); on CUDA it resolves (keeping the attention too where it can)."""
    keep = backend in execution.KEEPABLE_ATTENTION_BACKENDS
    config = ExecutionConfig(attention_backend=backend, recompute=True, keep_attention=keep)
    assert config.resolved("cuda", "compact").attention_backend == backend
    with pytest.raises(ValueError, match=f"^execution.attention_backend {backend} runs {runs} on CUDA: it needs "
                                         "device cuda, got 'cpu' \\(on the CPU use sdpa\\)$"):
        execution.resolved_for_run(None, config, "cpu", "compact")
    with pytest.raises(ValueError, match=f"^--attention-backend {backend} runs {runs} on CUDA"):
        config.resolved("cpu", as_flags=True)
    assert ExecutionConfig(attention_backend="sdpa").resolved("cpu").attention_backend == "sdpa"


@pytest.mark.parametrize("device, execution_name, expected", [
    ("cpu", "compact", ("compact", "harts", "fp32", "sdpa", "torch")),
    ("cpu", "baseline", ("baseline", "per-trajectory", "fp32", "sdpa", "torch")),
    ("cuda", "compact", ("compact", "harts", "bf16", "varlen", "fla")),
    ("cuda", None, (None, None, "bf16", "varlen", "fla")),
], ids=["cpu-compact", "cpu-baseline", "cuda-compact", "cuda-no-execution"])
def test_resolved_fills_the_device_and_execution_defaults(device, execution_name, expected):
    resolved = ExecutionConfig().resolved(device, execution_name)
    assert (resolved.execution, resolved.planner, resolved.dtype, resolved.attention_backend,
            resolved.kda_backend) == expected
    assert resolved.experts_backend is None  # the model config's


def test_resolved_keeps_what_is_given():
    given = ExecutionConfig(execution="baseline", planner="harts", dtype="fp32", attention_backend="naive",
                            kda_backend="torch", experts_backend="loop")
    assert given.resolved("cuda", "compact") == given
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        given.resolved("tpu")


def _parse(add, argv):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add(parser)
    return parser.parse_args(argv)


def test_every_field_has_help_and_a_flag_that_round_trips():
    helps = execution.field_help()
    assert set(helps) == set(execution.FIELDS) and all(len(text) > 20 for text in helps.values())
    defaults = _parse(execution.add_arguments, [])
    assert ExecutionConfig(**execution.from_arguments(defaults)) == ExecutionConfig()
    config = ExecutionConfig(execution="baseline", planner="greedy-trie", capacity=99, dtype="bf16", recompute=True,
                             recompute_blocks=3, memory_margin=0.125, recompute_by_rows=True, keep_attention=True,
                             keep_kda_intermediates=True, attention_backend="varlen", kda_backend="fla",
                             gdn_kernel="kda", experts_backend="lean", logprob_chunk_rows=17,
                             logprob_grad_precision="input", mtp_loss_scaling_factor=0.25, kda_calls="linked")
    argv = []
    for name in execution.FIELDS:
        value = getattr(config, name)
        argv += [execution.flag(name)] if value is True else [execution.flag(name), str(value)]
    assert ExecutionConfig(**execution.from_arguments(_parse(execution.add_arguments, argv))) == config
    overrides = _parse(lambda p: execution.add_arguments(p, overrides=True), ["--no-recompute", "--capacity", "5"])
    assert execution.from_arguments(overrides, given=True) == {"recompute": False, "capacity": 5}


SURFACES = {
    # command: the knobs it does not take, and why.
    "train-step": ("memory_margin",),  # no search of the recomputed blocks
    "verify": ("execution", "memory_margin"),  # runs both; no search
    "train": (),  # --dtype is the run's: parameters and autocast
    "rl": ("execution",),  # runs the config's executions
    "bench fidelity": ("execution", "planner", "recompute", "recompute_blocks", "memory_margin", "recompute_by_rows",
                       "keep_attention", "keep_kda_intermediates",  # its paths fix these
                       "mtp_loss_scaling_factor",  # it compares the decoder's logits; MTP runs at the model's factor
                       "kda_calls"),  # how the KDA calls launch: the same values either way
}


@pytest.mark.parametrize("command", SURFACES)
def test_every_command_offers_every_knob_that_applies(command):
    flags = command_options(*command.split())
    offered = {name for name in execution.FIELDS if execution.flag(name) in flags}
    assert offered == set(execution.FIELDS) - set(SURFACES[command])


BAD = {
    "train-step": ["train-step", "--model", "tiny", "--trees", "data/samples/tiny-step.jsonl.gz", "--execution",
                   "compact", "--recompute-blocks", "2"],
    "train-step-backend": ["train-step", "--model", "tiny", "--trees", "data/samples/tiny-step.jsonl.gz",
                           "--execution", "compact", "--recompute", "--attention-backend", "bogus"],
    "verify": ["verify", "--model", "tiny", "--trees", "data/samples/tiny-step.jsonl.gz", "--keep-attention"],
    "train": ["train", "--model", "tiny", "--trees", "tiny", "--out", "{tmp}/run", "--recompute-by-rows"],
    "rl": ["rl", "--config", "tiny", "--out", "{tmp}/rl.json", "--recompute", "--keep-kda-intermediates"],
    "train-auto-on-cpu": ["train", "--model", "tiny", "--trees", "tiny", "--out", "{tmp}/run", "--recompute",
                          "--recompute-blocks", "auto"],
    "rl-auto-on-cpu": ["rl", "--config", "tiny", "--out", "{tmp}/rl.json", "--recompute", "--recompute-blocks",
                       "auto"],
    "rl-margin": ["rl", "--config", "tiny", "--out", "{tmp}/rl.json", "--memory-margin", "1"],
    "train-margin": ["train", "--model", "tiny", "--trees", "tiny", "--out", "{tmp}/run", "--memory-margin", "1"],
    "train-step-auto": ["train-step", "--model", "tiny", "--trees", "data/samples/tiny-step.jsonl.gz", "--execution",
                        "compact", "--recompute", "--recompute-blocks", "auto"],
    "bench-speedup-margin": ["bench", "speedup", "--model", "tiny", "--trees", "tiny", "--memory-margin", "-0.1",
                             "--out", "{tmp}/s.json"],
    "bench-fidelity": ["bench", "fidelity", "--model", "tiny", "--trees", "tiny", "--capacity", "0",
                       "--out", "{tmp}/f.json"],
    "train-step-triton-tree-on-cpu": ["train-step", "--model", "tiny", "--trees", "data/samples/tiny-step.jsonl.gz",
                                      "--execution", "compact", "--attention-backend", "triton_tree"],
    "train-triton-tree-on-cpu": ["train", "--model", "tiny", "--trees", "tiny", "--out", "{tmp}/run",
                                 "--attention-backend", "triton_tree"],
    "verify-varlen-on-cpu": ["verify", "--model", "tiny", "--trees", "data/samples/tiny-step.jsonl.gz",
                             "--attention-backend", "varlen"],
    "bench-speedup-triton-tree-on-cpu": ["bench", "speedup", "--model", "tiny", "--trees", "tiny", "--out",
                                         "{tmp}/s.json", "--compact-attention-backend", "triton_tree"],
}


@pytest.mark.parametrize("case", BAD)
def test_every_command_refuses_a_bad_knob_before_building_a_model(case, tmp_path, monkeypatch, capsys):
    from harts.cli.main import main
    from harts.model.model import HybridModel

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(HybridModel, "__init__", built)
    try:
        code = main([arg.format(tmp=tmp_path) for arg in BAD[case]])
    except SystemExit as exit:  # argparse's refusal of a value its type or choices rule out
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error:" in err.splitlines()[-1] and "a model was built" not in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("own", "named"), [(["--attention-backend"], "--attention-backend "),
                                            (["--compact-attention-backend"], "--compact-attention-backend ")],
                         ids=["shared", "compact-own"])
def test_bench_speedup_names_the_flag_that_gave_the_refused_backend(own, named, tmp_path, capsys):
    from harts.cli.main import main

    argv = ["bench", "speedup", "--model", "tiny", "--trees", "tiny", "--out", str(tmp_path / "s.json"), *own,
            "triton_tree"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"harts: error: {named}triton_tree runs Triton")


def test_a_field_is_a_yaml_key_of_every_config_that_holds_one():
    from harts.rl.config import RLConfig
    from harts.training.config import TrainConfig

    for cls in (TrainConfig, RLConfig):
        (field,) = [f for f in dataclasses.fields(cls) if f.name == "execution"]
        assert field.default_factory is ExecutionConfig


@pytest.mark.parametrize("name", execution.PRESETS)
def test_every_preset_is_knobs_that_pass_the_check(name):
    preset = execution.PRESETS[name]
    assert preset and set(preset) <= set(execution.FIELDS)
    ExecutionConfig(**preset).check()


def _parse_command(argv: list[str]) -> argparse.Namespace:
    from harts.cli.main import build_parser

    return build_parser().parse_args(argv)


STEP_ARGS = ["--model", "tiny", "--trees", "data/samples/tiny-step.jsonl.gz"]


@pytest.mark.parametrize("order", ["flag-after", "flag-before"])
def test_a_preset_sets_its_knobs_on_every_command_and_flags_beside_it_win(order, tmp_path):
    from harts.bench.speedup.executions import knobs_of
    from harts.cli.train import _step_config
    from harts.cli.train_loop import build_config

    preset, flag = ["--preset", "memory-lean"], ["--logprob-chunk-rows", "512"]
    given = preset + flag if order == "flag-after" else flag + preset
    expected = dict(recompute=True, experts_backend="lean", logprob_chunk_rows=512)

    def knobs(config):
        return {name: getattr(config, name) for name in expected}

    args = _parse_command(["train-step", *STEP_ARGS, "--execution", "compact", *given])
    assert knobs(_step_config(args, "compact")) == expected
    args = _parse_command(["verify", *STEP_ARGS, *given])
    assert knobs(_step_config(args, "baseline")) == expected
    args = _parse_command(["bench", "speedup", *STEP_ARGS, *given])
    assert knobs(knobs_of(args, "compact")) == expected
    args = _parse_command(["rl", "--config", "tiny", "--out", str(tmp_path / "r.json"), *given])
    assert {k: v for k, v in execution.from_arguments(args, given=True).items() if k in expected} == expected
    args = _parse_command(["train", *STEP_ARGS[:2], "--trees", "tiny", "--out", str(tmp_path / "run"), *given])
    assert knobs(build_config(args).execution) == expected
    args = _parse_command(["bench", "fidelity", *STEP_ARGS, "--preset", "cpu", "--out", str(tmp_path / "f.json")])
    assert (args.dtype, args.experts_backend) == ("fp32", "loop")  # only the knobs fidelity takes


GDN_STEP = ["--model", "gdn-h200", "--trees", "data/samples/tiny-step.jsonl.gz", "--device", "cuda"]
GDN_REFUSED = {
    # command: its argv on a GDN model whose baseline runs on CUDA, and how it names the knob (after a prefix).
    "train-step": (["train-step", *GDN_STEP, "--execution", "baseline"], "--gdn-kernel"),
    "verify": (["verify", *GDN_STEP], "--gdn-kernel"),
    "train-step-parallel": (["train-step", *GDN_STEP, "--execution", "baseline", "--parallel", "dp2"],
                            "--gdn-kernel"),
    "train": (["train", *GDN_STEP[:2], "--trees", "tiny", "--device", "cuda", "--execution", "baseline", "--out",
               "{tmp}/run"], "execution.gdn_kernel"),
    "rl": (["rl", "--config", "{config}", "--device", "cuda", "--out", "{tmp}/rl.json"],
           ("{config}: ", "execution.gdn_kernel")),
    "bench-speedup": (["bench", "speedup", *GDN_STEP, "--out", "{tmp}/s.json"], "--gdn-kernel"),
    "bench-speedup-variant": (["bench", "speedup", *GDN_STEP, "--gdn-kernel", "kda", "--variant", "gdn-kernel=gdn",
                               "--out", "{tmp}/s.json"], ("--variant gdn-kernel=gdn: ", "--gdn-kernel")),
    "bench-fidelity": (["bench", "fidelity", *GDN_STEP, "--out", "{tmp}/f.json"], "--gdn-kernel"),
}


@pytest.fixture
def refusing_fla(monkeypatch, tmp_path_factory):
    """A CUDA device where the installed fla refuses its GDN kernel's backward, faked on this CPU; a model that is
    built fails the test. Gives the path of an RL config of gdn-h200 (outside the command's output folder)."""
    import torch

    from harts.model.model import HybridModel
    from harts.ops.gdn import packed

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(HybridModel, "__init__", built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(packed, "fla_gdn_refusal", lambda: "fla 0.6.0 refuses it here")
    config = tmp_path_factory.mktemp("rl") / "gdn-h200.yaml"
    text = (REPO / "configs" / "rl" / "gdn-tiny.yaml").read_text(encoding="utf-8")
    config.write_text(text.replace("model: gdn-tiny", "model: gdn-h200"), encoding="utf-8")
    return config


def _run_command(argv: list[str]) -> int:
    from harts.cli.main import main

    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize("case", GDN_REFUSED)
def test_every_command_refuses_the_gdn_kernel_fla_refuses_before_building_a_model(case, tmp_path, refusing_fla,
                                                                                    capsys):
    """On a GPU where fla refuses its GDN kernel's backward, every command whose baseline runs a GDN model refuses
    the default gdn_kernel in one line naming the knob as the command takes it, before it builds a model or writes
    anything; with gdn_kernel kda it goes on to build the model."""
    argv, named = GDN_REFUSED[case]
    where, named = named if isinstance(named, tuple) else ("", named)
    argv = [arg.format(tmp=tmp_path, config=refusing_fla) for arg in argv]
    assert _run_command(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"harts: error: {where.format(config=refusing_fla)}{named} gdn: fla 0.6.0 refuses it here; {named} kda runs "
        "the baseline's GDN calls on fla's KDA kernels (the compact calls' kernels), or install Triton >= 3.7.1 or "
        "tilelang"), err
    assert not list(tmp_path.iterdir())
    if "variant" in case:
        argv[argv.index("gdn-kernel=gdn")] = "gdn-kernel=kda"
        argv.remove("--variant")
        argv.remove("gdn-kernel=kda")
    elif case == "rl":
        text = refusing_fla.read_text(encoding="utf-8")
        refusing_fla.write_text(text.replace("execution: {", "execution: {gdn_kernel: kda, "), encoding="utf-8")
    else:
        argv += ["--gdn-kernel", "kda"]
    if case.endswith("parallel"):  # the ranks build the models: it goes on to launch them
        assert _run_command(argv) == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith("parallel config 'dp2' needs 2 GPUs, 0 are visible")
        return
    with pytest.raises(AssertionError, match="a model was built"):
        _run_command(argv)


@pytest.mark.parametrize("argv", [
    ["train-step", *GDN_STEP, "--execution", "compact"],
    ["train-step", "--model", "h200", *GDN_STEP[2:], "--execution", "baseline"],
    ["train-step", *GDN_STEP, "--execution", "baseline", "--kda-backend", "torch"],
    ["train-step", *GDN_STEP[:4], "--execution", "baseline", "--device", "cpu"],
], ids=["compact", "kda-model", "torch-backend", "cpu"])
def test_no_command_refuses_where_fla_gdn_kernel_does_not_run(argv, refusing_fla):
    with pytest.raises(AssertionError, match="a model was built"):
        _run_command(argv)
