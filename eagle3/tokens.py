"""Exact token ids of a generated turn.

vLLM returns them (``return_token_ids``): that is the source of truth, because re-tokenising
text is not guaranteed to give back the ids the model sampled. When a server gives none,
``rebuild_token_ids`` reconstructs them from the chat template, with the reasoning wrapped
in the model's think tokens the way the template and reasoning parser split it: the seed run
had to do this by hand around Kimi's 163606/163607 and got it wrong.
"""

from __future__ import annotations

from typing import Any


def template_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, str]],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt ids a server builds: the chat template with the generation prompt, tokenised."""
    return [
        int(i)
        for i in tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(chat_template_kwargs or {}),
        )["input_ids"]
    ]


def rebuild_token_ids(
    tokenizer: Any,
    messages: list[dict[str, str]],
    reasoning: str | None,
    content: str | None,
    finish_reason: str | None,
    *,
    think_start_id: int | None = None,
    think_end_id: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) as the server would have produced them.

    - prompt: the chat template with the generation prompt (which may already open ``<think>``).
    - completion: ``<think>`` unless the prompt opened it, the reasoning, ``</think>``, the content,
      and the end-of-turn token when the model stopped by itself (finish_reason "stop").
      Reasoning without content means the model never closed the block: no ``</think>`` is added.
    """
    prompt_ids = template_prompt_ids(tokenizer, messages, chat_template_kwargs)
    ids: list[int] = []
    if reasoning:
        if think_start_id is None or think_end_id is None:
            raise ValueError(
                "the response has reasoning but the profile sets no think tokens "
                "(target.think_*_id)"
            )
        if think_start_id not in prompt_ids[-4:]:
            ids.append(think_start_id)
        ids += tokenizer.encode(reasoning, add_special_tokens=False)
        if content is not None:
            ids.append(think_end_id)
    if content:
        ids += tokenizer.encode(content, add_special_tokens=False)
    if finish_reason == "stop" and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return prompt_ids, ids
