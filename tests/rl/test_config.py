"""The RL config: the shipped files load, defaults resolve by device, bad values name their key."""

import re
from pathlib import Path

import pytest

from harts.rl.config import load_rl_config, resolve

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs" / "rl").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_configs_load(path):
    config = resolve(load_rl_config(path))
    assert config.name == path.stem and config.executions == ["compact", "baseline"]
    assert config.dtype in ("fp32", "bf16") and config.execution.kda_backend in ("torch", "fla")


def test_resolve_by_device(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text("name: x\nmodel: cpu-small\ndevice: cuda\n")
    config = resolve(load_rl_config(path))
    assert (config.dtype, config.execution.attention_backend, config.execution.kda_backend) == ("bf16", "varlen", "fla")
    path.write_text("name: x\nmodel: cpu-small\n")
    config = resolve(load_rl_config(path))
    assert (config.dtype, config.execution.attention_backend, config.execution.kda_backend) == ("fp32", "sdpa", "torch")


@pytest.mark.parametrize("text, message", [
    ("device: cuda\n", "execution.kda_backend fla needs the model's KDA chunk_size 64, model tiny has 16; set "
                       "execution.kda_backend: torch"),
], ids=["fla-with-chunks-of-16"])
def test_resolve_refuses_backends_the_model_cannot_run(tmp_path, text, message):
    path = tmp_path / "rl.yaml"
    path.write_text("name: x\nmodel: tiny\n" + text)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        resolve(load_rl_config(path), where=path)


@pytest.mark.parametrize("text, message", [
    ("model: tiny\n", "missing required key 'name'"),
    ("name: x\nmodel: tiny\nrollout: {samples: 4}\n", "unknown key 'rollout.samples'"),
    ("name: x\nmodel: tiny\nseeds: [0, 0]\n", "seeds must be distinct"),
    ("name: x\nmodel: tiny\nexecutions: [compact, replay]\n", "executions must be distinct names"),
    ("name: x\nmodel: tiny\nnum_steps: 0\n", "num_steps must be >= 1"),
    ("name: x\nmodel: tiny\nloss: {name: ppo}\n", "loss.name must be 'grpo'"),
    ("name: x\nmodel: tiny\nexecution: {planner: magic}\n", "execution.planner must be one of"),
    ("name: x\nmodel: tiny\nexecution: {execution: compact}\n", "harts rl runs the executions of `executions`"),
    ("name: x\nmodel: tiny\ndtype: fp32\nexecution: {dtype: bf16}\n", "execution.dtype 'bf16' differs from dtype"),
    ("name: x\nmodel: tiny\nexecution: {capacity: 0}\n", "execution.capacity must be an int >= 1"),
    ("name: x\nmodel: tiny\nwarm_start: {accuracy: 1.5}\n", "warm_start.accuracy must be in"),
    ("name: x\nmodel: tiny\nenv: {num_values: 40}\n", "num_values must be in"),
    ("name: x\nmodel: tiny\nrollout: {top_p: 0}\n", "rollout.top_p must be in"),
    ("name: x\nmodel: tiny\nexecution: {recompute_blocks: 1}\n",
     "execution.recompute_blocks needs execution.recompute"),
    ("name: x\nmodel: tiny\nexecution: {recompute: true, recompute_by_rows: true}\n",
     "execution.recompute_by_rows scales the blocks execution.recompute_blocks keeps"),
    ("name: x\nmodel: tiny\nexecution: {logprob_grad_precision: tf32}\n", "execution.logprob_grad_precision must be"),
    ("name: x\nmodel: tiny\nexecution: {kda_backend: triton}\n",
     re.escape("execution.kda_backend must be one of ('torch', 'fla'), got 'triton'")),
    ("name: x\nmodel: tiny\nexecution: {attention_backend: flash}\n", "execution.attention_backend must be one of"),
    ("name: x\nmodel: tiny\nexecution: {recompute: true, keep_attention: true, attention_backend: flex}\n",
     "execution.keep_attention needs an attention backend among"),
], ids=["no-name", "unknown-key", "repeated-seed", "unknown-execution", "no-steps", "ppo", "planner", "execution-given",
        "dtype-differs", "zero-capacity", "accuracy",
        "values", "top-p", "recompute-blocks-alone", "by-rows-without-blocks", "grad-precision", "kda-backend", "attention-backend",
        "keep-attention-flex"])
def test_bad_configs_name_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "rl.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        load_rl_config(path)
    assert str(error.value).startswith(str(path))


@pytest.mark.parametrize("text, message", [
    ("env: {text_vocab: 200}\n", "env.text_vocab: the environment's 264 tokens exceed model tiny's vocabulary (256)"),
    ("rollout: {temperature: 0.7}\n", "rollout.temperature and rollout.top_p must be 1 for harts rl"),
    ("rollout: {top_p: 0.9}\n", "rollout.temperature and rollout.top_p must be 1 for harts rl"),
    ("loss: {pooled_balance_coeff: 0.5}\n",
     "loss.pooled_balance_coeff 0.5 on model 'tiny': transformers' load-balancing loss is the softmax one; the model "
     "routes with sigmoid scores"),
    ("execution: {recompute: true, recompute_blocks: auto}\n",
     "execution.recompute_blocks auto searches a GPU's memory (it probes for out-of-memory errors): it needs device "
     "cuda, got 'cpu'"),
], ids=["env-vocab-over-the-model", "temperature", "top-p", "pooled-balance-sigmoid", "recompute-blocks-auto-on-cpu"])
def test_resolve_refuses_what_the_run_would_get_wrong(tmp_path, text, message):
    """Before the warm start: an environment the model cannot embed (an IndexError minutes later), sampling that
    would make the on-policy GRPO step silently off-policy, and a pooled load-balancing loss the model cannot give."""
    path = tmp_path / "rl.yaml"
    path.write_text("name: x\nmodel: tiny\n" + text)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        resolve(load_rl_config(path), where=path)


def test_execution_fields_reach_the_learners(tmp_path):
    from harts.rl.loop import _learner, initial_model

    path = tmp_path / "rl.yaml"
    path.write_text("name: x\nmodel: tiny\nexecution: {recompute: true, recompute_blocks: 1, "
                    "logprob_grad_precision: input, keep_attention: true, recompute_by_rows: true, "
                    "logprob_chunk_rows: 96}\n")
    config = resolve(load_rl_config(path))
    for execution in ("compact", "baseline"):
        step = _learner(execution, initial_model(config, seed=0), config).engine.config
        assert (step.execution, step.recompute, step.recompute_blocks, step.logprob_grad_precision) == (
            execution, True, 1, "input")
        assert step.keep_attention and step.recompute_by_rows and step.logprob_chunk_rows == 96


def test_the_pooled_balance_coeff_reaches_the_learners(tmp_path):
    from harts.rl.loop import _learner, initial_model

    path = tmp_path / "rl.yaml"
    path.write_text("name: x\nmodel: gdn-tiny\nloss: {pooled_balance_coeff: 0.5}\n")
    config = resolve(load_rl_config(path))
    for execution in ("compact", "baseline"):
        assert _learner(execution, initial_model(config, seed=0), config).engine.config.pooled_balance_coeff == 0.5
