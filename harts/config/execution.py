"""How a step is planned and executed: the one execution config of every entry point.

`ExecutionConfig` holds every execution knob (the microbatch planner and capacity, the dtype, the recomputation and
what it keeps, the memory margin of the search for the recomputed blocks, the attention, KDA and experts backends,
the kernel of a Gated DeltaNet baseline, the LM head's chunk and gradient precision, the MTP loss's factor, which
decides whether the MTP layers run), their choices and their rules (`check`), and `resolved(device, execution)`,
the one place that fills the defaults depending on the device and the execution. `StepConfig` (harts.objective.step) extends it with the loss; `harts
train` and `harts rl` read it from their YAML's `execution` section, the benchmarks and the pipeline from their
flags and keys, which are the field names. `add_arguments` makes every surface's flags from the fields, their types,
choices and docstrings (`field_help`), the pipeline's keys (`json_schema`: bounds from `BOUNDS` and `WORDS`, which
`check` applies too) and the bench record's keys likewise, so that a new knob is one field here, its consumer and a
test (docs/development.md "Adding an execution knob"; tests/config/test_adding_a_knob.py). Torch-free:
the command lines build and refuse a bad value before torch is imported; the lower layers take their choice lists
from here (tests/config/test_execution.py checks them against the registries they name).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Any

EXECUTIONS = ("baseline", "compact")
"""The two executions: each trajectory its own packed sequence, or the microbatch's trie (harts.runtime.layout)."""
PLANNERS = ("harts", "treetrain-ortools", "greedy-trie", "per-trajectory")
"""The microbatch planners (harts.planning.microbatch)."""
DTYPES = ("fp32", "bf16")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("naive", "sdpa", "varlen", "flex", "cudnn", "flash4", "triton_tree", "flash4_tree")
"""The MLA backends (harts.ops.attention.groups.BACKENDS)."""
CUDA_ATTENTION_BACKENDS = {"varlen": "torch's varlen flash-attention kernel", "cudnn": "cuDNN's attention kernels",
                           "flash4": "FlashAttention-4's kernels", "triton_tree": "Triton kernels",
                           "flash4_tree": "FlashAttention-4's kernels"}
"""The MLA backends whose kernels run on CUDA only, and what they run: a config resolved for another device refuses
them before a model is built."""
KEEPABLE_ATTENTION_BACKENDS = ("naive", "sdpa", "varlen", "flash4", "triton_tree", "flash4_tree")
"""The MLA backends whose outputs a recomputation can keep (harts.ops.attention.groups.KEEPABLE_BACKENDS)."""
KDA_BACKENDS = ("torch", "fla")
"""The KDA backends (harts.ops.kda.compact)."""
GDN_KERNELS = ("gdn", "kda")
"""The kernels of the per-trajectory baseline's Gated DeltaNet call on the fla backend (harts.ops.gdn.packed): fla's
GDN kernel, or its KDA kernels on the KDA form."""
EXPERT_BACKENDS = ("auto", "loop", "grouped", "lean")
"""The MoE experts' backends (harts.model.moe)."""
KDA_CALLS = ("separate", "linked")
"""How the compact execution's planned KDA calls run on fla (harts.ops.kda.compact.prepare_schedule)."""
GRAD_PRECISIONS = ("fp32", "input")
"""The LM head's logit-gradient precisions (harts.objective.logprobs)."""

DEFAULT_CAPACITY = 65536
DEFAULT_LOGPROB_CHUNK_ROWS = 4096
DEFAULT_MEMORY_MARGIN = 0.05
"""5% of the GPU: 7.2 GB of an H200's 143.8 GB, where `auto` once chose blocks peaking 0.12 GB below the total
(issue 44), and 4 GB of an 80 GB H100."""

AUTO = "auto"
"""recompute_blocks `auto`: the fewest recomputed blocks that fit, found by `harts.engine.Engine.fit_recompute_blocks`
(harts train, harts rl and bench speedup search; the other commands take a number)."""
SEARCH_DEVICES = ("cuda",)
"""The devices where recompute_blocks `auto` can search: it probes for out-of-memory errors, which only a GPU's
allocator raises (on the CPU the system would kill the process). Tests widen it to search simulated memory."""

CHOICES = {
    "execution": EXECUTIONS, "planner": PLANNERS, "dtype": DTYPES, "attention_backend": ATTENTION_BACKENDS,
    "kda_backend": KDA_BACKENDS, "kda_calls": KDA_CALLS, "gdn_kernel": GDN_KERNELS,
    "experts_backend": EXPERT_BACKENDS, "logprob_grad_precision": GRAD_PRECISIONS,
}
"""The fields that take one of a few names, and those names."""

BOUNDS: dict[str, tuple[float, float | None]] = {
    "capacity": (1, None), "recompute_blocks": (0, None), "memory_margin": (0, 1), "logprob_chunk_rows": (1, None),
    "mtp_loss_scaling_factor": (0, None),
}
"""The numeric fields' bounds: (minimum, maximum exclusive or None). An int field takes integers, a float field
finite numbers; `check` refuses what lies outside, and the pipeline's schema states them (`json_schema`)."""
WORDS = {"recompute_blocks": (AUTO,)}
"""The words a numeric field takes besides its numbers."""


PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(dtype="fp32", attention_backend="sdpa", kda_backend="torch", experts_backend="loop"),
    "memory-lean": dict(recompute=True, experts_backend="lean", logprob_chunk_rows=1024),
    "h200-fastest": dict(dtype="bf16", attention_backend="flash4", kda_backend="fla", experts_backend="lean",
                         logprob_grad_precision="input", logprob_chunk_rows=2048, recompute=True, keep_attention=True),
}
"""Settings users pick as a whole (`--preset NAME`; docs/execution.md "Every execution knob"): the CPU's
defaults, spelled out; the least activation memory at a small cost in time (recomputation, the lean experts, a
smaller LM-head chunk); the fastest measured on one H200 (docs/results.md "A stronger baseline": FlashAttention-4,
which needs flash-attn-4, bf16 LM-head gradients, the lean experts; give the recomputed blocks for your model and
capacity, `--recompute-blocks N`, or `auto` on harts train, harts rl and bench speedup). Flags given beside a
preset win."""


def default_planner(execution: str) -> str:
    """The planner of an execution when none is chosen: HARTS for the compact one, per-trajectory for the
    baseline."""
    return "harts" if execution == "compact" else "per-trajectory"


def default_dtype(device: str) -> str:
    return "bf16" if device == "cuda" else "fp32"


def default_attention_backend(device: str) -> str:
    """varlen on CUDA (no optional package, no per-shape plans), sdpa elsewhere."""
    return "varlen" if device == "cuda" else "sdpa"


def default_kda_backend(device: str) -> str:
    """fla's Triton kernels on CUDA, the PyTorch reference elsewhere."""
    return "fla" if device == "cuda" else "torch"


@dataclass(kw_only=True)
class ExecutionConfig:
    """How a step is planned and executed. None fields take the device's or the execution's default
    (`resolved`)."""

    execution: str | None = None
    """baseline (each trajectory its own sequence) or compact (each microbatch's trie once); None: the command's
    (harts train: compact; verify, harts rl and bench speedup run both)."""
    planner: str | None = None
    """The microbatch planner (default: harts for the compact execution, per-trajectory for the baseline)."""
    capacity: int = DEFAULT_CAPACITY
    """T: tokens per microbatch (compact tokens; the baseline's semantic tokens)."""
    dtype: str | None = None
    """fp32 or bf16 (bf16 autocast; default: bf16 on CUDA, fp32 on CPU)."""
    recompute: bool = False
    """Per-layer activation recomputation."""
    recompute_blocks: int | str | None = None
    """With recompute: recompute only blocks 0..N-1 (of each pipeline stage), the others keep their activations
    (Megatron's block method: less recomputation for more memory; default: every block; 0: none, the MTP layers
    still recomputed). auto (harts train, harts rl and bench speedup, on CUDA): the fewest, 0 included, with which
    a step runs and leaves memory_margin of the GPU free."""
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    """With recompute_blocks auto: the share of the GPU's total memory (>= 0, < 1) the search leaves free, for the
    allocator's fragmentation and for steps larger than the one searched: it takes the fewest recomputed blocks
    whose step peaks at most (1 - memory_margin) x the GPU's total memory. A share of the GPU rather than GB, so
    that one value serves an 80 GB and a 141 GB GPU alike."""
    recompute_by_rows: bool = False
    """With recompute_blocks: a microbatch smaller than another of the step keeps more blocks, in proportion to its
    rows (KDA and ancestor-KV rows too), within that one's activation memory. Same values."""
    keep_attention: bool = False
    """With recompute: the recomputed MLA blocks keep their attention kernels' outputs (output and log-sum-exp)
    instead of running the attention again. Same values, more memory (every attention backend but cudnn and
    flex)."""
    keep_kda_intermediates: bool = False
    """With recompute and the fla KDA: the recomputed blocks' KDA calls keep fla's intermediates (WY factors, gated
    q/k, chunk states) from the recomputation for the backward instead of computing them a third time (a transient
    of one block's intermediates)."""
    attention_backend: str | None = None
    """The MLA backend (default: sdpa on CPU, varlen on CUDA; triton_tree and flash4_tree, CUDA only: Triton kernels,
    or FlashAttention-4's with the tree mask as their block sparsity, reading the ancestors' keys and values in place
    through the tree mask, no ancestor-KV copies)."""
    kda_backend: str | None = None
    """The KDA backend (default: torch on CPU, fla on CUDA)."""
    kda_calls: str = "separate"
    """The compact execution's planned KDA calls on fla: separate (one after another, each a launch of every fla
    kernel, the boundary states handed over between them) or linked (all of them as one launch of each kernel per
    KDA layer, whose state kernels hand the states over inside it, so that the chain of dependent chunks is a
    root-to-leaf path, not the calls' longest sequences one after another; on an H100 the same bits as separate,
    the op 9% faster on a paper microbatch but its peak 2.5 GiB higher). Same values (gradients to rounding); a
    schedule without replay, the fidelity ablation, runs its calls one after another either way."""
    gdn_kernel: str = "gdn"
    """A Gated DeltaNet model's per-trajectory baseline on the fla backend: gdn runs fla's chunk_gated_delta_rule,
    kda fla's KDA kernels on the KDA form (the gate broadcast over the key channels), the kernels of the compact
    calls, which always run them. The torch backend runs its one PyTorch form either way. gdn is refused on CUDA
    before a model is built where the installed fla refuses its backward (fla 0.6 on Hopper with Triton >= 3.4.0
    and < 3.7.1)."""
    experts_backend: str | None = None
    """The MoE experts' backend, overriding the model config's moe.experts_backend (auto: grouped on CUDA, loop
    elsewhere; lean: grouped in one autograd node that keeps less for the backward and adds the shared expert's
    output in its combine kernel)."""
    logprob_chunk_rows: int = DEFAULT_LOGPROB_CHUNK_ROWS
    """Rows of the LM head's logits formed at a time (its transient memory: N x vocabulary fp32)."""
    logprob_grad_precision: str = "fp32"
    """The LM head's logit gradients: fp32 (TF32 gradient matmuls for bf16 on CUDA) or input (rounded once to
    bf16, bf16 tensor-core matmuls)."""
    mtp_loss_scaling_factor: float | None = None
    """For a model with MTP layers: the MTP loss's factor (default: the model config's mtp.loss_scaling_factor;
    a Hugging Face checkpoint's, 0 for Ling-3.0's, which trains no MTP layer); 0 runs no MTP layer."""

    def check(self, prefix: str = "", *, as_flags: bool = False) -> None:
        """ValueError naming the field (`prefix` + its name, or with `as_flags` its flag) unless every field has an
        allowed value and the fields agree. Not run on construction, so that a config holding this one names its
        key (`TrainConfig` checks "execution."); `resolved` and `StepConfig` run it."""

        def key(name: str) -> str:
            return flag(name) if as_flags else prefix + name

        for field in dataclasses.fields(ExecutionConfig):
            value = getattr(self, field.name)
            choices = CHOICES.get(field.name)
            if choices is not None and not (value is None and _optional(field)) and value not in choices:
                raise ValueError(f"{key(field.name)} must be one of {choices}, got {value!r}")
            if field.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{key(field.name)} must be true or false, got {value!r}")
            if field.name in BOUNDS and not (value is None and _optional(field)) and value not in WORDS.get(
                    field.name, ()):
                _check_number(key(field.name), value, field)
        needs_recompute = [name for name in ("recompute_blocks", "recompute_by_rows", "keep_attention",
                                             "keep_kda_intermediates") if getattr(self, name) not in (None, False)]
        if needs_recompute and not self.recompute:
            raise ValueError(f"{key(needs_recompute[0])} needs {key('recompute')}")
        if self.recompute_by_rows and self.recompute_blocks is None:
            raise ValueError(f"{key('recompute_by_rows')} scales the blocks {key('recompute_blocks')} keeps: it needs "
                             f"{key('recompute_blocks')}")
        if self.keep_attention and self.attention_backend not in (None, *KEEPABLE_ATTENTION_BACKENDS):
            raise ValueError(f"{key('keep_attention')} needs an attention backend among "
                             f"{', '.join(KEEPABLE_ATTENTION_BACKENDS)} (those whose output a recomputation can keep), "
                             f"got {self.attention_backend!r}")
        if self.keep_kda_intermediates and self.kda_backend not in (None, "fla"):
            raise ValueError(f"{key('keep_kda_intermediates')} keeps fla's KDA intermediates: it needs "
                             f"{key('kda_backend')} 'fla', got {self.kda_backend!r}")

    def resolved(self, device: str, execution: str | None = None, *, as_flags: bool = False, prefix: str = ""):
        """This config (of its own class) with the device's and the execution's defaults filled in: `execution`
        (when this config names none), the planner, the dtype and the attention and KDA backends; checked before
        and after (a rule that holds of the device's default, e.g. fla's KDA for keep_kda_intermediates; recompute
        blocks auto only on a `SEARCH_DEVICES` device; a `CUDA_ATTENTION_BACKENDS` backend only on CUDA), the
        errors naming `prefix` + the key, or with `as_flags` the flag."""
        self.check(prefix, as_flags=as_flags)
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
        if self.recompute_blocks == AUTO and device not in SEARCH_DEVICES:
            name = flag("recompute_blocks") if as_flags else prefix + "recompute_blocks"
            raise ValueError(f"{name} {AUTO} searches a GPU's memory (it probes for out-of-memory errors): it needs "
                             f"device {' or '.join(SEARCH_DEVICES)}, got {device!r}")
        if self.attention_backend in CUDA_ATTENTION_BACKENDS and device != "cuda":
            name = flag("attention_backend") if as_flags else prefix + "attention_backend"
            raise ValueError(f"{name} {self.attention_backend} runs {CUDA_ATTENTION_BACKENDS[self.attention_backend]} "
                             f"on CUDA: it needs device cuda, got {device!r} (on the CPU use sdpa)")
        execution = self.execution or execution
        if execution is not None and execution not in EXECUTIONS:
            raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, got {execution!r}")
        filled = dict(
            execution=execution,
            planner=self.planner or (default_planner(execution) if execution else None),
            dtype=self.dtype or default_dtype(device),
            attention_backend=self.attention_backend or default_attention_backend(device),
            kda_backend=self.kda_backend or default_kda_backend(device),
        )
        resolved = dataclasses.replace(self, **filled)
        resolved.check(prefix, as_flags=as_flags)
        return resolved

    def knobs(self) -> dict[str, Any]:
        """The fields of `ExecutionConfig` (not of a subclass) by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ExecutionConfig)}


def check_run_dtype(dtype: str | None, execution: ExecutionConfig) -> None:
    """A training run's dtype (harts train, harts rl) is its parameters' and its autocast's: execution.dtype, when
    given, is the same (ValueError otherwise)."""
    if None not in (dtype, execution.dtype) and dtype != execution.dtype:
        raise ValueError(f"execution.dtype {execution.dtype!r} differs from dtype {dtype!r}: the run's dtype is its "
                         "parameters' and its autocast's, give one")


def resolved_for_run(dtype: str | None, execution: ExecutionConfig, device: str,
                     execution_name: str | None = None) -> ExecutionConfig:
    """A training run's execution config (harts train, harts rl) resolved for `device`, its dtype the run's:
    `dtype`, else execution.dtype, else the device's default (`check_run_dtype` keeps the two from differing); the
    errors name the YAML section's keys (execution.NAME)."""
    run_dtype = dtype or execution.dtype or default_dtype(device)
    return dataclasses.replace(execution, dtype=run_dtype).resolved(device, execution_name, prefix="execution.")


def _types(field: dataclasses.Field) -> tuple[str, ...]:
    """The types of a field's annotation (`int | str | None` -> int, str, None)."""
    return tuple(part.strip() for part in field.type.split("|"))


def _optional(field: dataclasses.Field) -> bool:
    return "None" in _types(field)


def _check_number(name: str, value: Any, field: dataclasses.Field) -> None:
    """ValueError unless `value` is a number of the field's kind (int, or finite float) within its `BOUNDS`."""
    low, high = BOUNDS[field.name]
    integer = "int" in _types(field)
    kind = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not kind or value < low or (high is not None and value >= high):
        what = f"an int >= {low}" if integer else f"a number >= {low} and < {high}" if high is not None else (
            f"a finite number >= {low}")
        words = "".join(f" or {word!r}" for word in WORDS.get(field.name, ()))
        null = " (or null: the default)" if _optional(field) and field.default is None and not words else ""
        raise ValueError(f"{name} must be {what}{words}{null}, got {value!r}")


FIELDS = tuple(f.name for f in dataclasses.fields(ExecutionConfig))
"""Every knob's name (a flag is `--name-with-dashes`, a YAML key the name)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def field_help(cls: type = ExecutionConfig) -> dict[str, str]:
    """The docstring below each field of dataclass `cls` (and its bases), as one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _positive_int(text: str) -> int:
    from harts.args import positive_int

    return positive_int(text)


def blocks_count(text: str) -> int:
    """argparse type of recompute blocks: a non-negative int (0: none recomputed)."""
    from harts.args import non_negative_int

    return non_negative_int(text)


def auto_or_blocks_count(text: str) -> int | str:
    """argparse type of recompute blocks where a command searches them: a non-negative int or auto."""
    from harts.args import non_negative_int_or

    return non_negative_int_or(text, (AUTO,))


def _fraction(text: str) -> float:
    from harts.args import fraction

    return fraction(text)


def _non_negative_float(text: str) -> float:
    from harts.args import non_negative_float

    return non_negative_float(text)


def argument(name: str, *, default: bool = True, negatable: bool = False) -> tuple[str, dict[str, Any]]:
    """The flag of field `name` and its argparse keywords: its type or choices, its help (the field's docstring)
    and, with `default`, the field's default (a boolean is a store_true flag, or with `negatable` a
    --flag/--no-flag pair whose default is None: an override of a config file). recompute_blocks takes a number
    here (`blocks_count`): a command that searches (`AUTO`) gives it `auto_or_blocks_count`."""
    field = next(f for f in dataclasses.fields(ExecutionConfig) if f.name == name)
    keywords: dict[str, Any] = {"help": field_help()[name].replace("%", "%%")}
    if field.type == "bool":
        keywords["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
    elif name in CHOICES:
        keywords["choices"] = CHOICES[name]
    elif name == "recompute_blocks":
        keywords.update(type=blocks_count, metavar="N")
    elif field.type in ("int", "int | None", "int | str | None"):
        keywords.update(type=_positive_int, metavar="N")
    elif field.type == "float":
        keywords.update(type=_fraction, metavar="F")
    elif field.type == "float | None":
        keywords.update(type=_non_negative_float, metavar="F")
    if default and field.type != "bool":
        keywords["default"] = field.default
    return flag(name), keywords


class PresetAction(argparse.Action):
    """`--preset NAME`: sets each knob of `PRESETS[NAME]` that the command takes and that no flag before it set
    (a flag after it wins as any later flag does)."""

    def __call__(self, parser, namespace, values, option_string=None):
        for name, value in PRESETS[values].items():
            if hasattr(namespace, name) and getattr(namespace, name) == parser.get_default(name):
                setattr(namespace, name, value)
        setattr(namespace, self.dest, values)


def add_preset_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--preset", choices=tuple(PRESETS), action=PresetAction, default=None,
                        help="a named setting of several knobs (" + "; ".join(
                            f"{name}: {', '.join(f'{k}={v}' for k, v in knobs.items())}"
                            for name, knobs in PRESETS.items()) + "); flags given beside it win")


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: tuple[str, ...] = FIELDS, *,
                  exclude: tuple[str, ...] = (), overrides: bool = False, preset: bool = True,
                  **replace: dict[str, Any]) -> None:
    """Add the flags of fields `names` (less `exclude`) to `parser`, each as `argument` makes it (with `overrides`:
    default None and negatable booleans, flags that override a config file) with the keywords of `replace[name]`
    replacing its own (a surface's required flag, or a type taking more words), and with `preset` `--preset`."""
    unknown = set(names) | set(exclude) | set(replace)
    assert unknown <= set(FIELDS), unknown - set(FIELDS)
    for name in names:
        if name in exclude:
            continue
        option, keywords = argument(name, default=not overrides, negatable=overrides)
        parser.add_argument(option, **{**keywords, **replace.get(name, {})})
    if preset:
        add_preset_argument(parser)


def from_arguments(args: argparse.Namespace, names: tuple[str, ...] = FIELDS, *,
                   given: bool = False) -> dict[str, Any]:
    """The values of the flags of `names` that `args` holds, by field name (with `given`, only those not None:
    the overrides given)."""
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return {name: value for name, value in values.items() if value is not None} if given else values


_JSON_TYPES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "None": "null"}


def json_schema(name: str, *, required: bool = False) -> dict[str, Any]:
    """The JSON schema of field `name` as a key of a config file (the pipeline's; harts.workflow.config): its type
    from the annotation, its choices as an enum, its `BOUNDS` and `WORDS`, its docstring as the description and a
    default: the field's, or null for a number (where it means the command's default: a job's command then names
    only the numbers its config sets). `required`: a key the config must give, without null or default."""
    field = next(f for f in dataclasses.fields(ExecutionConfig) if f.name == name)
    nullable = not required and (_optional(field) or name in BOUNDS)
    schema: dict[str, Any] = {}
    if name in CHOICES:
        schema["enum"] = [None, *CHOICES[name]] if nullable else list(CHOICES[name])
    else:
        types = [_JSON_TYPES[part] for part in _types(field) if part != "None"] + ["null"] * nullable
        schema["type"] = types[0] if len(types) == 1 else types
    if name in BOUNDS:
        low, high = BOUNDS[name]
        schema["minimum"] = low
        if high is not None:
            schema["exclusiveMaximum"] = high
    if name in WORDS:
        words = WORDS[name]
        schema["pattern"] = f"^{words[0]}$" if len(words) == 1 else f"^({'|'.join(words)})$"
    if not required:
        schema["default"] = None if nullable else field.default
    schema["description"] = field_help()[name]
    return schema


def markdown_table() -> str:
    """docs/execution.md's table of every knob (tests/test_docs.py checks that the page holds it;
    `python -m harts.config.execution` prints it)."""
    rows = ["| knob (YAML key) | flag | values | default | what it does |", "| --- | --- | --- | --- | --- |"]
    for field in dataclasses.fields(ExecutionConfig):
        if field.name in CHOICES:
            values = ", ".join(f"`{choice}`" for choice in CHOICES[field.name])
        elif field.type == "bool":
            values = "`true`, `false`"
        elif field.name in BOUNDS:
            low, high = BOUNDS[field.name]
            values = (f"an integer >= {low}" if "int" in _types(field) else f"a number >= {low}") + (
                f" and < {high}" if high is not None else "") + "".join(f", `{w}`" for w in WORDS.get(field.name, ()))
        else:
            values = " or ".join(f"`{part}`" for part in _types(field))
        default = "see its text" if field.default is None else f"`{str(field.default).lower()}`" if isinstance(
            field.default, bool) else f"`{field.default}`"
        rows.append(f"| `{field.name}` | `{flag(field.name)}` | {values} | {default} | {field_help()[field.name]} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
