"""Agent loops with images: prompts, image observations, image tool results, the proxy.

The loop tests drive the loops with :class:`FakeVisionClient`, a stand-in for the rollout
client that records the ``multi_modal`` each generate call got and answers scripted text (the
loops' part is what they send and record, not what a model makes of the pixels). Tests that
need a rollout server that takes images are marked ``needs_vlm_server`` and skip until
``RolloutClient.generate`` accepts ``multi_modal=``.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from polyrl.agent import Tool, ToolResult, collate_trajectories, create_agent_loop
from polyrl.agent.envs import VisualColorEnv, create_env
from polyrl.core.columns import MULTI_MODAL
from polyrl.core.multimodal import (
    MultiModalInputs,
    encode_png,
    expand_placeholders,
    image_digest,
    mrope_positions,
)


@pytest.fixture(scope="module")
def proc(tiny_vl_processor):
    return tiny_vl_processor


@pytest.fixture(scope="module")
def tok(proc):
    return proc.tokenizer


class FakeVisionClient:
    """Stand-in for ``RolloutClient``: records each call's ids and ``multi_modal``, answers the
    next scripted text (ending in eos) with log-prob -0.5 per token."""

    def __init__(self, tok, script: list[str]):
        self.tok = tok
        self.script = list(script)
        self.calls: list[dict[str, Any]] = []

    async def generate(
        self,
        input_ids,
        sampling_params=None,
        *,
        session_id=None,
        request_id=None,
        multi_modal: MultiModalInputs | None = None,
    ):
        self.calls.append({"ids": list(input_ids), "multi_modal": multi_modal})
        ids = self.tok.encode(self.script.pop(0), add_special_tokens=False)
        ids.append(self.tok.eos_token_id)
        out = SimpleNamespace(
            output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", weight_version=3
        )
        return SimpleNamespace(outputs=[out], weight_version=3)


def image_sample(proc, color=(0, 0, 255)):
    """A dataset-style sample: chat messages with an image part, expanded ids, its media."""
    img = Image.new("RGB", (56, 56), color)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    ids, mm = proc.encode_messages(messages, images=[img])
    return {"raw_prompt": messages, "input_ids": ids, "multi_modal": mm}


def runs(ids, token):
    """``(start, length)`` of each run of ``token`` in ``ids``."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def full_ids(traj):
    return traj.prompt_ids + traj.response_ids


def test_single_turn_sends_sample_media_and_the_batch_keeps_them(proc, tok):
    sample = image_sample(proc)
    mm = sample["multi_modal"]
    loop = create_agent_loop("single_turn", tok, sampling_params={"max_new_tokens": 8})
    client = FakeVisionClient(tok, ["a blue square", "blue", "text only"])
    text_sample = {"raw_prompt": [{"role": "user", "content": "hello"}]}

    async def go():
        return [await loop.run(s, client) for s in (sample, dict(sample), text_sample)]

    trajs = asyncio.run(go())
    # The client got the sample's media object with the ids that hold its placeholders.
    assert client.calls[0]["multi_modal"] is mm and client.calls[1]["multi_modal"] is mm
    assert client.calls[0]["ids"] == list(sample["input_ids"])
    assert client.calls[2]["multi_modal"] is None
    assert trajs[0].multi_modal is mm and trajs[2].multi_modal is None
    batch = collate_trajectories(trajs, pad_token_id=0)
    column = batch.non_tensors[MULTI_MODAL]
    # The n samples of one prompt share one object (its pixels are pickled once); text: None.
    assert column[0] is mm and column[1] is mm and column[2] is None
    # A text-only batch has no such column.
    assert MULTI_MODAL not in collate_trajectories(trajs[2:], pad_token_id=0).non_tensors


def test_a_prompt_with_image_data_and_no_media_is_rendered_and_processed(proc, tok):
    img = Image.new("RGB", (56, 56), (9, 9, 9))
    sample = {
        "raw_prompt": [
            {"role": "user", "content": [{"type": "image", "image": img}, "what is it?"]}
        ]
    }
    loop = create_agent_loop("single_turn", tok, processor=proc)
    client = FakeVisionClient(tok, ["dark"])
    traj = asyncio.run(loop.run(sample, client))
    want, mm = proc.encode_messages(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
        images=[img],
    )
    assert traj.prompt_ids == want == client.calls[0]["ids"]
    assert traj.multi_modal.digests == mm.digests == client.calls[0]["multi_modal"].digests
    no_proc = create_agent_loop("single_turn", tok)
    with pytest.raises(ValueError, match="no vision processor"):
        asyncio.run(no_proc.run(sample, FakeVisionClient(tok, ["x"])))
    bare = {"raw_prompt": [{"role": "user", "content": [{"type": "image"}, "hi"]}]}
    with pytest.raises(ValueError, match="no 'multi_modal'"):
        asyncio.run(loop.run(bare, FakeVisionClient(tok, ["x"])))


def test_env_loop_puts_the_samples_images_before_the_observations(proc, tok):
    sample = image_sample(proc)
    loop = create_agent_loop(
        "env", tok, env="visual_color", env_kwargs={"color": "blue"}, processor=proc
    )
    traj = asyncio.run(loop.run(sample, FakeVisionClient(tok, ["blue"])))
    square = VisualColorEnv().reset(color="blue")[1]["image"]
    assert traj.multi_modal.digests == (sample["multi_modal"].digests[0], image_digest(square))
    ids = full_ids(traj)
    assert expand_placeholders(ids, proc.token_ids, traj.multi_modal) == ids
    assert len(runs(traj.prompt_ids, proc.token_ids["image"])) == 2


def test_env_image_observations_over_two_turns_are_token_exact(proc, tok):
    loop = create_agent_loop(
        "env",
        tok,
        env="visual_color",
        env_kwargs={"color": "red", "max_tries": 3},
        max_turns=4,
        sampling_params={"max_new_tokens": 16},
        processor=proc,
    )
    sample = {"raw_prompt": [{"role": "system", "content": "Look carefully."}]}
    client = FakeVisionClient(tok, ["blue", "red"])
    traj = asyncio.run(loop.run(sample, client))
    traj.validate()
    assert traj.finish_reason == "done" and traj.reward == 1.0 and traj.num_turns == 2

    # The two images the environment showed, rebuilt the same way.
    env = VisualColorEnv()
    first = env.reset(color="red")[1]["image"]
    second = env.step("blue")[0][1]["image"]
    mm = traj.multi_modal
    assert mm is not None and mm.kinds == ("image", "image")
    assert mm.digests == (image_digest(first), image_digest(second))  # token order
    counts = proc.process_media(images=[first, second]).token_counts
    assert mm.token_counts == counts and counts[0] != counts[1]  # 56x56 and 112x56 pixels
    assert mm.sources == (encode_png(first), encode_png(second))

    pad = proc.token_ids["image"]
    ids = full_ids(traj)
    # One full run per image: the first in the prompt, the second in the env delta.
    (r1, r2) = runs(ids, pad)
    assert r1[1] == counts[0] and r1[0] < len(traj.prompt_ids)
    assert r2[1] == counts[1] and r2[0] >= len(traj.prompt_ids)
    assert expand_placeholders(ids, proc.token_ids, mm) == ids
    mrope_positions(ids, mm, proc.token_ids, proc.merge_size)  # grids match the runs in order

    # The prompt is what the processor renders for the system turn plus the observation.
    obs_msgs = sample["raw_prompt"] + [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What colour is this square? One of "},
                {"type": "image"},
            ],
        }
    ]
    obs_msgs[1]["content"][0]["text"] = traj.messages[1]["content"][0]["text"]
    want_prompt, _ = proc.encode_messages(obs_msgs, images=[first])
    assert traj.prompt_ids == want_prompt
    # Turn 2's request is the whole conversation rendered at once (no drift), and was sent
    # both images; turn 1 only the first.
    turn2_ids, turn2_mm = proc.encode_messages(traj.messages[:-1], images=[first, second])
    assert client.calls[1]["ids"] == turn2_ids == ids[: len(turn2_ids)]
    assert len(client.calls[0]["multi_modal"]) == 1
    sent = client.calls[1]["multi_modal"]
    assert sent.digests == turn2_mm.digests and len(sent.media_payload()["images"]) == 2
    assert client.calls[0]["ids"] == traj.prompt_ids

    # Loss mask: 1 exactly on the model's tokens; the env tokens (its image run too) are 0.
    start2 = r2[0] - len(traj.prompt_ids)
    assert traj.response_mask[start2 : start2 + counts[1]] == [0] * counts[1]
    model = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m]
    assert tok.decode(model, skip_special_tokens=True) == "bluered"
    assert all(
        lp == 0.0 for lp, m in zip(traj.rollout_log_probs, traj.response_mask, strict=True) if not m
    )
    # Messages keep the image parts without pixels (the media live in multi_modal).
    assert traj.messages[3]["content"][1] == {"type": "image"}

    batch = collate_trajectories([traj], pad_token_id=0)
    assert batch.non_tensors[MULTI_MODAL][0] is mm
    loss_mask = batch.tensors["loss_mask"][0]
    assert float(loss_mask.sum()) == sum(traj.response_mask)


class SnapshotTool(Tool):
    """Returns a picture of the requested colour (content parts with an image)."""

    name = "snapshot"
    description = "Take a picture."
    parameters = {"type": "object", "properties": {"color": {"type": "string"}}}

    async def call(self, arguments, **context):
        img = Image.new("RGB", (56, 56), (0, 200, 0))
        data = base64.b64encode(encode_png(img)).decode()
        return ToolResult(
            [
                {"type": "text", "text": "Here:"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
            ]
        )


CALL = '<tool_call>{"name": "snapshot", "arguments": {"color": "green"}}</tool_call>'


def test_tool_result_with_an_image_joins_the_trajectory(proc, tok):
    loop = create_agent_loop(
        "tool",
        tok,
        tools=[SnapshotTool()],
        sampling_params={"max_new_tokens": 32},
        processor=proc,
    )
    sample = image_sample(proc)  # the prompt has an image of its own, first in token order
    client = FakeVisionClient(tok, [CALL, "It is green."])
    traj = asyncio.run(loop.run(sample, client))
    traj.validate()
    assert traj.finish_reason == "stop" and traj.tool_calls == 1 and traj.tool_errors == 0
    mm = traj.multi_modal
    green = image_digest(Image.new("RGB", (56, 56), (0, 200, 0)))
    assert mm.digests == (sample["multi_modal"].digests[0], green)
    ids = full_ids(traj)
    pad = proc.token_ids["image"]
    (r1, r2) = runs(ids, pad)
    assert r1[0] < len(traj.prompt_ids) <= r2[0] and r1[1] == r2[1] == 4
    assert all(traj.response_mask[r2[0] - len(traj.prompt_ids) + k] == 0 for k in range(4))
    # The prompt was re-rendered with the tool schema, its image expanded with the sample's
    # media; the first turn was sent one image, the second both.
    assert client.calls[0]["multi_modal"] is sample["multi_modal"]
    assert len(client.calls[1]["multi_modal"]) == 2
    assert client.calls[1]["ids"] == ids[: len(client.calls[1]["ids"])]
    assert traj.messages[-2]["role"] == "tool"
    assert traj.messages[-2]["content"] == [{"type": "text", "text": "Here:"}, {"type": "image"}]


def test_without_a_processor_images_are_a_clear_error(proc, tok):
    env_loop = create_agent_loop("env", tok, env="visual_color", env_kwargs={"color": "red"})
    with pytest.raises(ValueError, match="environment 'visual_color'.*no vision processor"):
        asyncio.run(env_loop.run({"raw_prompt": []}, FakeVisionClient(tok, ["blue"])))

    tool_loop = create_agent_loop("tool", tok, tools=[SnapshotTool()])
    text = {"raw_prompt": [{"role": "user", "content": "take a picture"}]}
    with pytest.raises(ValueError, match="tool 'snapshot' result.*no vision processor"):
        asyncio.run(tool_loop.run(text, FakeVisionClient(tok, [CALL, "done"])))

    # An image the processor cannot read names the tool that returned it.
    class BrokenTool(SnapshotTool):
        async def call(self, arguments, **context):
            return [{"type": "image", "image": b"not a png"}]

    broken = create_agent_loop("tool", tok, tools=[BrokenTool()], processor=proc)
    with pytest.raises(ValueError, match="result of tool 'snapshot'.*not a readable image"):
        asyncio.run(broken.run(text, FakeVisionClient(tok, [CALL, "done"])))

    # Text-only content parts need no processor: they become the tool message's text.
    class PartsTool(SnapshotTool):
        async def call(self, arguments, **context):
            return [{"type": "text", "text": "no "}, {"type": "text", "text": "picture"}]

    parts_loop = create_agent_loop("tool", tok, tools=[PartsTool()])
    traj = asyncio.run(parts_loop.run(text, FakeVisionClient(tok, [CALL, "done"])))
    assert traj.tool_errors == 0 and traj.messages[-2]["content"] == "no picture"

    # A text env with a processor still works (the processor is only used for media).
    text_loop = create_agent_loop(
        "env", tok, env="guess_number", env_kwargs={"secret": 7}, processor=proc
    )
    traj = asyncio.run(text_loop.run({"raw_prompt": []}, FakeVisionClient(tok, ["5", "7"])))
    assert traj.reward == 1.0 and traj.multi_modal is None


def test_visual_color_env_is_registered_and_checks_its_arguments():
    env = create_env("visual_color")
    obs = env.reset(seed=3)
    assert [p["type"] for p in obs] == ["text", "image"] and obs[1]["image"].size == (56, 56)
    assert env.step(env.color)[1:3] == (1.0, True)
    with pytest.raises(ValueError, match="color must be one of"):
        env.reset(color="mauve")


# ----------------------------------------------------------------------------- the proxy


def needs_vlm_server() -> Any:
    """Skip until the rollout client sends media (``generate(..., multi_modal=)``)."""
    from polyrl.rollout.client import RolloutClient

    ready = "multi_modal" in inspect.signature(RolloutClient.generate).parameters
    return pytest.mark.skipif(
        not ready, reason="waits on the rollout server/client taking images (multi_modal=)"
    )


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(encode_png(img)).decode()


def image_message(text: str, img) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_url(img)}},
        ],
    }


def test_proxy_records_image_url_parts_with_the_session(proc, tok):
    from polyrl.agent.proxy import RecordingProxy

    client = FakeVisionClient(tok, ["a red square", "now green"])
    proxy = RecordingProxy(client, tok, processor=proc)
    red, green = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (112, 56), (0, 255, 0))
    messages = [image_message("What is this?", red)]

    async def go():
        first, sid = await proxy.chat({"messages": messages, "max_tokens": 8}, "s1")
        messages.append(first["choices"][0]["message"])
        messages.append(image_message("And this?", green))
        await proxy.chat({"messages": messages, "max_tokens": 8}, sid)

    asyncio.run(go())
    # Each request is what the processor renders for the conversation so far: the proxy's
    # ids equal the server's own, image runs expanded.
    template = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]}
    ]
    want1, mm1 = proc.encode_messages(template, images=[red])
    assert client.calls[0]["ids"] == want1
    assert client.calls[0]["multi_modal"].digests == mm1.digests
    template += [
        {"role": "assistant", "content": "a red square"},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image"}]},
    ]
    want2, mm2 = proc.encode_messages(template, images=[red, green])
    assert client.calls[1]["ids"] == want2  # the recorded ids were extended, not re-rendered
    assert client.calls[1]["multi_modal"].digests == mm2.digests  # the whole context's media

    (traj,) = proxy.trajectories("s1")
    assert traj.multi_modal.digests == mm2.digests
    answer = tok.encode("now green", add_special_tokens=False) + [tok.eos_token_id]
    assert full_ids(traj) == want2 + answer
    green_run = want2.index(proc.token_ids["image"], len(want1))
    assert traj.response_mask[green_run - len(traj.prompt_ids)] == 0
    body = proxy.trajectory("s1")
    media = body["multi_modal"]
    assert media["kinds"] == ["image", "image"] and media["digests"] == list(mm2.digests)
    assert media["token_counts"] == list(mm2.token_counts)
    assert [base64.b64decode(b) for b in media["images"]] == [encode_png(red), encode_png(green)]
    assert body["messages"][0]["content"][1] == {"type": "image"}  # the pixels are sent once


def test_proxy_refuses_remote_urls_and_images_without_a_processor(proc, tok):
    from polyrl.agent.proxy import RecordingProxy
    from polyrl.core.rollout_api import InvalidRequestError

    proxy = RecordingProxy(FakeVisionClient(tok, ["x"] * 4), tok, processor=proc)
    remote = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
    }
    with pytest.raises(InvalidRequestError, match="only data: URLs") as err:
        asyncio.run(proxy.chat({"messages": [remote]}, "r"))
    assert err.value.status == 400
    broken = image_message("x", Image.new("RGB", (56, 56)))
    broken["content"][1]["image_url"]["url"] = "data:image/png;base64,AAAA"
    with pytest.raises(InvalidRequestError, match="not a readable image"):
        asyncio.run(proxy.chat({"messages": [broken]}, "r"))
    text_proxy = RecordingProxy(FakeVisionClient(tok, ["x"]), tok)
    with pytest.raises(InvalidRequestError, match="without a vision processor"):
        asyncio.run(
            text_proxy.chat({"messages": [image_message("x", Image.new("RGB", (56, 56)))]}, "t")
        )
    assert not proxy.sessions  # a session whose only call failed never was


# ---------------------------------------------------------------- with a real rollout server
# These wait on the rollout side taking images (RolloutClient.generate(multi_modal=), the
# /generate 'images' field, the OpenAI route's image_url parts); they skip until it lands.


@pytest.fixture(scope="module")
def vlm_server(tiny_vl_dir):
    from polyrl.rollout.launcher import ServerProcess

    options = {"num_threads": 1, "max_num_seqs": 8, "kv_cache_tokens": 4096, "max_model_len": 1024}
    proc = ServerProcess(tiny_vl_dir, options=options).start(timeout=180)
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@needs_vlm_server()
def test_env_loop_with_image_observations_on_a_real_server(vlm_server, proc, tok):
    from polyrl.rollout.client import RolloutClient

    loop = create_agent_loop(
        "env",
        tok,
        env="visual_color",
        env_kwargs={"color": "red", "max_tries": 2},
        max_turns=2,
        sampling_params={"max_new_tokens": 8, "temperature": 0.0},
        processor=proc,
    )

    async def go():
        async with RolloutClient([vlm_server.url], health_interval=0) as client:
            return await loop.run({"raw_prompt": []}, client)

    traj = asyncio.run(go())
    traj.validate()
    ids = full_ids(traj)
    assert expand_placeholders(ids, proc.token_ids, traj.multi_modal) == ids
    if traj.num_turns == 2:  # a random model does not name the colour: two images were sent
        assert len(traj.multi_modal) == 2


@needs_vlm_server()
def test_proxy_ids_equal_the_servers_own_on_a_real_server(vlm_server, proc, tok):
    import httpx

    from polyrl.agent.proxy import RecordingProxy
    from polyrl.rollout.client import RolloutClient

    img = Image.new("RGB", (56, 56), (255, 0, 0))
    body = {"messages": [image_message("What is this?", img)], "max_tokens": 6, "temperature": 0}

    async def go():
        async with RolloutClient([vlm_server.url], health_interval=0) as client:
            proxy = RecordingProxy(client, tok, processor=proc)
            answer, _ = await proxy.chat(dict(body), "real")
            return proxy, answer

    proxy, answer = asyncio.run(go())
    (traj,) = proxy.trajectories("real")
    own = httpx.post(f"{vlm_server.url}/v1/chat/completions", json=body, timeout=60).json()
    # The server renders and expands the same prompt, and greedy decoding gives the same text.
    assert own["usage"]["prompt_tokens"] == len(traj.prompt_ids)
    assert own["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]
    want, _ = proc.encode_messages(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}],
            }
        ],
        images=[img],
    )
    assert traj.prompt_ids == want
