"""The shipped configurations, installed as the package `harts.configs` (pyproject's package-dir).

models/, parallel/, rl/ and trees/ hold NAME.yaml files that `harts.config.shipped_config_path` resolves
by name; the pipeline*.yaml files beside them belong to the Snakemake workflow and are not installed.
"""
