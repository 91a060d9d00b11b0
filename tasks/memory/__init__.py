"""Memory: what a profile point will need and what it took (optimum-benchmark keeps its memory
tracker apart the same way).

:mod:`formula` (the KV-cache formulas and the cache's measured bytes, weight bytes, and the
estimate of a point's need, checked before anything is allocated) and :mod:`readings` (the live
readings: the resident set size and a peak-RSS sampler in a separate process, peak and allocated
CUDA memory, the memory free for a new allocation).

Imports ``tasks.models`` alone (a model's text config); ``tasks.profile`` reads memory through this
room. torch and the standard library only (psutil only in the RSS sampler's own process):
``python -m tasks.profile`` runs on a GPU machine with torch and transformers alone.
"""
