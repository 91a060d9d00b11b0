"""The report stage: is this run better or worse than the baseline?

- ``summary``: the audit's headline metrics and ``summary.md``;
- ``compare``: runs side by side (polars) and their plots;
- ``baseline`` / ``regression``: find the baseline runs, judge each metric, the verdict;
- ``plots``: the stream, tokenize and sweep charts (matplotlib, CJK-capable fonts).
"""
