"""The server with speculative decoding: a streamed completion carries several accepted tokens
in one event and reads the same as the whole completion and as the engine without
speculation; /metrics counts the drafts."""

import httpx
import pytest
from server_helpers import MODEL_NAME, ServerThread, assert_no_leaks, idle_stats, parse_sse

from flashlet import LLM, SamplingParams
from flashlet.server import EngineLoop, ServerConfig, create_app

PROMPT = ("Repeat this list exactly: apples, pears, plums, figs, dates, limes, cherries. "
          "Repeat: apples, pears, plums, figs, dates, limes, cherries. Repeat:")


@pytest.mark.slow
def test_streamed_speculative_completion(demo_model_dir, demo_llm):
    expected = demo_llm.generate([PROMPT], SamplingParams(max_new_tokens=16))[0].text
    llm = LLM(str(demo_model_dir), speculative_config={"method": "ngram",
                                                       "num_speculative_tokens": 4})
    loop = EngineLoop(engine=llm.engine).start()
    assert loop.wait_ready(30)
    server = ServerThread(create_app(loop, ServerConfig(model_name=MODEL_NAME))).start()
    try:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=300) as r:
            events = parse_sse(r.iter_lines())
        streamed = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]")
        assert whole["choices"][0]["text"] == streamed == expected
        chunks = [e for e in events if e != "[DONE]" and e["choices"][0]["text"]]
        assert len(chunks) < whole["usage"]["completion_tokens"]  # several tokens an event
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        accepted = [line for line in metrics.splitlines()
                    if line.startswith("flashlet_spec_decode_num_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0
    finally:
        server.stop()
        assert_no_leaks(idle_stats(loop))
        loop.stop()
