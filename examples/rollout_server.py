"""The rollout server on its own: start it, then query it three ways.

What it shows:

* ``ServerProcess`` starts a native rollout server (a real HTTP server in a child process), the
  same server ``polyrl serve MODEL_DIR --port 8000`` runs from the shell;
* ``RolloutClient``: polyrl's async client, token-in/token-out (``/generate``), with the
  sampled token ids, their log-probs and the weight version that produced them;
* the OpenAI-compatible API (``/v1/chat/completions``) with plain ``httpx``, and with the
  ``openai`` package when it is installed (it is in polyrl's ``test`` extra).

Run it::

    python examples/rollout_server.py --smoke    # the tests use this
    python examples/rollout_server.py --model /models/Qwen2.5-0.5B-Instruct

The server binds 127.0.0.1; another ``host`` needs an API key (``POLYRL_API_KEY``).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

import httpx

from polyrl.models.loader import load_tokenizer
from polyrl.rollout.client import RolloutClient
from polyrl.rollout.launcher import ServerProcess

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


async def with_polyrl_client(url: str, tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    async with RolloutClient([url]) as client:
        result = await client.generate(
            ids, {"n": 2, "max_new_tokens": 8, "temperature": 1.0, "logprobs": True, "seed": 0}
        )
        for out in result.outputs:
            print(
                "generate:",
                out.output_ids,
                [round(lp, 2) for lp in out.logprobs],
                out.finish_reason,
                f"weights v{out.weight_version}",
            )


def with_httpx(url: str) -> None:
    body = {"model": "polyrl", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    print("httpx chat:", repr(answer["choices"][0]["message"]["content"]), answer["usage"])


def with_openai(url: str) -> None:
    try:
        import openai
    except ImportError:
        print("openai is not installed; skipped")
        return
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    answer = client.chat.completions.create(
        model="polyrl", messages=MESSAGES, max_tokens=8, temperature=0
    )
    print("openai chat:", repr(answer.choices[0].message.content))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model (for the tests)")
    parser.add_argument("--model", default="", help="HF model directory (default: a tiny one)")
    args = parser.parse_args()
    model = args.model
    if not model:
        from polyrl.models.tiny import build_tiny_model

        model = str(build_tiny_model("qwen2", tempfile.mkdtemp() + "/tiny", size="nano"))
    # Engine options are the backend's (see `polyrl serve --help`); these keep it small on CPU.
    options = {"num_threads": 1, "max_num_seqs": 8, "kv_cache_tokens": 4096}
    with ServerProcess(model, options=options) as server:  # start() on enter, stop() on exit
        print("server at", server.url)
        asyncio.run(with_polyrl_client(server.url, load_tokenizer(model)))
        with_httpx(server.url)
        with_openai(server.url)
        print("health:", httpx.get(f"{server.url}/health").json())


if __name__ == "__main__":
    main()
