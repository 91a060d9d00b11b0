"""The local profile stage: prefill and per-token decode inside a transformers model.

- ``measure``: :func:`~tasks.profile.measure.profile_point`, one point on a loaded model, and
  its prompt ids;
- ``phases``: the two phases (gpt-fast's ``prefill`` / ``decode_one_token``) and one timed run;
- ``timing``: the device, the :class:`~tasks.profile.timing.Timer` on its clock, percentiles;
- ``result``: the typed results (``PointMeasurement``, ``ProfilePointResult``); their
  ``to_dict()`` is the JSON contract;
- ``grid``: which points a sweep runs (:class:`~tasks.profile.grid.ProfilePoint`) and the checks
  made before anything heavy;
- ``runner``: a sweep of points over one model spec, points that may not fit in child processes;
- ``gpu_metrics``: NVML power and utilisation; ``plots``: the profile's PNG charts;
  ``journal``: the points written to the run's work folder;
- ``standalone`` / ``__main__``: ``python -m tasks.profile``, torch and transformers only.

Memory (the KV-cache formulas, the estimate checked before a point, the live readings) is the
room of its own ``tasks.memory``. Nothing here imports prefect or mlflow.
"""
