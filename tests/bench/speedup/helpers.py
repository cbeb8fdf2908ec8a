"""Running `harts bench speedup` on the tiny model and checking that a record's figures agree with each other."""

import json

import pytest

from harts.bench.speedup.metrics import execution_times, flops_metrics
from harts.cli.main import main
from harts.config import from_dict
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
