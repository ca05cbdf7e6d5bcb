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
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from eagle3.config import ConfigError, PipelineConfig, load_config
from eagle3.errors import Eagle3Error, Interrupted
from eagle3.serving.gpus import GPUsBusy, units_restored

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Profile YAML (configs/*.yaml).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a field: section.field=value (value read as YAML). Repeatable.",
    ),
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
def plan(
    config: ConfigOpt, set_: SetOpt = None, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Print stages, resolved settings, server command lines and artifact locations. Runs nothing."""
    from eagle3.plan import build_plan, render_plan

    p = build_plan(_load(config, set_))
    typer.echo(json.dumps(p, indent=2) if as_json else render_plan(p))


@app.command()
def preflight(config: ConfigOpt, set_: SetOpt = None) -> None:
    """Check what would stop a hero run on this machine (binaries, units, target, GPUs, disk). Runs nothing."""
    from eagle3.preflight import preflight as run_checks
    from eagle3.preflight import render

    checks = run_checks(_load(config, set_))
    typer.echo(render(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


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
    chat: Annotated[
        str | None, typer.Option(help="Send one chat message once ready, print the answer.")
    ] = None,
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
        _fail(str(e))
    except KeyboardInterrupt:
        typer.echo("stopped")


def _served(cfg: PipelineConfig, base_url: str | None):
    """A context with the target's base URLs: an existing endpoint, or a server started here."""
    import contextlib

    from eagle3.embedded import resolve_model
    from eagle3.serving.server import start_server

    if base_url:
        from eagle3.serving.readiness import root_url

        return contextlib.nullcontext([root_url(base_url), *cfg.generate.endpoints])

    @contextlib.contextmanager
    def started():
        with start_server(cfg, resolve_model(cfg.target.model, cfg.paths.cache_dir)) as server:
            typer.echo(f"server ready in {server.ready_s:.1f} s at {server.base_url}", err=True)
            yield [server.base_url, *cfg.generate.endpoints]

    return started()


BaseUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--base-url",
        help="Use a running server (e.g. http://127.0.0.1:8000) instead of starting one.",
    ),
]


@app.command()
def generate(
    config: ConfigOpt,
    set_: SetOpt = None,
    base_url: BaseUrlOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Output folder (default: <run dir>/generate/<key>, the key of these settings)."
        ),
    ] = None,
) -> None:
    """Send every prompt to the target and keep reasoning, answer and exact token ids (resumable)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from eagle3.embedded import EmbeddedModelError
    from eagle3.generate.runner import ServerUnavailable
    from eagle3.serving.readiness import ServerError
    from eagle3.stages import run_stage, stage_key

    cfg = _load(config, set_)
    out = out or cfg.paths.artifact_dir("generate", stage_key(cfg, "generate"))
    tokenizer = _tokenizer_path(cfg)
    try:
        with _served(cfg, base_url) as urls:
            with Progress(
                TextColumn("generate"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[tps]:.0f} tok/s  errors {task.fields[err]}"),
                TimeRemainingColumn(),
                transient=False,
            ) as bar:
                task = bar.add_task("generate", total=cfg.generate.num_samples, tps=0.0, err=0)

                def show(p):
                    bar.update(
                        task,
                        completed=p.done + p.failed + p.skipped,
                        tps=p.tokens_per_s,
                        err=p.failed + p.skipped,
                    )

                options = {"base_urls": urls, "tokenizer_path": tokenizer}
                log = lambda m: typer.echo(m, err=True)  # noqa: E731
                _, manifest, _ = run_stage(
                    cfg, "generate", {}, out, on_progress=show, log=log, options=options
                )
    except (ServerError, EmbeddedModelError, ServerUnavailable, ValueError, FileNotFoundError) as e:
        if isinstance(e, Eagle3Error):
            raise
        _fail(str(e))
    except Interrupted as e:
        _saved(e, f"{_count_samples(out)} samples are saved in {out}")
        raise
    run = manifest["this_run"]
    typer.echo(
        f"{out}: {manifest['totals']['samples']} samples in total; this run {run['counts']}, "
        f"{run['completion_tokens_per_s']} tok/s over {run['wall_s']} s"
    )


@app.command("profile-concurrency")
def profile_concurrency_cmd(
    config: ConfigOpt,
    set_: SetOpt = None,
    base_url: BaseUrlOpt = None,
    levels: Annotated[
        str | None, typer.Option(help="Comma-separated levels, e.g. 1,4,16,64.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for the JSON and PNG.")] = None,
) -> None:
    """Sweep concurrency levels against the live server; save throughput/latency and pick the knee."""
    from eagle3.generate.profile import profile_concurrency
    from eagle3.serving.readiness import ServerError

    cfg = _load(config, set_)
    out = out or cfg.paths.stage_dir("generate") / "profile"
    lv = [int(x) for x in levels.split(",")] if levels else None
    try:
        with _served(cfg, base_url) as urls:
            report = profile_concurrency(
                cfg,
                urls,
                out,
                lv,
                on_level=lambda r: typer.echo(
                    f"  concurrency {r['concurrency']:4d}: {r['tokens_per_s']:8.1f} tok/s  "
                    f"p50 {r['latency_p50_s']:.2f} s  p95 {r['latency_p95_s']:.2f} s"
                ),
            )
    except ServerError as e:
        _fail(str(e))
    typer.echo(
        f"knee: {report['knee']} (best {report['best']} at {report['best_tokens_per_s']:.0f} tok/s); "
        f"saved {out}/concurrency-profile.json and .png"
    )


@app.command()
def extract(
    config: ConfigOpt,
    set_: SetOpt = None,
    generate_dir: Annotated[
        Path | None, typer.Option(help="Generate output (default: <run dir>/generate/latest).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output folder (default: <run dir>/extract/<key>).")
    ] = None,
) -> None:
    """Hidden states at the auxiliary layers (+ final pre-norm state) over the generated conversations."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from eagle3.embedded import EmbeddedModelError, resolve_model
    from eagle3.extract.runner import TokenizerMismatch
    from eagle3.stages import run_stage

    cfg = _load(config, set_)
    generate_dir = generate_dir or cfg.paths.stage_dir("generate")
    try:
        model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
        with (
            units_restored(cfg),
            Progress(
                TextColumn("extract"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()
            ) as bar,
        ):
            task = bar.add_task("extract", total=None)
            out, m, _ = run_stage(
                cfg,
                "extract",
                {"generate": generate_dir},
                out,
                model=model,
                on_progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
    except (EmbeddedModelError, TokenizerMismatch, FileNotFoundError, GPUsBusy) as e:
        _fail(str(e))
    run = m["this_run"]
    typer.echo(
        f"{out}: {m['samples']} samples, {m['tokens']} tokens, {m['bytes_per_token']} bytes/token "
        f"({m['storage_dtype']}), layers {m['aux_layers']}; "
        f"this run: {run['stored']} computed, {run['reused']} reused"
    )


@app.command()
def vocab(
    config: ConfigOpt,
    set_: SetOpt = None,
    extract_dir: Annotated[
        Path | None, typer.Option(help="Extract output (default: <run dir>/extract/latest).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output folder (default: <run dir>/vocab/<key>).")
    ] = None,
) -> None:
    """Draft vocabulary (d2t/t2d) from the loss-carrying tokens of the training data."""
    from eagle3.stages import STAGES, run_stage

    cfg = _load(config, set_)
    extract_dir = extract_dir or cfg.paths.stage_dir("extract")
    try:
        out, m, _ = run_stage(cfg, "vocab", {"extract": extract_dir}, out)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    typer.echo(
        f"{STAGES['vocab'].file(out, 'vocab')}: draft vocab {m['draft_vocab_size']} covers "
        f"{m['coverage']:.2%} of {m['loss_tokens']} loss tokens ({m['distinct']} distinct, "
        f"{m['padded']} padded)"
    )


@app.command("make-tiny-target")
def make_tiny_target(
    kind: Annotated[str, typer.Argument(help="deepseek-v3")],
    config: ConfigOpt = Path("configs/smollm2-cpu.yaml"),
    out: Annotated[
        Path | None,
        typer.Option(help="Folder (default: the cache folder of embedded:tiny-<kind>)."),
    ] = None,
) -> None:
    """Build a tiny random-weight target of an architecture family that cannot run here (tokenizer: SmolLM2)."""
    from eagle3.embedded import prepare_model
    from eagle3.tiny import make_tiny_deepseek_v3

    if kind != "deepseek-v3":
        _fail(f"unknown kind {kind!r}; known: deepseek-v3")
    cfg = _load(config, [])
    if (
        out is None
    ):  # the embedded target's cache folder (what `embedded:tiny-deepseek-v3` resolves to)
        path = prepare_model(cfg.paths.cache_dir, f"tiny-{kind}")
    else:
        smol = prepare_model(cfg.paths.cache_dir, "smollm2-135m-instruct")
        path = make_tiny_deepseek_v3(out, tokenizer_from=smol)
    typer.echo(str(path))


def _tokenizer_path(cfg: PipelineConfig) -> str | None:
    """Tokenizer used only to rebuild token ids a server did not return."""
    if cfg.target.tokenizer:
        return cfg.target.tokenizer
    if cfg.target.is_embedded:
        from eagle3.embedded import prepared_path

        p = prepared_path(cfg.paths.cache_dir, cfg.target.embedded_name)
        return str(p) if p else None
    return None


@app.command("render-unit")
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
        text = render_unit(_load(config, set_), speculative=speculative)
    except ValueError as e:
        _fail(str(e))
    if output:
        output.write_text(text)
        typer.echo(f"wrote {output}")
    else:
        typer.echo(text, nl=False)


@app.command()
def train(
    config: ConfigOpt,
    set_: SetOpt = None,
    extract_dir: Annotated[
        Path | None, typer.Option(help="Extract output (default: <run dir>/extract/latest).")
    ] = None,
    vocab_file: Annotated[
        Path | None,
        typer.Option(help="A vocab file (default: the one in <run dir>/vocab/latest)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output folder (default: <run dir>/train/<key>).")
    ] = None,
) -> None:
    """Train the EAGLE-3 draft (TTT unroll) on the stored hidden states; export it for vLLM.

    Several GPUs: train.nproc_per_node=N starts N local ranks under torchrun, as in the hero run;
    or `torchrun --nproc-per-node N -m eagle3.cli train -c PROFILE` (train.distributed: ddp or
    fsdp; docs/train.md)."""
    from eagle3.embedded import EmbeddedModelError, resolve_model
    from eagle3.stages import run_stage
    from eagle3.train import TrainingDiverged

    cfg = _load(config, set_)
    extract_dir = extract_dir or cfg.paths.stage_dir("extract")
    vocab_dir = vocab_file.parent if vocab_file else cfg.paths.stage_dir("vocab")
    options = {"vocab_file": vocab_file} if vocab_file else {}

    def progress(p: dict) -> None:
        if p["step"] % 10 == 0 or p["step"] == p["total_steps"]:
            top1 = " ".join(f"{s['correct'] / max(s['count'], 1):.2f}" for s in p["steps"])
            loss = "nan (skipped)" if p["loss"] is None else f"{p['loss']:.4f}"
            typer.echo(
                f"  step {p['step']}/{p['total_steps']} epoch {p['epoch'] + 1} lr {p['lr']:.2e} "
                f"loss {loss} top1/step {top1}"
            )

    try:
        # a hub id: see eagle3.target_checkpoint.checkpoint_dir
        target_dir = resolve_model(cfg.target.model, cfg.paths.cache_dir)
        with units_restored(cfg):
            out, m, _ = run_stage(
                cfg,
                "train",
                {"extract": extract_dir, "vocab": vocab_dir},
                out,
                model=target_dir,
                on_progress=progress,
                options=options,
            )
    except (
        EmbeddedModelError,
        TrainingDiverged,
        ValueError,
        KeyError,
        FileNotFoundError,
        GPUsBusy,
    ) as e:
        _fail(str(e))
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 wrote everything and reports
        return
    final = m["final"] or {}
    typer.echo(
        f"{m['export']}: {m['steps']} steps ({m['skipped_nan']} skipped), final top-1 per step "
        f"{[round(x, 3) for x in final.get('top1', []) if x is not None]}"
    )


@app.command()
def verify(
    config: ConfigOpt,
    set_: SetOpt = None,
    draft: Annotated[
        Path | None,
        typer.Option(help="Exported draft (default: the one in <run dir>/train/latest)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output folder (default: <run dir>/verify/<key>).")
    ] = None,
) -> None:
    """Baseline server vs target + draft: acceptance (vLLM counters), speedup, greedy match, gate."""
    from rich.progress import Progress

    from eagle3.embedded import EmbeddedModelError, resolve_model
    from eagle3.stages import run_stage
    from eagle3.verify import GateFailed
    from eagle3.verify.workload import WorkloadError

    cfg = _load(config, set_)
    train_dir = draft.parent if draft else cfg.paths.stage_dir("train")
    options = {"draft_dir": draft} if draft else {}
    try:
        model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
        with units_restored(cfg), Progress(transient=False) as bar:
            tasks: dict[tuple[str, int], int] = {}

            def progress(label: str, c: int, done: int, requests: int) -> None:
                key = (label, c)
                if key not in tasks:
                    tasks[key] = bar.add_task(f"{label} c={c}", total=requests)
                bar.update(tasks[key], completed=done)

            out, r, _ = run_stage(
                cfg,
                "verify",
                {"train": train_dir},
                out,
                model=model,
                on_progress=progress,
                log=bar.console.print,
                options=options,
            )
    except GateFailed as e:
        _fail(str(e))
    except (EmbeddedModelError, WorkloadError, ValueError, FileNotFoundError, RuntimeError) as e:
        _fail(str(e))
    typer.echo((out / "report.md").read_text())


@app.command("estimate-acceptance")
def estimate_acceptance(
    draft: Annotated[Path, typer.Argument(help="Exported draft folder (vLLM format).")],
    config: ConfigOpt,
    set_: SetOpt = None,
    generate_dir: Annotated[
        Path | None,
        typer.Option(help="Sequences to score (default: <run dir>/generate/latest)."),
    ] = None,
    k: Annotated[int, typer.Option(help="Draft tokens per chain.")] = 3,
    max_sequences: Annotated[int, typer.Option()] = 32,
) -> None:
    """Acceptance in PyTorch alone (target + draft, greedy chains) on generated samples: a quick
    check without a server. Best on held-out greedy samples; on training samples it is optimistic.
    The n-gram (prompt lookup) baseline is simulated on the same sequences next to it (the profile's
    verify.ngram_prompt_lookup_min / _max)."""
    from eagle3.embedded import resolve_model
    from eagle3.generate.storage import iter_samples
    from eagle3.verify import offline_acceptance

    cfg = _load(config, set_)
    model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
    seqs = []
    for s in iter_samples(generate_dir or cfg.paths.stage_dir("generate")):
        seqs.append((s["prompt_token_ids"], s["completion_token_ids"]))
        if len(seqs) >= max_sequences:
            break
    if not seqs:
        _fail("no generated samples to score")
    v = cfg.verify
    r = offline_acceptance(
        model, draft, seqs, k, ngram_lookup=(v.ngram_prompt_lookup_min, v.ngram_prompt_lookup_max)
    )
    typer.echo(json.dumps(r, indent=2))
    ng = r["ngram"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    typer.echo(
        f"draft: acceptance length {fmt(r['acceptance_length'])} over {r['chains']} chains of "
        f"{r['sequences']} sequences (k={k})\n"
        f"n-gram baseline (prompt lookup, n {v.ngram_prompt_lookup_min}..{v.ngram_prompt_lookup_max}), same "
        f"sequences: acceptance length {fmt(ng['acceptance_length'])} over all steps, "
        f"{fmt(ng['acceptance_length_proposing'])} over the {ng['proposing_chains']} steps where it proposed "
        "(what vLLM's /metrics would count)"
    )


def _saved(e: Interrupted, what: str) -> None:
    """Attach what a command had saved when it was interrupted (main() prints it)."""
    e.saved = what  # type: ignore[attr-defined]


def _count_samples(out: Path) -> int:
    from eagle3.generate.storage import iter_samples

    return sum(1 for _ in iter_samples(out, on_bad=lambda *_: None)) if out.exists() else 0


def main(argv: list[str] | None = None) -> None:
    """Entry point: the Typer app with signal handling and one-line errors (eagle3.entry)."""
    from eagle3.entry import run

    run(app, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
