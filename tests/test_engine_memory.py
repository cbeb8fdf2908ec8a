"""The search of recompute_blocks auto against fake probes (harts.engine_memory.fit_recompute_blocks): the memory
margin's limit (exact at its boundary, with reserved bytes and a peak to stay within), the record it returns, and the
error that names the margin when even every block does not fit."""

import math
import re

import pytest

from harts.engine_memory import fit_recompute_blocks, memory_limit_bytes


def _probes(peaks: dict[int, int], out_of_memory: tuple[int, ...] = ()):
    """A probe answering from a table of peaks by blocks (those in `out_of_memory` ran out of memory, with a peak
    that would fit otherwise); the blocks probed, in order."""
    probed = []

    def probe(n: int) -> dict:
        probed.append(n)
        return {"recompute_blocks": n, "fits": n not in out_of_memory, "peak_memory_bytes": peaks[n], "seconds": 0.0}

    return probe, probed


@pytest.mark.parametrize(("total", "margin", "reserved", "limit"), [
    (1000, 0.05, 0, 950),  # 0.05 as written: 1/20, not the float just above it
    (1000, 0.1, 0, 900),
    (1000, 0.3, 0, 700),
    (1000, 0.0, 0, 1000),
    (1001, 0.05, 0, 950),  # the margin rounds up to a byte: 50.05 -> 51
    (1000, 0.05, 30, 920),
    (143_771_000_000, 0.05, 0, 143_771_000_000 - 7_188_550_000),
    # In binary floats 1000 * (1 - 0.07) is 929.99..., and 100 * 0.07 is 7.000...01 (which rounds up to 8).
    (1000, 0.07, 0, 930),
    (100, 0.07, 0, 93),
], ids=["5%", "10%", "30%", "none", "rounds-up", "reserved", "h200", "7%-of-1000", "7%-of-100"])
def test_the_limit_is_the_total_less_the_margin_and_the_reserved_bytes(total, margin, reserved, limit):
    assert memory_limit_bytes(total, margin, reserved) == limit


@pytest.mark.parametrize(("margin", "found", "probed"), [
    (0.1, 3, [4, 1, 2, 3]),  # limit 900: 2 blocks peak at 901
    (0.099, 2, [4, 1, 2]),  # limit 901: 2 blocks fit exactly at it, 1 block's 960 does not
    (0.04, 1, [4, 1, 0]),  # limit 960: every probe but none recomputed (1,000) fits
    (0.0, 0, [4, 1, 0]),  # limit 1,000: no recomputation fits
    (0.3, 4, [4, 1, 2, 3]),  # limit 700: only every block (700)
], ids=["one-byte-over", "at-the-limit", "all-but-none-fit", "none-recomputed", "only-every-block"])
def test_the_fewest_blocks_whose_peak_leaves_the_margin(margin, found, probed):
    probe, asked = _probes({4: 700, 3: 900, 2: 901, 1: 960, 0: 1000})
    search = fit_recompute_blocks(probe, 4, device_memory_bytes=1000, memory_margin=margin)
    assert search["recompute_blocks"] == found and asked == probed
    assert search["memory_limit_bytes"] == memory_limit_bytes(1000, margin)
    assert (search["memory_margin"], search["device_memory_bytes"], search["reserved_bytes"]) == (margin, 1000, 0)
    assert [p["recompute_blocks"] for p in search["probes"]] == probed
    assert "within_peak_memory_bytes" not in search


def test_a_probe_that_ran_out_of_memory_never_fits():
    """An out-of-memory answer is no even where its peak (measured up to the error) is under the limit."""
    probe, _ = _probes({4: 100, 2: 100, 3: 100, 1: 100}, out_of_memory=(2, 1))
    assert fit_recompute_blocks(probe, 4, device_memory_bytes=1000, memory_margin=0.05)["recompute_blocks"] == 3


def test_reserved_bytes_and_a_peak_to_stay_within_lower_the_limit():
    peaks = {8: 500, 3: 750, 6: 600, 5: 651, 7: 550}
    probe, _ = _probes(peaks)
    search = fit_recompute_blocks(probe, 8, device_memory_bytes=1000, memory_margin=0.1, reserved_bytes=250)
    assert (search["recompute_blocks"], search["memory_limit_bytes"], search["reserved_bytes"]) == (6, 650, 250)
    probe, _ = _probes(peaks)
    search = fit_recompute_blocks(probe, 8, device_memory_bytes=1000, memory_margin=0.1, within_bytes=560)
    assert (search["recompute_blocks"], search["within_peak_memory_bytes"]) == (7, 560)


@pytest.mark.parametrize(("out_of_memory", "message"), [
    ((), "the step does not fit in 0.00 GB (the device's 0.00 GB less memory_margin 0.25) even with every block (4) "
         "recomputed: with every block it peaked at 0.00 GB"),
    ((4,), "even with every block (4) recomputed: with every block it ran out of memory"),
], ids=["over-the-margin", "out-of-memory"])
def test_nothing_fits_is_an_error_naming_the_margin(out_of_memory, message):
    probe, probed = _probes({4: 751}, out_of_memory=out_of_memory)
    with pytest.raises(ValueError, match=re.escape(message)):
        fit_recompute_blocks(probe, 4, device_memory_bytes=1000, memory_margin=0.25)
    assert probed == [4]


def test_the_error_names_the_reserved_bytes_and_the_peak_to_stay_within():
    probe, _ = _probes({2: 95 * 10**8})
    with pytest.raises(ValueError) as error:
        fit_recompute_blocks(probe, 2, device_memory_bytes=10**10, memory_margin=0.05, reserved_bytes=2 * 10**8,
                             within_bytes=9 * 10**9, within="the baseline's peak")
    assert str(error.value) == (
        "the step does not fit in 9.30 GB (the device's 10.00 GB less memory_margin 0.05 and 0.20 GB reserved) and "
        "within the baseline's peak (9.00 GB) even with every block (2) recomputed: with every block it peaked at "
        "9.50 GB")


@pytest.mark.parametrize("num_blocks", [1, 3, 24])
def test_every_threshold_of_the_limit(num_blocks):
    """Peaks falling by 10 bytes a block: for every limit, the answer is the fewest blocks under it (0 included),
    in at most 1 + ceil(log2(num_blocks + 1)) probes."""
    peaks = {n: 1000 - 10 * n for n in range(num_blocks + 1)}
    for fewest in range(num_blocks + 1):
        limit = peaks[fewest]
        probe, probed = _probes(peaks)
        # A device whose 50% margin leaves exactly `limit`.
        search = fit_recompute_blocks(probe, num_blocks, device_memory_bytes=2 * limit, memory_margin=0.5)
        assert search["recompute_blocks"] == fewest, (fewest, probed)
        assert len(probed) <= 1 + math.ceil(math.log2(num_blocks + 1))


@pytest.mark.parametrize(("at_least", "found", "probed"), [
    (3, 3, [3]),  # the blocks found before still fit: one probe
    (None, 3, [8, 3, 1, 2]),  # a first search bisects from every block
    (2, 3, [2, 8, 5, 3]),  # they do not: every block, then a bisection above them
    (6, 6, [6]),
    (8, 8, [8]),
    (0, 3, [0, 8, 4, 2, 3]),  # none recomputed before (a smaller step): every block, then a bisection
], ids=["still-fit", "first-search", "above-them", "more-than-needed", "every-block", "from-none"])
def test_a_search_again_starts_from_the_blocks_found(at_least, found, probed):
    """A search after an earlier one tries the blocks it found first and never answers fewer."""
    probe, asked = _probes({n: 1000 - 100 * n for n in range(9)})
    search = fit_recompute_blocks(probe, 8, device_memory_bytes=1400, memory_margin=0.5, at_least=at_least)
    assert (search["recompute_blocks"], asked) == (found, probed)
    assert [p["recompute_blocks"] for p in search["probes"]] == probed


def test_a_search_again_from_one_block_is_one_probe():
    """1 block found before (the tiny model on a GPU): a search again tries 1 alone, not every block first."""
    probe, asked = _probes({n: 100 for n in range(1, 5)})
    assert fit_recompute_blocks(probe, 4, device_memory_bytes=1000, memory_margin=0.05, at_least=1)[
        "recompute_blocks"] == 1 and asked == [1]


def test_an_error_of_a_probes_own_step_passes_through():
    """A ValueError of the step itself (a loss that needs inputs the step lacks) is not "does not fit"."""

    def probe(n: int) -> dict:
        raise ValueError("the step's own error")

    with pytest.raises(ValueError, match="^the step's own error$"):
        fit_recompute_blocks(probe, 4, device_memory_bytes=1000, memory_margin=0.05)


@pytest.mark.parametrize(("at_least", "probed"), [(3, [3, 4]), (4, [4])], ids=["below-every-block", "every-block"])
def test_a_search_again_that_nothing_fits_is_an_error(at_least, probed):
    probe, asked = _probes({n: 800 for n in range(1, 5)}, out_of_memory=(1, 2, 3, 4))
    with pytest.raises(ValueError, match=re.escape("even with every block (4) recomputed: with every block it ran out "
                                                   "of memory")):
        fit_recompute_blocks(probe, 4, device_memory_bytes=1000, memory_margin=0.25, at_least=at_least)
    assert asked == probed
