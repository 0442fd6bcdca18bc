"""`mira serve` end to end: the bundled model on the CPU behind uvicorn on loopback, driven by the
official `openai` client and plain HTTP; answers checked against the library's own generation."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
import uvicorn

from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

import mira
from mira.runtime.engine import BUNDLED_MODEL
from mira.runtime.generate import SamplingConfig, encode_messages, stream_generate
from mira.serve.app import create_app
from mira.serve.command import listen
from mira.store.convert import convert
from token_text_reference import alternative_text, token_texts

KEY = "sk-test-key"
NAME = "mira-tiny-moe"
WAITING = 7  # the concurrent test's 8 clients: one running, seven waiting
DEADLINE_S = 60  # bound on every wait below
SYSTEM = {"role": "system", "content": "You answer briefly."}


@contextmanager
def serving(app):
    """Run `app` with uvicorn on 127.0.0.1 at a free port in a thread; yields its base URL."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    store = tmp_path_factory.mktemp("bundled") / "store"
    convert(BUNDLED_MODEL, store, "int8-shared", progress=False)
    return mira.load(store, device="cpu", progress=False)


@pytest.fixture(scope="module")
def url(model):
    with serving(create_app(model, NAME, api_key=KEY, max_waiting=WAITING)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=DEADLINE_S)


AUTH = {"Authorization": f"Bearer {KEY}"}


def _idle(url):
    """Wait until nothing runs or waits on the server's device."""
    deadline = time.monotonic() + DEADLINE_S
    while httpx.get(f"{url}/health").json()["pending"]:
        assert time.monotonic() < deadline, "the server's queue did not drain"
        time.sleep(0.05)


def _metric(url, name):
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _alone(model, messages=None, prompt=None, **settings):
    """The text the library generates for the same request, with nothing else running."""
    ids = encode_messages(model, messages) if messages else model.tokenizer(prompt, return_tensors="pt").input_ids
    report = stream_generate(model, ids, SamplingConfig(**settings), lambda text: None)
    return report.text, report.finish_reason, report.new_tokens


def test_models_lists_the_one_model(client):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME) == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_uses_the_template_with_the_system_and_every_message(client, model):
    messages = [SYSTEM, {"role": "user", "content": "What is Python?"},
                {"role": "assistant", "content": "A programming language."},
                {"role": "user", "content": "Who made it?"}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    text, finish, tokens = _alone(model, messages, max_new_tokens=12, temperature=0)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == finish
    assert reply.usage.completion_tokens == tokens
    assert reply.usage.prompt_tokens == encode_messages(model, messages).shape[1]


def test_streamed_chat_is_the_whole_answer_in_pieces(client):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    settings = dict(model=NAME, messages=messages, max_tokens=16, temperature=0.8, top_p=0.9, seed=5)
    whole = client.chat.completions.create(**settings)
    chunks = list(client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices


def test_a_stream_batches_its_text_by_the_interval_and_flushes_at_the_end(model):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    text, _, tokens = _alone(model, messages, max_new_tokens=16, min_new_tokens=16, temperature=0)
    with serving(create_app(model, NAME, stream_interval_s=DEADLINE_S)) as base:
        started = time.monotonic()
        chunks = list(openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0).chat.completions.create(
            model=NAME, messages=messages, max_tokens=16, temperature=0, stream=True, extra_body={"min_tokens": 16}))
        elapsed = time.monotonic() - started
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text and tokens == 16
    assert len(pieces) <= 2  # what came first at once, then the rest when the generation ended
    assert elapsed < DEADLINE_S / 2  # the end flushed it: nobody waited out the interval


def test_completions_streamed_and_not_with_stop_and_top_k(client, model):
    prompt = "Once upon a time"
    text, _, _ = _alone(model, prompt=prompt, max_new_tokens=20, temperature=0)
    stop = text.split(" ")[3]
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert reply.choices[0].text == text[:text.index(stop)] and reply.choices[0].finish_reason == "stop"
    sampled = dict(model=NAME, prompt=prompt, max_tokens=10, temperature=1.0, seed=3, extra_body={"top_k": 5})
    whole = client.completions.create(**sampled)
    assert whole.choices[0].text == _alone(model, prompt=prompt, max_new_tokens=10, temperature=1.0, top_k=5,
                                           seed=3)[0]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**sampled, stream=True))
    assert streamed == whole.choices[0].text


def test_a_stop_string_ends_the_tokens_their_logprobs_and_usage_at_the_token_that_met_it(client, model):
    prompt = "Once upon a time"
    input_ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    generated = _generated_ids(model, input_ids, max_new_tokens=20, temperature=0)
    words = model.tokenizer.decode(generated, skip_special_tokens=True).split(" ")
    stop = " " + words[3]
    met = next(k for k in range(1, len(generated) + 1)
               if stop in model.tokenizer.decode(generated[:k], skip_special_tokens=True))
    assert met < len(generated)  # the loop decodes on after the token that met the stop
    texts = token_texts(model.tokenizer, generated[:met])
    settings = dict(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=stop, logprobs=1)
    reply = client.completions.create(**settings)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert choice.logprobs.tokens == texts and reply.usage.completion_tokens == met
    assert max(choice.logprobs.text_offset) <= len(choice.text)
    chunks = list(client.completions.create(**settings, stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == texts
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_an_end_of_sequence_at_exactly_max_tokens_finishes_as_stop(client, model):
    text, finish, tokens = _alone(model, prompt="Hi", max_new_tokens=200, temperature=0)
    assert finish == "stop" and tokens < 200  # the model ends this answer itself
    for max_tokens, reason in ((tokens, "stop"), (tokens - 1, "length")):
        reply = client.completions.create(model=NAME, prompt="Hi", max_tokens=max_tokens, temperature=0)
        assert reply.choices[0].finish_reason == reason and reply.usage.completion_tokens == max_tokens


def _generated_ids(model, input_ids, **settings):
    """The ids the library generates for the same request (its log-probabilities' tokens)."""
    report = stream_generate(model, input_ids, SamplingConfig(logprobs=0, **settings), lambda text: None)
    return [entry.token for entry in report.logprobs]


def _reference_logprobs(model, input_ids, generated):
    """[N, V] float64 log-probabilities of each generated token's step, from one forward of the model over
    the prompt and the generated tokens together (no KV cache, no generate loop)."""
    ids = torch.cat([input_ids, torch.tensor([generated])], dim=1)
    with torch.no_grad():
        logits = model.hf_model(ids).logits[0].double()  # [T + N, V]
    return torch.log_softmax(logits, dim=-1)[input_ids.shape[1] - 1:-1]


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=1.3, top_k=3, seed=11)],
                         ids=["greedy", "sampled"])
def test_chat_logprobs_are_the_models_at_each_step_before_sampling_settings(client, model, settings):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    input_ids = encode_messages(model, messages)
    generated = _generated_ids(model, input_ids, max_new_tokens=12, **settings)
    reference = _reference_logprobs(model, input_ids, generated)
    extra = {"extra_body": {"top_k": settings["top_k"]}} if "top_k" in settings else {}
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, logprobs=True, top_logprobs=4,
                                           temperature=settings["temperature"], seed=settings.get("seed"), **extra)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(generated)
    texts = token_texts(model.tokenizer, generated)
    for step, (entry, token, text) in enumerate(zip(content, generated, texts)):
        assert entry.token == text and entry.bytes == list(text.encode())
        assert entry.logprob == pytest.approx(reference[step, token].item(), abs=2e-3)  # the raw logits'
        top = reference[step].topk(4)
        assert [t.token for t in entry.top_logprobs] == [alternative_text(model.tokenizer, generated[:step], i)
                                                         for i in top.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
    assert "".join(texts) == reply.choices[0].message.content
    if settings["temperature"] == 0:
        assert all(entry.token == entry.top_logprobs[0].token for entry in content)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, logprobs=True,
                                                 top_logprobs=4, temperature=settings["temperature"],
                                                 seed=settings.get("seed"), stream=True, **extra))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert streamed == content
    for chunk in chunks:  # a chunk's log-probabilities are those of the tokens whose text it carries
        if chunk.choices and chunk.choices[0].logprobs:
            assert "".join(entry.token for entry in chunk.choices[0].logprobs.content) == chunk.choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content


def test_completion_logprobs_name_each_token_its_offset_and_the_likeliest(client, model):
    prompt = "Once upon a time"
    input_ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    generated = _generated_ids(model, input_ids, max_new_tokens=10, temperature=0)
    reference = _reference_logprobs(model, input_ids, generated)
    texts = token_texts(model.tokenizer, generated)
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == texts and "".join(texts) == reply.choices[0].text
    assert logprobs.token_logprobs == pytest.approx([reference[i, t].item() for i, t in enumerate(generated)],
                                                    abs=2e-3)
    assert logprobs.text_offset == [sum(len(text) for text in texts[:i]) for i in range(len(texts))]
    for step, top in enumerate(logprobs.top_logprobs):
        likeliest = reference[step].topk(2)
        assert top == pytest.approx({alternative_text(model.tokenizer, generated[:step], i): v for i, v in
                                     zip(likeliest.indices.tolist(), likeliest.values.tolist())}, abs=2e-3)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                            stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for part in parts for t in part.tokens] == texts
    assert [o for part in parts for o in part.text_offset] == logprobs.text_offset
    assert client.completions.create(model=NAME, prompt=prompt, max_tokens=2).choices[0].logprobs is None


def test_an_echoed_prompt_of_token_ids_comes_back_with_its_logprobs(client, model):
    prompt = model.tokenizer("Once upon a time, in a land", return_tensors="pt").input_ids
    generated = _generated_ids(model, prompt, max_new_tokens=6, temperature=0)
    reference = _reference_logprobs(model, prompt[:, :1], prompt[0, 1:].tolist() + generated)  # every token after
    ids = prompt[0].tolist() + generated  # the first, given those before it
    settings = dict(model=NAME, prompt=[prompt[0].tolist()], max_tokens=6, temperature=0, echo=True, logprobs=3)
    reply = client.completions.create(**settings)
    choice = reply.choices[0]
    echoed = model.tokenizer.decode(prompt[0], skip_special_tokens=True)
    assert choice.text == echoed + model.tokenizer.decode(generated, skip_special_tokens=True)
    logprobs = choice.logprobs
    texts = token_texts(model.tokenizer, prompt[0].tolist()) + token_texts(model.tokenizer, generated)
    assert logprobs.tokens == texts
    assert all(choice.text[offset:offset + len(text)] == text for offset, text in zip(logprobs.text_offset, texts))
    assert logprobs.text_offset[prompt.shape[1]] == len(echoed)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx([reference[i, t].item() for i, t in enumerate(ids[1:])],
                                                        abs=2e-3)
    for step, top in enumerate(logprobs.top_logprobs[1:]):
        likeliest = reference[step].topk(3)
        place = step + 1  # in ids; the completion is decoded apart from the prompt
        before = ids[:place] if place < prompt.shape[1] else generated[:place - prompt.shape[1]]
        assert top == pytest.approx({alternative_text(model.tokenizer, before, i): v for i, v in
                                     zip(likeliest.indices.tolist(), likeliest.values.tolist())}, abs=2e-3)
    chunks = list(client.completions.create(**settings, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [lp for part in parts for lp in part.token_logprobs] == logprobs.token_logprobs
    assert [o for part in parts for o in part.text_offset] == logprobs.text_offset
    for chunk in chunks:  # a chunk's tokens are its own text's: the echoed prompt's go out with it
        part = chunk.choices[0].logprobs
        assert "".join(part.tokens if part else []) == chunk.choices[0].text
    echoed = client.completions.create(model=NAME, prompt="Once upon", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Once upon") and echoed.choices[0].logprobs is None


def test_max_tokens_0_with_echo_scores_the_prompt_and_generates_nothing(client, model):
    """The older way of scoring a text through OpenAI's completions (vLLM takes it too): the prompt back
    with its logprobs and no new token; without echo there is nothing to answer, and it is refused."""
    text = "Once upon a time, in a land"
    ids = model.tokenizer(text).input_ids
    reference = _reference_logprobs(model, torch.tensor([ids[:1]]), ids[1:])  # [T - 1, V]
    settings = dict(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=2)
    reply = client.completions.create(**settings)
    choice = reply.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 0)
    logprobs = choice.logprobs
    assert logprobs.tokens == token_texts(model.tokenizer, ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx([reference[i, t].item() for i, t in enumerate(ids[1:])],
                                                        abs=2e-3)
    for step, top in enumerate(logprobs.top_logprobs[1:]):
        likeliest = reference[step].topk(2)
        assert top == pytest.approx({alternative_text(model.tokenizer, ids[:step + 1], i): v for i, v in
                                     zip(likeliest.indices.tolist(), likeliest.values.tolist())}, abs=2e-3)
    chunks = list(client.completions.create(**settings, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason == "length"
    assert [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs] \
        == logprobs.token_logprobs
    plain = client.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=NAME, prompt=text, max_tokens=0)
    assert error.value.param == "max_tokens" and "echo" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=NAME, prompt="word " * 3000, max_tokens=0, echo=True, logprobs=0)
    assert error.value.code == "context_length_exceeded" and "does not fit: shorten it" in error.value.message


def test_lm_evals_completions_api_model_scores_through_the_server(url, model):
    """lm-eval's own client of an OpenAI-compatible server (`--model local-completions`): its log-
    likelihoods of continuations, read from echoed prompts' logprobs, are the model's."""
    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=NAME, tokenizer=str(BUNDLED_MODEL),
                             tokenizer_backend="huggingface", header=AUTH, max_retries=1)
    pairs = [("The capital of France is", " Paris"), ("Once upon a time", " there was a king")]
    results = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=0)
                                for pair in pairs], disable_tqdm=True)
    for (context, continuation), (total, greedy) in zip(pairs, results):
        first = len(model.tokenizer(context).input_ids)
        whole = torch.tensor([model.tokenizer(context + continuation).input_ids])
        reference = _reference_logprobs(model, whole[:, :first], whole[0, first:].tolist())
        assert total == pytest.approx(sum(reference[i, t].item() for i, t in enumerate(whole[0, first:])), abs=1e-2)
        assert greedy == all(reference[i].argmax() == t for i, t in enumerate(whole[0, first:].tolist()))


TOOL_TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nYou may call: {{ tools | tojson }}<|end|>\n{% endif %}"
                 "{% for message in messages %}<|{{ message.role }}|>\n{% if message.tool_calls %}"
                 "{% for call in message.tool_calls %}<call>{{ call.function | tojson }}</call>{% endfor %}"
                 "{% else %}{{ message.content }}{% endif %}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _tool_model(model, opening: str, closing: str):
    """The served model with a chat template that shows tools, and a response template that reads the text
    between `opening` and `closing` as a call of the tool of that name, with no arguments."""
    tooled = mira.load(model.store.path, device="cpu", progress=False)
    tooled.tokenizer.chat_template = TOOL_TEMPLATE
    tooled.tokenizer.response_template = {"start_anchor": "<|assistant|>\n", "fields": {
        "content": {"content": "text"},
        "tool_calls": {"open": opening, "close": closing, "content": "text", "repeats": True,
                       "transform": {"type": "function", "function": {"name": "{content}", "arguments": {}}}}}}
    return tooled


def test_tools_and_earlier_calls_reach_the_model_through_its_chat_template(model):
    call = {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "And in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_7", "content": "Rain, 4 degrees."}]
    tooled = _tool_model(model, "<call>", "</call>")
    as_template_reads = [messages[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "Rain, 4 degrees.", "tool_call_id": "call_7"}]
    prompt = tooled.tokenizer.apply_chat_template(as_template_reads, tools=[WEATHER], tokenize=False,
                                                  add_generation_prompt=True)
    assert '<call>{"name": "weather", "arguments": {"city": "Oslo"}}</call>' in prompt and "The weather in a city" in prompt
    ids = tooled.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    alone = stream_generate(tooled, ids, SamplingConfig(max_new_tokens=12, temperature=0), lambda text: None)
    with serving(create_app(tooled, NAME)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        settings = dict(model=NAME, messages=messages, tools=[WEATHER], max_tokens=12, temperature=0)
        reply = client.chat.completions.create(**settings)
        chunks = list(client.chat.completions.create(**settings, stream=True))
    assert reply.usage.prompt_tokens == ids.shape[1]
    message = reply.choices[0].message  # read by the response template, whose text fields strip by default
    assert message.content == alone.text.strip() and message.tool_calls is None
    assert reply.choices[0].finish_reason == alone.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_an_answer_read_for_tools_ends_before_its_stop_string(model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tooled = _tool_model(model, "<call>", "</call>")  # no call in the answer: it is all text
    ids = encode_messages(tooled, messages, tools=[WEATHER])
    text = stream_generate(tooled, ids, SamplingConfig(max_new_tokens=16, temperature=0), lambda t: None).text
    stop = text.split(" ")[3]
    assert stop and text.find(stop) > 0, text
    with serving(create_app(tooled, NAME)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        settings = dict(model=NAME, messages=messages, tools=[WEATHER], max_tokens=16, temperature=0, stop=[stop])
        whole = client.chat.completions.create(**settings).choices[0]
        chunks = list(client.chat.completions.create(**settings, stream=True))
    assert whole.message.content == text[:text.find(stop)].strip() and whole.finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content


def test_a_call_in_the_answer_comes_back_as_a_tool_call_whole_and_streamed(model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tooled = _tool_model(model, "<call>", "</call>")
    ids = encode_messages(tooled, messages, tools=[WEATHER])
    text = stream_generate(tooled, ids, SamplingConfig(max_new_tokens=16, temperature=0), lambda t: None).text
    words = text.split(" ")
    assert len(set(words[1:4])) == 3, text  # three distinct words: the middle one is called
    tooled = _tool_model(model, f" {words[1]} ", f" {words[3]} ")  # the answer calls the tool named words[2]
    with serving(create_app(tooled, NAME)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        settings = dict(model=NAME, messages=messages, tools=[WEATHER], max_tokens=16, temperature=0)
        whole = client.chat.completions.create(**settings).choices[0]
        chunks = list(client.chat.completions.create(**settings, stream=True))
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == words[2] and call.function.arguments == "{}" and call.id.startswith("call_")
    streamed = [c.choices[0].delta for c in chunks if c.choices[0].delta.tool_calls]
    assert len(streamed) == 1 and streamed[0].content == whole.message.content  # whole, in one chunk
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed[0].tool_calls] == [(0, words[2], "{}")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tools_a_model_cannot_take_are_refused(url, client, model):
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as error:  # the bundled model's template shows no tools
        client.chat.completions.create(**ask)
    assert error.value.param == "tools" and "does not show tools" in error.value.message
    assert client.chat.completions.create(**ask, tool_choice="none").choices[0].finish_reason in ("stop", "length")
    tooled = _tool_model(model, "<call>", "</call>")
    tooled.tokenizer.response_template = None
    with serving(create_app(tooled, NAME)) as base:
        with pytest.raises(openai.BadRequestError) as error:
            openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0).chat.completions.create(**ask)
    assert "--response-template" in error.value.message


def test_concurrent_clients_get_what_they_would_get_alone(url, client):
    def request(client_index: int, round_index: int):
        """One of 24 distinct seeded requests: chat or completion, streamed or not."""
        seed = 100 * client_index + round_index
        common = dict(model=NAME, max_tokens=6, temperature=1.0, seed=seed)
        stream = client_index % 2 == 1
        if (client_index + round_index) % 2 == 0:
            messages = [SYSTEM, {"role": "user", "content": f"Name a color, number {seed}."}]
            if stream:
                chunks = list(client.chat.completions.create(messages=messages, stream=True, **common))
                text = "".join(c.choices[0].delta.content or "" for c in chunks)
                return text, chunks[-1].choices[0].finish_reason
            reply = client.chat.completions.create(messages=messages, **common)
            return reply.choices[0].message.content, reply.choices[0].finish_reason
        prompt = f"The number {seed} is"
        if stream:
            chunks = list(client.completions.create(prompt=prompt, stream=True, **common))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        reply = client.completions.create(prompt=prompt, **common)
        return reply.choices[0].text, reply.choices[0].finish_reason

    def rounds(client_index: int):
        return [request(client_index, r) for r in range(3)]

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(rounds, range(8)))
    alone = [[request(c, r) for r in range(3)] for c in range(8)]
    assert together == alone
    assert all(finish in ("stop", "length") for answers in together for _, finish in answers)


BAD = {
    "malformed JSON": ('{"messages": [', "not valid JSON"),
    "messages of the wrong type": (json.dumps({"messages": "hi"}), "messages"),
    "a temperature as a string": (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                              "temperature": "0.5"}), "temperature"),
    "a temperature out of range": (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                               "temperature": 3}), "temperature"),
    "max_tokens of 0": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
                        "max_tokens"),
    "top_p of 0": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}), "top_p"),
    "an unknown role": (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), "role"),
    "no messages": (json.dumps({"messages": []}), "messages"),
    "two choices": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2}), "n"),
    "five stop strings": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}),
                          "stop"),
    "a prompt longer than the context": (json.dumps({"messages": [{"role": "user", "content": "word " * 3000}]}),
                                         "context"),
    "more tokens than the context holds": (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 5000}), "context"),
    "an unknown model": (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
                         "does not exist"),
    "top_logprobs without logprobs": (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                  "top_logprobs": 2}), "needs logprobs"),
    "21 top logprobs": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                    "top_logprobs": 21}), "top_logprobs"),
    "a forced tool call": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}), "tool_choice"),
    "a JSON response format": (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                           "response_format": {"type": "json_object"}}), "response_format"),
    "a logit bias": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"42": 100}}),
                     "logit_bias"),
    "a seed beyond 64 bits": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}), "seed"),
    "stream options without a stream": (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                    "stream_options": {"include_usage": True}}), "stream_options"),
    "a temperature that is not a number": ('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                                           "finite number"),
    "an assistant message without content": (json.dumps({"messages": [{"role": "assistant"}]}),
                                             "an assistant message needs content"),
    "functions, the older form of tools": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "functions": [
        {"name": "f", "parameters": {"type": "object", "properties": {}}}]}), "give them as tools"),
    "a forced function call": (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                           "function_call": {"name": "f"}}), "function_call"),
    "an image in a message": (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}), 'of type "image_url"'),
    "a stop that is a number": (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": 5}),
                                "a string or a list of at most 4 strings"),
    "a repetition penalty that would overflow the logits": (
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 1, "repetition_penalty": 1e-300}),
        "repetition_penalty"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_4xx_with_an_openai_error_body_and_the_server_keeps_serving(url, client, case):
    body, says = BAD[case]
    answer = httpx.post(f"{url}/v1/chat/completions", content=body,
                        headers={**AUTH, "Content-Type": "application/json"}, timeout=DEADLINE_S)
    assert 400 <= answer.status_code < 500, answer.text
    error = answer.json()["error"]
    assert says in error["message"] or says == error["param"], error
    assert "Value error" not in error["message"] and "str" not in (error["param"] or "").split("."), error
    assert error["type"] == "invalid_request_error"
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).choices[0].finish_reason


def test_bad_input_through_the_openai_client_raises_its_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    for unserved in ({"suffix": " end"}, {"best_of": 2}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=NAME, prompt="Hi", max_tokens=2, **unserved)
        assert error.value.param == next(iter(unserved)) and "does not support" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=2, logprobs=6)
    assert error.value.param == "logprobs" and "5" in error.value.message
    unset = {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
             "response_format": {"type": "text"}, "logit_bias": {}, "functions": [], "function_call": "none"}
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **unset)
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=NAME, prompt="word " * 3000, max_tokens=5)
    assert error.value.code == "context_length_exceeded" and error.value.param == "prompt"
    assert "5 more were asked for: shorten the prompt or lower max_tokens" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 3000}])
    assert "no token is left to generate: shorten the prompt" in error.value.message


def test_null_fields_take_their_defaults(url):
    nulls = dict.fromkeys(("n", "frequency_penalty", "presence_penalty", "stream", "min_tokens", "seed", "stop"))
    chat = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=DEADLINE_S,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **nulls})
    assert chat.status_code == 200, chat.text
    completion = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=DEADLINE_S,
                            json={"prompt": "Once upon a time", "max_tokens": None, "temperature": 0, **nulls})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens


def test_an_empty_prompt_or_a_body_not_sent_as_json_is_refused_before_any_stream(url):
    for prompt in ("", [], [[]]):
        for stream in (False, True):
            answer = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=DEADLINE_S,
                                json={"prompt": prompt, "max_tokens": 2, "stream": stream})
            assert answer.status_code == 400 and "empty" in answer.json()["error"]["message"], answer.text
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for content_type in ({}, {"Content-Type": "text/plain"}):
        answer = httpx.post(f"{url}/v1/completions", content=body, headers={**AUTH, **content_type})
        assert answer.status_code == 400
        assert "Content-Type: application/json" in answer.json()["error"]["message"], answer.text


def test_api_key_missing_wrong_and_right(url):
    assert httpx.get(f"{url}/health").status_code == 200  # health needs no key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/v1/models", "/metrics"):
            answer = httpx.get(f"{url}{path}", headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        posted = httpx.post(f"{url}/v1/completions", headers=headers, json={"prompt": "hi", "max_tokens": 1})
        assert posted.status_code == 401
        malformed = httpx.post(f"{url}/v1/completions", headers={**headers, "Content-Type": "application/json"},
                               content='{"prompt": [')
        assert malformed.status_code == 401  # not a JSON error: the key comes first
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


LONG = {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 1500,
        "min_tokens": 1500, "temperature": 0}


def test_a_streaming_client_that_disconnects_cancels_its_generation(url):
    cancelled = _metric(url, "mira_requests_cancelled_total")
    generated = _metric(url, "mira_completion_tokens_total")
    with httpx.Client(timeout=DEADLINE_S) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json={**LONG, "stream": True}) as answer:
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
    _idle(url)  # bounded: the remaining 1,500 tokens would take far longer than the deadline on the CPU
    assert _metric(url, "mira_requests_cancelled_total") == cancelled + 1
    assert _metric(url, "mira_completion_tokens_total") - generated < LONG["max_tokens"] / 2


def test_a_waiting_client_that_disconnects_cancels_its_request(url):
    cancelled = _metric(url, "mira_requests_cancelled_total")
    generated = _metric(url, "mira_completion_tokens_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=LONG, timeout=1.0)
    _idle(url)
    assert _metric(url, "mira_requests_cancelled_total") == cancelled + 1
    assert _metric(url, "mira_completion_tokens_total") - generated < LONG["max_tokens"] / 2


def test_a_full_queue_answers_429_with_retry_after(url, client):
    with httpx.Client(timeout=DEADLINE_S) as http, OpenStreams(http, url, WAITING + 1) as streams:
        deadline = time.monotonic() + DEADLINE_S
        while httpx.get(f"{url}/health").json()["pending"] < WAITING + 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        full = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json={**LONG, "max_tokens": 2,
                                                                              "min_tokens": 0})
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert len(streams) == WAITING + 1
    _idle(url)  # closing the streams cancelled all of them
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices[0].text is not None


class OpenStreams(list):
    """`count` streaming long requests held open until the block ends, then closed (cancelling them)."""

    def __init__(self, http, url, count):
        super().__init__()
        self.http, self.url, self.count = http, url, count

    def __enter__(self):
        for _ in range(self.count):
            answer = self.http.send(self.http.build_request("POST", f"{self.url}/v1/chat/completions", headers=AUTH,
                                                            json={**LONG, "stream": True}), stream=True)
            assert answer.status_code == 200
            self.append(answer)
        return self

    def __exit__(self, *exc):
        for answer in self:
            answer.close()


def test_metrics_count_requests_tokens_and_tiers(url, client):
    before = _metric(url, "mira_completion_tokens_total")
    reply = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0,
                                      extra_body={"min_tokens": 4})
    assert reply.usage.completion_tokens == 4
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    assert _metric(url, "mira_completion_tokens_total") == before + 4
    for name in ("mira_requests_total{", "mira_time_to_first_token_seconds_bucket", "mira_decode_tokens_per_second",
                 'mira_expert_tokens_total{tier="miss"}', 'mira_pcie_bytes_total{kind="demand"}', "mira_queue_waiting"):
        assert name in text
    assert _metric(url, 'mira_requests_total{endpoint="/v1/completions",status="200"}') >= 1
    assert _metric(url, 'mira_expert_tokens_total{tier="miss"}') > 0  # the CPU reads every expert in place
