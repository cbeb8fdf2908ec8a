import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from harts.config import load_config
from harts.model.moe import updated_expert_bias
from harts import engine as engine_module
from harts.training.config import load_train_config
from harts.training.loop import LOG_NAME, train
from harts.trees.io import write_step
from harts.trees.synth import SynthConfig, generate_step

MICRO = str(Path(__file__).with_name("micro-trees.yaml"))
BAD_STEP = str(Path(__file__).parents[1] / "data" / "bad_inputs" / "verify-old-logprobs-minus-1000.jsonl")
CURVE = ("step", "epoch", "data_step", "loss", "policy_loss", "moe_loss", "grad_norm", "lr", "clip_fraction", "kl",
         "semantic_tokens", "compact_tokens", "rows")


def _config(**overrides):
    """Six steps over the three micro steps (two epochs, shuffled), warm-up then cosine, clipping
    active on some steps, checkpoints every 2 steps: every piece of resumable state matters."""
    values = {"model": "tiny", "data.trees": MICRO, "data.shuffle": True, "num_steps": 6, "seed": 3,
              "execution.capacity": 1024, "optimizer.lr": 3e-3, "optimizer.max_grad_norm": 0.05,
              "schedule.warmup_steps": 2, "schedule.decay": "cosine", "checkpoint.every": 2}
    return load_train_config(None, {**values, **overrides})


def _curve(records):
    return [{key: record[key] for key in CURVE} for record in records]


def _logged_steps(run_dir):
    with (Path(run_dir) / LOG_NAME).open() as handle:
        return [json.loads(line) for line in handle if json.loads(line)["event"] == "step"]


def _weights(run_dir, step):
    return safetensors.torch.load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


@pytest.fixture(scope="module", params=[
    "fp32",
    # Slow: ~8 s for the reference and both resume tests with bf16 parameters and fp32 masters on
    # the CPU (the masters' round trip alone is checked fast in test_checkpoint.py).
    pytest.param("bf16", marks=pytest.mark.slow),
])
def reference(request, tmp_path_factory):
    """The uninterrupted run: (dtype, run directory, its step records)."""
    run_dir = tmp_path_factory.mktemp(f"reference-{request.param}")
    return request.param, run_dir, train(_config(dtype=request.param), run_dir)


class Kill(Exception):
    pass


def _kill_after(step):
    def hook(record):
        if record["step"] == step:
            raise Kill

    return hook


def test_resume_after_a_kill_repeats_the_uninterrupted_run(reference, tmp_path):
    dtype, reference_dir, expected = reference
    assert [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6]
    assert len({r["loss"] for r in expected}) == 6
    assert 0 < sum(r["grad_norm"] > 0.05 for r in expected) < 6  # clipping active on some steps
    assert [r["data_step"] for r in expected[:3]] != [r["data_step"] for r in expected[3:]]  # two shuffled epochs
    with pytest.raises(Kill):
        train(_config(dtype=dtype), tmp_path, on_step_end=[_kill_after(3)])  # checkpoint at 2, step 3 lost
    resumed = train(_config(dtype=dtype), tmp_path, resume=True)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert _curve(resumed) == _curve(expected[2:])  # bitwise: == on floats
    assert _curve(_logged_steps(tmp_path)) == _curve(expected)  # the killed step 3's record was replaced
    final, reference_final = _weights(tmp_path, 6), _weights(reference_dir, 6)
    assert final.keys() == reference_final.keys()
    assert all(torch.equal(final[name], reference_final[name]) for name in final)
    assert any(name.endswith("expert_bias") for name in final)


def test_resume_after_max_steps_repeats_the_uninterrupted_run(reference, tmp_path):
    dtype, _, expected = reference
    first = train(_config(dtype=dtype), tmp_path, max_steps=4)
    assert (tmp_path / "checkpoints" / "step_000004").is_dir()  # the stop saves, though 4 is a multiple of 2 anyway
    rest = train(_config(dtype=dtype), tmp_path, resume=True, max_steps=5)
    last = train(_config(dtype=dtype), tmp_path, resume=True)
    assert _curve(first + rest + last) == _curve(expected)
    assert (tmp_path / "checkpoints" / "step_000005").is_dir()
    assert train(_config(dtype=dtype), tmp_path, resume=True) == []  # done


def test_expert_bias_follows_the_steps_counts(tmp_path, monkeypatch):
    results = []

    def recording(*args, **kwargs):
        results.append(run_step(*args, **kwargs))
        return results[-1]

    run_step = engine_module.run_step
    monkeypatch.setattr(engine_module, "run_step", recording)  # the name the engine calls
    train(_config(num_steps=2), tmp_path)
    weights = _weights(tmp_path, 2)
    names = [f"blocks.{i}.mlp.expert_bias" for i in (1, 2, 3)]  # tiny: a dense layer, then three MoE layers
    assert sorted(n for n in weights if n.endswith("expert_bias")) == names
    rate = 1e-3  # tiny's bias_update_rate (the MoEConfig default)
    moved = []
    for layer, name in enumerate(names):
        expected = torch.zeros(4)
        for result in results:
            counts = result.tokens_per_expert[layer]
            assert float(counts.sum()) == result.num_semantic_tokens * 2  # q-weighted: S tokens × top-2
            expected = updated_expert_bias(counts, expected, rate)
        assert torch.equal(weights[name], expected), name
        moved.append(bool(expected.any()))
    assert any(moved)


def _log(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / LOG_NAME).read_text().splitlines()]


def test_cpu_records_hold_no_device_memory(reference):
    """The CPU has no device peak or total: the records say null rather than a process-wide number."""
    _, run_dir, records = reference
    assert [r["peak_memory_bytes"] for r in records] == [None] * len(records)
    starts = [r for r in _log(run_dir) if r["event"] == "start"]
    assert starts and all(r["device_memory_bytes"] is None for r in starts)


def test_recompute_blocks_auto_trains_with_the_fewest_blocks_that_fit(tmp_path, monkeypatch):
    """With recompute_blocks auto (the CPU allowed to search a simulated device, where fewer than 3 of the tiny
    model's 4 blocks run out of memory), each start searches on its first step before training it: the run is the
    run with 3 blocks given, bit for bit, across a resume; the log holds each start's search, the first leaving room
    for the AdamW moments not yet allocated (none once a checkpoint's are loaded)."""
    from harts import engine_memory
    from harts.config import execution
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel

    run_step = engine_module.run_step
    ran = []

    def simulated(model, step, microbatches, config, **kwargs):
        ran.append(config.recompute_blocks)
        if config.recompute_blocks < 3:
            raise torch.OutOfMemoryError("simulated")
        return run_step(model, step, microbatches, config, **kwargs)

    monkeypatch.setattr(engine_module, "run_step", simulated)
    monkeypatch.setattr(execution, "SEARCH_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(engine_memory, "device_memory_bytes", lambda device: 1 << 50)
    knobs = {"num_steps": 4, "execution.recompute": True, "execution.memory_margin": 0.125}
    expected = train(_config(**knobs, **{"execution.recompute_blocks": 3}), tmp_path / "given")
    assert set(ran) == {3}
    ran.clear()
    auto = _config(**knobs, **{"execution.recompute_blocks": "auto"})
    first = train(auto, tmp_path / "auto", max_steps=2)
    assert ran[:4] == [4, 1, 2, 3] and set(ran[4:]) == {3}  # the search, then the steps
    rest = train(auto, tmp_path / "auto", resume=True)
    assert _curve(first + rest) == _curve(expected)
    assert all(torch.equal(a, b) for a, b in zip(_weights(tmp_path / "auto", 4).values(),
                                                 _weights(tmp_path / "given", 4).values()))
    searches = [r for r in _log(tmp_path / "auto") if r["event"] == "recompute_search"]
    # Data step 1's microbatch has more key/value rows than step 0's: searched again, from the 3 blocks found.
    assert [(r["step"], r["recompute_blocks"], r["reason"].split(" ")[0]) for r in searches] == [
        (0, 3, "not"), (1, 3, "a"), (2, 3, "not")]
    parameters = sum(p.numel() for p in HybridModel(load_model_config("tiny")).parameters())
    assert [r["reserved_bytes"] for r in searches] == [2 * 4 * parameters, 0, 0]  # fp32 moments, then allocated
    assert [p["recompute_blocks"] for p in searches[1]["probes"]] == [3]
    for search in searches[::2]:
        tries = [(p["recompute_blocks"], p["fits"]) for p in search["probes"]]
        assert tries == [(4, True), (1, False), (2, False), (3, True)]
        assert (search["memory_margin"], search["device_memory_bytes"]) == (0.125, 1 << 50)
        assert search["memory_limit_bytes"] == (1 << 50) - (1 << 47) - search["reserved_bytes"]
    starts = [r for r in _log(tmp_path / "auto") if r["event"] == "start"]
    assert [r["device_memory_bytes"] for r in starts] == [1 << 50] * 2
    assert starts[0]["config"]["train"]["execution"]["recompute_blocks"] == "auto"


def test_recompute_blocks_auto_searches_again_before_a_step_outside_the_searched_ones(tmp_path, monkeypatch):
    """The micro steps in order (two epochs), their microbatches (rows, KDA rows, key/value rows) (380, 428, 588),
    (355, 410, 826) and (380, 438, 886); in the simulated memory the last needs 3 recomputed blocks, the others 2.
    The first step's search finds 2; each later step that its microbatches do not cover is searched on again before
    it runs, from the blocks found (step 2: one probe that fits; step 3: 2 run out, then 4 and 3 fit), and the second
    epoch's steps, covered, are not. Without the search again step 3 would run with 2 blocks and run out of memory."""
    from harts import engine_memory
    from harts.config import execution

    run_step = engine_module.run_step
    ran = []

    def simulated(model, step, microbatches, config, **kwargs):
        ran.append(config.recompute_blocks)
        if config.recompute_blocks < (3 if int(step.lengths.sum()) == 886 else 2):
            raise torch.OutOfMemoryError("simulated")
        return run_step(model, step, microbatches, config, **kwargs)

    monkeypatch.setattr(engine_module, "run_step", simulated)
    monkeypatch.setattr(execution, "SEARCH_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(engine_memory, "device_memory_bytes", lambda device: 1 << 50)
    records = train(_config(**{"data.shuffle": False, "execution.recompute": True,
                               "execution.recompute_blocks": "auto", "checkpoint.every": 0}), tmp_path)
    assert len(records) == 6
    searches = [r for r in _log(tmp_path) if r["event"] == "recompute_search"]
    assert [(r["step"], r["data_step"], r["recompute_blocks"]) for r in searches] == [(0, 0, 2), (1, 1, 2), (2, 2, 3)]
    assert [[p["recompute_blocks"] for p in r["probes"]] for r in searches] == [[4, 1, 2], [2], [2, 4, 3]]
    assert [r["extents"] for r in searches] == [[[380, 428, 588]], [[355, 410, 826]], [[380, 438, 886]]]
    assert searches[0]["reason"] == "not searched yet"
    assert searches[2]["reason"] == ("a microbatch of 380 rows, 438 KDA rows and 886 key/value rows that no "
                                     "microbatch searched on covers")
    assert ran == [4, 1, 2, 2, 2, 2, 2, 4, 3, 3, 3, 3, 3]  # each search's probes, then its step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_records_the_peak_memory_of_every_step_and_the_search(tmp_path):
    """On CUDA each step record holds the allocator's peak over that step (reset per step: above the weights, below
    the GPU's total) and recompute_blocks auto searches the GPU for real (the tiny model fits with none recomputed)."""
    config = _config(device="cuda", dtype="bf16", num_steps=3, **{
        "execution.kda_backend": "torch", "execution.recompute": True, "execution.recompute_blocks": "auto"})
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel

    records = train(config, tmp_path)
    total = torch.cuda.get_device_properties(torch.device("cuda")).total_memory
    weights = 2 * sum(p.numel() for p in HybridModel(load_model_config("tiny")).parameters())  # bf16
    assert all(isinstance(r["peak_memory_bytes"], int) and weights < r["peak_memory_bytes"] < total for r in records)
    log = _log(tmp_path)
    (start,) = [r for r in log if r["event"] == "start"]
    search, *again = [r for r in log if r["event"] == "recompute_search"]
    assert start["device_memory_bytes"] == search["device_memory_bytes"] == total
    assert search["recompute_blocks"] == 0 and search["memory_margin"] == 0.05
    assert all(p["fits"] and p["peak_memory_bytes"] <= search["memory_limit_bytes"] for p in search["probes"])
    # Steps with a microbatch outside the searched ones: one try of the 0 blocks found, which fits.
    assert all([(p["recompute_blocks"], p["fits"]) for p in r["probes"]] == [(0, True)] for r in again)


def test_a_non_finite_loss_stops_before_any_update(tmp_path):
    with pytest.raises(ValueError, match=r"step 1 \(.*minus-1000.jsonl\): the loss is inf; the step's old_logprobs "
                                         r"go down to -1000"):
        train(_config(**{"data.trees": BAD_STEP, "data.shuffle": False}), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_run_directory_checks(tmp_path):
    one_step = {"num_steps": 1, "schedule.warmup_steps": 0}
    assert [r["step"] for r in train(_config(**one_step), tmp_path / "new", resume=True)] == [1]  # nothing to resume
    train(_config(**one_step), tmp_path)
    with pytest.raises(ValueError, match="holds an earlier run .*; continue it with --resume"):
        train(_config(**one_step), tmp_path)
    with pytest.raises(ValueError, match=r"config.json: 'train.optimizer.lr' is 0.003 in the checkpoint but 0.1 now"):
        train(_config(**one_step, **{"optimizer.lr": 0.1}), tmp_path, resume=True)
    with pytest.raises(ValueError, match=r"warmup_steps \(2\) exceeds num_steps \(1\)"):
        train(_config(num_steps=1), tmp_path / "other")


def test_resume_fills_keys_an_older_checkpoint_lacks(tmp_path):
    """A checkpoint written before a config key existed resumes when the key is at its default (and not else)."""
    import json

    one_step = {"num_steps": 2, "schedule.warmup_steps": 0}
    train(_config(**one_step), tmp_path, max_steps=1)
    for path in (tmp_path / "checkpoints").glob("*/config.json"):
        saved = json.loads(path.read_text())
        # logprob_grad_precision came first; dtype, keep_kda_intermediates and experts_backend with the one execution
        # config (the dtype then defaults by device: fp32 here).
        # mtp_loss_scaling_factor came with MTP layers.
        for key in ("logprob_grad_precision", "dtype", "keep_kda_intermediates", "experts_backend",
                    "mtp_loss_scaling_factor"):
            del saved["train"]["execution"][key]
        del saved["model"]["mtp"]  # the model config's MTP layers came later
        path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"'train.execution.logprob_grad_precision' is 'fp32' in the checkpoint but "
                                         r"'input' now"):
        train(_config(**one_step, **{"execution.logprob_grad_precision": "input"}), tmp_path, resume=True)
    train(_config(**one_step), tmp_path, resume=True)


def test_the_mtp_loss_factor_is_an_execution_key(tmp_path):
    """A model whose MTP layers' factor is 0 (as a Ling-3.0 checkpoint loads) trains no MTP layer; the execution
    section's mtp_loss_scaling_factor trains them (the step records carry the MTP loss and rows)."""
    import yaml

    from harts.config import config_to_dict
    from harts.model.config import MTPConfig, load_model_config

    model = tmp_path / "tiny-mtp.yaml"
    model.write_text(yaml.safe_dump({**config_to_dict(load_model_config("tiny")), "name": "tiny-mtp",
                                     "mtp": config_to_dict(MTPConfig(num_layers=1, loss_scaling_factor=0.0))}))
    one_step = {"model": str(model), "num_steps": 1, "schedule.warmup_steps": 0}
    (off,) = train(_config(**one_step), tmp_path / "off")
    assert "mtp_loss" not in off
    (on,) = train(_config(**one_step, **{"execution.mtp_loss_scaling_factor": 0.3}), tmp_path / "on")
    assert on["mtp_loss"] > 0 and on["mtp_rows"][0] > 0 and on["policy_loss"] == off["policy_loss"]
    assert on["loss"] == pytest.approx(on["policy_loss"] + on["moe_loss"] + on["mtp_loss"], rel=1e-6)


@pytest.mark.slow
def test_resume_is_exact_with_two_threads(tmp_path):
    # Slow: two runs of four steps with two intra-op threads (up to 50x slower on a loaded 2-core
    # machine, see tests/fixtures.py); the other tests run one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = _config(num_steps=4)
        expected = train(config, tmp_path / "whole")
        with pytest.raises(Kill):
            train(config, tmp_path / "parts", on_step_end=[_kill_after(3)])
        resumed = train(config, tmp_path / "parts", resume=True)
    finally:
        torch.set_num_threads(threads)
    assert _curve(resumed) == _curve(expected[2:])
    final, reference_final = _weights(tmp_path / "parts", 4), _weights(tmp_path / "whole", 4)
    assert all(torch.equal(final[name], reference_final[name]) for name in final)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resume_on_cuda_repeats_the_uninterrupted_run(tmp_path, deterministic_cuda):
    """On CUDA in bf16, under torch's deterministic algorithms, a second uninterrupted run and a killed and resumed
    one repeat the first bit for bit. Without them the runs cannot be compared: on the H200 two uninterrupted runs
    of this config differ by 3e-4 relative in step 1's gradient norm (atomic adds), and by step 4 the gradient
    norms are 0.03 and 0.47 (clipping, expert-bias signs), so any tolerance that two clean runs pass also passes a
    resume that lost state. The tiny model's chunks of 16 take the torch KDA (fla's start at 64)."""
    config = _config(device="cuda", dtype="bf16", **{"execution.kda_backend": "torch"})
    expected = train(config, tmp_path / "first")
    assert _curve(train(config, tmp_path / "second")) == _curve(expected)
    with pytest.raises(Kill):
        train(config, tmp_path / "resumed", on_step_end=[_kill_after(3)])
    resumed = train(config, tmp_path / "resumed", resume=True)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert _curve(resumed) == _curve(expected[2:])
    for run in ("second", "resumed"):
        weights, reference = _weights(tmp_path / run, 6), _weights(tmp_path / "first", 6)
        assert [name for name in reference if not torch.equal(weights[name], reference[name])] == [], run


def test_a_run_killed_before_its_first_checkpoint_restarts_from_step_0(tmp_path):
    """No dead end: resuming a run directory that has a log but no checkpoint starts again, keeping the log."""
    config = _config(num_steps=3, **{"checkpoint.every": 0})  # only the last step checkpoints
    expected = train(config, tmp_path / "whole")
    with pytest.raises(Kill):
        train(config, tmp_path / "killed", on_step_end=[_kill_after(2)])
    assert not list((tmp_path / "killed").glob("checkpoints/step_*"))
    with pytest.raises(ValueError, match="holds an earlier run"):
        train(config, tmp_path / "killed")
    resumed = train(config, tmp_path / "killed", resume=True)
    assert _curve(resumed) == _curve(expected)
    assert _curve(_logged_steps(tmp_path / "killed")) == _curve(expected)  # the killed run's two steps were removed
    lines = [json.loads(line) for line in (tmp_path / "killed" / LOG_NAME).read_text().splitlines()]
    assert [(r["event"], r.get("resumed_from")) for r in lines if r["event"] == "start"] == [("start", None)] * 2


@pytest.mark.parametrize("damage", ["middle", "non-utf8-middle"])
def test_a_damaged_log_line_before_the_last_is_refused_and_kept(tmp_path, damage):
    """Only the line being appended can be torn (a kill, a full disk): a damaged earlier line means the log was
    altered, so a resume refuses it by line number and leaves the log as it was (a torn last line is removed:
    tests/test_files.py)."""
    one_step = {"num_steps": 2, "schedule.warmup_steps": 0}
    train(_config(**one_step), tmp_path / "run", max_steps=1)
    log = tmp_path / "run" / LOG_NAME
    lines = log.read_bytes().splitlines(keepends=True)
    bad = b'{"event": "step", "note": "caf\xe9"}\n' if damage == "non-utf8-middle" else b'{"event": "st\n'
    damaged = b"".join([lines[0], bad, *lines[1:]])
    log.write_bytes(damaged)
    with pytest.raises(ValueError, match=rf"{LOG_NAME}: line 2: not a JSON record"):
        train(_config(**one_step), tmp_path / "run", resume=True)
    assert log.read_bytes() == damaged


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    one_step = {"num_steps": 2, "schedule.warmup_steps": 0}
    train(_config(**one_step), tmp_path / "run", max_steps=1)
    train(_config(**one_step, seed=4), tmp_path / "other", max_steps=1)
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    shutil.copytree(tmp_path / "other" / "checkpoints", tmp_path / "run" / "checkpoints")
    # What a bare --resume does: the checkpoint's own config, which matches it.
    with pytest.raises(ValueError, match=r"train.jsonl: 'train.seed' is 3 in the run's first start but 4 now "
                                         r"\(step_000001 is not this run's\?\)"):
        train(_config(**one_step, seed=4), tmp_path / "run", resume=True)


def test_changed_data_steps_are_refused_by_name(tmp_path):
    synth = load_config(MICRO, SynthConfig)
    steps = tmp_path / "steps"
    steps.mkdir()
    for index in range(3):
        write_step(generate_step(synth, 0, index), steps / f"step_{index:03d}.jsonl")
    config = _config(**{"data.trees": str(steps), "data.shuffle": False, "num_steps": 3,
                        "schedule.warmup_steps": 0})
    train(config, tmp_path / "run", max_steps=2)
    start = json.loads((tmp_path / "run" / LOG_NAME).read_text().splitlines()[0])
    assert start["data"]["num_steps"] == 3 and len(start["data"]["sha256"]) == 64

    write_step(generate_step(synth, 0, 1), steps / "step_001.jsonl")  # regenerated, the same content: resumes
    assert train(config, tmp_path / "run", resume=True, max_steps=2) == []  # checked, then nothing left to do
    (steps / "step_003.jsonl").write_bytes((steps / "step_000.jsonl").read_bytes())
    with pytest.raises(ValueError, match=r"steps has 4 data steps, the checkpoint's run had 3; restore the run's data"):
        train(config, tmp_path / "run", resume=True)
    (steps / "step_003.jsonl").unlink()
    write_step(generate_step(synth, 99, 1), steps / "step_001.jsonl")
    with pytest.raises(ValueError, match=r"step_001.jsonl: data step 1 has changed since step_000002 \(sha256 \w{12}"
                                         r"\.\.\. then, \w{12}\.\.\. now\); restore the run's data, or pass "
                                         r"--accept-changed-data"):
        train(config, tmp_path / "run", resume=True)
    assert [r["step"] for r in train(config, tmp_path / "run", resume=True, accept_changed_data=True)] == [3]
