"""kvconnectors benchmarks: `kvconnectors bench transfer` and `kvconnectors bench tiers`
(also `python -m benchmarks.transfer` / `python -m benchmarks.tiers`)."""
