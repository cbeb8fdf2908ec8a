from pathlib import Path

import jsonschema
import pytest

from harts.workflow.config import coerce_strings, load_schema

SCHEMA = load_schema(Path(__file__).resolve().parents[2] / "workflows/schemas/pipeline.schema.yaml")


def _config(**speedup):
    return {"seed": "3", "datasets": {"tiny": {"synth": "configs/trees/tiny.yaml"}},
            "planning": {"datasets": ["tiny"], "steps": ["0", "1"], "capacity": "512", "dp": "2",
                         "planners": ["harts", "treetrain-ortools"], "time_limit_s": "2.5"},
            "speedup": {"dataset": "tiny", "steps": ["0"], "models": ["tiny"], "parallel": ["single"],
                        "planners": ["harts"], "capacity": "512", "device": "cpu", "dtype": "fp32",
                        "recompute": "true", "repeats": "1", "breakdown": "False", **speedup},
            "fidelity": {"dataset": "tiny", "step": "0", "models": ["tiny"], "parallel": ["single"],
                         "capacity": "512", "device": "cpu", "dtype": "bf16"}}


def test_strings_become_the_schema_types():
    config = coerce_strings(_config(), SCHEMA)
    jsonschema.validate(config, SCHEMA)
    assert config["seed"] == 3 and config["planning"]["steps"] == [0, 1] and config["planning"]["dp"] == 2
    assert config["planning"]["time_limit_s"] == 2.5 and config["speedup"]["capacity"] == 512
    assert config["speedup"]["recompute"] is True and config["speedup"]["breakdown"] is False
    # Names and paths stay strings, even where they look like numbers elsewhere.
    assert config["speedup"]["models"] == ["tiny"] and config["datasets"]["tiny"]["synth"] == "configs/trees/tiny.yaml"


@pytest.mark.parametrize("field, value", [("capacity", "5x12"), ("capacity", "1.5"), ("recompute", "maybe"),
                                          ("repeats", "")], ids=["letters", "fraction", "not-boolean", "empty"])
def test_other_strings_are_left_for_the_validation(field, value):
    config = coerce_strings(_config(**{field: value}), SCHEMA)
    assert config["speedup"][field] == value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, SCHEMA)


def test_exponent_numbers_and_integers_for_numbers():
    config = coerce_strings(_config(), SCHEMA)
    for text, expected in (("1e-3", 1e-3), ("10", 10), ("-.5", -0.5)):
        config["planning"]["time_limit_s"] = text
        assert coerce_strings(config, SCHEMA)["planning"]["time_limit_s"] == expected


def test_nullable_fields_take_their_type_or_null():
    config = coerce_strings(_config(recompute_blocks="4", attention_backend="null"), SCHEMA)
    jsonschema.validate(config, SCHEMA)
    assert config["speedup"]["recompute_blocks"] == 4 and config["speedup"]["attention_backend"] is None
    config = coerce_strings(_config(recompute_blocks="null", attention_backend="flash4"), SCHEMA)
    jsonschema.validate(config, SCHEMA)
    assert config["speedup"]["recompute_blocks"] is None and config["speedup"]["attention_backend"] == "flash4"
    config = coerce_strings(_config(recompute_blocks="auto", compact_recompute_blocks="auto"), SCHEMA)
    jsonschema.validate(config, SCHEMA)
    assert config["speedup"]["recompute_blocks"] == config["speedup"]["compact_recompute_blocks"] == "auto"
    for key, value in (("recompute_blocks", "all"), ("compact_recompute_blocks", "automatic"),
                       ("recompute_blocks", "-1"), ("compact_recompute_blocks", "-1")):
        config = coerce_strings(_config(**{key: value}), SCHEMA)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(config, SCHEMA)


def test_the_schema_offers_every_attention_backend():
    from harts.ops.attention.groups import BACKENDS

    assert SCHEMA["properties"]["speedup"]["properties"]["attention_backend"]["enum"] == [None, *BACKENDS]


def test_the_schema_offers_every_experts_backend():
    from harts.model.moe import EXPERT_BACKENDS

    assert SCHEMA["properties"]["speedup"]["properties"]["experts_backend"]["enum"] == [None, *EXPERT_BACKENDS]
    config = coerce_strings(_config(experts_backend="null"), SCHEMA)
    jsonschema.validate(config, SCHEMA)
    assert config["speedup"]["experts_backend"] is None


@pytest.mark.parametrize("change, message", [
    (lambda c: c["speedup"].update(bogus=1), "pipeline config: key 'speedup': Additional properties are not allowed "
                                             "('bogus' was unexpected)"),
    (lambda c: c["speedup"].update(capacity="5x12"), "pipeline config: key 'speedup.capacity': '5x12' is not of "
                                                     "type 'integer'"),
], ids=["unknown-key", "wrong-type"])
def test_a_bad_pipeline_config_is_one_line_naming_the_key(change, message):
    """Snakemake prints the error of the Snakefile's validate: jsonschema's own is the whole schema (340 lines)."""
    from harts.workflow.config import validate

    config = coerce_strings(_config(), SCHEMA)
    change(config)
    with pytest.raises(ValueError) as error:
        validate(config, SCHEMA)
    assert str(error.value) == message
