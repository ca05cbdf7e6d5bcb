"""The extract stage: generate output -> sharded hidden states for training.

    manifest = extract(cfg, generate_dir, out_dir, model_path)

Reads the generate shards lazily (memory stays bounded for any dataset size), skips
samples already stored (resume by sample id), copies the samples a previous extract with the
same settings already computed (``reuse_from``: the nightly regeneration adds a few new
samples to thousands; only those go to the GPUs), runs the configured backend, drops samples
with NaN/inf states (recorded in errors.jsonl with the reason), and writes a manifest with
the target, tokenizer fingerprint, layer ids and their convention, dtype, counts and bytes/token.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from eagle3.atomic import write_json_atomic
from eagle3.config import PipelineConfig
from eagle3.errors import MissingSamples, NoResult, TokenIdMismatch, disk_full, is_disk_full
from eagle3.extract.inputs import Example, iter_examples
from eagle3.extract.storage import Sample, ShardWriter
from eagle3.generate.checks import require_checked_ids
from eagle3.generate.storage import JsonlAppender, SampleScan, repair_jsonl, scan_samples
from eagle3.keys import extract_settings_key

CONVENTION = (
    "vLLM: aux layer k is the INPUT of decoder layer k "
    "(= HF output_hidden_states[k], 0 = embeddings); "
    "final is the OUTPUT of the last decoder layer before the final norm"
)


class TokenizerMismatch(TokenIdMismatch):
    """The local tokenizer is not the one the generate stage's server used."""


def check_fingerprint(
    generate_manifest: dict[str, Any], model_path: str, cfg: PipelineConfig
) -> str | None:
    """The local tokenizer must be the one the server used in generate. Returns the fingerprint."""
    from transformers import AutoTokenizer

    from eagle3.fingerprint import local_fingerprint

    tok = AutoTokenizer.from_pretrained(
        cfg.target.tokenizer or model_path, trust_remote_code=cfg.target.trust_remote_code
    )
    mine = local_fingerprint(tok, cfg.generate.chat_template_kwargs)
    theirs = generate_manifest.get("tokenizer_fingerprint")
    if theirs and theirs != mine:
        raise TokenizerMismatch(
            f"tokenizer fingerprint {mine} of {cfg.target.tokenizer or model_path} differs from "
            f"{theirs}, the one the generate stage's server used: the token ids would mean "
            "different things. Point target.tokenizer (or the model) at the served model's "
            "tokenizer, or regenerate."
        )
    return mine


def settings_key(cfg: PipelineConfig) -> str:
    """The extract stage key without its input: equal keys store equal states for equal tokens."""
    return extract_settings_key(cfg)


def previous_extract(cfg: PipelineConfig, out_dir: Path) -> Path | None:
    """The stage's latest complete artifact, if it is another folder than ``out_dir``."""
    from eagle3 import artifacts

    found = artifacts.latest(cfg, "extract")
    if found is None or found[0].resolve() == Path(out_dir).resolve():
        return None
    return found[0]


class Reuse:
    """Samples of a previous extract output that this run may copy instead of computing.

    Only when that output was made with the same settings (target, layers, dtype, lengths,
    backend, code version: :func:`settings_key`), and per sample only when the id, the token ids
    and the loss mask are identical."""

    def __init__(self, cfg: PipelineConfig, folder: Path | None):
        from eagle3.extract.storage import HiddenStateDataset

        self.folder, self.ds, self.index, self.reason = folder, None, {}, None
        if folder is None:
            self.reason = "no previous extract"
            return
        try:
            theirs = json.loads((Path(folder) / "manifest.json").read_text()).get("settings_key")
        except (OSError, json.JSONDecodeError) as err:
            self.reason = f"{folder}: unreadable manifest ({err})"
            return
        if theirs != settings_key(cfg):
            self.reason = f"{folder}: made with other settings"
            return
        self.ds = HiddenStateDataset(Path(folder), dtype=torch.float32)
        self.index = {sid: i for i, sid in enumerate(self.ds.ids)}

    def get(self, ex: Example) -> Sample | None:
        i = self.index.get(ex.id)
        if i is None:
            return None
        old = self.ds[i]
        if old.input_ids.tolist() != list(ex.input_ids) or old.loss_mask.tolist() != [
            bool(m) for m in ex.loss_mask
        ]:
            return None
        return old


def check_input(generate_dir: Path, gen_manifest: dict[str, Any]) -> SampleScan:
    """Compare the generate folder with its manifest before any model is loaded.

    Returns the scan: the sample ids, and the unreadable lines (recorded by the caller: they
    explain missing samples). Raises MissingSamples when fewer samples are there than the manifest
    lists and no unreadable line accounts for them (a shard deleted or cut short by hand, a copy
    that did not finish)."""
    scan = scan_samples(generate_dir)
    listed = int((gen_manifest.get("totals") or {}).get("samples", 0))
    if len(scan.ids) + len(scan.bad) < listed:
        raise MissingSamples(
            f"{generate_dir}: manifest.json lists {listed} samples, the shards hold "
            f"{len(scan.ids)} ({len(scan.bad)} unreadable lines): a shard is missing or was cut. "
            "Restore it, or rerun generate into that folder (it requests only what is missing), "
            "then rerun extract"
        )
    return scan


class ErrorLog:
    """extract's errors.jsonl: one line per skipped sample or unreadable input line, each once
    (a rerun meets the same bad lines again)."""

    def __init__(self, path: Path):
        self.known = (
            {(r.get("id"), r.get("reason")) for r in repair_jsonl(path)[0]}
            if path.is_file()
            else set()
        )
        self.out = JsonlAppender(path)

    def record(self, sid: str | None, reason: str, where: str | None = None) -> None:
        if (sid, reason) not in self.known:
            self.known.add((sid, reason))
            self.out.append(
                {
                    "id": sid,
                    "reason": reason,
                    **({"where": where} if where else {}),
                    "time": time.time(),
                }
            )

    def close(self) -> None:
        self.out.close()


def _states(
    cfg: PipelineConfig, model_path: str, out_dir: Path, examples: Iterator[Example]
) -> Iterator[tuple[Example, torch.Tensor, torch.Tensor]]:
    """(example, aux states, final state) from the configured backend."""
    e, layers = cfg.extract, cfg.aux_layers
    first = next(examples, None)  # copies the reused samples up to the first one to compute
    if first is None:  # all resumed, reused or skipped: no model load, no server, no GPUs taken
        return
    examples = itertools.chain([first], examples)
    if e.backend == "hf":
        from eagle3.extract.hf_backend import extract_hf

        yield from extract_hf(
            model_path,
            examples,
            layers,
            e.token_budget,
            e.chunk_samples,
            e.device,
            e.dtype,
            cfg.target.trust_remote_code,
        )
        return
    from eagle3.extract.vllm_backend import extract_vllm

    # one server for the whole run; layer N (= num_hidden_layers) is the final pre-norm state
    waiting: dict[str, Example] = {}

    def requests() -> Iterator[tuple[str, list[int]]]:
        for ex in examples:
            waiting[ex.id] = ex
            yield ex.id, ex.input_ids

    n = cfg.target.num_hidden_layers
    for sid, hidden in extract_vllm(
        cfg,
        model_path,
        requests(),
        [*layers, n],
        out_dir / "vllm-work",
        concurrency=e.vllm_concurrency,
    ):
        ex = waiting.pop(sid)
        yield ex, hidden[:, : len(layers)].flatten(1), hidden[:, len(layers)]


def _answer_examples(
    cfg: PipelineConfig, model_path: str, generated: set[str], done: set[str], stats: Counter
) -> Iterator[Example | tuple[str, str]]:
    """``extract.dataset_answers`` examples (eagle3/extract/answers.py), cut like generate's."""
    from transformers import AutoTokenizer

    from eagle3.extract.answers import dataset_answer_examples
    from eagle3.extract.inputs import fit_example

    tok = AutoTokenizer.from_pretrained(
        cfg.target.tokenizer or model_path, trust_remote_code=cfg.target.trust_remote_code
    )
    for ex in dataset_answer_examples(cfg, tok, generated, stats):
        if ex.id not in done:
            yield fit_example(
                ex, cfg.extract.max_seq_len, cfg.extract.truncation, cfg.target.vocab_size
            )


def _manifest(
    cfg: PipelineConfig,
    generate_dir: Path,
    model_path: str,
    fingerprint: str | None,
    writer: ShardWriter,
    out_dir: Path,
    this_run: dict[str, Any],
) -> dict[str, Any]:
    e = cfg.extract
    tokens = sum(v[2] for v in writer.index.values())
    shard_bytes = sum((out_dir / s).stat().st_size for s in writer.shards)
    return {
        "stage": "extract",
        "target": cfg.target.model,
        "model_path": model_path,
        "backend": e.backend,
        "tokenizer_fingerprint": fingerprint,
        "aux_layers": cfg.aux_layers,
        "convention": CONVENTION,
        "hidden_size": cfg.target.hidden_size,
        "storage_dtype": e.storage_dtype,
        "states": e.states,  # online: token ids and loss masks only (train makes the states)
        "config": e.model_dump(mode="json"),
        "settings_key": settings_key(cfg),
        "generate_dir": str(generate_dir),
        "samples": len(writer.index),
        "tokens": tokens,
        "bytes": shard_bytes,
        "bytes_per_token": round(shard_bytes / max(tokens, 1), 1),
        "this_run": this_run,
    }


class _ExtractRun:
    """One extract run into ``out_dir``: the shard writer, the error log, the counts, the reuse
    source and the progress callback, and the steps that fill them."""

    def __init__(
        self,
        cfg: PipelineConfig,
        generate_dir: Path,
        out_dir: Path,
        model_path: str,
        gen_manifest: dict[str, Any],
        scan: SampleScan,
        on_progress: Callable[[int, int], None] | None,
        reuse_from: Path | None,
    ):
        e = self.e = cfg.extract
        self.cfg, self.model_path, self.scan, self.on_progress = cfg, model_path, scan, on_progress
        self.generate_dir, self.out_dir = generate_dir, out_dir
        unreadable = scan.bad
        self.writer = ShardWriter(out_dir, e.storage_dtype, e.samples_per_shard)
        self.resumed_from = len(self.writer.done_ids)
        self.errors = ErrorLog(out_dir / "errors.jsonl")
        self.counts = {
            "stored": 0,
            "reused": 0,
            "skipped": 0,
            "truncated": 0,
            "nonfinite": 0,
            "unreadable": len(unreadable),
        }
        self.reuse = Reuse(cfg, reuse_from)
        self.computed_tokens = 0
        self.total = gen_manifest["totals"]["samples"] + e.dataset_answers
        self.started = time.time()
        for where, reason in unreadable:
            self.errors.record(None, f"{where}: {reason}", where)
        self.answer_stats: Counter = Counter()

    def _progress(self) -> None:
        if self.on_progress:
            self.on_progress(
                self.resumed_from + self.counts["stored"] + self.counts["reused"], self.total
            )

    def _note_truncated(self, ex: Example) -> None:
        if ex.truncated_from:
            self.errors.record(
                ex.id, f"truncated from {ex.truncated_from} to {len(ex.input_ids)} tokens"
            )
            self.counts["truncated"] += 1

    def examples(self) -> Iterator[Example]:
        """The examples still to compute; skipped ones are recorded, reusable ones copied."""
        e, writer = self.e, self.writer
        items = iter_examples(
            self.generate_dir,
            e.max_seq_len,
            e.truncation,
            skip=writer.done_ids,
            vocab_size=self.cfg.target.vocab_size,
            on_bad=lambda *_: None,
        )
        if e.dataset_answers:
            items = itertools.chain(
                items,
                _answer_examples(
                    self.cfg, self.model_path, self.scan.ids, writer.done_ids, self.answer_stats
                ),
            )
        for item in items:
            if isinstance(item, tuple):
                self.errors.record(*item)
                self.counts["skipped"] += 1
                continue
            old = self.reuse.get(item)
            if old is None:
                yield item
                continue
            self._note_truncated(item)
            writer.add(old)
            self.counts["reused"] += 1
            self._progress()

    def store(self, ex: Example, aux: torch.Tensor | None, final: torch.Tensor | None) -> None:
        """Keep one computed sample, unless its states are not finite (``None``: online states,
        the tokens and mask alone)."""
        if aux is not None and not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
            self.errors.record(ex.id, "non-finite hidden states (NaN/inf)")
            self.counts["nonfinite"] += 1
            return
        self._note_truncated(ex)
        self.writer.add(
            Sample(
                ex.id,
                torch.tensor(ex.input_ids),
                torch.tensor(ex.loss_mask, dtype=torch.bool),
                aux,
                final,
            )
        )  # a full shard is written as soon as it fills: the resume unit
        self.counts["stored"] += 1
        self.computed_tokens += len(ex.input_ids)
        self._progress()

    def compute(self) -> None:
        """Every remaining sample through the backend into the shards; on any failure the complete
        samples are kept (a rerun resumes after them) and a full disk says how much more is
        needed."""
        writer = self.writer
        states = (
            ((ex, None, None) for ex in self.examples())  # no target: train produces them
            if self.e.states == "online"
            else _states(self.cfg, self.model_path, self.out_dir, self.examples())
        )
        try:
            for ex, aux, final in states:
                self.store(ex, aux, final)
            writer.close()
        except BaseException as err:
            try:
                writer.close()  # keep the complete samples already computed
            except Exception:
                pass
            if is_disk_full(err):
                per_sample = writer.bytes_written / max(len(writer.index) - self.resumed_from, 1)
                raise disk_full(
                    self.out_dir,
                    per_sample * max(self.total - len(writer.index), 1)
                    if writer.bytes_written
                    else None,
                    "the remaining hidden states",
                ) from err
            raise
        finally:
            self.errors.close()

    def this_run(self) -> dict[str, Any]:
        """The manifest's ``this_run``: what this run resumed, stored, reused and skipped."""
        return {
            "resumed_from": self.resumed_from,
            **self.counts,
            "wall_s": round(time.time() - self.started, 2),
            **(
                {"dataset_answers": {"rows_not_taken": dict(self.answer_stats)}}
                if self.e.dataset_answers
                else {}
            ),
            "reuse": {
                "from": str(self.reuse.folder) if self.reuse.folder else None,
                "why_not": self.reuse.reason,
            },
            "tokens_per_s": round(self.computed_tokens / max(time.time() - self.started, 1e-9), 1),
        }


def extract(
    cfg: PipelineConfig,
    generate_dir: Path,
    out_dir: Path,
    model_path: str,
    on_progress: Callable[[int, int], None] | None = None,
    reuse_from: Path | None = None,
) -> dict[str, Any]:
    """Run the stage into ``out_dir`` (resuming what is there); see the module docstring."""
    generate_dir, out_dir = Path(generate_dir), Path(out_dir)
    gen_manifest = json.loads((generate_dir / "manifest.json").read_text())
    require_checked_ids(generate_dir, gen_manifest, cfg.extract.accept_unchecked_token_ids)
    fingerprint = check_fingerprint(gen_manifest, model_path, cfg)
    scan = check_input(generate_dir, gen_manifest)
    run = _ExtractRun(
        cfg, generate_dir, out_dir, model_path, gen_manifest, scan, on_progress, reuse_from
    )
    run.compute()
    if not run.writer.index:
        raise NoResult(
            f"extract stored 0 samples from {generate_dir} into {out_dir}: every sample was "
            f"skipped; the reasons are in {out_dir / 'errors.jsonl'}. Fix the generate output, "
            "then rerun extract"
        )
    manifest = _manifest(
        cfg, generate_dir, model_path, fingerprint, run.writer, out_dir, run.this_run()
    )
    write_json_atomic(out_dir / "manifest.json", manifest)
    return manifest
