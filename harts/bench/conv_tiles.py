"""`harts bench conv-tiles`: the fused KDA short-conv + SiLU kernels' time over tile shapes, on CUDA.

`harts.ops.conv.fused` launches its shifted kernels at fixed tiles (rows × channels × warps), chosen on
one H200; this benchmark times forward and backward at each tile of `--tiles` on random bf16 rows of a
model's KDA shape (channels = 3 × heads × head dim, the conv width) and checks each against the
default tiles (the forward and dx must be the same bits at every tile; dw within 1e-5, its partial
sums follow the tile's rows), so a user on another GPU can see whether other tiles would be faster.
One record per tile (CUDA events, median of `--repeats` after one warm-up call: `kda_handoff.cuda_timed`),
the defaults marked.
"""

from __future__ import annotations

import argparse
import logging
from functools import partial
from pathlib import Path

from harts.args import positive_int, records_file

logger = logging.getLogger(__name__)

DEFAULT_TILES = "32x128x4,32x64x4,16x128x4,64x64x4,32x128x8,64x128x8,16x64x2,8x256x4,16x256x8"


def parse_tiles(text: str) -> list[tuple[int, int, int]]:
    """'RxCxW,...' → [(rows, channels, warps)]: powers of two, rows and channels ≥ 1, warps in 1..16."""
    tiles = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--tiles: {item.strip()!r} is not ROWSxCHANNELSxWARPS (e.g. 32x128x4)")
        tile = tuple(int(p) for p in parts)
        if any(v < 1 or v & (v - 1) for v in tile) or tile[2] > 16:
            raise ValueError(f"--tiles: {item.strip()!r}: sizes must be powers of two, warps at most 16")
        tiles.append(tile)
    return tiles


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("conv-tiles", help="GPU: time the fused KDA conv + SiLU kernels over tile shapes")
    parser.add_argument("--model", default="ling3-tiny", help="model config whose KDA shape is timed")
    parser.add_argument("--rows", type=positive_int, default=65536, help="rows of the timed call (T)")
    parser.add_argument("--tiles", default=DEFAULT_TILES, help="comma-separated ROWSxCHANNELSxWARPS")
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--out", type=records_file, default="reports/raw/kernels/conv_tiles.json")
    parser.set_defaults(run=run, files=lambda a: ([a.out], []))


def run(args: argparse.Namespace) -> int:
    tiles = parse_tiles(args.tiles)
    import torch

    from harts.bench.kda_handoff import cuda_timed
    from harts.model.config import load_model_config
    from harts.ops.conv.fused import (
        BACKWARD_TILE,
        FORWARD_TILE,
        shifted_conv_silu_backward,
        shifted_conv_silu_forward,
    )
    from harts.tracking.records import error_message, make_record, write_records

    if not torch.cuda.is_available():
        raise ValueError("harts bench conv-tiles: needs a CUDA device (the kernels are Triton's)")
    model = load_model_config(args.model)
    if model.kda is not None:
        kda = model.kda
        parts, channels, width = 3, 3 * kda.num_heads * kda.head_dim, kda.conv_size
    else:
        # GDN's conv runs over q, k and v's concatenated channels as one part (harts.model.gdn).
        gdn = model.gdn
        channels = 2 * gdn.num_key_heads * gdn.key_head_dim + gdn.num_value_heads * gdn.value_head_dim
        parts, width = 1, gdn.conv_size
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, channels, generator=generator, device="cuda").bfloat16()
    weight = (torch.randn(channels, width, generator=generator, device="cuda") * 0.5).bfloat16()
    dy = torch.randn(parts, args.rows, channels // parts, generator=generator, device="cuda").bfloat16()
    y0 = shifted_conv_silu_forward(x, weight, parts)
    dx0, dw0 = shifted_conv_silu_backward(x, weight, dy)
    base = {"model": args.model, "rows": args.rows, "channels": channels, "width": width, "parts": parts,
            "dtype": "bf16", "repeats": args.repeats}
    records = []
    logger.info(f"{'tile':>10} {'forward ms':>11} {'backward ms':>12}  check")
    for tile in tiles:
        config = {**base, "tile": {"rows": tile[0], "channels": tile[1], "warps": tile[2]},
                  "default_forward": tile == FORWARD_TILE, "default_backward": tile == BACKWARD_TILE}
        try:
            y = shifted_conv_silu_forward(x, weight, parts, tile)
            dx, dw = shifted_conv_silu_backward(x, weight, dy, tile)
            dw_error = float((dw - dw0).abs().max() / dw0.abs().max())
            same = torch.equal(y, y0) and torch.equal(dx, dx0) and dw_error < 1e-5
            if not same:
                raise AssertionError(f"tile {tile} computes other values than the default tiles "
                                     f"(dw error {dw_error:.1e})")
            forward = cuda_timed(partial(shifted_conv_silu_forward, x, weight, parts, tile), 1, args.repeats, "cuda")
            backward = cuda_timed(partial(shifted_conv_silu_backward, x, weight, dy, tile), 1, args.repeats, "cuda")
            results = {"forward_ms": forward["median_ms"], "backward_ms": backward["median_ms"],
                       "forward": forward, "backward": backward, "dw_relative_error": dw_error}
            records.append(make_record("conv-tiles", config, results))
            logger.info(f"{'x'.join(map(str, tile)):>10} {results['forward_ms']:11.3f} "
                        f"{results['backward_ms']:12.3f}  ok")
        except Exception as error:  # noqa: BLE001 - a failing tile is an error record, the others still run
            records.append(make_record("conv-tiles", config, error=error_message(error)))
            logger.info(f"{'x'.join(map(str, tile)):>10} error: {error_message(error)}")
        write_records(records, Path(args.out))
    logger.info(f"wrote {len(records)} record(s) to {args.out}")
    return 1 if any("error" in r for r in records) else 0
