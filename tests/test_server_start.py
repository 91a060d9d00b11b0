"""A server that does not start says what failed (issue 31, item 4): the lines of its log that
name the error (tasks.engines.server_log.error_lines) come first, in the message's first line too, before
the log's tail; before, the message ended with the log's last 20 lines, for llama.cpp's server
the tail of argparse's help text, while the error was at the log's top."""

from __future__ import annotations

import time

import pytest

from tasks.engines.server import ServerStartError, embedded_server
from tasks.engines.server_log import error_lines

#: What llama-cpp-python 0.3.36's server wrote for ``--n_threads -5`` (its help cut to a few
#: options): pydantic's validation, then the whole of argparse's help.
LLAMACPP_BAD_OPTION = """\
1 validation error for ModelSettings
n_threads
  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=-5, input_type=int]
    For further information visit https://errors.pydantic.dev/2.14/v/greater_than_equal
usage: __main__.py [-h] [--model MODEL] [--model_alias MODEL_ALIAS]
                   [--n_gpu_layers N_GPU_LAYERS] [--split_mode SPLIT_MODE]

🦙 Llama.cpp python server. Host your own LLMs!🚀

options:
  -h, --help            show this help message and exit
  --n_threads N_THREADS
                        The number of threads to use. Use -1 for max cpu
                        threads (default: 1)
  --verbose VERBOSE     Whether to print debug information. (default: True)
  --config_file CONFIG_FILE
                        Path to a config file to load.
"""

#: vLLM's API server refusing its configuration: its processes' prefixes, INFO lines, the
#: traceback's frames, then the exception and pydantic's message.
VLLM_REFUSED = """\
INFO 12-02 10:00:01 [__init__.py:241] Automatically detected platform cpu.
(APIServer pid=4242) INFO 12-02 10:00:04 [api_server.py:1805] vLLM API server version 0.32.0
(APIServer pid=4242) Traceback (most recent call last):
(APIServer pid=4242)   File "<frozen runpy>", line 198, in _run_module_as_main
(APIServer pid=4242)   File "vllm/engine/arg_utils.py", line 1201, in create_model_config
(APIServer pid=4242)     raise ValueError(f"invalid max_model_len: {value}")
(APIServer pid=4242) pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
(APIServer pid=4242)   Value error, User-specified max_model_len (100000) is greater than the derived max_model_len (8192). [type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]
(APIServer pid=4242)     For further information visit https://errors.pydantic.dev/2.11/v/value_error
"""

#: argparse refusing a value: the usage, then its ``prog: error:`` line.
ARGPARSE_REFUSED = """\
usage: __main__.py [-h] [--model MODEL] [--n_threads N_THREADS]
__main__.py: error: argument --n_threads: invalid int value: 'two'
"""


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (
            LLAMACPP_BAD_OPTION,
            [
                "1 validation error for ModelSettings",
                "n_threads: Input should be greater than or equal to 1 "
                "[type=greater_than_equal, input_value=-5, input_type=int]",
            ],
        ),
        (
            VLLM_REFUSED,
            [
                "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
                "Value error, User-specified max_model_len (100000) is greater than the derived "
                "max_model_len (8192). [type=value_error, input_value=ArgsKwargs((), {}), "
                "input_type=ArgsKwargs]",
            ],
        ),
        (ARGPARSE_REFUSED, ["__main__.py: error: argument --n_threads: invalid int value: 'two'"]),
        ("INFO: loading the model\nINFO: still loading\n", []),  # nothing names an error: the tail
    ],
)
def test_the_lines_that_name_the_error_are_picked_and_the_help_text_is_not(log, expected) -> None:
    assert error_lines(log) == expected


def test_many_errors_keep_the_first_and_the_last_each_once() -> None:
    log = "\n".join(f"ERROR worker {i % 20}: failed" for i in range(100))  # 20 distinct, repeated
    picked = error_lines(log, limit=6)
    assert picked == [*(f"ERROR worker {i}: failed" for i in range(4)), "...", *(
        f"ERROR worker {i}: failed" for i in (18, 19)
    )]  # fmt: skip


def test_a_llamacpp_server_with_a_bad_option_says_what_failed_first(tmp_path) -> None:
    """The embedded llama.cpp server given ``--n_threads -5`` (what ``infermeter tune
    --server-param n_threads=-5`` starts): the message's first line, the one ``tune`` prints,
    names the field and pydantic's reason; the log's tail (argparse's help) comes after."""
    started = time.monotonic()
    with pytest.raises(ServerStartError) as caught:
        with embedded_server(extra_args=["--n_threads", "-5"], log_dir=tmp_path, startup_timeout_s=60):
            pytest.fail("the server should not have become healthy")
    assert time.monotonic() - started < 30  # about 1 s here: the server exits at once
    first, *rest = str(caught.value).splitlines()
    assert first == (
        "llamacpp server exited with code 1 before it was healthy: 1 validation error for "
        "ModelSettings | n_threads: Input should be greater than or equal to 1 "
        "[type=greater_than_equal, input_value=-5, input_type=int]"
    )
    assert rest[0] == f"its log ({tmp_path / 'llamacpp_server.log'}) says what failed:"
    assert "  n_threads: Input should be greater than or equal to 1" in rest[2]
    assert rest[3] == "and ends:" and "--config_file" in "\n".join(rest[4:])  # the help's tail
