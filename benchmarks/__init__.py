"""The benchmark suite: one question per module group, one runner (`python -m benchmarks run`).

Results and how to run them: benchmarks/RESULTS.md.
"""
