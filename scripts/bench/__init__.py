"""Benchmarks, one job a module, run from the repository root:

    python -m scripts.bench.decode        decoding strategies side by side (lookahead, auto, transformers)
    python -m scripts.bench.ar            autoregressive throughput against transformers and the memory bandwidth
    python -m scripts.bench.exactness     where greedy lookahead and autoregressive outputs part, and why
    python -m scripts.bench.ablation      compression with and without the bonus token and the prompt pool
    python -m scripts.bench.matmul_floor  the weight matmuls of one token, alone: the floor under a decode step

common.py holds what they share (prompt sets, settings, the machine record, output files, the usage error);
contenders.py and timing.py the side-by-side timed loop of decode and ar; plots.py all matplotlib code.
transformers and matplotlib are benchmark-only dependencies: pip install -e ".[bench]".
"""
