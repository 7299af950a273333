"""A real Prometheus (Debian's `prometheus` binary) on loopback, scraping the targets of a
file-based service-discovery file such as the one Ray writes in its session directory."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

SCRAPE_INTERVAL = "1s"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_prometheus() -> str:
    """The binary's path; skips the test where there is none."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not found: `apt-get install -y prometheus` (Debian)")
    return binary


class PrometheusServer:
    def __init__(self, sd_file: Path, work_dir: Path) -> None:
        binary = require_prometheus()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = work_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "5s"},
            "scrape_configs": [{
                "job_name": "ray",
                "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "5s"}],
            }],
        }))
        self.log = open(work_dir / "prometheus.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={work_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited; see {self.log.name}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prometheus not ready after {timeout_s} s")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on an error answer)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
