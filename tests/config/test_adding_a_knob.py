"""Adding a knob is one field of harts.config.execution.ExecutionConfig (and, for a number, its `BOUNDS`): shown by
adding one. A fresh interpreter loads harts.config.execution from a copy of its source with a field `demo_rows`
(an int >= 2 or null) added, before anything imports it, and reports what every surface then offers; nothing else
is edited. The field must be a flag with the docstring as help on train-step, verify, harts train, harts rl and
bench speedup (a `--variant` flag too, whose variant measures a baseline of its own rather than reusing the run's),
a key of harts train's YAML `execution` section (refused below its bound), a key of the pipeline's `speedup`
section (its schema property made from the field, a job's flag), and a key of the bench speedup record's config.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELP = "A knob that only tests/config/test_adding_a_knob.py adds, in its own interpreter: rows of nothing."

SCRIPT = r'''
import argparse, contextlib, importlib.util, io, json, os, sys
from pathlib import Path

import harts.config

tmp = Path(sys.argv[1])
source = Path(harts.config.__file__).with_name("execution.py").read_text(encoding="utf-8")
field = '    demo_rows: int | None = None\n    """HELP"""\n\n    def check(self'
bounds = 'BOUNDS: dict[str, tuple[float, float | None]] = {\n    "demo_rows": (2, None),'
patched = source.replace("    def check(self", field, 1).replace("BOUNDS: dict[str, tuple[float, float | None]] = {",
                                                                   bounds, 1)
assert patched.count("demo_rows") == 2
(tmp / "execution.py").write_text(patched, encoding="utf-8")
spec = importlib.util.spec_from_file_location("harts.config.execution", tmp / "execution.py")
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
harts.config.execution = module

from harts.cli.main import build_parser, main

found = {"fields": list(module.FIELDS), "help": {}}
for words in (["train-step"], ["verify"], ["train"], ["rl"], ["bench", "speedup"], ["bench", "fidelity"]):
    parser = build_parser()
    for word in words:
        (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = subparsers.choices[word]
    (action,) = [a for a in parser._actions if "--demo-rows" in a.option_strings] or [None]
    found["help"][" ".join(words)] = action and action.help

@contextlib.contextmanager
def surface(name):
    """What fails on one surface is its finding, so that the others are still looked at."""
    try:
        yield
    except BaseException as error:  # argparse's refusal too (SystemExit)
        found[name] = f"failed: {type(error).__name__}: {error}"


from harts.bench.speedup.cli import parse_variant, pipeline_flags
from harts.bench.speedup.reuse import baseline_settings
from harts.bench.speedup.run import run_variants
from harts.training.config import train_config_from_dict
from harts.workflow.config import coerce_strings, load_schema, validate

with surface("variant"):
    found["variant"] = parse_variant("demo-rows=5")
with surface("reuse"):
    own, variant = run_variants(build_parser().parse_args(["bench", "speedup", "--model", "tiny", "--trees", "t",
                                                           "--variant", "demo-rows=5"]))
    found["reuse"] = baseline_settings(own, "fp32") != baseline_settings(variant, "fp32")
run = {"model": "tiny", "data": {"trees": "tiny"}}
with surface("yaml"):
    found["yaml"] = train_config_from_dict({**run, "execution": {"demo_rows": 3}}, "run.yaml").execution.demo_rows
with surface("yaml_refusal"):
    train_config_from_dict({**run, "execution": {"demo_rows": 1}}, "run.yaml")
schema = load_schema(Path("workflows/schemas/pipeline.schema.yaml"))
found["schema"] = schema["properties"]["speedup"]["properties"].get("demo_rows")
section = {"dataset": "tiny", "steps": [0], "models": ["tiny"], "parallel": ["single"], "planners": ["harts"],
           "capacity": 512, "device": "cpu", "dtype": "fp32", "recompute": False, "repeats": 1, "breakdown": False}
config = {"seed": 0, "datasets": {"tiny": {"synth": "configs/trees/tiny.yaml"}},
          "planning": {"datasets": ["tiny"], "steps": [0], "capacity": 512, "dp": 2,
                       "planners": ["harts", "greedy-trie"], "time_limit_s": 1},
          "speedup": {**section, "demo_rows": "4"},
          "fidelity": {"dataset": "tiny", "step": 0, "models": ["tiny"], "parallel": ["single"], "capacity": 512,
                       "device": "cpu", "dtype": "fp32"}}
with surface("pipeline"):
    validate(coerce_strings(config, schema), schema)
    found["pipeline"] = {"value": config["speedup"]["demo_rows"], "flags": pipeline_flags(config["speedup"])}
    validate(defaulted := {**config, "speedup": dict(section)}, schema)
    found["pipeline"]["default"] = defaulted["speedup"].get("demo_rows", "missing")

os.environ["WANDB_MODE"] = "disabled"
with surface("record"), contextlib.redirect_stdout(io.StringIO()):
    code = main(["bench", "speedup", "--model", "tiny", "--trees", "data/samples/tiny-step.jsonl.gz", "--capacity",
                 "1024", "--repeats", "1", "--no-breakdown", "--demo-rows", "3", "--out", str(tmp / "speedup.json")])
    assert code == 0, code
    (record,) = json.loads((tmp / "speedup.json").read_text())
    found["record"] = record["config"].get("demo_rows", "missing")
print(json.dumps(found))
'''.replace("HELP", HELP)


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("knob")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp)], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_field_is_added_in_the_subprocess_only(found):
    from harts.config.execution import FIELDS

    assert found["fields"] == [*FIELDS, "demo_rows"]


@pytest.mark.parametrize("command", ["train-step", "verify", "train", "rl", "bench speedup"])
def test_it_is_a_flag_with_its_help(found, command):
    assert found["help"][command] == HELP


def test_bench_fidelity_takes_only_the_knobs_it_names(found):
    assert found["help"]["bench fidelity"] is None


def test_it_is_a_variant_flag_of_bench_speedup(found):
    assert found["variant"] == {"demo_rows": 5, "variant": "demo-rows=5"}


def test_a_variant_of_it_measures_its_own_baseline(found):
    assert found["reuse"] is True


def test_it_is_a_yaml_key_checked_against_its_bounds(found):
    assert found["yaml"] == 3
    assert found["yaml_refusal"].startswith("failed: ValueError: run.yaml: execution.demo_rows must be an int >= 2")


def test_it_is_a_pipeline_key_made_from_the_field(found):
    assert found["schema"] == {"type": ["integer", "null"], "minimum": 2, "default": None, "description": HELP}
    pipeline = found["pipeline"]
    assert pipeline["value"] == 4 and pipeline["default"] is None and pipeline["flags"][-2:] == ["--demo-rows", "4"]


def test_it_is_in_the_bench_speedup_record(found):
    assert found["record"] == 3
