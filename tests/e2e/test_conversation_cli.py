"""`mira serve`, `mira chat` and `mira generate --system / --messages / --prompt -` as a user runs them:
fresh processes on the bundled model (CPU), loopback only."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai

from tiny_models import make_checkpoint

DEADLINE_S = 120


def _command(*args):
    entry = shutil.which("mira")
    return [entry, *args] if entry else [sys.executable, "-m", "mira.cli", *args]


def _mira(*args, stdin=None):
    return subprocess.run(_command(*args), input=stdin, capture_output=True, text=True, timeout=DEADLINE_S)


def test_generate_takes_a_system_message_a_prompt_on_stdin_or_a_conversation_file(tmp_path):
    common = ("--device", "cpu", "--temperature", "0", "--max-new-tokens", "10", "--quiet")
    piped = _mira("generate", "--system", "You answer briefly.", "--prompt", "-", *common, stdin="What is Python?")
    assert piped.returncode == 0, piped.stderr
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "system", "content": "You answer briefly."},
                                        {"role": "user", "content": "What is Python?"}]))
    from_file = _mira("generate", "--messages", str(conversation), *common)
    assert from_file.returncode == 0, from_file.stderr
    assert piped.stdout == from_file.stdout and piped.stdout.strip()
    plain = _mira("generate", "--prompt", "What is Python?", *common)
    assert plain.stdout != piped.stdout  # the system message reached the model
    conversation.write_text('{"role": "user"}')
    bad = _mira("generate", "--messages", str(conversation), *common)
    assert bad.returncode == 1 and bad.stderr.startswith("mira: error:") and "JSON list" in bad.stderr


def test_chat_keeps_the_conversation_across_turns(tmp_path):
    common = ("--device", "cpu", "--temperature", "0", "--max-new-tokens", "8", "--quiet")
    chat = _mira("chat", *common, "--system", "You answer briefly.", stdin="What is Python?\nWho made it?\n")
    assert chat.returncode == 0, chat.stderr
    replies = chat.stdout.split("\n")[:-1]
    assert len(replies) == 2 and all(replies)
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "system", "content": "You answer briefly."},
                                        {"role": "user", "content": "What is Python?"},
                                        {"role": "assistant", "content": replies[0]},
                                        {"role": "user", "content": "Who made it?"}]))
    second = _mira("generate", "--messages", str(conversation), *common)
    assert second.stdout == replies[1] + "\n"


def test_chat_refuses_a_model_without_a_chat_template_or_a_tokenizer_before_reading_a_turn(tmp_path):
    checkpoint = make_checkpoint("mixtral", tmp_path / "ckpt")  # a tokenizer without a chat template
    common = ("--model", str(checkpoint), "--device", "cpu", "--quiet")
    untemplated = _mira("chat", *common, stdin="Hello\nAgain\n")
    assert untemplated.returncode == 1 and untemplated.stdout == ""
    assert "mira: error: the tokenizer of" in untemplated.stderr and "mira generate --prompt" in untemplated.stderr
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).unlink()
    bare = _mira("chat", *common, stdin="Hello\n")
    assert bare.returncode == 1 and "has no tokenizer files, which chat needs" in bare.stderr


@contextlib.contextmanager
def _server():
    """`mira serve` on the bundled model at a free loopback port: (process, its /v1 URL) once it answers."""
    server = subprocess.Popen(_command("serve", "--device", "cpu", "--port", "0", "--quiet"),
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                              env={**os.environ, "MIRA_API_KEY": ""})
    try:
        deadline = time.monotonic() + DEADLINE_S
        line = ""
        while "serving" not in line:
            assert time.monotonic() < deadline and server.poll() is None, "mira serve did not start"
            line = server.stderr.readline()
        url = line.split(" at ")[1].split()[0]
        while True:  # the socket listens before uvicorn runs: wait for its first answer
            try:
                assert httpx.get(url.removesuffix("/v1") + "/health").json()["model"] == "mira-tiny-moe"
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        yield server, url
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(DEADLINE_S)


def test_serve_binds_loopback_and_answers_the_openai_client():
    with _server() as (_, url):
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=DEADLINE_S)
        reply = client.chat.completions.create(model="mira-tiny-moe", max_tokens=4,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content is not None


def test_ctrl_c_ends_a_running_generation_and_the_server_at_once():
    """uvicorn alone waits for every connection to close; mira serve's first SIGINT also ends the
    generation that runs (its stream gets an error event) and the server exits within seconds."""
    with _server() as (server, url):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1800, "min_tokens": 1800,
                "stream": True}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=DEADLINE_S) as answer:
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # generating
            server.send_signal(signal.SIGINT)
            stopped = time.monotonic()
            rest = list(lines)
        assert server.wait(30) in (0, 130) and time.monotonic() - stopped < 30  # 130: the SIGINT, re-raised
        assert any("shutting down" in line for line in rest) and "Traceback" not in server.stderr.read()
