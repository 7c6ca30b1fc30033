"""The official ``openai`` client talks to the simulator without errors (streaming included).

The client is synchronous here, run in a worker thread, while the simulator is served by the
test's trio loop: ``openai``'s async client expects asyncio.
"""

from __future__ import annotations

import openai
import trio

from trio_pdrouter_sim import SimConfig, serve_sim


def _use_client(base_url: str) -> tuple[str, str, int, str]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    try:
        chat_text = ""
        usage_total = 0
        stream = client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "Say something"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices:
                chat_text += chunk.choices[0].delta.content or ""
            elif chunk.usage is not None:
                usage_total = chunk.usage.total_tokens
        completion_text = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model="sim-model", prompt="Once upon", max_tokens=3, stream=True
            )
        )
        whole = client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        models = client.models.list()
        return (
            chat_text,
            completion_text,
            usage_total,
            models.data[0].id + str(whole.choices[0].message.content),
        )
    finally:
        client.close()


async def test_openai_client_streams() -> None:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_sim, SimConfig.fast(port=0))
        chat, completion, usage_total, other = await trio.to_thread.run_sync(_use_client, url)
        assert chat == " tok0 tok1 tok2 tok3 tok4"
        assert completion == " tok0 tok1 tok2"
        assert usage_total > 5
        assert other == "sim-model tok0 tok1"
        nursery.cancel_scope.cancel()
