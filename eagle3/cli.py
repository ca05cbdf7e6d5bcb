"""`eagle3` command line: every stage runs without Prefect.

    eagle3 plan --config configs/kimi-k25-hero.yaml
    eagle3 prepare-model --config configs/smollm2-cpu.yaml
    eagle3 serve --config configs/smollm2-cpu.yaml [--chat "Hi"] [--hold]
    eagle3 render-unit --config configs/kimi-k25-hero.yaml

Errors of the pipeline's own kinds (eagle3.errors) print one line, no traceback; `--debug`
anywhere on the command line (or EAGLE3_DEBUG=1) shows it. SIGTERM and SIGINT stop every server
the command started (eagle3.signals) and say what was saved and how to resume.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli_common import ConfigOpt, SetOpt, fail, load_profile
from eagle3.cli_stages import (
    estimate_acceptance,
    extract,
    generate,
    profile_concurrency_cmd,
    run_stage_cmd,
    train,
    verify,
    vocab,
)

# A command's docstring is its help. Typer's command list keeps a docstring's line breaks, so
# the one-line summaries stay one line even past 100 characters (noqa: E501).
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])


def plan(
    config: ConfigOpt, set_: SetOpt = None, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Print stages, resolved settings, server command lines and artifact locations. Runs nothing."""  # noqa: E501
    from eagle3.plan import build_plan, render_plan

    p = build_plan(load_profile(config, set_))
    typer.echo(json.dumps(p, indent=2) if as_json else render_plan(p))


def preflight(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Check what would stop a hero run on this machine (binaries, units, target, GPUs, disk). Runs nothing."""  # noqa: E501
    from eagle3.preflight import preflight as run_checks
    from eagle3.preflight import render

    checks = run_checks(load_profile(config, set_))
    typer.echo(render(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


def validate(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Load and validate a profile."""
    cfg = load_profile(config, set_)
    typer.echo(f"{config}: ok (profile {cfg.name}, target {cfg.target.model})")


def prepare_model_cmd(config: ConfigOpt, set_: SetOpt = None, no_check: bool = False) -> None:
    """Convert the embedded target's GGUF into a safetensors folder (once, cached by hash)."""
    from eagle3.embedded import EmbeddedModelError, prepare_model

    cfg = load_profile(config, set_)
    if not cfg.target.is_embedded:
        typer.echo(f"target {cfg.target.model} is not embedded: nothing to prepare")
        return
    t0 = time.time()
    try:
        path = prepare_model(cfg.paths.cache_dir, cfg.target.embedded_name, check=not no_check)
    except EmbeddedModelError as e:
        fail(str(e))
    typer.echo(f"{path}  ({time.time() - t0:.1f} s)")


def serve(
    config: ConfigOpt,
    set_: SetOpt = None,
    chat: Annotated[
        str | None, typer.Option(help="Send one chat message once ready, print the answer.")
    ] = None,
    hold: Annotated[bool, typer.Option(help="Keep serving until Ctrl-C.")] = False,
) -> None:
    """Start the target's vLLM server with the configured backend and wait until it is ready."""
    from eagle3.embedded import EmbeddedModelError, resolve_model
    from eagle3.input_checks import check_target_available
    from eagle3.serving.client import chat as chat_once
    from eagle3.serving.readiness import ServerError
    from eagle3.serving.server import start_server

    cfg = load_profile(config, set_)
    check_target_available(cfg, for_server=True)  # a hub id with no network: at once (issue #39)
    try:
        model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
        typer.echo(f"starting {cfg.serve.backend} server for {model} ...")
        with start_server(cfg, model) as server:
            typer.echo(
                f"ready in {server.ready_s:.1f} s at {server.base_url} (model {server.model})"
            )
            if chat:
                r = chat_once(server.base_url, server.model, chat, api_key=server.api_key)
                typer.echo(json.dumps(r.to_dict(), indent=2))
            if hold:
                signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
                # Started from a background job (`cmd &` in a script), SIGINT arrives ignored and
                # Python keeps it so: Ctrl-C / kill -INT must still stop the server.
                signal.signal(signal.SIGINT, signal.default_int_handler)
                typer.echo("serving; Ctrl-C stops the server")
                while True:
                    time.sleep(3600)
    except (ServerError, EmbeddedModelError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        typer.echo("stopped")


def make_tiny_target(
    kind: Annotated[str, typer.Argument(help="deepseek-v3")],
    config: ConfigOpt = Path("configs/smollm2-cpu.yaml"),
    out: Annotated[
        Path | None,
        typer.Option(help="Folder (default: the cache folder of embedded:tiny-<kind>)."),
    ] = None,
) -> None:
    """Build a tiny random-weight target of an architecture family that cannot run here (tokenizer: SmolLM2)."""  # noqa: E501
    from eagle3.embedded import prepare_model
    from eagle3.tiny import make_tiny_deepseek_v3

    if kind != "deepseek-v3":
        fail(f"unknown kind {kind!r}; known: deepseek-v3")
    cfg = load_profile(config, [])
    if out is None:  # the embedded target's cache folder (what `embedded:tiny-deepseek-v3` is)
        path = prepare_model(cfg.paths.cache_dir, f"tiny-{kind}")
    else:
        smol = prepare_model(cfg.paths.cache_dir, "smollm2-135m-instruct")
        path = make_tiny_deepseek_v3(out, tokenizer_from=smol)
    typer.echo(str(path))


def render_unit_cmd(
    config: ConfigOpt,
    set_: SetOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o")] = None,
    speculative: Annotated[
        bool, typer.Option(help="The verify stage's target + draft unit instead.")
    ] = False,
) -> None:
    """Render the systemd unit that serves this profile's target."""
    from eagle3.serving.units import render_unit

    try:
        text = render_unit(load_profile(config, set_), speculative=speculative)
    except ValueError as e:
        fail(str(e))
    if output:
        output.write_text(text)
        typer.echo(f"wrote {output}")
    else:
        typer.echo(text, nl=False)


def tensorboard_cmd(
    config: ConfigOpt,
    set_: SetOpt = None,
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1.")] = 6006,
) -> None:
    """TensorBoard over a profile's train and verify runs (<run dir>/tensorboard), on 127.0.0.1 only."""  # noqa: E501
    import subprocess

    from eagle3.tracking import tensorboard_argv

    log_dir = load_profile(config, set_).paths.run_dir / "tensorboard"
    if not log_dir.is_dir():
        fail(f"{log_dir}: no TensorBoard runs yet (train or verify with tracking.tensorboard on)")
    typer.echo(f"TensorBoard over {log_dir}: http://127.0.0.1:{port} (Ctrl-C stops it)")
    raise typer.Exit(subprocess.call(tensorboard_argv(log_dir, port)))


# Every command, in the order `eagle3 --help` lists them.
COMMANDS = [
    ("plan", plan),
    ("preflight", preflight),
    ("validate", validate),
    ("prepare-model", prepare_model_cmd),
    ("serve", serve),
    ("generate", generate),
    ("profile-concurrency", profile_concurrency_cmd),
    ("extract", extract),
    ("vocab", vocab),
    ("make-tiny-target", make_tiny_target),
    ("render-unit", render_unit_cmd),
    ("train", train),
    ("verify", verify),
    ("estimate-acceptance", estimate_acceptance),
    ("run-stage", run_stage_cmd),
    ("tensorboard", tensorboard_cmd),
]
for _name, _command in COMMANDS:
    app.command(_name)(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point: the Typer app with signal handling and one-line errors (eagle3.entry)."""
    from eagle3.entry import run

    run(app, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
