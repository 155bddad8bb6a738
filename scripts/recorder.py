"""scripts/recorder.py: a request recorder in front of an inference engine, to see a run from the server's side.

What it does
  Listens on the loopback, forwards every request to the engine as it came (path, body, answer and status passed
  back unchanged), and appends one JSON line per request to a file: the time, the path, the model (or adapter)
  name the request named, the role (the policy: /v1/completions; the judge or the user: /v1/chat/completions, told
  apart by their max_tokens, 03's JUDGE_MAX_TOKENS and USER_MAX_TOKENS), the prompt's tokens as the engine counted
  them (its answer's usage), max_tokens, the request's whole size (prompt + max_tokens, what must fit the engine's
  window), the status, and for an adapter load its name and path. The rehearsal (scripts/rehearsal.py) and the
  engine's tests read these lines; a run pointed at the recorder's URL instead of the engine's is otherwise the
  same run.

Reads   nothing but the requests. Writes  --log (JSON lines, appended).
Usage   python scripts/recorder.py --engine http://localhost:8000 --port 8100 --log runs/requests.jsonl
        (then --engine http://localhost:8100 for 04 and 05); stops on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2

JUDGE_MAX_TOKENS, USER_MAX_TOKENS = 200, 120  # 03_rollout.py's (a test holds them equal)


def role_of(path: str, body: dict) -> str | None:
    """Who sent a request: the policy (a completion), the judge or the user (a chat, by its max_tokens)."""
    if path.endswith("/completions") and "/chat/" not in path:
        return "policy"
    if path.endswith("/chat/completions"):
        return {JUDGE_MAX_TOKENS: "judge", USER_MAX_TOKENS: "user"}.get(body.get("max_tokens"), "chat")
    return None


def record(path: str, body: dict, status: int, answer: dict) -> dict:
    """One line of the log from a request's path and JSON body and the engine's status and answer."""
    line = {"t": round(time.time(), 3), "path": path, "status": status, "model": body.get("model")}
    role = role_of(path, body)
    if role is not None:
        prompt = (answer.get("usage") or {}).get("prompt_tokens") if isinstance(answer, dict) else None
        line.update(role=role, prompt_tokens=prompt, max_tokens=body.get("max_tokens"))
        line["request_tokens"] = prompt + body.get("max_tokens", 0) if prompt is not None else None
    if "lora_name" in body:
        line.update(lora_name=body["lora_name"], lora_path=body.get("lora_path"))
    return line


def serve(engine: str, port: int, log: str) -> ThreadingHTTPServer:
    """The recorder listening on 127.0.0.1:port (0: any free one), forwarding to `engine`; serve_forever runs it."""
    client, lock = httpx2.Client(base_url=engine.rstrip("/"), timeout=3600), threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def forward(self, method: str):
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                answer = client.request(method, self.path, content=data, headers={"Content-Type": "application/json"})
            except httpx2.TransportError as e:
                self.send_error(502, f"the engine cannot be reached: {e}")
                return
            if method == "POST":
                try:
                    body = json.loads(data or b"{}")
                    reply = (
                        answer.json() if answer.headers.get("content-type", "").startswith("application/json") else {}
                    )
                except ValueError:
                    body, reply = {}, {}
                with lock, open(log, "a") as out:
                    out.write(json.dumps(record(self.path, body, answer.status_code, reply)) + "\n")
            self.send_response(answer.status_code)
            self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
            self.send_header("Content-Length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        def do_GET(self):
            self.forward("GET")

        def do_POST(self):
            self.forward("POST")

        def log_message(self, *args):  # the log file says it all
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", required=True, help="the engine's URL (http://localhost:8000)")
    p.add_argument("--port", type=int, default=8100, help="the recorder's port on 127.0.0.1")
    p.add_argument("--log", required=True, help="the JSON-lines file the requests are appended to")
    a = p.parse_args(argv)
    server = serve(a.engine, a.port, a.log)
    print(f"recording {a.engine} at http://127.0.0.1:{server.server_address[1]} into {a.log}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
