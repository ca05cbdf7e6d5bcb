"""A minimal OpenAI-compatible HTTP server answering /health and /v1/models.

TEST DOUBLE: used only where no real vLLM can be run for the case under test: behind the
stand-in `systemctl` (no systemd runs on these machines) and for the external backend's
error paths. Every test that needs real serving uses the real vLLM CPU server.

    python openai_stub.py PORT MODEL_NAME [--die-after SECONDS]
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    port, model = int(sys.argv[1]), sys.argv[2]
    die_after = (
        float(sys.argv[sys.argv.index("--die-after") + 1]) if "--die-after" in sys.argv else None
    )

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                body = b""
            elif self.path == "/v1/models":
                body = json.dumps(
                    {"object": "list", "data": [{"id": model, "object": "model"}]}
                ).encode()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"stub serving {model} on {port}", flush=True)
    if die_after is not None:

        def die():
            time.sleep(die_after)
            print("stub: simulated crash (CUDA out of memory)", flush=True)
            import os

            os._exit(3)

        threading.Thread(target=die, daemon=True).start()
    srv.serve_forever()


if __name__ == "__main__":
    main()
