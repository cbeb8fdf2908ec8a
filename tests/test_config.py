from dataclasses import dataclass, field

import pytest

from harts.config import config_to_dict, load_config


@dataclass(kw_only=True)
class Inner:
    size: int
    ratio: float = 0.5


@dataclass(kw_only=True)
class Outer:
    name: str
    inner: Inner
    flags: list[int] = field(default_factory=list)
    maybe: float | None = None
    enabled: bool = True


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_loads_nested(tmp_path):
    config = load_config(_write(tmp_path, "name: x\ninner: {size: 3}\nflags: [1, 2]\nmaybe: 2\n"), Outer)
    assert config.inner.size == 3 and config.inner.ratio == 0.5 and config.maybe == 2.0
    assert config_to_dict(config) == {"name": "x", "inner": {"size": 3, "ratio": 0.5}, "flags": [1, 2], "maybe": 2.0, "enabled": True}


@pytest.mark.parametrize("text, fragment", [
    ("name: x\ninner: {size: 3, extra: 1}\n", "unknown key 'inner.extra'"),
    ("name: x\n", "missing required key 'inner'"),
    ("name: x\ninner: {size: 3.5}\n", "key 'inner.size': expected an integer"),
    ("name: x\ninner: {size: true}\n", "key 'inner.size': expected an integer"),
    ("name: 4\ninner: {size: 3}\n", "key 'name': expected a string"),
    ("name: x\ninner: {size: 3}\nflags: [a]\n", "key 'flags[0]'"),
    ("name: x\ninner: {size: 3}\nenabled: 1\n", "key 'enabled': expected true or false"),
    ("- 1\n", "expected a mapping"),
    ("name: [\n", "invalid YAML"),
])
def test_strict(tmp_path, text, fragment):
    with pytest.raises(ValueError) as error:
        load_config(_write(tmp_path, text), Outer)
    assert fragment in str(error.value) and "c.yaml" in str(error.value)


@pytest.mark.parametrize("name", ["paper", "cpu-small", "cpu-deep", "tiny"])
def test_shipped_tree_configs_load(name):
    from harts.trees.synth import SynthConfig

    load_config(f"configs/trees/{name}.yaml", SynthConfig)
