from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harts.config import config_to_dict, load_config, load_yaml_mapping, shipped_config_path, shipped_configs


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


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
"""The "billion laughs": 9^9 strings from 415 bytes of YAML through shared aliases."""


@pytest.mark.parametrize("text, message", [
    (BOMB, "line 2: YAML aliases (*a) are not accepted"),
    ("name: x\ninner: {size: 3}\nname: y\n", "line 3: duplicate key 'name'"),
    ("name: x\ninner: {size: 4611686018427387904}\n", "line 2: integer 4611686018427387904 is too large"),
    ("name: x\ninner: {size: -4611686018427387904}\n", "line 2: integer -4611686018427387904 is too large"),
], ids=["alias-bomb", "duplicate-key", "integer-2^62", "integer-minus-2^62"])
def test_yaml_beyond_plain_bounded_data_is_refused_at_once(tmp_path, text, message):
    import time

    path = _write(tmp_path, text)
    start = time.perf_counter()
    with pytest.raises(ValueError) as error:
        load_config(path, Outer)
    assert time.perf_counter() - start < 1.0
    assert str(error.value).startswith(f"{path}: invalid YAML ({message}")
    # Anchors alone hold no alias, and an integer below the bound is fine.
    assert load_config(_write(tmp_path, "name: &n x\ninner: {size: 4611686018427387903}\n"), Outer).inner.size > 0


def test_a_wrong_value_is_shown_with_its_type_and_a_bounded_excerpt(tmp_path):
    path = _write(tmp_path, "name: x\ninner: {size: [" + ", ".join(f'"{"y" * 5000}"' for _ in range(50)) + "]}\n")
    with pytest.raises(ValueError) as error:
        load_config(path, Outer)
    message = str(error.value)
    assert message.startswith(f"{path}: key 'inner.size': expected an integer, got list ['yyy")
    assert len(message) < len(str(path)) + 400


@pytest.mark.parametrize("name", ["paper", "cpu-small", "cpu-deep", "tiny"])
def test_shipped_tree_configs_load(name):
    from harts.trees.synth import SynthConfig

    load_config(f"configs/trees/{name}.yaml", SynthConfig)


REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("folder", ["models", "parallel", "trees"])
def test_shipped_configs_are_the_repository_ones(folder):
    # The installed package data and configs/ are one set of files (package-dir maps one to the other).
    shipped = shipped_configs(folder)
    assert sorted(shipped) == sorted(p.stem for p in (REPO_CONFIGS / folder).glob("*.yaml"))
    for name, entry in shipped.items():
        assert entry.read_text(encoding="utf-8") == (REPO_CONFIGS / folder / f"{name}.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "argument, folder, expected",
    [("tiny", "models", "models/tiny.yaml"), ("dp2-ep2", "parallel", "parallel/dp2-ep2.yaml"),
     ("paper-slice", "trees", "trees/paper-slice.yaml")],
    ids=["model", "parallel", "trees"],
)
def test_a_name_resolves_to_the_shipped_file(argument, folder, expected):
    resolved = shipped_config_path(argument, folder)
    assert resolved.read_text(encoding="utf-8") == (REPO_CONFIGS / expected).read_text(encoding="utf-8")


@pytest.mark.parametrize("argument", ["tiny.yaml", "elsewhere/tiny.yml", "configs/models/h200.yaml"],
                         ids=["bare-file", "missing-folder", "repo-path"])
def test_a_path_stays_a_path(argument, tmp_path, monkeypatch):
    # Relative to the working directory, never looked up among the shipped configs.
    monkeypatch.chdir(tmp_path)
    assert shipped_config_path(argument, "models") == Path(argument)
    with pytest.raises(ValueError, match=f"^{argument}: no such config file$"):
        load_yaml_mapping(shipped_config_path(argument, "models"))


@pytest.mark.parametrize(
    "folder, message",
    [("models", "unknown model 'nope' (known: bailing-tiny, cpu-small, gdn-h200, gdn-tiny, h200, kimi-tiny, "
                "ling3-tiny, ling3-tiny-8l, ling3-tiny-mtp, ling3-tiny-shape, tiny; or give a path)"),
     ("trees", "unknown trees config 'nope' (known: cpu-deep, cpu-small, gpu-deep, paper, paper-4x, paper-capped, paper-slice, "
                "tiny; or give a path)")],
    ids=["model", "trees"],
)
def test_an_unknown_name_lists_the_known_ones(folder, message):
    with pytest.raises(ValueError) as error:
        shipped_config_path("nope", folder)
    assert str(error.value) == message


def test_a_source_checkout_without_install_reads_its_configs_folder(monkeypatch):
    """On PYTHONPATH without `pip install`, the package-dir mapping behind harts.configs does not exist."""
    import importlib.resources

    from harts import config as harts_config

    real = importlib.resources.files

    def files(anchor):
        if anchor == "harts.configs":
            raise ModuleNotFoundError("No module named 'harts.configs'")
        return real(anchor)

    monkeypatch.setattr(importlib.resources, "files", files)
    assert harts_config.shipped_config_path("tiny", "models").name == "tiny.yaml"
    assert "paper-slice" in harts_config.shipped_configs("trees")
