"""The stage commands of `eagle3`: generate (and its concurrency sweep), extract, vocab, train,
verify, and the server-free acceptance estimate. Each one keys, runs and seals its stage through
eagle3.stages.run_stage, as the Prefect flow does; eagle3/cli.py registers them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli_common import (
    BaseUrlOpt,
    ConfigOpt,
    SetOpt,
    count_samples,
    fail,
    load_profile,
    progress_bar,
    saved,
    served,
    tokenizer_path,
)
from eagle3.errors import Eagle3Error, Interrupted
from eagle3.input_checks import check_dataset, check_target_available
from eagle3.serving.gpus import GPUsBusy, units_restored
from eagle3.writer_lock import check_output_dir, writer_lock

# Long one-line docstrings (noqa: E501) stay one line: eagle3/cli.py says why.


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
    """Send every prompt to the target and keep reasoning, answer and exact token ids (resumable)."""  # noqa: E501
    from eagle3.embedded import EmbeddedModelError
    from eagle3.generate.runner import ServerUnavailable
    from eagle3.serving.readiness import ServerError
    from eagle3.stages import run_stage, stage_key

    cfg = load_profile(config, set_)
    out = out or cfg.paths.artifact_dir("generate", stage_key(cfg, "generate"))
    tokenizer = tokenizer_path(cfg)
    # every input before the server (issue #39): each of these fails in a second
    check_output_dir(out)
    check_dataset(cfg)
    if not base_url:
        check_target_available(cfg, for_server=True)
    try:
        # one writer per folder: taken before the server starts, held through run_stage
        with writer_lock(out, "generate"), served(cfg, base_url) as urls:
            fields = "{task.fields[tps]:.0f} tok/s  errors {task.fields[err]}"
            with progress_bar("generate", fields) as bar:
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
        fail(str(e))
    except Interrupted as e:
        saved(e, f"{count_samples(out)} samples are saved in {out}")
        raise
    run = manifest["this_run"]
    typer.echo(
        f"{out}: {manifest['totals']['samples']} samples in total; this run {run['counts']}, "
        f"{run['completion_tokens_per_s']} tok/s over {run['wall_s']} s"
    )
    unchecked = (manifest.get("token_check") or {}).get("unchecked_samples")
    if unchecked:  # said again last: the warning above may have scrolled away
        typer.secho(
            f"WARNING: the token ids of {unchecked} samples are NOT checked "
            f"({manifest['token_check']['unchecked']}); extract refuses this folder unless "
            "extract.accept_unchecked_token_ids=true",
            fg="yellow",
            err=True,
        )


def profile_concurrency_cmd(
    config: ConfigOpt,
    set_: SetOpt = None,
    base_url: BaseUrlOpt = None,
    levels: Annotated[
        str | None, typer.Option(help="Comma-separated levels, e.g. 1,4,16,64.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for the JSON and PNG.")] = None,
) -> None:
    """Sweep concurrency levels against the live server; save throughput/latency and pick the knee."""  # noqa: E501
    from eagle3.generate.client import Exhausted
    from eagle3.generate.profile import profile_concurrency
    from eagle3.serving.readiness import ServerError

    cfg = load_profile(config, set_)
    out = out or cfg.paths.stage_dir("generate") / "profile"
    lv = [int(x) for x in levels.split(",")] if levels else None
    try:
        with served(cfg, base_url) as urls:
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
        fail(str(e))
    except Exhausted as e:  # a --base-url nothing answers at: one line, not a traceback (#42)
        where = f"the server at {base_url} is up" if base_url else "the server is up"
        fail(f"profile-concurrency got no answer ({e}): check that {where}")
    typer.echo(
        f"knee: {report['knee']} (best {report['best']} at "
        f"{report['best_tokens_per_s']:.0f} tok/s); "
        f"saved {out}/concurrency-profile.json and .png"
    )


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
    """Hidden states at the auxiliary layers (+ final pre-norm state) over the generated conversations."""  # noqa: E501
    from eagle3.embedded import EmbeddedModelError, resolve_model
    from eagle3.extract.runner import TokenizerMismatch
    from eagle3.stages import run_stage

    cfg = load_profile(config, set_)
    generate_dir = generate_dir or cfg.paths.stage_dir("generate")
    try:
        model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
        bar, tasks = progress_bar("extract"), []  # shown from the first progress: an input
        # error (checked before any work) prints its line alone

        def show(done: int, total: int | None) -> None:
            if not tasks:
                bar.start()
                tasks.append(bar.add_task("extract", total=None))
            bar.update(tasks[0], completed=done, total=total)

        try:
            with units_restored(cfg):
                out, m, _ = run_stage(
                    cfg, "extract", {"generate": generate_dir}, out, model=model, on_progress=show
                )
        finally:
            if tasks:
                bar.stop()
    except (EmbeddedModelError, TokenizerMismatch, FileNotFoundError, GPUsBusy) as e:
        fail(str(e))
    typer.echo(extract_summary(out, m))


def extract_summary(out: Path, m: dict) -> str:
    """extract's closing line; it names the lines it could not read and the samples it skipped
    (issue #30: the console said nothing of them, only errors.jsonl did)."""
    run = m["this_run"]
    text = (
        f"{out}: {m['samples']} samples, {m['tokens']} tokens, {m['bytes_per_token']} bytes/token "
        f"({m['storage_dtype']}), layers {m['aux_layers']}; "
        f"this run: {run['stored']} computed, {run['reused']} reused"
    )
    unreadable, skipped = run.get("unreadable", 0), run.get("skipped", 0)
    if unreadable or skipped:
        text += (
            f"; {unreadable} unreadable lines and {skipped} skipped samples: see "
            f"{Path(out) / 'errors.jsonl'}"
        )
    return text


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

    cfg = load_profile(config, set_)
    extract_dir = extract_dir or cfg.paths.stage_dir("extract")
    try:
        out, m, _ = run_stage(cfg, "vocab", {"extract": extract_dir}, out)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    typer.echo(
        f"{STAGES['vocab'].file(out, 'vocab')}: draft vocab {m['draft_vocab_size']} covers "
        f"{m['coverage']:.2%} of {m['loss_tokens']} loss tokens ({m['distinct']} distinct, "
        f"{m['padded']} padded)"
    )


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

    cfg = load_profile(config, set_)
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
        fail(str(e))
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 wrote everything and reports
        return
    final = m["final"] or {}
    typer.echo(
        f"{m['export']}: {m['steps']} steps ({m['skipped_nan']} skipped), final top-1 per step "
        f"{[round(x, 3) for x in final.get('top1', []) if x is not None]}"
    )


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
    """Baseline server vs target + draft: acceptance (vLLM counters), speedup, greedy match, gate."""  # noqa: E501
    from rich.progress import Progress

    from eagle3.embedded import EmbeddedModelError, resolve_model
    from eagle3.stages import run_stage
    from eagle3.verify import GateFailed
    from eagle3.verify.workload import WorkloadError

    cfg = load_profile(config, set_)
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
        fail(str(e))
    except (EmbeddedModelError, WorkloadError, ValueError, FileNotFoundError, RuntimeError) as e:
        fail(str(e))
    typer.echo((out / "report.md").read_text())


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

    cfg = load_profile(config, set_)
    model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
    seqs = []
    for s in iter_samples(generate_dir or cfg.paths.stage_dir("generate")):
        seqs.append((s["prompt_token_ids"], s["completion_token_ids"]))
        if len(seqs) >= max_sequences:
            break
    if not seqs:
        fail("no generated samples to score")
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
        f"n-gram baseline (prompt lookup, n {v.ngram_prompt_lookup_min}.."
        f"{v.ngram_prompt_lookup_max}), same sequences: acceptance length "
        f"{fmt(ng['acceptance_length'])} over all steps, "
        f"{fmt(ng['acceptance_length_proposing'])} over the {ng['proposing_chains']} steps where "
        "it proposed (what vLLM's /metrics would count)"
    )


def run_stage_cmd(
    name: Annotated[str, typer.Argument(help="A stage of the registry (eagle3/stages.py).")],
    config: ConfigOpt,
    set_: SetOpt = None,
    input_: Annotated[
        list[str] | None,
        typer.Option("--input", help="STAGE=FOLDER (default: each input stage's latest artifact)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output folder (default: <run dir>/<stage>/<key>).")
    ] = None,
) -> None:
    """Any registry stage on its inputs (a new stage needs no command of its own); prints its summary."""  # noqa: E501
    import json

    from eagle3.embedded import EmbeddedModelError, resolve_model
    from eagle3.stages import STAGES, run_stage

    cfg = load_profile(config, set_)
    if name not in STAGES:
        fail(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    inputs = STAGES[name].inputs
    given = dict(i.split("=", 1) for i in input_ or [] if "=" in i)
    bad = [i for i in input_ or [] if "=" not in i or i.split("=", 1)[0] not in inputs]
    if bad:
        fail(f"--input {bad[0]!r}: expected STAGE=FOLDER with STAGE one of {list(inputs)}")
    dirs = {i: Path(given.get(i) or cfg.paths.stage_dir(i)) for i in inputs}
    try:
        model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
    except EmbeddedModelError:
        model = None  # not prepared: only a stage that reads the target needs it
    try:
        out, _, summary = run_stage(cfg, name, dirs, out, model=model)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    typer.echo(f"{out}: {json.dumps(summary)}")
