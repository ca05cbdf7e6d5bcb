"""A zero-work OpenAI-compatible server: answers every chat completion at once with a canned
vLLM-shaped response. Used to measure the client's own ceiling (the client must never be the
bottleneck). Minimal HTTP/1.1 with keep-alive on asyncio.Protocol: far faster than the client.

    python bench/zero_server.py PORT [MODEL]

MODEL (default "zero") is the name ``/v1/models`` lists. Its token ids are canned ([9, 8, 7, 6,
5] for every prompt) and it has no ``/tokenize``: the fault tests and bench/faults.py use it as a
server whose ids are not the target's (issue #30).
"""

from __future__ import annotations

import asyncio
import json
import sys

BODY = json.dumps(
    {
        "id": "chatcmpl-0",
        "object": "chat.completion",
        "created": 0,
        "model": "zero",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "token_ids": [1, 2, 3, 4],
                "message": {"role": "assistant", "content": "ok", "reasoning": "r"},
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
        "prompt_token_ids": [9, 8, 7, 6, 5],
    }
).encode()


def models_body(name: str) -> bytes:
    return json.dumps(
        {"object": "list", "data": [{"id": name, "object": "model", "max_model_len": 4096}]}
    ).encode()


MODELS = models_body("zero")


def response(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class Handler(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            path = head.split(" ", 2)[1]
            self.buf = self.buf[end:]
            if path.endswith("/chat/completions"):
                self.t.write(response(BODY))
            elif path.endswith("/models"):
                self.t.write(response(MODELS))
            else:
                self.t.write(response(b""))


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        Handler, "127.0.0.1", port, backlog=4096
    )
    print(f"zero server on {port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        MODELS = models_body(sys.argv[2])
    asyncio.run(main(int(sys.argv[1])))
