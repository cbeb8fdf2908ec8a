"""The records file of `harts bench speedup` and `harts bench fidelity` where --out is not given:
reports/raw/BENCH/MODEL[-PARALLEL].json, named when the command starts, so that the CLI checks it against the inputs
and locks it as it does a given --out (harts.files)."""

from typing import Any


def default_records_path(bench: str, model: str, parallel: str | None) -> str:
    """reports/raw/`bench`/ the model config's name, and the parallel config's after a dash where one is given."""
    from harts.model.config import load_model_config
    from harts.parallel.config import load_parallel_config

    suffix = f"-{load_parallel_config(parallel).name}" if parallel else ""
    return f"reports/raw/{bench}/{load_model_config(model).name}{suffix}.json"


def records_files(bench: str):
    """The `files` of a bench's parser: its records file (--out, or the default, set on the arguments here) and
    its trees."""

    def files(args: Any) -> tuple[list[str], list[str]]:
        if args.out is None:
            args.out = default_records_path(bench, args.model, args.parallel)
        return [args.out], [args.trees]

    return files
