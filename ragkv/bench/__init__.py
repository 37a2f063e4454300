"""``ragkv bench``: workloads, the four lanes, and the report that shows the savings stack.

- :mod:`ragkv.bench.workload`: synthetic (bundled corpus, BM25, Zipf, sessions) and trace
  workloads as lists of :class:`~ragkv.bench.workload.RequestSpec`.
- :mod:`ragkv.bench.lanes`: ``no-cache``, ``apc``, ``apc+assembler``, ``ragkv`` and the replay.
- :mod:`ragkv.bench.runner`: one engine configuration for every lane; :func:`run_bench`.
- :mod:`ragkv.bench.report`: table, JSON (stable keys), determinism check, plot.
"""
