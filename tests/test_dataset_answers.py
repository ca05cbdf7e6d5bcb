"""extract.dataset_answers: the dataset's own answers as extra training contexts (issue #14).

Real parts: the SmolLM2 tokenizer and model (extract's hf backend on the CPU); the generate folder
is written by hand with real token ids, so no server is needed."""

from __future__ import annotations

import json

from eagle3.extract.answers import ID_PREFIX, dataset_answer_examples
from eagle3.extract.storage import HiddenStateDataset
from eagle3.generate.prompts import sample_id
from eagle3.tokens import template_prompt_ids
from tests.conftest import gen_cfg


def conv(q: str, a: str, *more: dict) -> dict:
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}, *more]}


def test_dataset_answers_add_the_datasets_own_answers(smol_model, tmp_path):
    from transformers import AutoTokenizer

    from eagle3.extract.runner import extract

    tok = AutoTokenizer.from_pretrained(smol_model)
    mt_bench_turn = (
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
        "experiences and must-see attractions."
    )
    rows = [
        conv("What is 2 + 2?", "4."),  # answered by the target in generate: left out
        conv(
            "Name a colour.",
            "Blue.",
            {"from": "human", "value": "Another?"},
            {"from": "gpt", "value": "Red."},
        ),
        conv(mt_bench_turn, "Aloha!"),  # an MT-bench prompt: excluded
        {"conversations": [{"from": "gpt", "value": "a piece of a split conversation"}]},
        conv("Say hi.", "Hi!"),
        conv("Count to three.", "1, 2, 3."),
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = gen_cfg(
        tmp_path, f"generate.dataset={data}", "extract.backend=hf", "extract.dataset_answers=2"
    )

    # the generate stage's own sample for the first prompt (real ids through the chat template)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    gen = tmp_path / "gen"
    gen.mkdir()
    prompt_ids = template_prompt_ids(tok, msgs)
    rec = {
        "id": sample_id(msgs),
        "messages": msgs,
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": tok.encode("2 + 2 = 4.", add_special_tokens=False)
        + [tok.eos_token_id],
    }
    (gen / "samples-00000.jsonl").write_text(json.dumps(rec) + "\n")
    (gen / "manifest.json").write_text(json.dumps({"totals": {"samples": 1}}))

    picked = list(dataset_answer_examples(cfg, tok, {rec["id"]}))
    assert len(picked) == 2 and all(ex.id.startswith(ID_PREFIX) for ex in picked)
    texts = {tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m]) for ex in picked}
    assert texts <= {"Blue.<|im_end|>", "Hi!<|im_end|>", "1, 2, 3.<|im_end|>"}, (
        "first answers only, MT-bench out"
    )
    ex = picked[0]
    n_prompt = ex.loss_mask.index(1)
    first_user = tok.decode(ex.input_ids[:n_prompt])
    assert first_user.endswith("<|im_start|>assistant\n") and "What is 2 + 2?" not in first_user

    m = extract(cfg, gen, tmp_path / "ext", str(smol_model))
    assert m["samples"] == 3 and m["this_run"]["stored"] == 3
    assert (
        m["this_run"]["dataset_answers"]["rows_not_taken"][
            "prompt answered by the target (generate)"
        ]
        == 1
    )
    ds = HiddenStateDataset(tmp_path / "ext")
    assert sorted(ds.ids) == sorted([rec["id"], *(e.id for e in picked)])
    again = extract(
        cfg, gen, tmp_path / "ext", str(smol_model)
    )  # a rerun resumes: nothing computed twice
    assert again["samples"] == 3 and again["this_run"]["stored"] == 0


def test_later_turns_continue_the_sequence_as_a_server_would_prompt_them(smol_model):
    """dataset_answer_turns=2: one sequence = turn 2's prompt (the history through the chat
    template) + its answer; both answers in the loss, a trailing unanswered user turn left out."""
    from collections import Counter

    from transformers import AutoTokenizer

    from eagle3.extract.answers import answer_example

    tok = AutoTokenizer.from_pretrained(smol_model)
    msgs = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Red, of course."},
        {"role": "user", "content": "And a third?"},
    ]
    stats: Counter = Counter()
    one = answer_example(tok, msgs, {}, 1, stats)
    two = answer_example(tok, msgs, {}, 3, stats)
    assert not stats
    assert two.input_ids[: len(one.input_ids)] == one.input_ids
    second = template_prompt_ids(tok, msgs[:3])
    assert two.input_ids[: len(second)] == second  # what verify sends for turn 2
    answer2 = tok.encode("Red, of course.", add_special_tokens=False) + [tok.eos_token_id]
    assert two.input_ids[len(second) :] == answer2
    loss = [i for i, m in zip(two.input_ids, two.loss_mask) if m]
    assert tok.decode(loss) == "Blue.<|im_end|>Red, of course.<|im_end|>"
    assert one.id != two.id and one.id == answer_example(tok, msgs[:2], {}).id
