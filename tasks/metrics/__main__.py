"""``python -m tasks.metrics [FILE]``: rewrite FILE's metric table, else print the table."""

import sys
from pathlib import Path

from tasks.metrics.doc import markdown_table, replace_table

if len(sys.argv) > 1:
    path = Path(sys.argv[1])
    path.write_text(replace_table(path.read_text(encoding="utf-8")), encoding="utf-8")
else:
    print(markdown_table(), end="")
