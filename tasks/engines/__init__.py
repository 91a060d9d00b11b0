"""The embedded engines' room: the servers this project starts and everything about their life.

- ``server.py``: the embedded OpenAI-compatible servers (llama.cpp, vLLM) and any server a
  command runs in the background: start, health, key, stop, and a death named.
- ``server_log.py``: what a server's log says when it failed.
- ``lifeline.py``: the watcher that stops a server when its command dies in any way.
- ``death.py``: a server that died while a command used it, noticed and named.
- ``build.py``: how llama.cpp is built here (portable, no AMX; cached by its settings).
- ``smoke.py``: one real generation, the install's last step and a check of ``doctor``.

Neither prefect nor mlflow; engines know no MLflow.
"""
