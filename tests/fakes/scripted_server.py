"""TEST DOUBLE: an OpenAI-compatible server that answers with a scripted sequence of statuses.

vLLM cannot be made to answer 429 or 503 on demand, so the client's retry policy is tested
against this; everything else about generation is tested against the real vLLM server.
Nor can vLLM be made to answer 200 with a body that is not JSON (a proxy's error page: status
299 in the script), nor, cheaply, with a completion of no token (status 298: finish_reason
"length", empty text, ``token_ids: []``, what issue #39 saw), nor to return token ids that are not its tokenizer's (the canned answer's
ids are [9, 8, 7, 6, 5]): tests/test_faults.py uses this for those two cases. ``/v1/models``
always answers (model "zero") without taking a status from the script.

    python scripted_server.py PORT STATUS[,STATUS...]   e.g. 429,503,200  (then 200 forever)
"""

import asyncio
import json
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "bench"))
from zero_server import BODY, MODELS, Handler, response  # noqa: E402

STATUSES: list[int] = []
_empty = json.loads(BODY)
_empty["choices"][0].update(
    finish_reason="length", token_ids=[], message={"role": "assistant", "content": ""}
)
_empty["usage"]["completion_tokens"] = 0
EMPTY = json.dumps(_empty).encode()


class Scripted(Handler):
    def data_received(self, data):
        self.buf += data
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buf[:head_end].decode("latin-1")
        length = next(
            (
                int(ln.split(":")[1])
                for ln in head.split("\r\n")
                if ln.lower().startswith("content-length")
            ),
            0,
        )
        if len(self.buf) < head_end + 4 + length:
            return
        self.buf = self.buf[head_end + 4 + length :]
        if head.split(" ", 2)[1].endswith("/models"):
            self.t.write(response(MODELS))
            return
        status = STATUSES.pop(0) if STATUSES else 200
        if status == 200:
            self.t.write(response(BODY))
        elif status == 298:  # 200 with a completion of no token (finish_reason length, no text)
            self.t.write(response(EMPTY))
        elif status == 299:  # 200 with a body that is not JSON (a proxy's error page)
            self.t.write(response(b"<html><body>502 Bad Gateway</body></html>"))
        else:
            body = json.dumps({"error": {"message": f"scripted {status}"}}).encode()
            self.t.write(
                f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                + body
            )


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Scripted, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    STATUSES.extend(int(s) for s in sys.argv[2].split(","))
    asyncio.run(main(int(sys.argv[1])))
