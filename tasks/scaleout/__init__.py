"""Load across processes and hosts: where a stream level's requests are sent from.

:mod:`levels` (the level loop: per level and repeat, the prefix-cache reset, the ``/metrics``
scrapes and gauges around the measured part, then the run here or elsewhere, the repeats pooled),
:mod:`multiproc` (a level over client processes of this machine, each its own event loop and
GIL), :mod:`dask_cluster` (a LocalCluster or a scheduler's workers for the run),
:mod:`dask_load` (a level over Dask workers, on other hosts too), :mod:`dask_wire` (the link
from a worker's client task back to this process) and :mod:`clocksync` (each worker's clock
offset, removed from its stamps).

The seam: the processes and workers run the stream's own level (``tasks.stream.load``) and send
back its records, so this room imports ``tasks.stream``; the level loop sits here, not in the
stream, because it is what chooses among them, so the stream never imports this room (no cycle
between the two). The loop's figures are the stream's (:mod:`tasks.stream.level_figures`), and
what ``task_runner`` may say is the config's (``tasks.config.taskrunner``: its field validates
with it, and the config imports nothing of this room).
"""
