"""Build the vLLM server command line from the serve config.

One function, so that the process backend, the systemd unit renderer and `eagle3 plan`
all show the very same command line.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from eagle3.config import ServeConfig

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_command(
    serve: ServeConfig,
    model: str,
    served_model_name: str,
    *,
    port: int | None = None,
    trust_remote_code: bool = False,
    speculative_config: dict[str, Any] | None = None,
) -> list[str]:
    """argv that starts vLLM's OpenAI-compatible server for ``model``.

    ``speculative_config`` overrides ``serve.speculative_config`` (the verify stage starts the
    same target once without and once with a draft).
    """
    if serve.entrypoint == "module":
        argv = [serve.vllm_python, "-m", API_SERVER_MODULE, "--model", model]
    else:
        argv = [serve.vllm_bin, "serve", model]
    argv += [
        "--served-model-name",
        served_model_name,
        "--host",
        serve.host,
        "--port",
        str(serve.port if port is None else port),
        "--dtype",
        serve.dtype,
    ]
    if serve.max_model_len:
        argv += ["--max-model-len", str(serve.max_model_len)]
    if serve.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(serve.tensor_parallel_size)]
    if serve.gpu_memory_utilization:
        argv += ["--gpu-memory-utilization", str(serve.gpu_memory_utilization)]
    if trust_remote_code:
        argv += ["--trust-remote-code"]
    if serve.reasoning_parser:
        argv += ["--reasoning-parser", serve.reasoning_parser]
    if serve.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", serve.tool_call_parser]
    if serve.chat_template:
        argv += ["--chat-template", serve.chat_template]
    if serve.enforce_eager:
        argv += ["--enforce-eager"]
    spec = speculative_config if speculative_config is not None else serve.speculative_config
    if spec:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"), sort_keys=True)]
    argv += list(serve.extra_args)
    return argv


def format_command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """A shell-pasteable rendering (environment first)."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items()))
    cmd = shlex.join(argv)
    return f"{prefix} {cmd}" if prefix else cmd
