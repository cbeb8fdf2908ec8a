"""Without verl, importing harts.integrations.verl is one error naming the extra that installs it (both test
environments: verl is hidden from the import system where it is installed)."""

import importlib
import sys

import pytest

from harts.extras import MissingExtra


def test_without_verl_the_import_names_the_extra(monkeypatch):
    for name in [name for name in sys.modules if name == "verl" or name.startswith("verl.")] + ["verl"]:
        monkeypatch.setitem(sys.modules, name, None)  # import verl... now raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "harts.integrations.verl", raising=False)
    with pytest.raises(MissingExtra, match=r"^harts.integrations.verl needs verl, which is not installed: "
                                           r"pip install 'harts\[verl\]'$"):
        importlib.import_module("harts.integrations.verl")
