"""The package side of the Snakemake pipeline (Snakefile, workflows/): the GPU pool that gives each job its own
devices (devices) and the pipeline config as the workflow receives it (config)."""
