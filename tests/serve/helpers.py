"""Starting the server under test (`python -m minilade.serve` as a subprocess on a free loopback port) and talking
to it over raw HTTP."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

WORDS = "the cat sat on the mat and the dog ran to the cat while the bird sang over the red house by the sea"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONTEXT = 512
API_KEY = "test-key"
# The longest a server may take to load and measure its tables: a first start on a machine also builds the native
# operator or compiles graphs (a compiled demo model's steps and shared passes took some 60 s on 2 cores, twice that
# beside other tests: 120 s was exceeded in a full run).
START_S = 300


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log: Path  # its stdout and stderr

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then its exit status (killed after `timeout` seconds)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, *args: str) -> ServerProcess:
    """The server started on 127.0.0.1 and answering /health with 200: float32 eager steps unless args say otherwise
    (a later option overrides an earlier one)."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="minilade-serve-", suffix=".log")[1])
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "minilade.serve", "--ckpt", str(ckpt), "--port", str(port),
                                    "--dtype", "float32", "--compile", "off", *args],
                                   stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {server.output()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise AssertionError(f"the server did not become healthy in {START_S} s: {server.output()}")




def post(server: ServerProcess, path: str, body: object, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def metric(server: ServerProcess, name: str) -> float:
    """A metric's value from GET /metrics, its labelled samples summed."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")
