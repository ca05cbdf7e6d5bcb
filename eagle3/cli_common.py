"""What the `eagle3` commands share: the --config/--set/--base-url options, loading a profile,
failing with one red line, and reaching the target's server.

Its own module so that eagle3/cli.py (the app) and eagle3/cli_stages.py (the stage commands) both
use it without importing each other: `python -m eagle3.cli` runs cli.py as ``__main__``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eagle3.config import ConfigError, PipelineConfig, load_config
from eagle3.errors import Interrupted

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Profile YAML (configs/*.yaml).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a field: section.field=value (value read as YAML). Repeatable.",
    ),
]

BaseUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--base-url",
        help="Use a running server (e.g. http://127.0.0.1:8000) instead of starting one.",
    ),
]


def load_profile(config: Path, overrides: list[str] | None) -> PipelineConfig:
    """The profile with its --set overrides; a bad one exits 2 with the file and field named."""
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None


def fail(msg: str) -> None:
    """Exit 1 with one red line: the errors a user can fix need no traceback. The ``error:``
    prefix is the one eagle3.entry prints for the pipeline's own errors (issue #30: some lines
    had it, some did not)."""
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(1)


def served(cfg: PipelineConfig, base_url: str | None):
    """A context with the target's base URLs: an existing endpoint, or a server started here."""
    import contextlib

    from eagle3.embedded import resolve_model
    from eagle3.serving.server import start_server

    if base_url:
        from eagle3.serving.readiness import root_url

        return contextlib.nullcontext([root_url(base_url), *cfg.generate.endpoints])

    from eagle3.input_checks import check_target_available

    check_target_available(
        cfg, for_server=True
    )  # a hub id with no network: at once, not after 50 s of retries

    @contextlib.contextmanager
    def started():
        with start_server(cfg, resolve_model(cfg.target.model, cfg.paths.cache_dir)) as server:
            typer.echo(f"server ready in {server.ready_s:.1f} s at {server.base_url}", err=True)
            yield [server.base_url, *cfg.generate.endpoints]

    return started()


def tokenizer_path(cfg: PipelineConfig) -> str | None:
    """The tokenizer that checks the server's token ids (and rebuilds ids a server did not
    return); None lets generate take ``target.model`` (eagle3.generate.checks)."""
    if cfg.target.tokenizer:
        return cfg.target.tokenizer
    if cfg.target.is_embedded:
        from eagle3.embedded import prepared_path

        p = prepared_path(cfg.paths.cache_dir, cfg.target.embedded_name)
        return str(p) if p else None
    return None


def saved(e: Interrupted, what: str) -> None:
    """Attach what a command had saved when it was interrupted (main() prints it)."""
    e.saved = what  # type: ignore[attr-defined]


def count_samples(out: Path) -> int:
    """Samples a (possibly interrupted) generate folder holds."""
    from eagle3.generate.storage import iter_samples

    return sum(1 for _ in iter_samples(out, on_bad=lambda *_: None)) if out.exists() else 0


def progress_bar(label: str, *fields: str):
    """The stage commands' progress bar: label, bar, done/total, ``fields`` (rich format strings
    over the task's fields), time left; it stays on screen when done."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    extra = [TextColumn(f) for f in fields]
    columns = [TextColumn(label), BarColumn(), MofNCompleteColumn(), *extra, TimeRemainingColumn()]
    return Progress(*columns, transient=False)
