"""The local profile stage: prefill and per-token decode inside a transformers model.

- ``measure``: the two phases (gpt-fast's ``prefill`` / ``decode_one_token``), the timer and
  :func:`~tasks.profile.measure.profile_point`, one point on a loaded model;
- ``grid``: which points a sweep runs (:class:`~tasks.profile.grid.ProfilePoint`) and the checks
  made before anything heavy;
- ``runner``: a sweep of points over one model spec, points that may not fit in child processes;
- ``memory``: KV-cache formula and measured bytes, weights, RSS sampler, CUDA peak, estimates;
- ``gpu_metrics``: NVML power and utilisation; ``plots``: the profile's PNG charts;
- ``standalone`` / ``__main__``: ``python -m tasks.profile``, torch and transformers only.

Nothing here imports prefect or mlflow.
"""
