"""Running `harts bench speedup` on the tiny model and checking that a record's figures agree with each other; the
search for the recomputed blocks on the CPU against simulated memory (harts.config.execution's `SEARCH_DEVICES`
widened, the device's total and its out-of-memory errors or its probes' answers simulated)."""

import json

import pytest
import torch

from harts import engine as engine_module
from harts import engine_memory
from harts.bench.speedup.metrics import execution_times, flops_metrics
from harts.cli.main import main
from harts.config import execution, from_dict
from harts.engine import Engine
from harts.model.config import ModelConfig
from harts.trees.trie import PrefixIndex


def speedup(args, tmp_path, capsys):
    out = tmp_path / "speedup.json"
    code = main(["bench", "speedup", "--model", "tiny", *args, "--out", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, json.loads(out.read_text()), printed


def check_record(record, step, parallel: str, world_size: int):
    config, results = record["config"], record["results"]
    assert config["parallel"] == parallel and config["world_size"] == world_size
    semantic = step.num_semantic_tokens
    assert results["semantic_tokens"] == semantic
    assert results["baseline"]["attention_pairs"] == sum(int(n) * (int(n) + 1) // 2 for n in step.lengths)
    pairs = (results["compact"]["attention_pairs"], results["baseline"]["attention_pairs"])
    assert results["attention_pair_ratio"] == pairs[0] / pairs[1]
    assert 0 < results["attention_pair_ratio"] < 1
    base, comp = results["baseline"], results["compact"]
    assert base["rows"] == semantic and base["attention_kv_rows"] == semantic
    assert results["compact_tokens"] == comp["rows"] >= results["lower_bound_compact_tokens"]
    assert results["lower_bound_compact_tokens"] == PrefixIndex.from_step(step).segment_tree().num_compact_tokens
    assert results["compression"] == pytest.approx(semantic / comp["rows"])
    for name, execution in (("baseline", base), ("compact", comp)):
        assert len(execution["samples"]) == 1 and len(execution["samples"][0]) == world_size, name
        assert execution_times(execution["samples"]) == {k: execution[k] for k in execution_times(execution["samples"])}
        assert execution["planning_s"] >= execution["layout_s"] > 0
        assert execution["fbg_s"] >= max(execution["forward_s"], execution["backward_s"]) > 0
        assert execution["peak_memory_bytes"] > 0
    assert results["fbg_speedup"] == pytest.approx(base["fbg_s"] / comp["fbg_s"])
    assert results["efficiency"] == pytest.approx(results["fbg_speedup"] / results["compression"])
    model_config = from_dict(ModelConfig, config["model_config"], "record")
    assert {k: results[k] for k in ("flops_compression", "flops_efficiency")} == flops_metrics(model_config, base, comp)


def simulated_device(monkeypatch, total: int = 1 << 50) -> None:
    """Let the CPU search (`SEARCH_DEVICES` widened) a device of `total` bytes (default: more than any probe's RSS,
    so that only the simulated out-of-memory errors bind)."""
    monkeypatch.setattr(execution, "SEARCH_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(engine_memory, "device_memory_bytes", lambda device: total)


def simulated_memory(monkeypatch, fewest):
    """run_step raises out of memory when an execution recomputes fewer blocks than `fewest[execution]`; the
    (execution, blocks) of every step that ran, in order."""
    simulated_device(monkeypatch)
    ran = []
    run_step = engine_module.run_step

    def simulated(model, step, microbatches, config, **kwargs):
        if config.recompute_blocks < fewest[config.execution]:
            raise torch.OutOfMemoryError(f"{config.execution} at {config.recompute_blocks} blocks (simulated)")
        ran.append((config.execution, config.recompute_blocks))
        return run_step(model, step, microbatches, config, **kwargs)

    monkeypatch.setattr(engine_module, "run_step", simulated)
    return ran


def simulated_probes(monkeypatch, fewest, peaks, total: int = 1 << 50):
    """Engine.probe answers from tables: an execution fits from `fewest[execution]` blocks on, with the peak
    `peaks[execution][blocks]`, on a device of `total` bytes; the (execution, blocks) of every probe, in order."""
    simulated_device(monkeypatch, total)
    probed = []

    def simulated(engine, step, planned, blocks):
        execution_name = engine.config.execution
        probed.append((execution_name, blocks))
        return {"recompute_blocks": blocks, "fits": blocks >= fewest[execution_name],
                "peak_memory_bytes": peaks[execution_name][blocks], "seconds": 0.0}

    monkeypatch.setattr(Engine, "probe", simulated)
    return probed
