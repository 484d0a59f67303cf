"""lab/api_stages.py's step messages decode as the API process decodes an engine core's: the
tool fakes the core's side, so a field the engine's outputs gained must reach it too (one it
lacked stopped the tool at its first finished request once)."""

import importlib.util
from pathlib import Path

import msgspec

from flashlet.server.messages import StepOutputs

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "api_stages.py"
spec = importlib.util.spec_from_file_location("api_stages", SCRIPT)
api_stages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(api_stages)


def test_step_frames_decode_as_the_core_sends_them():
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepOutputs)
    going = decoder.decode(api_stages.step_frame(encoder, 7, 1234, finished=False))
    last = decoder.decode(api_stages.step_frame(encoder, 7, 1235, finished=True))
    (a,), (b,) = going.outputs, last.outputs
    assert (a.request_id, a.new_token_ids, a.finished) == (7, [1234], False)
    assert (b.request_id, b.new_token_ids, b.finished, b.finish_reason) == (7, [1235], True, "length")
