#!/usr/bin/env python3
"""`nflash serve` against the official `openai` Python client (pinned in
scripts/requirements-test.txt), as `make test` runs it: a chat completion,
the same streamed (its chunks joined must equal the whole greedy reply),
a text completion, /v1/models, a 401 (wrong API key) and a 400 (empty
messages).

    .venv/bin/python scripts/test_openai_client.py PACK
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent
KEY = "test-key-1234"


def start(pack: str) -> tuple[subprocess.Popen, str, list[str]]:
    """nflash serve on a free port; its process, base URL and stderr lines."""
    p = subprocess.Popen(
        [str(REPO / "target/release/nflash"), "serve", "--model", pack, "--port", "0", "--api-key", KEY,
         "--temperature", "0"],
        stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    for line in p.stderr:
        log.append(line)
        if "http://" in line:
            url = line[line.index("http://"):].split()[0]
            threading.Thread(target=lambda: log.extend(p.stderr), daemon=True).start()
            return p, url, log
    sys.exit("nflash serve did not start:\n" + "".join(log))


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    proc, url, log = start(sys.argv[1])
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="nflash", messages=msgs, max_tokens=24, temperature=0)
        text = r.choices[0].message.content
        assert "Paris" in text, text
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage
        chunks = list(client.chat.completions.create(model="nflash", messages=msgs, max_tokens=24, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert joined == text, (joined, text)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        c = client.completions.create(model="nflash", prompt="The capital of France is", max_tokens=8,
                                      temperature=0)
        assert "Paris" in c.choices[0].text, c
        models = [m.id for m in client.models.list()]
        assert models == [Path(sys.argv[1]).stem], models
        try:
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401
        try:
            client.chat.completions.create(model="nflash", messages=[], max_tokens=4)
            raise AssertionError("empty messages were accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "messages" in str(e), e
        print(f"openai {openai.__version__} client against nflash serve: chat {text!r}, "
              f"{len(chunks)} streamed chunks equal to it, completion, models {models}, 401 and 400: ok")
    finally:
        proc.terminate()
        proc.wait()
    if any("panicked" in line for line in log):
        sys.exit("nflash serve panicked:\n" + "".join(log))


if __name__ == "__main__":
    main()
