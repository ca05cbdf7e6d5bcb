"""`eagle3` command line: every stage runs without Prefect.

    eagle3 plan --config configs/kimi-k25-hero.yaml
    eagle3 prepare-model --config configs/smollm2-cpu.yaml
    eagle3 serve --config configs/smollm2-cpu.yaml [--chat "Hi"] [--hold]
    eagle3 render-unit --config configs/kimi-k25-hero.yaml
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle3.config import ConfigError, PipelineConfig, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Profile YAML (configs/*.yaml).")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a field: section.field=value (value read as YAML). Repeatable."),
]


def _load(config: Path, overrides: list[str] | None) -> PipelineConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        typer.secho(str(e), fg="red", err=True)
        raise typer.Exit(2) from None


def _fail(msg: str) -> None:
    typer.secho(msg, fg="red", err=True)
    raise typer.Exit(1)


@app.command()
def plan(config: ConfigOpt, set_: SetOpt = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Print stages, resolved settings, server command lines and artifact locations. Runs nothing."""
    from eagle3.plan import build_plan, render_plan

    p = build_plan(_load(config, set_))
    typer.echo(json.dumps(p, indent=2) if as_json else render_plan(p))


@app.command("validate")
def validate(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Load and validate a profile."""
    cfg = _load(config, set_)
    typer.echo(f"{config}: ok (profile {cfg.name}, target {cfg.target.model})")


@app.command("prepare-model")
def prepare_model_cmd(config: ConfigOpt, set_: SetOpt = None, no_check: bool = False) -> None:
    """Convert the embedded target's GGUF into a safetensors folder (once, cached by hash)."""
    from eagle3.embedded import EmbeddedModelError, prepare_model

    cfg = _load(config, set_)
    if not cfg.target.is_embedded:
        typer.echo(f"target {cfg.target.model} is not embedded: nothing to prepare")
        return
    t0 = time.time()
    try:
        path = prepare_model(cfg.paths.cache_dir, cfg.target.embedded_name, check=not no_check)
    except EmbeddedModelError as e:
        _fail(str(e))
    typer.echo(f"{path}  ({time.time() - t0:.1f} s)")


@app.command()
def serve(
    config: ConfigOpt,
    set_: SetOpt = None,
    chat: Annotated[Optional[str], typer.Option(help="Send one chat message once ready, print the answer.")] = None,
    hold: Annotated[bool, typer.Option(help="Keep serving until Ctrl-C.")] = False,
) -> None:
    """Start the target's vLLM server with the configured backend and wait until it is ready."""
    from eagle3.embedded import EmbeddedModelError, resolve_model
    from eagle3.serving.client import chat as chat_once
    from eagle3.serving.readiness import ServerError
    from eagle3.serving.server import start_server

    cfg = _load(config, set_)
    try:
        model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
        typer.echo(f"starting {cfg.serve.backend} server for {model} ...")
        with start_server(cfg, model) as server:
            typer.echo(f"ready in {server.ready_s:.1f} s at {server.base_url} (model {server.model})")
            if chat:
                r = chat_once(server.base_url, server.model, chat, api_key=server.api_key)
                typer.echo(json.dumps(r.to_dict(), indent=2))
            if hold:
                signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
                typer.echo("serving; Ctrl-C stops the server")
                while True:
                    time.sleep(3600)
    except (ServerError, EmbeddedModelError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        typer.echo("stopped")


@app.command("render-unit")
def render_unit_cmd(
    config: ConfigOpt,
    set_: SetOpt = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o")] = None,
) -> None:
    """Render the systemd unit that serves this profile's target."""
    from eagle3.serving.units import render_unit

    text = render_unit(_load(config, set_))
    if output:
        output.write_text(text)
        typer.echo(f"wrote {output}")
    else:
        typer.echo(text, nl=False)


if __name__ == "__main__":
    app()
