"""What is sent: workloads that yield requests with their schedule (DESIGN.md, "The house").

A workload knows nothing of HTTP: it turns a file or a description into prompts (built from
token ids where sharing matters), per-request output lengths and, for a recorded trace, the
send times. ``trace.py``: recorded traces (Mooncake JSONL, plain timestamped JSONL).
"""
