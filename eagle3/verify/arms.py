"""The verify stage's three arms, served one after the other with the same settings: the target
alone (baseline), target + draft (speculative), and target + prompt lookup (the n-gram baseline,
optional). Each is started through the serve stage, warmed up and measured at every concurrency.
A k sweep (``measure_sweep``) serves the draft and the n-gram at several ks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.atomic import replace_symlink
from eagle3.serving.gpus import release_gpus
from eagle3.serving.server import Server, start_server
from eagle3.serving.units import speculative_config
from eagle3.verify.client import WorkloadRun, run_workload, warmup
from eagle3.verify.metrics import Snapshot, snapshot
from eagle3.verify.ngram import simulate_ngram
from eagle3.verify.ngram_baseline import ngram_speculative_config
from eagle3.verify.sweep import MethodSweep, acceptance_from_positions, best_draft, run_sweep
from eagle3.verify.workload import Conversation

Window = tuple[WorkloadRun, Snapshot, Snapshot]
"""One measured window: the client's run, the server's counters before and after it."""

Progress = Callable[[str, int, int, int], None]


def point_candidate(link: Path, draft_dir: Path) -> None:
    """Atomically point ``link`` (named by the speculative unit) at the draft under test."""
    replace_symlink(link, draft_dir)


def speculative_server(cfg: Any, model: str, spec: dict[str, Any], log_dir: Path) -> Server:
    """The target + draft server (an external or systemd one must already carry ``spec``)."""
    s = cfg.serve
    v = cfg.verify
    if s.backend == "external":
        if not v.speculative_base_url:
            raise ValueError(
                "serve.backend external: set verify.speculative_base_url to the server running "
                f"target + draft with --speculative-config '{spec}'"
            )
        serve = s.model_copy(update={"base_url": v.speculative_base_url})
        return start_server(cfg.model_copy(update={"serve": serve}), model)
    if s.backend == "systemd":
        if not v.speculative_unit:
            raise ValueError(
                "serve.backend systemd: set verify.speculative_unit to a unit serving target + "
                f"draft (its ExecStart needs --speculative-config '{spec}')"
            )
        point_candidate(Path(v.candidate_link), Path(spec["model"]))
        serve = s.model_copy(update={"unit": v.speculative_unit})
        return start_server(cfg.model_copy(update={"serve": serve}), model)
    return start_server(cfg, model, speculative_config=spec, log_dir=log_dir)


def ngram_server(cfg: Any, model: str, spec: dict[str, Any], log_dir: Path) -> Server | str:
    """The n-gram baseline server, or why it is not measured (a backend that starts no process
    needs its address or unit; the baseline is optional, so a missing one is reported, not
    fatal)."""
    s = cfg.serve
    v = cfg.verify
    flag = f"--speculative-config '{json.dumps(spec)}'"
    # backends that start no process: the n-gram server's own address or unit
    where = {
        "external": ("base_url", "ngram_base_url", "a server running the target with"),
        "systemd": ("unit", "ngram_unit", "a unit whose ExecStart carries"),
    }
    if s.backend in where:
        field, setting, what = where[s.backend]
        value = getattr(v, setting)
        if not value:
            return f"serve.backend {s.backend}: no verify.{setting} ({what} {flag})"
        serve = s.model_copy(update={field: value})
        return start_server(cfg.model_copy(update={"serve": serve}), model)
    return start_server(cfg, model, speculative_config=spec, log_dir=log_dir)


def measure(
    server: Server,
    convs: list[Conversation],
    cfg: Any,
    label: str,
    on_result: Progress | None = None,
) -> list[Window]:
    """Warm up, then one measured window per concurrency: (client run, counters before, after).

    ``on_result(label, concurrency, requests done, requests in the window)`` after each request."""
    v = cfg.verify
    requests = sum(len(c.turns) for c in convs)
    warmup(server.base_url, server.model, v.warmup_requests, server.api_key, v.timeout_s)
    windows = []
    for c in v.concurrency:
        before = snapshot(server.base_url, server.api_key)
        done = [0]

        def tick(_r: Any, c: int = c, done: list[int] = done) -> None:
            done[0] += 1
            if on_result is not None:
                on_result(label, c, done[0], requests)

        run = run_workload(
            server.base_url,
            server.model,
            convs,
            concurrency=c,
            max_tokens=v.max_tokens,
            temperature=v.temperature,
            seed=v.seed,
            api_key=server.api_key,
            timeout_s=v.timeout_s,
            on_result=tick,
        )
        after = snapshot(server.base_url, server.api_key)
        windows.append((run, before, after))
    return windows


@dataclass
class Arms:
    """What the three servers measured, and how each was served."""

    base: list[Window]
    base_info: dict[str, Any]
    spec: list[Window]
    spec_info: dict[str, Any]
    ngram: list[Window] | None
    ngram_info: dict[str, Any] | None
    ngram_reason: str | None


def measure_arms(
    cfg: Any,
    model: str,
    spec: dict[str, Any],
    convs: list[Conversation],
    log_dir: Path,
    log: Callable[[str], None],
    on_progress: Progress | None,
) -> Arms:
    """Baseline, then target + draft, then (``verify.ngram_baseline``) the n-gram baseline."""
    with start_server(cfg, model, log_dir=log_dir) as base_server:
        log(f"verify: baseline ready in {base_server.ready_s:.1f} s")
        base = measure(base_server, convs, cfg, "baseline", on_progress)
        base_info = base_server.info()
    # the baseline unit may still hold them
    release_gpus(cfg, "verify (speculative server)", log=log)
    with speculative_server(cfg, model, spec, log_dir) as spec_server:
        log(f"verify: speculative ready in {spec_server.ready_s:.1f} s")
        specw = measure(spec_server, convs, cfg, "speculative", on_progress)
        spec_info = spec_server.info()
    # its own log folder: the draft server's log stays the only *.log with
    # --speculative-config in logs/
    ngramw, ngram_info, reason = measure_ngram(
        cfg, model, convs, log_dir / "ngram", log, on_progress
    )
    return Arms(base, base_info, specw, spec_info, ngramw, ngram_info, reason)


def measure_ngram(
    cfg: Any,
    model: str,
    convs: list[Conversation],
    log_dir: Path,
    log: Callable[[str], None],
    on_progress: Progress | None,
) -> tuple[list[Window] | None, dict[str, Any] | None, str | None]:
    """The n-gram baseline's windows and server, or why it was not measured."""
    if not cfg.verify.ngram_baseline:
        return None, None, "verify.ngram_baseline is off"
    ngramw, ngram_info, ngram_reason = None, None, None
    release_gpus(cfg, "verify (n-gram server)", log=log)
    try:
        server = ngram_server(cfg, model, ngram_speculative_config(cfg), log_dir)
        if isinstance(server, str):
            ngram_reason = server
        else:
            with server:
                log(f"verify: n-gram ready in {server.ready_s:.1f} s")
                ngramw = measure(server, convs, cfg, "ngram", on_progress)
                ngram_info = server.info()
    # a baseline that failed is reported; the draft's numbers stand
    except Exception as e:  # noqa: BLE001
        ngramw, ngram_reason = None, f"the n-gram server failed: {type(e).__name__}: {e}"[:2000]
    if ngram_reason:
        log(f"verify: n-gram baseline not measured: {ngram_reason}")
    return ngramw, ngram_info, ngram_reason


def with_k(cfg: Any, k: int) -> Any:
    """The profile with verify serving this one k."""
    return cfg.model_copy(update={"verify": cfg.verify.with_k(k)})


def tokens_per_s(windows: list[Window]) -> dict[int, float]:
    return {run.concurrency: run.client_stats()["output_tokens_per_s"] for run, _, _ in windows}


def per_position(windows: list[Window]) -> dict[int, float]:
    """A server's acceptance per position over all its windows (vLLM's counters)."""
    total = Snapshot()
    for _, before, after in windows:
        total = total + (after - before)
    return dict(enumerate(total.summary()["acceptance_per_position"]))


Sweeps = tuple[MethodSweep, MethodSweep | None, MethodSweep | None]
"""The draft's sweep (sequential drafting), the n-gram's, and the draft's parallel-drafting one."""


def chosen_ks(cfg: Any, sweeps: Sweeps | None) -> tuple[int, int, bool]:
    """What the report is made at: the draft's k, the n-gram's k, and whether the draft is served
    with parallel drafting there: each method's best measured k at the lowest concurrency, the
    draft's faster way at it (``best_draft``; the one k of a single-k verify)."""
    if sweeps is None:
        return cfg.verify.k, cfg.verify.k, False
    c = min(cfg.verify.concurrency)
    draft, ngram, parallel = sweeps
    sw = best_draft(draft, parallel)[c]
    kd = sw.best_measured()[c]
    kn = ngram.best_measured()[c] if ngram and ngram.measured else kd
    return kd, kn, sw is parallel


def ngram_arm(
    servers: dict[tuple[str, int], tuple[list[Window], dict[str, Any]]],
    sweep: MethodSweep | None,
    k: int,
) -> tuple[list[Window] | None, dict[str, Any] | None]:
    """The n-gram arm of the report: its windows and server at ``k``, or none when its sweep did
    not finish (a server that failed after another had served: the report would otherwise show
    that first server's numbers beside "not measured")."""
    if sweep is None:
        return None, None
    return servers.get(("ngram", k), (None, None))


def parallel_ks(cfg: Any, draft_dir: Path) -> list[int]:
    """The sweep's ks the draft serves with parallel drafting: those from 2 up to the depths it
    was trained for (its config.json's ``parallel_drafting_depths``; at k = 1 both ways are the
    same single draft pass, served once, sequentially); none for a sequential draft or
    ``verify.parallel_drafting: off``."""
    if cfg.verify.parallel_drafting == "off":
        return []
    conf = json.loads((draft_dir / "config.json").read_text())
    depths = int(conf.get("parallel_drafting_depths") or 0)
    if conf.get("ptd_token_id") is None:
        return []
    return [k for k in cfg.verify.ks if 2 <= k <= depths]


def _acceptance(ks: list[int], estimate: Callable[[], dict[str, Any] | None]) -> tuple[Any, Any]:
    """(the offline estimate or None, the sweep's acceptance lengths: {k: AL} from the estimate,
    else a function of the largest k's counters)."""
    offline = estimate()
    if offline is None:
        return None, acceptance_from_positions(ks)
    return offline, {k: offline["by_k"][k]["acceptance_length"] or 1.0 for k in ks}


def measure_sweep(
    cfg: Any,
    model: str,
    draft_dir: Path,
    convs: list[Conversation],
    logs: Path,
    log: Callable[[str], None],
    on_progress: Progress | None,
    estimate: Callable[[WorkloadRun, bool], dict[str, Any] | None],
) -> tuple[Arms, Sweeps, dict[str, Any] | None]:
    """The k sweep: the baseline, acceptance at every k (``estimate``: the offline estimate on a
    baseline window, every k; else the largest k's counters; the n-gram simulated on the same
    outputs), then each method served at its ends and predicted best (eagle3.verify.sweep): the
    draft, the draft with parallel drafting (a draft trained for it: :func:`parallel_ks`), the
    n-gram; the arms at the chosen ks, the sweeps, and the offline estimate of the draft's
    chosen way of drafting."""
    v = cfg.verify
    if cfg.serve.backend != "process":
        raise ValueError(
            f"verify.num_speculative_tokens {v.ks}: a k sweep starts a server per k, which only "
            f"serve.backend process does (this profile: {cfg.serve.backend}); set one k"
        )
    ks = v.ks
    with start_server(cfg, model, log_dir=logs) as server:
        log(f"verify: baseline ready in {server.ready_s:.1f} s")
        base = measure(server, convs, cfg, "baseline", on_progress)
        base_info = server.info()
    base_tps = tokens_per_s(base)
    brun = base[0][0]
    seqs = [(r.prompt_token_ids, r.token_ids) for r in brun.results]
    offline, al_draft = _acceptance(ks, lambda: estimate(brun, False))
    pks = parallel_ks(cfg, draft_dir)
    offline_par, al_par = _acceptance(pks, lambda: estimate(brun, True) if pks else None)
    servers: dict[tuple[str, int], tuple[list[Window], dict[str, Any]]] = {}

    def serve(method: str, k: int) -> tuple[dict[int, float], dict[int, float]]:
        ck = with_k(cfg, k)
        if method in ("draft", "parallel"):
            spec = speculative_config(cfg, str(draft_dir), k, method == "parallel")
            srv = speculative_server(ck, model, spec, logs / f"{method}-k{k}")
        else:
            srv = ngram_server(ck, model, ngram_speculative_config(ck), logs / f"ngram-k{k}")
        assert not isinstance(srv, str)  # the process backend always starts one
        with srv:
            log(f"verify: {method} k={k} ready in {srv.ready_s:.1f} s")
            windows = measure(srv, convs, ck, f"{method} k={k}", on_progress)
            servers[(method, k)] = (windows, srv.info())
        return tokens_per_s(windows), per_position(windows)

    common = {"servers": v.sweep_servers, "measure_all": v.sweep_measure_all, "log": log}
    draft = run_sweep("draft", ks, al_draft, base_tps, lambda k: serve("draft", k), **common)
    parallel = None
    if pks:
        parallel = run_sweep(
            "parallel", pks, al_par, base_tps, lambda k: serve("parallel", k), flat=True, **common
        )
    ngram, reason = None, None
    if not v.ngram_baseline:
        reason = "verify.ngram_baseline is off"
    else:
        lo, hi = v.ngram_prompt_lookup_min, v.ngram_prompt_lookup_max
        al_ngram = {k: simulate_ngram(seqs, k, lo, hi)["acceptance_length"] or 1.0 for k in ks}
        try:
            ngram = run_sweep(
                "n-gram", ks, al_ngram, base_tps, lambda k: serve("ngram", k), **common
            )
        # a baseline that failed is reported; the draft's numbers stand
        except Exception as e:  # noqa: BLE001
            reason = f"the n-gram server failed: {type(e).__name__}: {e}"[:2000]
            log(f"verify: n-gram baseline not measured: {reason}")
    sweeps = (draft, ngram, parallel)
    kd, kn, par = chosen_ks(cfg, sweeps)
    for sw in sweeps:
        if sw is not None:
            log(f"verify: {sw.summary_line()}")
    spec_w, spec_info = servers[("parallel" if par else "draft", kd)]
    ngram_w, ngram_info = ngram_arm(servers, ngram, kn)
    arms = Arms(base, base_info, spec_w, spec_info, ngram_w, ngram_info, reason)
    return arms, sweeps, offline_par if par else offline
