import pytest

from harts.training.config import TrainConfig, load_train_config, resolve

YAML = """\
model: tiny
num_steps: 4
data: {trees: tiny, seed: 3}
execution: {capacity: 1024}
loss: {name: ppo, ppo: {clip_ratio_high: 0.28, dual_clip_ratio: 3.0}}
optimizer: {lr: 1.0e-4, weight_decay: 0.0}
schedule: {warmup_steps: 1, decay: cosine, min_lr_ratio: 0.1}
checkpoint: {every: 2}
"""


LOSS_LINE = "loss: {name: ppo, ppo: {clip_ratio_high: 0.28, dual_clip_ratio: 3.0}}"


def _write(tmp_path, text: str):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return path


def test_yaml_sections_load_into_their_dataclasses(tmp_path):
    config = load_train_config(_write(tmp_path, YAML))
    assert isinstance(config, TrainConfig)
    assert (config.model, config.num_steps, config.data.trees, config.data.seed) == ("tiny", 4, "tiny", 3)
    assert config.loss.name == "ppo" and config.loss.ppo.clip_ratio_high == 0.28 and config.loss.ppo.dual_clip_ratio == 3.0
    assert config.optimizer.lr == 1e-4 and config.optimizer.beta2 == 0.999
    assert (config.schedule.warmup_steps, config.schedule.decay, config.checkpoint.every) == (1, "cosine", 2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("optimizer: {lr: 1.0e-4, weight_decay: 0.0}", "optimizer: {lr: 1.0e-4, weight_decay: 0.0, lrr: 1}"),
         "unknown key 'optimizer.lrr'"),
        (("num_steps: 4", "num_step: 4"), "unknown key 'num_step'"),
        (("loss: {name: ppo, ppo: {clip_ratio_high: 0.28, dual_clip_ratio: 3.0}}", "loss: {name: ppo, ppo: {kl_coef: 0.1}}"),
         "unknown key 'loss.ppo.kl_coef'"),
        (("data: {trees: tiny, seed: 3}", "data: {seed: 3}"), "missing required key 'data.trees'"),
        (("execution: {capacity: 1024}", "execution: {capacity: '1024'}"), "key 'execution.capacity': expected an integer"),
        (("schedule: {warmup_steps: 1, decay: cosine, min_lr_ratio: 0.1}", "schedule: {decay: linear}"),
         "schedule.decay must be one of"),
        (("optimizer: {lr: 1.0e-4, weight_decay: 0.0}", "optimizer: {lr: .nan}"), "optimizer.lr must be a finite number"),
        (("execution: {capacity: 1024}", "execution: {planner: best}"), "execution.planner must be one of"),
        (("execution: {capacity: 1024}", "execution: {recompute_blocks: 2}"),
         "execution.recompute_blocks needs execution.recompute"),
        (("execution: {capacity: 1024}", "execution: {recompute: true, recompute_by_rows: true}"),
         "execution.recompute_by_rows scales the blocks execution.recompute_blocks keeps"),
        (("execution: {capacity: 1024}", "execution: {logprob_grad_precision: bf16}"),
         "execution.logprob_grad_precision must be one of"),
        (("execution: {capacity: 1024}", "execution: {attention_backend: flash3}"),
         "execution.attention_backend must be one of .*'flash4'.*, got 'flash3'"),
        (("execution: {capacity: 1024}", "execution: {kda_backend: triton}"), "execution.kda_backend must be one of"),
        (("execution: {capacity: 1024}", "execution: {keep_attention: true}"),
         "execution.keep_attention needs execution.recompute"),
        ((LOSS_LINE, "loss: {pooled_balance_coeff: -1}"),
         "loss.pooled_balance_coeff must be a finite number >= 0, got -1"),
        ((LOSS_LINE, "loss: {pooled_balance_coeff: .inf}"),
         "loss.pooled_balance_coeff must be a finite number >= 0, got inf"),
    ],
    ids=["unknown-nested", "unknown-top", "kl-in-ppo", "missing-trees", "wrong-type", "bad-decay", "nan-lr", "bad-planner",
         "recompute-blocks-alone", "by-rows-without-blocks", "bad-grad-precision", "bad-attention-backend", "bad-kda-backend",
         "keep-attention-alone", "pooled-negative", "pooled-inf"],
)
def test_yaml_is_strict(tmp_path, edit, message):
    old, new = edit
    path = _write(tmp_path, YAML.replace(old, new))
    with pytest.raises(ValueError, match=message) as error:
        load_train_config(path)
    assert str(error.value).startswith(str(path))


def test_overrides_replace_keys_and_are_checked(tmp_path):
    path = _write(tmp_path, YAML)
    config = load_train_config(path, {"optimizer.lr": 0.5, "data.shuffle": True, "execution.execution": "baseline"})
    assert config.optimizer.lr == 0.5 and config.optimizer.weight_decay == 0.0  # the rest of the section stays
    assert config.data.shuffle and config.data.seed == 3 and config.execution.execution == "baseline"
    with pytest.raises(ValueError, match="unknown key 'optimizer.learning_rate'"):
        load_train_config(path, {"optimizer.learning_rate": 0.5})
    with pytest.raises(ValueError, match="key 'model': expected a mapping"):
        load_train_config(path, {"model.name": "tiny"})


def test_flags_alone_make_a_config():
    config = load_train_config(None, {"model": "tiny", "data.trees": "tiny"})
    assert config.data.trees == "tiny" and config.optimizer.lr == 1e-6
    with pytest.raises(ValueError, match="command line: missing required key 'model'"):
        load_train_config(None, {"data.trees": "tiny"})


@pytest.mark.parametrize(
    ("device", "execution", "expected"),
    [
        ("cpu", "compact", ("harts", "sdpa", "torch", "fp32")),
        ("cpu", "baseline", ("per-trajectory", "sdpa", "torch", "fp32")),
        ("cuda", "compact", ("harts", "varlen", "fla", "bf16")),
    ],
    ids=["cpu-compact", "cpu-baseline", "cuda-compact"],
)
def test_resolve_makes_every_default_explicit(device, execution, expected):
    config = load_train_config(None, {"model": "tiny", "data.trees": "tiny", "device": device,
                                      "execution.execution": execution})
    resolved = resolve(config, num_data_steps=7)
    assert resolved.num_steps == 7
    assert (resolved.execution.planner, resolved.execution.attention_backend, resolved.execution.kda_backend,
            resolved.dtype) == expected
    given = load_train_config(None, {"model": "tiny", "data.trees": "tiny", "device": device, "num_steps": 2,
                                     "dtype": "fp32", "execution.planner": "greedy-trie"})
    assert (resolve(given, 7).num_steps, resolve(given, 7).dtype, resolve(given, 7).execution.planner) == (
        2, "fp32", "greedy-trie")


def test_execution_fields_reach_the_step_config():
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.training.loop import engine_of

    config = load_train_config(None, {
        "model": "tiny", "data.trees": "tiny", "execution.recompute": True, "execution.recompute_blocks": 2,
        "execution.logprob_grad_precision": "input", "execution.logprob_chunk_rows": 64,
        "execution.keep_attention": True, "execution.recompute_by_rows": True, "execution.memory_margin": 0.2,
        "loss.name": "ppo", "loss.pooled_balance_coeff": 0.25,
    })
    model = HybridModel(load_model_config("tiny"))
    step = engine_of(resolve(config, num_data_steps=1), model).config
    assert (step.loss, step.pooled_balance_coeff) == ("ppo", 0.25)  # the loss section's fields too
    assert (step.recompute, step.recompute_blocks, step.logprob_grad_precision, step.logprob_chunk_rows) == (
        True, 2, "input", 64)
    assert step.keep_attention and step.recompute_by_rows and step.memory_margin == 0.2
    auto = load_train_config(None, {"model": "tiny", "data.trees": "tiny", "device": "cuda",
                                    "execution.recompute": True, "execution.recompute_blocks": "auto"})
    engine = engine_of(resolve(auto, num_data_steps=1), model)
    assert engine.search_pending and engine.config.recompute_blocks == 4  # every block until the search
