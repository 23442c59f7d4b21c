"""kvconnectors benchmarks: `kvconnectors bench transfer` and `kvconnectors bench tiers`
(also `python -m kvconnectors.benchmarks.transfer` / `python -m kvconnectors.benchmarks.tiers`)."""
