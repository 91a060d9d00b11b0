"""What the commands print: the consoles, the value formatter and the table frame that fits its
width (``common``), and the tables of one command each (``stream``: cache, turns, outcomes;
``breakdown``: profile's per-part table; ``distribution``: a local sweep's sampler view)."""
