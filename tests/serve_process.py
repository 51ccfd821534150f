"""A real `kvforge serve` in a subprocess on a free port of 127.0.0.1, for the
server tests. It is always stopped (SIGTERM, then SIGKILL) when the test ends."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Bounds for waiting on the server, not measurements: generous, so a busy machine never fails a test.
START_TIMEOUT_S = 180
POLL_S = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str]):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvforge-serve-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvforge", "serve", "kvforge-tiny", "--port", str(self.port), "--threads", "1",
             "--uvicorn-log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvforge serve exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(OSError):
                if self.get("/health")[0] == 200:
                    return
            time.sleep(POLL_S * 4)
        raise RuntimeError(f"kvforge serve did not become healthy:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, bytes]:
        status, _, body = self.request("GET", path)
        return status, body

    def post_json(self, path: str, payload: dict | bytes, headers: dict[str, str] | None = None):
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, response_headers, data = self.request("POST", path, body, headers)
        return status, response_headers, json.loads(data) if data else None

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 if absent)."""
        _, text = self.get("/metrics")
        want = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(w in line for w in want):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_for(self, predicate, what: str):
        """Poll `predicate` until true (bounded, never a latency assertion)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(POLL_S)
        raise AssertionError(f"timed out waiting for {what}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:  # stop() may come twice: a test's own, then the context's
            self.log.close()
            os.unlink(self.log.name)
        return self.proc.returncode


@contextlib.contextmanager
def running_server(*args: str):
    server = ServerProcess(list(args))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def openai_client(server: ServerProcess, api_key: str = "unused", async_: bool = False):
    import openai

    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return cls(base_url=server.base + "/v1", api_key=api_key, max_retries=0, timeout=120)
