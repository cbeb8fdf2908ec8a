"""`harts trees ...` and `harts plan ...` start fast: they never import torch, fla or megatron."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "fla", "megatron")

COMMANDS = {
    "trees-stats": ["trees", "stats", "--json", "data/samples/tiny-step.jsonl.gz"],
    "trees-validate": ["trees", "validate", "data/samples/tiny-step.jsonl.gz"],
    "trees-ingest": ["trees", "ingest", "--format", "messages", "--tokenizer", "byte",
                     "data/samples/messages.jsonl", "{tmp}/out.jsonl"],
    "trees-synth": ["trees", "synth", "--config", "configs/trees/tiny.yaml", "--steps", "0", "--out", "{tmp}/synth"],
    "trees-synth-by-name": ["trees", "synth", "--config", "tiny", "--steps", "0", "--out", "{tmp}/synth"],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_no_heavy_imports(name, tmp_path):
    argv = [arg.format(tmp=tmp_path) for arg in COMMANDS[name]]
    code = (
        "import sys\n"
        "from harts.cli.main import main\n"
        f"status = main({argv!r})\n"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
        "assert status == 0, status\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
