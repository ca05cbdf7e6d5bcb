"""Training contexts from the dataset's own answers (``extract.dataset_answers``): no generation.

The draft never learns the tokens of its training sequences: it learns the target's
distribution at every position of them, read off the target's own states (extract stores them,
train takes the labels from them). So the sequences need not be the target's writing; they
only decide in which contexts the target is read. A dataset's answers (ShareGPT's are
ChatGPT's) cost no generation and are many, where generation on a small machine is slow.
Measured (docs/train.md, "Draft quality", H200, offline k = 3 on MT-bench): 1,000 answers the
target wrote alone give acceptance 1.39; the same plus 8,780 ShareGPT answers 1.81. The target's
own answers still matter: they hold what it writes when serving (its loops included).

Each conversation that opens with a user turn gives one example: the first user turn through
the chat template, then the first answer's tokens and the end-of-turn token; the loss covers
the answer. With ``extract.dataset_answer_turns`` N > 1 the example goes on through up to N
user/answer pairs (MT-bench's second turns are such contexts), every answer in the loss.
Conversations whose prompt the generate stage answered are left out (that prompt is already
there, with the target's own answer), and so are excluded prompts (MT-bench).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.extract.inputs import Example
from eagle3.generate.prompts import (
    RowError,
    _key,
    exclusion_keys,
    open_rows,
    row_messages,
    sample_id,
    select_turns,
)
from eagle3.tokens import template_prompt_ids

ID_PREFIX = "answer-"


def answer_example(
    tokenizer: Any,
    messages: list[dict[str, str]],
    chat_template_kwargs: dict[str, Any],
    turns: int = 1,
    stats: Counter | None = None,
) -> Example:
    """One example from a conversation's first user turn and the answer after it; with
    ``turns`` > 1 also the next user/answer pairs, in one sequence, each answer in the loss.

    A later turn is rendered the way a server builds its prompt (the history's text through the
    chat template); it is appended only where that rendering starts with the sequence so far
    (the answer's own tokens + end-of-turn), so the one sequence equals each turn's prompt plus
    its answer. Where it does not (a template that rewrites the history), the example stops
    there and ``stats`` counts it."""
    prompt = select_turns(messages, "first")
    ids = template_prompt_ids(tokenizer, prompt, chat_template_kwargs)
    mask = [0] * len(ids)
    eot = tokenizer.eos_token_id  # SmolLM2 / ChatML: <|im_end|>, what the target ends a turn with
    history = list(prompt)
    for turn in range(turns):
        answer = messages[len(history)] if len(history) < len(messages) else None
        if answer is None or answer["role"] != "assistant" or not answer["content"].strip():
            if turn == 0:
                raise RowError("no answer after the first user turn")
            break
        completion = tokenizer.encode(answer["content"], add_special_tokens=False)
        completion += [eot] if eot is not None else []
        ids, mask = ids + completion, mask + [1] * len(completion)
        history.append(answer)
        nxt, reply = (messages[len(history) : len(history) + 2] + [None, None])[:2]
        if turn + 1 == turns or nxt is None or nxt["role"] != "user" or reply is None:
            break  # (a user turn with no answer after it adds no loss)
        following = template_prompt_ids(tokenizer, [*history, nxt], chat_template_kwargs)
        if following[: len(ids)] != ids:
            if stats is not None:
                stats["later turn: the chat template re-renders the history"] += 1
            break
        mask += [0] * (len(following) - len(ids))
        ids = following
        history.append(nxt)
    return Example(ID_PREFIX + sample_id(history), ids, mask)


def dataset_answer_examples(
    cfg: PipelineConfig, tokenizer: Any, generated_ids: set[str], stats: Counter | None = None
) -> Iterator[Example]:
    """Up to ``extract.dataset_answers`` examples of ``generate.dataset`` in a seeded order
    (``generate.seed``); rows are parsed lazily. Rows that give none are counted in ``stats`` by
    reason (they are rows of the dataset, not samples: the generate stage records unreadable
    ones)."""
    g, want, turns = cfg.generate, cfg.extract.dataset_answers, cfg.extract.dataset_answer_turns
    stats = stats if stats is not None else Counter()
    rows, _ = open_rows(g.dataset, g.split)
    exclude = exclusion_keys(g.exclude_files, mt_bench=g.exclude_mt_bench)
    order = list(range(len(rows)))
    # not generate's order: its first prompts are left out anyway
    random.Random(g.seed + 1).shuffle(order)
    taken, seen = 0, set()
    for idx in order:
        if taken >= want:
            return
        row = rows[idx]
        if isinstance(row, tuple):  # local jsonl or embedded: (where, row, error)
            _, row, err = row
            if err:
                stats["unreadable row"] += 1
                continue
        try:
            msgs = row_messages(row, g.data_format, g.prompt_column, g.messages_column)
            prompt = select_turns(msgs, "first")
            if sample_id(prompt) in generated_ids:
                stats["prompt answered by the target (generate)"] += 1
                continue
            if any(_key(m["content"]) in exclude for m in prompt if m["role"] == "user"):
                stats["excluded prompt"] += 1
                continue
            ex = answer_example(tokenizer, msgs, g.chat_template_kwargs, turns, stats)
        except IndexError:
            stats["no answer after the first user turn"] += 1
            continue
        except RowError as e:
            stats[str(e)] += 1
            continue
        if ex.id in seen:
            stats["duplicate"] += 1
            continue
        seen.add(ex.id)
        taken += 1
        yield ex
