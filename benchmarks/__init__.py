"""attnreg's benchmarks (issue 7): ``python -m benchmarks`` runs them, writes JSON, renders docs.

Sections (see ``benchmarks/README.md``): ``ceilings`` (copy bandwidth, bf16
matrix rate), P1/P2 (MLA decode per backend), P3 (split-KV under CUDA graphs),
P4 (8-layer decode step, eager vs graph), ``prefill`` (absorbed vs MHA), P5
(``attnreg compat`` start-up), P6 (per-call overhead of the backend interface).

Performance is measured here, never in timed tests; ``tests/benchmarks`` only
tests the harness logic.
"""
