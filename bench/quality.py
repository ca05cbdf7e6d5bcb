"""Draft quality: how acceptance grows with data and recipe, against the n-gram baseline.

From a generate folder: extract (once) -> per experiment a subset of N samples, its vocab, the
train stage with the experiment's overrides -> offline acceptance (k draft tokens, greedy) on the
target's own answers to MT-bench (80 x 2 turns) and on held-out prompts, next to prompt-lookup
(n-gram) simulated on the same tokens. Everything goes through the library (eagle3.extract,
eagle3.vocab, eagle3.train, eagle3.verify.offline); results are JSON lines, one per experiment.

    python bench/quality.py prompts --out .gpu/prompts.jsonl.gz          # tokenised ShareGPT prompts (CPU)
    python bench/quality.py generate-hf --prompts .gpu/prompts.jsonl.gz --split train --out GEN [--temperature 0.7]
    python bench/quality.py mtbench-hf --out MT                           # target's greedy MT-bench answers, 2 turns
    python bench/quality.py answers --exclude GEN --exclude HELD --out ANS  # ShareGPT's own answers (no generation)
    python bench/quality.py combine --src GEN --src ANS --out MIX         # regenerated first, then the answers
    python bench/quality.py run --train-gen GEN --eval mtbench=MT --eval heldout=HELD --work W \\
        --exp '{"name": "all", "samples": 0, "set": ["train.epochs=10"]}' ... --out results.jsonl
    python bench/quality.py plot results.jsonl docs/quality-scaling.png [--demo 1.23]
    python bench/quality.py coverage --train-gen MIX --eval heldout=HELD --eval mtbench=OUTS.jsonl

``generate-hf`` and ``mtbench-hf`` are the bench's stand-in for the generate stage on a machine
without vLLM (the GPU machine here): the same weights, chat template and settings through
transformers' ``generate``. On such data the token ids can differ from vLLM CPU's where the two
numerics round differently (greedy decoding is not bit-stable across kernels); the evaluation only
needs what the target emits, which either gives.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROFILE = Path(__file__).resolve().parents[1] / "configs" / "smollm2-cpu.yaml"
MAX_PROMPT = 1536  # + 512 new tokens = the profile's max_model_len 2048


def _cfg(overrides: list[str] = ()):
    from eagle3.config import load_config

    return load_config(PROFILE, list(overrides))


def _target(cfg) -> Path:
    from eagle3.embedded import resolve_model

    return Path(resolve_model(cfg.target.model, cfg.paths.cache_dir))


def _tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_target(cfg))


# ---------------------------------------------------------------------------------------------
# Prompts and HF generation (the bench's stand-in for the generate stage without vLLM)
# ---------------------------------------------------------------------------------------------


def cmd_prompts(a) -> None:
    """ShareGPT first turns in the generate stage's order (seed 0, MT-bench excluded), tokenised
    with the chat template; the last ``--heldout`` are the held-out evaluation prompts."""
    from eagle3.generate.prompts import Prompt, PromptStats, exclusion_keys, iter_prompts

    cfg = _cfg()
    tok = _tokenizer(cfg)
    stats = PromptStats()
    rows, long = [], 0
    for p in iter_prompts(
        a.dataset, seed=0, exclude=exclusion_keys([], mt_bench=True), stats=stats
    ):
        if not isinstance(p, Prompt):
            continue
        ids = tok.apply_chat_template(
            p.messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        if len(ids) > MAX_PROMPT:
            long += 1
            continue
        rows.append({"id": p.id, "prompt_token_ids": list(ids)})
    held = rows[-a.heldout :]
    train = rows[: -a.heldout]
    with gzip.open(a.out, "wt") as f:
        for r in train:
            f.write(json.dumps({**r, "split": "train"}) + "\n")
        for r in held:
            f.write(json.dumps({**r, "split": "heldout"}) + "\n")
    print(
        json.dumps(
            {
                "prompts": len(rows),
                "train": len(train),
                "heldout": len(held),
                "too_long": long,
                "excluded": stats.excluded,
                "skipped": stats.skipped,
            }
        )
    )


@torch.no_grad()
def hf_generate(
    model,
    prompts: list[list[int]],
    max_new: int,
    temperature: float,
    batch: int,
    eos: int,
    pad: int,
    seed: int = 0,
    log=print,
) -> list[tuple[list[int], str]]:
    """(completion ids incl. the end-of-turn token, finish reason) per prompt, batched by length."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[tuple[list[int], str] | None] = [None] * len(prompts)
    torch.manual_seed(seed)
    t0 = time.time()
    for bi in range(0, len(order), batch):
        idx = order[bi : bi + batch]
        L = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        att = torch.zeros((len(idx), L), dtype=torch.long)
        for j, i in enumerate(idx):  # left padding
            ids[j, L - len(prompts[i]) :] = torch.tensor(prompts[i])
            att[j, L - len(prompts[i]) :] = 1
        kw = (
            dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
            if temperature > 0
            else dict(do_sample=False)
        )
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=att.to(device),
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=pad,
            **kw,
        )[:, L:].tolist()
        for j, i in enumerate(idx):
            g = gen[j]
            if eos in g:
                out[i] = (g[: g.index(eos) + 1], "stop")
            else:
                out[i] = (g, "length")
        log(f"  generated {min(bi + batch, len(order))}/{len(order)} ({time.time() - t0:.0f} s)")
    return out  # type: ignore[return-value]


def _load_lm(cfg, device: str):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(_target(cfg), dtype=dtype).to(device).eval()


def write_generate_folder(out: Path, samples: list[dict], settings: dict) -> None:
    """A folder the extract stage reads like the generate stage's own (samples + manifest)."""
    from eagle3.atomic import write_json_atomic
    from eagle3.fingerprint import local_fingerprint

    cfg = _cfg()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples-00000.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    write_json_atomic(
        out / "manifest.json",
        {
            "stage": "generate",
            "target": cfg.target.model,
            "config": settings,
            "tokenizer_fingerprint": local_fingerprint(_tokenizer(cfg)),
            "totals": {
                "samples": len(samples),
                "completion_tokens": sum(len(s["completion_token_ids"]) for s in samples),
            },
            "token_ids_source": "bench/quality.py (transformers generate)",
        },
    )


def cmd_generate_hf(a) -> None:
    cfg = _cfg()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = _tokenizer(cfg)
    rows = [json.loads(line) for line in gzip.open(a.prompts, "rt")]
    rows = [r for r in rows if r["split"] == a.split][: a.num or None]
    model = _load_lm(cfg, device)
    t0 = time.time()
    res = hf_generate(
        model,
        [r["prompt_token_ids"] for r in rows],
        a.max_tokens,
        a.temperature,
        a.batch,
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.pad_token_id or 0,
        a.seed,
    )
    wall = time.time() - t0
    samples = [
        {
            "id": r["id"],
            "prompt_token_ids": r["prompt_token_ids"],
            "completion_token_ids": c,
            "finish_reason": fr,
            "token_ids_source": "hf-bench",
        }
        for r, (c, fr) in zip(rows, res)
    ]
    write_generate_folder(
        Path(a.out),
        samples,
        {
            "split": a.split,
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
            "seed": a.seed,
        },
    )
    toks = sum(len(s["completion_token_ids"]) for s in samples)
    capped = sum(s["finish_reason"] == "length" for s in samples)
    print(
        json.dumps(
            {
                "samples": len(samples),
                "completion_tokens": toks,
                "at_cap": capped,
                "wall_s": round(wall, 1),
                "tokens_per_s": round(toks / wall),
                "device": device,
            }
        )
    )


def cmd_mtbench_hf(a) -> None:
    """The target's greedy answers to MT-bench's 80 conversations, turn 2 after its own turn 1
    (as the verify stage sends them: the answer's text back through the chat template)."""
    from eagle3.verify.workload import load_workload

    cfg = _cfg()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = _tokenizer(cfg)
    model = _load_lm(cfg, device)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    convs = load_workload(a.workload)
    history = [[] for _ in convs]
    samples = []
    for turn in range(2):
        prompts = []
        for c, h in zip(convs, history):
            h.append({"role": "user", "content": c.turns[turn]})
            prompts.append(
                list(
                    tok.apply_chat_template(
                        h, add_generation_prompt=True, tokenize=True, return_dict=True
                    )["input_ids"]
                )
            )
        res = hf_generate(model, prompts, a.max_tokens, 0.0, 160, eos, tok.pad_token_id or 0)
        for c, h, p, (comp, fr) in zip(convs, history, prompts, res):
            h.append({"role": "assistant", "content": tok.decode(comp, skip_special_tokens=True)})
            samples.append(
                {
                    "id": f"mtbench-{c.id}-t{turn + 1}",
                    "prompt_token_ids": p,
                    "completion_token_ids": comp,
                    "finish_reason": fr,
                    "token_ids_source": "hf-bench",
                }
            )
    write_generate_folder(
        Path(a.out),
        samples,
        {"workload": "mt_bench", "turns": 2, "max_tokens": a.max_tokens, "temperature": 0.0},
    )
    print(
        json.dumps(
            {
                "samples": len(samples),
                "completion_tokens": sum(len(s["completion_token_ids"]) for s in samples),
            }
        )
    )


def cmd_answers(a) -> None:
    """ShareGPT's own first answers as a generate folder: what ``extract.dataset_answers`` adds
    (eagle3/extract/answers.py), here as a folder the bench can cut into subsets. Prompts of
    ``--exclude`` folders (the regenerated and held-out sets) and MT-bench are left out. The
    results of 2026-12-03 used commit 11c7542's version of this command (same examples, file order
    shuffled with seed 0 instead of the library's seeded row order).

    ``--turns N`` (``extract.dataset_answer_turns``): up to N answers of each conversation, one
    sample per answer (its whole history as the prompt), since a generate folder holds one
    completion a sample; the loss positions are those of the stage's one-sequence examples, the
    extract pays for each history again. The first answers are the ``--turns 1`` samples."""
    from collections import Counter

    from eagle3.extract.answers import dataset_answer_examples
    from eagle3.generate.storage import iter_samples

    cfg = _cfg(
        [
            f"generate.dataset={a.dataset}",
            f"extract.dataset_answers={a.num}",
            f"extract.dataset_answer_turns={a.turns}",
        ]
    )
    skip = {s["id"] for d in a.exclude for s in iter_samples(Path(d))}
    stats: Counter = Counter()
    samples = []
    for ex in dataset_answer_examples(cfg, _tokenizer(cfg), skip, stats):
        m = ex.loss_mask
        starts = [i for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1])]
        for k, p in enumerate(starts):
            end = next((i for i in range(p, len(m)) if not m[i]), len(m))
            samples.append(
                {
                    "id": ex.id if k == 0 else f"{ex.id}-turn{k + 1}",
                    "prompt_token_ids": ex.input_ids[:p],
                    "completion_token_ids": ex.input_ids[p:end],
                    "finish_reason": "stop",
                    "token_ids_source": "dataset-answer",
                }
            )
    meta = {"source": a.dataset, "dataset_answers": a.num, "dataset_answer_turns": a.turns}
    write_generate_folder(Path(a.out), samples, meta)
    print(
        json.dumps(
            {
                "samples": len(samples),
                "rows_not_taken": dict(stats),
                "completion_tokens": sum(len(s["completion_token_ids"]) for s in samples),
            }
        )
    )


# ---------------------------------------------------------------------------------------------
# Extract, subsets, train, evaluate
# ---------------------------------------------------------------------------------------------


def extract_folder(gen: Path, out: Path, overrides: list[str] = ()) -> Path:
    from eagle3.extract.runner import extract

    base = ["extract.max_seq_len=2048", "extract.token_budget=65536", "extract.dataset_answers=0"]
    cfg = _cfg([*base, *overrides])
    if (out / "manifest.json").is_file():
        return out
    t0 = time.time()
    m = extract(cfg, gen, out, str(_target(cfg)))
    print(
        f"extract {gen} -> {out}: {m['samples']} samples, {m['tokens']} tokens, {time.time() - t0:.0f} s",
        flush=True,
    )
    return out


def subset_folder(full: Path, gen: Path, n: int, out: Path) -> Path:
    """An extract folder of the first ``n`` samples in generate order (random prompt order):
    the full folder's shards linked, the index filtered. ``n <= 0``: all."""
    from eagle3.generate.storage import iter_samples

    index = json.loads((full / "index.json").read_text())
    order = [s["id"] for s in iter_samples(gen) if s["id"] in index]
    keep = list(index) if n <= 0 else order[:n]  # all: extract.dataset_answers' samples too
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for shard in full.glob("hidden-*.safetensors"):
        os.symlink(shard.resolve(), out / shard.name)
    (out / "index.json").write_text(json.dumps({i: index[i] for i in keep}))
    manifest = json.loads((full / "manifest.json").read_text())
    manifest.update(
        samples=len(keep), subset_of=str(full)
    )  # train checks the count against the index
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def subset_vocab(extract_dir: Path, out: Path, draft_vocab_size: int, target_vocab: int) -> Path:
    """The vocab stage's mapping counted over the subset's own loss tokens."""
    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.vocab import build_vocab, count_tokens, save_vocab

    ds = HiddenStateDataset(extract_dir)
    h = {}
    pairs = []
    for shard, pos, _ in ds.entries:
        if shard not in h:
            from safetensors import safe_open

            f = safe_open(str(extract_dir / shard), framework="pt")
            h[shard] = (
                f.get_tensor("input_ids"),
                f.get_tensor("loss_mask"),
                f.get_tensor("offsets"),
            )
        ids, mask, off = h[shard]
        pairs.append((ids[off[pos] : off[pos + 1]], mask[off[pos] : off[pos + 1]]))
    m = build_vocab(count_tokens(pairs, target_vocab), draft_vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    save_vocab(m, out / "vocab.safetensors")
    return out / "vocab.safetensors"


@torch.no_grad()
def evaluate(
    draft_dir: Path,
    eval_extract: Path,
    target_dir: Path,
    k: int,
    device: str,
    token_budget: int = 32768,
    parallel: bool = False,
) -> dict:
    """Offline acceptance of the draft on stored target states (the whole eval set), at ``k``
    with its acceptance per position, and the acceptance length at every smaller k (``by_k``:
    the same chains capped; vLLM's proposer walks them anew at each k, as walk_chains does).
    ``parallel``: the draft served with parallel drafting (one pass for all k tokens)."""
    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.verify.offline import (
        capped_chains,
        chain_accepts,
        load_draft_for_eval,
        summarize_chains,
    )

    draft, d2t = load_draft_for_eval(draft_dir, target_dir, device)
    ds = HiddenStateDataset(eval_extract, dtype=torch.float32)
    walks: list[tuple[list[int], int, int]] = []
    for idx in ds.batches(token_budget, shuffle=False):
        samples = [ds[i] for i in idx]
        L = max(len(s) for s in samples)
        aux = torch.zeros(len(samples), L, samples[0].aux.shape[-1], device=device)
        ids = torch.zeros(len(samples), L, dtype=torch.int64, device=device)
        for j, s in enumerate(samples):
            aux[j, : len(s)], ids[j, : len(s)] = s.aux.to(device), s.input_ids.to(device)
        lengths = torch.tensor([len(s) for s in samples], device=device)
        acc = chain_accepts(draft, aux, ids, lengths, k, d2t, parallel).tolist()
        for j, s in enumerate(samples):
            walks.append((acc[j], int(s.loss_mask.long().argmax()) - 1, len(s)))

    def at(kk: int) -> dict:
        return summarize_chains(capped_chains(walks, kk), kk)

    out = at(k)
    out["by_k"] = {kk: at(kk)["acceptance_length"] for kk in range(1, k + 1)}
    return out


def ngram_baseline(eval_extract: Path, k: int) -> dict | None:
    """Prompt lookup simulated on the same sequences (eagle3.verify.ngram)."""
    try:
        from eagle3.verify.ngram import simulate_ngram
    except ImportError:
        return None
    from eagle3.extract.storage import HiddenStateDataset

    ds = HiddenStateDataset(eval_extract)
    seqs = []
    for i in range(len(ds)):
        s = ds[i]
        p = int(s.loss_mask.long().argmax())
        ids = s.input_ids.tolist()
        seqs.append((ids[:p], ids[p:]))
    out = simulate_ngram(seqs, k)
    out["by_k"] = {kk: simulate_ngram(seqs, kk)["acceptance_length"] for kk in range(1, k + 1)}
    return out


def cmd_run(a) -> None:
    from eagle3.train import train

    global PROFILE
    PROFILE = Path(a.profile) if a.profile else PROFILE
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    target = _target(_cfg())
    evals = {}
    for spec in a.eval:
        name, gen = spec.split("=", 1)
        evals[name] = extract_folder(Path(gen), work / f"extract-{name}")
    if a.only_extract:
        extract_folder(Path(a.train_gen), work / "extract-train")
        return
    out = Path(a.out)
    done = (
        {json.loads(line)["name"] for line in out.read_text().splitlines()}
        if out.is_file()
        else set()
    )
    base = {}
    for name, ex in evals.items():
        base[name] = ngram_baseline(ex, a.k)
        print(f"n-gram on {name}: {json.dumps(base[name])}", flush=True)
    for exp in map(json.loads, a.exp):
        if exp["name"] in done:
            continue
        # extract keeps 2048 tokens (extract_folder); the profile's train default is 1024, which
        # dropped 7.6% of the mixture's tokens in sessions 2-3 (docs/train.md, Draft quality)
        # the exp's extract settings (extract.states=online: token ids and masks only, train
        # produces the states; extract.storage_dtype=float8_e4m3fn) get an extract folder each
        ex_over = exp.get("extract", [])
        suffix = "".join("-" + o.split("=", 1)[1] for o in ex_over)
        full = extract_folder(Path(a.train_gen), work / f"extract-train{suffix}", ex_over)
        overrides = ["train.max_seq_len=2048", *(a.set or []), *ex_over, *exp.get("set", [])]
        cfg = _cfg(overrides)
        ed = work / "runs" / exp["name"]
        sub = subset_folder(full, Path(a.train_gen), int(exp.get("samples", 0)), ed / "extract")
        vocab = subset_vocab(sub, ed / "vocab", cfg.vocab.draft_vocab_size, cfg.target.vocab_size)
        t0 = time.time()
        if (ed / "train").exists():
            shutil.rmtree(ed / "train")
        m = train(cfg, sub, vocab, target, ed / "train", device=device)
        wall = time.time() - t0
        row = {
            "name": exp["name"],
            "samples": len(json.loads((sub / "index.json").read_text())),
            "set": overrides,
            "train_s": round(wall, 1),
            "steps": m["steps"],
            "final": m["final"],
            "tokens": m["final"]["tokens"] if m["final"] else None,
            "device": device,
            "loop_s": m.get("loop_s"),
            # the extract this arm trained on (its own run's wall time, states or tokens only)
            "extract_s": json.loads((full / "manifest.json").read_text())
            .get("this_run", {})
            .get("wall_s"),
            "extract_bytes": sum(f.stat().st_size for f in full.glob("*.safetensors")),
            # each epoch's seconds and (online) where its states came from
            "epochs": [
                {k_: e.get(k_) for k_ in ("s", "time", "states")}
                for e in json.loads((ed / "train" / "metrics.json").read_text())["epochs"]
            ],
            "states": m.get("states"),
            "data_on_device": m.get("data_on_device"),
        }
        draft_conf = json.loads((ed / "train" / "vllm-draft" / "config.json").read_text())
        for name, ex in evals.items():
            row[name] = evaluate(ed / "train" / "vllm-draft", ex, target, a.k, device)
            row[f"{name}_ngram"] = base[name]
            if draft_conf.get("ptd_token_id") is not None:  # also served with parallel drafting
                row[f"{name}_parallel"] = evaluate(
                    ed / "train" / "vllm-draft", ex, target, a.k, device, parallel=True
                )
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k_: v for k_, v in row.items() if k_ not in ("final",)}), flush=True)
        if a.keep_draft != exp["name"]:
            shutil.rmtree(ed / "train" / "checkpoints", ignore_errors=True)
        del m
        gc.collect()  # the run's device-resident data (train.data_on_device) goes now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def cmd_extract(a) -> None:
    extract_folder(Path(a.gen), Path(a.out), a.set or [])


def cmd_eval(a) -> None:
    """Score an exported draft (e.g. the reference trainer's) exactly as ``run`` scores ours."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = _target(_cfg())
    row = {"name": a.name, "samples": a.samples, "draft": a.draft}
    for spec in a.eval:
        name, ex = spec.split("=", 1)
        row[name] = evaluate(Path(a.draft), Path(ex), target, a.k, device)
        row[f"{name}_ngram"] = ngram_baseline(Path(ex), a.k)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def cmd_combine(a) -> None:
    """One generate folder from several (in order), leaving out ids in ``--exclude`` folders and
    keeping at most ``--first`` samples of each source (0: all); ``--skip`` drops each source's first N."""
    from eagle3.generate.storage import iter_samples

    drop = {s["id"] for d in a.exclude for s in iter_samples(Path(d))}
    out, seen = [], set()
    for src in a.src:
        taken = 0
        for j, s in enumerate(iter_samples(Path(src))):
            if j < a.skip or s["id"] in drop or s["id"] in seen:
                continue
            if a.first and taken >= a.first:
                break
            seen.add(s["id"])
            out.append(s)
            taken += 1
    write_generate_folder(Path(a.out), out, {"combined_from": a.src, "excluded_from": a.exclude})
    print(json.dumps({"out": a.out, "samples": len(out)}))


def cmd_coverage(a) -> None:
    """The ceiling a draft vocabulary puts on acceptance: the vocab built as the vocab stage
    builds it (the most frequent loss tokens of ``--train-gen``, eagle3.vocab), at several sizes,
    and the share of the target's own answer tokens it holds on each ``--eval`` (a generate folder,
    or a verify run's ``outputs/baseline-c1.jsonl``: what the target emitted when served). A token
    outside the vocabulary can never be proposed, so the draft's first-position acceptance stays
    below this share."""
    import torch

    from eagle3.generate.storage import iter_samples
    from eagle3.vocab import build_vocab, count_tokens

    def answers(path: str) -> list[list[int]]:
        p = Path(path)
        if p.is_file():  # a verify run's outputs: one served answer per line
            return [json.loads(line)["token_ids"] for line in p.open() if line.strip()]
        return [s["completion_token_ids"] for s in iter_samples(p)]

    def flat(seqs: list[list[int]]) -> torch.Tensor:
        return torch.tensor([x for s in seqs for x in s], dtype=torch.int64)

    train = answers(a.train_gen)
    counts = count_tokens(((t, [1] * len(t)) for t in train), a.vocab_size)
    tokens = {"in-sample": flat(train)}  # each set flattened once, scored at every size
    tokens |= {k: flat(answers(v)) for k, v in (e.split("=", 1) for e in a.eval)}
    for size in a.sizes:
        keep = torch.zeros(a.vocab_size, dtype=torch.bool)
        keep[build_vocab(counts, size).draft_ids] = True
        row = {"draft_vocab_size": size}
        row |= {name: round(float(keep[t].float().mean()), 4) for name, t in tokens.items()}
        print(json.dumps(row))


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------


def cmd_plot(a) -> None:
    """Acceptance vs training samples (or epochs: ``--x epochs``), one line per (series,
    evaluation set), n-gram as levels; ``--match`` keeps the rows whose name contains it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(a.results).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("plot", True)]  # "plot": false: rows kept for tables only
    rows = [r for r in rows if a.match in r["name"]]
    if a.x == "epochs":  # the trained epochs, from the run's last metrics record
        rows = [dict(r, samples=r["final"]["epoch"]) for r in rows if r.get("final")]
    evals = sorted(
        {
            k
            for r in rows
            for k, v in r.items()
            if isinstance(v, dict) and "acceptance_length" in v and not k.endswith("_ngram")
        }
    )
    fig, ax = plt.subplots(figsize=(12, 5.5))
    styles = dict(zip(evals, ("o-", "s--", "^:", "d-.")))
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(r.get("series", r["name"]), []).append(r)
    for name, rs in series.items():
        for ev in evals:
            pts = sorted((r["samples"], r[ev]["acceptance_length"]) for r in rs if r.get(ev))
            if pts:
                ax.plot(*zip(*pts), styles[ev], label=f"{name} [{ev}]")
    for ev in evals:
        ng = next((r[f"{ev}_ngram"] for r in rows if r.get(f"{ev}_ngram")), None)
        if ng:
            ax.axhline(
                ng["acceptance_length"],
                color="gray",
                ls=styles[ev][1:] or "-",
                lw=1,
                label=f"n-gram, simulated [{ev}]",
            )
    if a.demo and a.x == "samples":
        ax.plot(
            [40],
            [a.demo],
            "r*",
            ms=12,
            label="make demo's draft (vLLM CPU, the demo's MT-bench workload)",
        )
    if a.x == "epochs":
        ax.set(xlabel="epochs", title="Draft acceptance vs epochs (offline estimate)")
    else:
        ax.set(
            xscale="log",
            xlabel="training samples (ShareGPT first turns; answers: the target's own, then ShareGPT's)",
            title="Draft acceptance vs data (offline estimate)",
        )
    ax.set(ylabel="acceptance length (k = 3, greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(a.png, dpi=110, bbox_inches="tight")
    print(f"wrote {a.png}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--dataset", default="embedded:sharegpt")
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--out", required=True)
    p = sub.add_parser("generate-hf")
    p.add_argument("--prompts", required=True)
    p.add_argument("--split", default="train")
    p.add_argument("--num", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("mtbench-hf")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--workload", default="mt_bench", help="'mt_bench' or MT-bench's question.jsonl")
    p.add_argument("--out", required=True)
    p = sub.add_parser("answers")
    p.add_argument("--dataset", default="embedded:sharegpt")
    p.add_argument("--num", type=int, default=100_000)
    p.add_argument("--exclude", action="append", default=[])
    p.add_argument(
        "--turns", type=int, default=1, help="answers per conversation (one sample each)"
    )
    p.add_argument("--out", required=True)
    p = sub.add_parser("run")
    p.add_argument("--train-gen", required=True)
    p.add_argument("--eval", action="append", default=[], help="NAME=GENERATE_DIR")
    p.add_argument("--work", required=True)
    p.add_argument(
        "--exp",
        action="append",
        default=[],
        help='JSON: {"name", "samples", "set": [...], "extract": [...]}',
    )
    p.add_argument("--set", action="append", help="overrides for every experiment")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--keep-draft", default="")
    p.add_argument("--profile", default="", help="profile the runs start from (default: CPU's)")
    p.add_argument("--only-extract", action="store_true")
    p.add_argument("--out", required=True)
    p = sub.add_parser("extract")
    p.add_argument("--gen", required=True)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--set", action="append", help="config overrides, e.g. extract.dataset_answers=N"
    )
    p = sub.add_parser("eval")
    p.add_argument("--draft", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--samples", type=int, default=0)
    p.add_argument("--eval", action="append", default=[], help="NAME=EXTRACT_DIR")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", required=True)
    p = sub.add_parser("combine")
    p.add_argument("--src", action="append", required=True)
    p.add_argument("--exclude", action="append", default=[])
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("coverage")
    p.add_argument("--train-gen", required=True)
    p.add_argument("--eval", action="append", default=[], help="NAME=GENERATE_DIR or outputs jsonl")
    p.add_argument("--vocab-size", type=int, default=49152, help="the target's vocabulary")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 24576, 32768, 49152])
    p = sub.add_parser("plot")
    p.add_argument("results")
    p.add_argument("png")
    p.add_argument("--demo", type=float, default=None)
    p.add_argument("--x", choices=("samples", "epochs"), default="samples")
    p.add_argument("--match", default="", help="only rows whose name contains this")
    a = ap.parse_args()
    {
        "prompts": cmd_prompts,
        "generate-hf": cmd_generate_hf,
        "mtbench-hf": cmd_mtbench_hf,
        "run": cmd_run,
        "plot": cmd_plot,
        "extract": cmd_extract,
        "eval": cmd_eval,
        "combine": cmd_combine,
        "answers": cmd_answers,
        "coverage": cmd_coverage,
    }[a.cmd](a)


if __name__ == "__main__":
    main()
